"""What the gateway needs to know about one engine dialect.

A `Dialect` answers: how to build the upstream request body, how to abort a request (beyond closing
its connection, which every dialect gets), where health and metrics live and what the metrics are
called. Dialects are stateless values; one module per engine defines one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest, message_from_body
from ..wire import ApiRequest


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Names of the load signals in an engine's Prometheus text (first match wins)."""

    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    #: KV-cache use as a fraction 0..1.
    kv_usage: tuple[str, ...] = ()
    #: Prefix-cache counters (cumulative, in tokens), from which the hit rate is computed.
    prefix_hits: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    #: Time per output token, cumulative: seconds (a histogram's `_sum`) and tokens (its `_count`).
    tpot_seconds: tuple[str, ...] = ()
    tpot_tokens: tuple[str, ...] = ()
    #: An info metric whose labels `num_gpu_blocks` and `block_size` give the KV cache's size.
    cache_info: tuple[str, ...] = ()
    #: A prefix-cache hit rate 0..1 the engine computes itself (for engines without the counters).
    prefix_hit_rate: tuple[str, ...] = ()

    def all(self) -> frozenset[str]:
        return frozenset(
            self.waiting
            + self.running
            + self.kv_usage
            + self.prefix_hits
            + self.prefix_queries
            + self.tpot_seconds
            + self.tpot_tokens
            + self.cache_info
            + self.prefix_hit_rate
        )


@dataclass(frozen=True, slots=True)
class AbortCall:
    """An extra HTTP call that tells the engine to stop a request."""

    method: str
    path: str
    json: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    metrics: MetricNames = field(default_factory=MetricNames)
    #: Body field carrying the request's priority (lower value = more urgent), if the engine has one.
    priority_field: str | None = None
    #: Body field carrying the gateway's request id, if the engine takes one (used to abort by id).
    request_id_field: str | None = None
    #: The engine honours `stream_options.include_usage`.
    stream_usage: bool = True
    #: The engine keeps prefix-cache blocks apart by the body's `cache_salt` (vLLM): the tenant's salt goes there
    #: (`ApiRequest.cache_salt`).
    cache_salt: bool = False
    #: The engine can continue a final assistant message (chat resumption after preemption).
    continue_final_message: bool = False
    #: The engine stops generating on disconnect only for streams: non-streaming client requests are
    #: sent upstream as streams (and assembled by the gateway) so that they can be aborted too.
    stream_upstream_always: bool = False
    #: The engine reports a stream's usage per choice, each for that choice alone (`assemble.ChoiceUsages` merges it).
    usage_per_choice: bool = False
    #: The engine closes the connection after a stream even when it advertised keep-alive.
    close_after_stream: bool = False
    #: Idle keep-alive connections are dropped after this long (must be below the engine's own timeout).
    keepalive_s: float = 15.0
    #: Where the engine says, in JSON, how many sequences it runs at once (llama.cpp `/props`, SGLang
    #: `/get_server_info`), and the top-level keys that carry the number: the instance's concurrency limit
    #: then starts there instead of being discovered from its queue (`fleet/capacity.py`).
    parallelism_path: str | None = None
    parallelism_keys: tuple[str, ...] = ()
    #: Where a one-token answer is asked of an engine that went silent in a call while its health check passed, before
    #: it takes traffic again (`fleet/answers.py`); None: its health check alone brings it back (a paid provider).
    answer_probe_path: str | None = "/v1/completions"
    #: Words of a 5xx error by which the engine blames the request itself (llama.cpp answers an embedding input
    #: longer than its batch with a 500): answered 400, neither retried elsewhere nor held against the engine.
    request_error_words: tuple[str, ...] = ()

    def request_error(self, status: int, body: bytes) -> bytes | None:
        """For an engine's 5xx that is really the request's fault: the 400 body to answer (OpenAI's envelope, the
        engine's message); None otherwise."""
        if status < 500 or not self.request_error_words:
            return None
        text = body.decode("utf-8", "replace")
        if not any(words in text for words in self.request_error_words):
            return None
        return InvalidRequest(message_from_body(body) or text, code="invalid_input").body_bytes()

    def upstream_body(
        self,
        request: ApiRequest,
        *,
        served_model: str,
        request_id: str,
        stream: bool,
        priority: int | None = None,
    ) -> dict[str, Any]:
        """The body sent to the engine: the client's body with the gateway's adjustments.

        The gateway always asks a stream for its usage (so records are exact) and strips the usage
        chunk again if the client did not ask for it.
        """
        body = dict(request.body)
        body["model"] = served_model
        if stream and not request.stream:
            body["stream"] = True
        if stream and self.stream_usage and request.endpoint.chunked:  # (a response's usage comes with it)
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        # The engine's queue order is the gateway's to set (`scheduling.engine_priority`): a client's own value
        # would let a batch request jump ahead of interactive ones inside the engine (or, behind a generic
        # OpenAI-compatible server, ask it for whatever it reads a `priority` as).
        body.pop("priority", None)
        if self.priority_field:
            body.pop(self.priority_field, None)
            if priority is not None:
                body[self.priority_field] = priority
        if self.request_id_field:
            body[self.request_id_field] = request_id
        if self.cache_salt and request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        return body

    def abort_call(self, request_id: str) -> AbortCall | None:
        """An explicit abort to send after closing the connection (None: closing is enough)."""
        return None

    def parallelism(self, document: Any) -> int | None:
        """How many sequences the engine runs at once, from what `parallelism_path` answered (None: it
        does not say; a missing, null, non-integer or non-positive value says nothing)."""
        if isinstance(document, dict):
            for key in self.parallelism_keys:
                found = positive_int(document.get(key))
                if found is not None:
                    return found
        return None


def positive_int(value: Any) -> int | None:
    """`value` if it is a positive integer (bools are not), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None
