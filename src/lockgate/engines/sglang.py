"""SGLang's OpenAI-compatible server.

SGLang notices a closed connection only when it next polls, so the gateway also calls
`POST /abort_request` with the request id (`rid`) it sent. `GET /get_server_info` carries its server
arguments, `max_running_requests` among them (null when left to SGLang's own sizing), and per scheduler
`internal_states`, where recent versions put the effective number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import AbortCall, Dialect, MetricNames, positive_int


@dataclass(frozen=True, slots=True)
class SGLangDialect(Dialect):
    def abort_call(self, request_id: str) -> AbortCall | None:
        return AbortCall("POST", "/abort_request", {"rid": request_id})

    def parallelism(self, document: Any) -> int | None:
        """The configured `max_running_requests`, else the schedulers' effective ones (summed: each
        data-parallel scheduler runs its own batch)."""
        found = Dialect.parallelism(self, document)
        if found is not None or not isinstance(document, dict):
            return found
        states = document.get("internal_states")
        if not isinstance(states, list):
            return None
        counts = [positive_int(s.get("max_running_requests")) for s in states if isinstance(s, dict)]
        known = [c for c in counts if c is not None]
        return sum(known) if known and len(known) == len(counts) else None


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
    parallelism_path="/get_server_info",
    parallelism_keys=("max_running_requests",),
)
