"""Hugging Face text-generation-inference (Messages API on `/v1/chat/completions`).

`GET /info` carries `max_batch_size` when the server was started with one (usually null: TGI then sizes
its batch by tokens, and the limit is discovered from its queue like any other engine's).
"""

from .base import Dialect, MetricNames

TGI = Dialect(
    name="tgi",
    health_path="/health",
    answer_probe_path="/v1/chat/completions",
    metrics=MetricNames(
        waiting=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
    ),
    parallelism_path="/info",
    parallelism_keys=("max_batch_size",),
)
