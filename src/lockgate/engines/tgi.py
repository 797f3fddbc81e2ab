"""Hugging Face text-generation-inference (Messages API on `/v1/chat/completions`)."""

from .base import Dialect, MetricNames

TGI = Dialect(
    name="tgi",
    health_path="/health",
    metrics=MetricNames(
        waiting=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
    ),
)
