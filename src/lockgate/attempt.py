"""Opening an engine call: route, send, and read up to the first event — retrying elsewhere while
nothing has reached any client.

Shared by the direct path (an `Exchange` holds the attempt) and by flights (a `Flight` holds it):
the holder receives each attempt's lease and call through `hold` the moment they exist and gives
them up through `drop`, so whoever owns the request owns the engine call at every `await`.

An attempt may be retried on another instance for a failed connect, a retryable status (502/503),
and for streams also a stream that breaks or ends before its first event. Retries are bounded by
the model's `retries` and by the request's deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import orjson

from .errors import GatewayError, UpstreamError, UpstreamProtocolError
from .fleet.instance import Lease  # at run time: the compiled build's dataclass resolves its field types
from .routing.policies import RouteRequest
from .upstream import UpstreamCall, UpstreamEvents
from .wire import ApiRequest

if TYPE_CHECKING:
    from .fleet.pool import Fleet, Pool
    from .metrics import GatewayMetrics


@dataclass(slots=True)
class Opened:
    """An opened engine call, its lease, and for a stream its events (`UpstreamEvents`: the events read ahead
    while opening, then the rest), which a holder takes read by read (`take`/`follow`) or iterates. The holder
    closes it with `close()` (synchronous, idempotent), which ends the events; the call itself belongs to the
    holder."""

    call: UpstreamCall
    lease: Lease
    #: The stream's events (None: the engine answers with one JSON body).
    events: UpstreamEvents | None

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


async def open_attempts(
    fleet: Fleet,
    metrics: GatewayMetrics,
    pool: Pool,
    api: ApiRequest,
    route: RouteRequest,
    request_id: str,
    *,
    hold: Callable[[Lease, UpstreamCall], None],
    drop: Callable[[], object],
    time_left: Callable[[], bool],
    priority: int | None = None,
) -> Opened:
    tried: set[str] = set()
    attempts = pool.config.retries + 1
    last_error: UpstreamError | None = None
    for attempt in range(attempts):
        # The model's pool as configured now: a reload since the request arrived (or was queued) may
        # have replaced it, and its old instances no longer take requests.
        pool = fleet.pools.get(pool.model, pool)
        try:
            instance, cached = pool.choose(replace(route, exclude=frozenset(tried)) if tried else route)
        except GatewayError:
            if last_error is not None:
                raise last_error from None
            raise
        # Embeddings are one body from every engine (nothing to abort mid-way, nothing to stream).
        stream = api.stream or (instance.dialect.stream_upstream_always and api.endpoint.generates)
        body = instance.dialect.upstream_body(
            api, served_model=pool.served[instance.key], request_id=request_id, stream=stream, priority=priority
        )
        call = UpstreamCall(
            fleet,
            metrics,
            instance,
            api.endpoint.path,
            orjson.dumps(body),
            request_id,
            stream=stream,
            # Only a sidecar (an engine published through etcd) is told whose request it is.
            headers=api.trace_headers + api.relay_headers if instance.published is not None else api.trace_headers,
        )
        lease = fleet.lease(instance, max(0, route.prompt_tokens - cached), route.prompt_tokens)
        hold(lease, call)
        try:
            await call.open()
            if call.served_by != instance.name:
                # Behind a sidecar that chose another engine of its node: the lease follows the work.
                served = pool.named(call.served_by)
                if served is not None:
                    lease.move(served)
            if not call.stream:
                return Opened(call, lease, None)
            events = call.events(lease)
            await events.read_first()
            return Opened(call, lease, events)
        except UpstreamError as exc:
            drop()
            # Nothing reached a client yet: a stream that broke before its first event may go elsewhere.
            retryable = exc.retryable or isinstance(exc, UpstreamProtocolError)
            if not retryable or attempt + 1 == attempts or not time_left():
                raise
            last_error = exc
            tried.add(instance.key)
            metrics.retries.labels(api.model).inc()
    raise AssertionError("unreachable")  # pragma: no cover
