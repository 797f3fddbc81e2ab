"""Engine dialects, one module each."""

from .base import AbortCall, Dialect, MetricNames
from .llamacpp import LLAMACPP
from .openai import OPENAI
from .sglang import SGLANG
from .tgi import TGI
from .vllm import VLLM

DIALECTS: dict[str, Dialect] = {d.name: d for d in (VLLM, SGLANG, TGI, LLAMACPP, OPENAI)}


def dialect_for(name: str) -> Dialect:
    return DIALECTS[name]


__all__ = ["DIALECTS", "AbortCall", "Dialect", "MetricNames", "dialect_for"]
