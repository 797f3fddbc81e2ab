"""lockgate: an OpenAI-compatible gateway in front of a fleet of LLM engines.

The names below are loaded when first used (PEP 562): a process that imports one module of the package (a
simulator, a benchmark's client, the CLI's parser) does not load the whole gateway with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config, ConfigError, load_config, parse_config
    from .gateway import Gateway
    from .server import GatewayServer

__all__ = ["Config", "ConfigError", "Gateway", "GatewayServer", "load_config", "parse_config"]
__version__ = "0.1.0"

_HOMES = {
    "Config": ".config",
    "ConfigError": ".config",
    "load_config": ".config",
    "parse_config": ".config",
    "Gateway": ".gateway",
    "GatewayServer": ".server",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lockgate' has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
