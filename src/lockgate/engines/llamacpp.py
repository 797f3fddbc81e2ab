"""llama.cpp's `llama-server` (OpenAI-compatible routes, `/health`, `/metrics` with `--metrics`).

It stops generating for a slot when the client connection closes.
"""

from .base import Dialect, MetricNames

LLAMACPP = Dialect(
    name="llamacpp",
    health_path="/health",
    metrics=MetricNames(
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
)
