"""Any OpenAI-compatible server: no metrics, health by listing models (and nothing generated to probe it: a provider's
tokens are paid for)."""

from .base import Dialect

OPENAI = Dialect(name="openai", health_path="/v1/models", metrics_path=None, answer_probe_path=None)
