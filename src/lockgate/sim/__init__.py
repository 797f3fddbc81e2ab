"""The engine simulator: a real HTTP server that behaves like one vLLM instance.

    async with SimServer(SimConfig(models=["m"])) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x")

See ``server.py`` (lifecycle), ``handlers.py`` (routes and fault-injection headers), ``scheduler.py`` (the
batching model) and ``generator.py`` (deterministic output).
"""

from .config import SimConfig
from .control import SimControl
from .generator import TokenStream, generate
from .kv import KVCache
from .scheduler import Scheduler, SchedulerConfig
from .server import SimServer
from .stats import RequestRecord, SimStats
from .tokens import render_chat, tokenize

__all__ = [
    "KVCache",
    "RequestRecord",
    "Scheduler",
    "SchedulerConfig",
    "SimConfig",
    "SimControl",
    "SimServer",
    "SimStats",
    "TokenStream",
    "generate",
    "render_chat",
    "tokenize",
]
