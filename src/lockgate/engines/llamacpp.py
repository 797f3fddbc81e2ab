"""llama.cpp's `llama-server` (OpenAI-compatible routes, `/health`, `/metrics` with `--metrics`).

Observed behaviour (docs/engines/llamacpp.md): it stops a slot when a *streaming* client disconnects,
but keeps generating a non-streaming request to the end, so the gateway always streams from it. It
closes the connection after a stream despite advertising keep-alive, and drops idle connections after
5 s. Its metrics have no KV-cache usage and no labels; it serves whatever `model` name it is sent. `/props`
says how many slots it has (`total_slots`).
"""

from .base import Dialect, MetricNames

LLAMACPP = Dialect(
    name="llamacpp",
    health_path="/health",
    metrics=MetricNames(
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        tpot_seconds=("llamacpp:tokens_predicted_seconds_total",),
        tpot_tokens=("llamacpp:tokens_predicted_total",),
    ),
    stream_upstream_always=True,
    # A completion's usage rides on each choice's finish chunk, a chat's on a usage-only chunk per choice.
    usage_per_choice=True,
    close_after_stream=True,
    keepalive_s=4.0,
    # `--parallel N` slots: exactly what it runs at once.
    parallelism_path="/props",
    parallelism_keys=("total_slots",),
    # `/v1/embeddings` with an input longer than its batch (`-b`, 512 by default): "input (601 tokens) is too large
    # to process. increase the physical batch size", with status 500.
    request_error_words=("is too large to process",),
)
