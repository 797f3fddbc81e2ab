"""Any OpenAI-compatible server: no metrics, health by listing models."""

from .base import Dialect

OPENAI = Dialect(name="openai", health_path="/v1/models", metrics_path=None)
