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
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from .errors import GatewayError, UpstreamError, UpstreamProtocolError
from .fleet.instance import Lease  # at run time: the compiled build's dataclass resolves its field types
from .routing.policies import RouteRequest
from .upstream import UpstreamCall, UpstreamEvents
from .wire import ApiRequest

if TYPE_CHECKING:
    from .fleet.pool import Fleet, Pool
    from .metrics import GatewayMetrics

T = TypeVar("T")


@dataclass(slots=True)
class Opened:
    """An opened engine call. A stream is read through `events()`: the events read ahead while opening,
    then the rest. A class rather than async generators, so that mypyc can compile it: the holder
    closes it with `close()` (synchronous, idempotent; `aclose()` is the same for callers written for
    async generators), which ends the iteration; the call itself belongs to the holder."""

    call: UpstreamCall
    lease: Lease
    #: Stream events already read (the network reads up to the first event with choices), each with the
    #: engine's bytes of it and whether it carries a token, and the rest of the stream.
    head: list[tuple[dict[str, Any], bytes, bool]]
    rest: UpstreamEvents | None
    closed: bool = False
    #: After `take()`: the stream is over, nothing more to take (plain attributes, not properties: a reader
    #: following the stream asks after every read).
    ended: bool = False
    #: After `take()`: the stream broke after the events it returned; the next `take()` raises why.
    broken: bool = False
    #: Events are here that `take()` did not return: never, it returns all of them (a read's worth).
    backlog: bool = False

    def events(self) -> Opened:
        """The whole stream (the events read ahead, then the rest), counting tokens for the
        instance's TPOT: this object, iterated once."""
        return self

    def __aiter__(self) -> Opened:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.closed:
            raise StopAsyncIteration
        if self.head:
            event, _, content = self.head.pop(0)
        else:
            rest = self.rest
            assert rest is not None
            # An event already taken needs no coroutine of the engine stream's (one per event, in pure Python).
            ready = rest.next_nowait()
            event, _, content = ready if ready is not None else await rest.__anext__()
        self.lease.completion_tokens += content
        return event

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
        """Every event that can be had without waiting (the events read ahead while opening, then
        `UpstreamEvents.take`), with the engine's bytes of each and whether it carries a token; `ended` and
        `broken` then say what follows. Counts tokens like `__anext__`. Not to be mixed with iterating."""
        if self.closed:
            return []
        rest = self.rest
        assert rest is not None
        out = self.head
        if out:
            self.head = []
            if not rest.broken:  # a break after the events read ahead is raised at the next take
                out += rest.take()
        else:
            out = rest.take()
        self.ended, self.broken = rest.ended, rest.broken
        tokens = 0
        for _, _, content in out:
            tokens += content
        self.lease.completion_tokens += tokens
        return out

    async def follow(self, step: Callable[[], T | None]) -> T:
        """Call `step` (which takes what is here with `take()`) at once and then from the engine connection's
        callback at each read, until it returns something (`Response.follow`)."""
        assert self.rest is not None
        return await self.rest.response.follow(step)

    def close(self) -> None:
        self.closed = self.ended = True
        self.broken = False
        if self.rest is not None:
            self.rest.close()

    async def aclose(self) -> None:
        self.close()


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
                return Opened(call, lease, [], None)
            rest = call.events()
            head = await _first_events(rest, call, lease)
            return Opened(call, lease, head, rest)
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


async def _first_events(
    events: UpstreamEvents, call: UpstreamCall, lease: Lease
) -> list[tuple[dict[str, Any], bytes, bool]]:
    """Read the stream, a network read at a time, up to the read that brought its first event with choices
    (the events after it in that read come along); nothing has been sent to a client yet."""
    head: list[tuple[dict[str, Any], bytes, bool]] = []
    try:
        while not events.ended:
            taken = events.take()
            head += taken
            if any(event.get("choices") for event, _, _ in taken):
                lease.first_token()
                return head
            if not taken:
                await events.response.wait()
    except BaseException:
        events.close()  # no `await` in a handler (see `relay.py`)
        raise
    raise UpstreamProtocolError(f"Instance {call.instance.name} sent an empty stream.")
