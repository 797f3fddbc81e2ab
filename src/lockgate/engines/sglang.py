"""SGLang's OpenAI-compatible server.

SGLang notices a closed connection only when it next polls, so the gateway also calls
`POST /abort_request` with the request id (`rid`) it sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import AbortCall, Dialect, MetricNames


@dataclass(frozen=True, slots=True)
class SGLangDialect(Dialect):
    def abort_call(self, request_id: str) -> AbortCall | None:
        return AbortCall("POST", "/abort_request", {"rid": request_id})


SGLANG = SGLangDialect(
    name="sglang",
    health_path="/health",
    metrics=MetricNames(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
        prefix_hit_rate=("sglang:cache_hit_rate",),
    ),
    priority_field="priority",
    request_id_field="rid",
    continue_final_message=True,
)
