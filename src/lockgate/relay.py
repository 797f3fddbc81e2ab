"""The direct request path: route, call the engine (retrying elsewhere before the first byte), relay
back. Requests that may be de-duplicated go to `dedup` instead, and preemptible ones to `resume`, which opens its
engine calls with `open_engine` too (`Gateway._admit_then_serve` decides).

Runs inside `Exchange.run()`, which owns every resource this code acquires and decides how the
request ends; nothing here needs to clean up after itself on cancellation.

No `await` inside an `except` or `finally` block here (nor in any module the compiled build compiles,
`setup.py`; a test checks): a mypyc-compiled coroutine that is suspended while handling an exception —
a cancellation above all, which reaches it through `throw()` with no interpreted frame in between —
leaves that exception as the thread's "exception being handled", for good, so that every later
exception anywhere in the process chains it (and those before it) as its context. Cleanup is synchronous.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from .attempt import Opened, open_attempts
from .edge.server import Reply, Request
from .exchange import Exchange, Phase
from .respond import pump, whole_body

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .errors import UpstreamError
    from .fleet.fleet import Fleet
    from .fleet.instance import Lease
    from .fleet.pool import HeaderLookup
    from .upstream import UpstreamCall
    from .wire import ApiRequest


async def relay(
    ex: Exchange,
    http_request: Request,
    fleet: Fleet,
    before_send: Callable[[Lease, bool], None] | None = None,
) -> Reply:
    """An admitted request that is not de-duplicated, straight from an engine of `fleet` (`before_send`: see
    `open_attempts`)."""
    # A non-streaming client's answer is read whole while opening: one that breaks midway goes elsewhere.
    whole_limit = None if ex.api.stream else fleet.upstream.max_response_bytes
    opened = await open_engine(ex, fleet, ex.api, http_request.headers, ex.id, before_send, whole_limit)
    ex.served_by(opened.call.served_by)
    try:
        if opened.whole is not None:
            body, raw = opened.whole
            return whole_body(ex, body, _headers(ex), raw)
        return await _relay_stream(ex, http_request, opened)
    finally:
        opened.close()


def open_engine(
    ex: Exchange,
    fleet: Fleet,
    api: ApiRequest,
    headers: HeaderLookup,
    upstream_id: str,
    before_send: Callable[[Lease, bool], None] | None = None,
    whole_limit: int | None = None,
    exclude: frozenset[str] = frozenset(),
    after: UpstreamError | None = None,
    resent: bool = False,
) -> Awaitable[Opened]:
    """Route `api` (the request's own, or a resumed one's continuation) and open its engine call, retrying elsewhere
    before the first byte (`open_attempts`, `whole_limit`, `exclude` and `after` too; `resent`: `RouteRequest.resent`);
    `ex` holds each attempt's lease and call, within its deadline (`in_time`)."""

    def hold(lease: Lease, call: UpstreamCall) -> None:
        ex.attach(lease, call)
        ex.phase = Phase.CONNECTING

    return open_attempts(
        fleet,
        ex.host.metrics,
        ex.pool,
        api,
        ex.pool.route_request(api, headers, ex.urgent, ex.yields, resent),
        upstream_id,
        hold=hold,
        drop=ex.detach,
        time_left=functools.partial(in_time, ex),
        priority=ex.engine_priority,
        before_send=before_send,
        whole_limit=whole_limit,
        exclude=exclude,
        after=after,
    )


def in_time(ex: Exchange) -> bool:
    """Whether the request's deadline leaves time for another engine call."""
    return ex.deadline_s is None or time.perf_counter() - ex.started < ex.deadline_s


def _headers(ex: Exchange) -> dict[str, str]:
    return {
        "x-request-id": ex.record.client_request_id or ex.id,
        "x-lockgate-instance": ex.record.instance or "",
        **ex.response_headers,
        "x-lockgate-cache": "bypass",
    }


async def _relay_stream(ex: Exchange, http_request: Request, opened: Opened) -> Reply:
    assert opened.events is not None  # a streaming client's engine call is a stream
    return await pump(ex, http_request, opened.events, _headers(ex))
