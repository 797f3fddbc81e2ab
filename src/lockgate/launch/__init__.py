"""Launchers for real inference engines used in development, demos and integration tests.

``lockgate.launch.llamacpp`` runs llama.cpp's HTTP server (the ``lockgate[llamacpp]`` extra) in a child
process. Names are re-exported lazily so that ``python -m lockgate.launch.llamacpp`` does not import the
module twice (runpy warns when a ``-m`` target is already in ``sys.modules``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockgate.launch.llamacpp import (
        EngineStartError,
        LlamaCppConfig,
        LlamaCppEngine,
        MissingExtraError,
        SyncLlamaCppEngine,
        find_smollm2_gguf,
    )

__all__ = [
    "EngineStartError",
    "LlamaCppConfig",
    "LlamaCppEngine",
    "MissingExtraError",
    "SyncLlamaCppEngine",
    "find_smollm2_gguf",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("lockgate.launch.llamacpp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
