"""lockgate: an OpenAI-compatible gateway in front of a fleet of LLM engines."""

from .config import Config, ConfigError, load_config, parse_config
from .gateway import Gateway
from .server import GatewayServer

__all__ = ["Config", "ConfigError", "Gateway", "GatewayServer", "load_config", "parse_config"]
__version__ = "0.1.0"
