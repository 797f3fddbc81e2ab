"""Opening an engine call: route, send, and read up to the first event — retrying elsewhere while
nothing has reached any client.

Shared by the direct path (an `Exchange` holds the attempt) and by flights (a `Flight` holds it):
the holder receives each attempt's lease and call through `hold` the moment they exist and gives
them up through `drop`, so whoever owns the request owns the engine call at every `await`.

An attempt may be retried on another instance for a failed connect, a retryable status (500-503, or the
engine refusing the gateway's credentials: 401/403/407), for streams also a stream that breaks or ends before its
first event, and for a non-streaming client an answer that breaks before its end (read whole while opening:
`whole_limit`; an answer too large is not tried again). Retries are bounded by the model's `retries` and by the
request's deadline. A connection that failed (refused, or dropped before an answer) rules out every instance at
that address for the retry: the engines behind one sidecar share it; so does any failure of a sidecar's (it tried
its node's other engines before it answered). A preemptible generation that breaks later goes on elsewhere through
here too (`resume.py`: `exclude`, `after`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from .answer import read_whole
from .errors import GatewayError, UpstreamConnectError, UpstreamError, another_may_answer
from .fleet.instance import Lease  # at run time: the compiled build's dataclass resolves its field types
from .fleet.pool import Held, LongPrefillBusy
from .fleet.state import HOLD_MAX_S
from .routing.policies import RouteRequest
from .upstream import UpstreamCall, UpstreamEvents
from .wire import ApiRequest

if TYPE_CHECKING:
    from .fleet.fleet import Fleet
    from .fleet.instance import Instance
    from .fleet.pool import Pool
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
    #: The whole answer for a non-streaming client, read while opening (`open_attempts`' `whole_limit`): its body and
    #: the engine's bytes of it (None: assembled from a stream).
    whole: tuple[dict[str, Any], bytes | None] | None = None

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
    before_send: Callable[[Lease, bool], None] | None = None,
    whole_limit: int | None = None,
    exclude: frozenset[str] = frozenset(),
    after: UpstreamError | None = None,
) -> Opened:
    """Route and open the engine call (see the module docstring); `before_send` is called with each attempt's
    lease just before its request goes out, and whether the engine streams its answer (then the lease sees its
    first token): a strict request makes room there (`PoolScheduler.make_room`). `whole_limit`: read the whole
    answer before returning (`Opened.whole`, within that many bytes: `answer.read_whole`), for a client that
    receives nothing before it, so that an engine dying midway sends it elsewhere too. `exclude` and `after`: the
    instances an engine call that broke midway rules out (`ruled_out`) and its error, for the call that takes over
    its generation (`resume.py`): counted as a retry, and raised if no other instance can be tried."""
    tried: set[str] = set(exclude)
    attempts = pool.config.retries + 1
    last_error: UpstreamError | None = after
    for attempt in range(attempts):
        request = replace(route, exclude=frozenset(tried)) if tried else route
        try:
            pool, instance, cached = await _route(fleet, metrics, pool, request)
        except GatewayError:
            if last_error is not None:
                raise last_error from None  # nowhere else to go: the engine's error, and no retry happened
            raise
        if last_error is not None:
            metrics.retries.labels(api.model).inc()  # moved to another instance
        # Embeddings are one body from every engine (nothing to abort mid-way, nothing to stream). A strict request
        # that makes room (`before_send`) is read as a stream whatever its client asked, and answered whole: its first
        # token is seen, it holds its instance until then and what holds it up is stopped when it is due
        # (`PoolScheduler.make_room`). Read as one body, it was watched by nothing (an outside run: non-streamed P0
        # answers took 7-11 s behind 20 long P2 prompts, nothing stopped).
        stream = api.stream or (
            api.endpoint.generates
            and (instance.dialect.stream_upstream_always or (route.urgent and before_send is not None))
        )
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
            choices_per_prompt=api.choices_per_prompt(),
        )
        uncached = max(0, route.prompt_tokens - cached)
        lease = fleet.lease(
            instance,
            pool.model,
            uncached,
            route.prompt_tokens,
            route.stream and stream and pool.is_long(instance, uncached),
            whole=not stream,
        )
        hold(lease, call)
        if before_send is not None:
            before_send(lease, stream)
        try:
            await call.open()
            if call.served_by != instance.name:
                # Behind a sidecar that chose another engine of its node: the lease follows the work.
                served = pool.named(call.served_by)
                if served is not None:
                    lease.move(served)
            events = None
            if call.stream:
                events = call.events(lease)
                await events.read_first()
            opened = Opened(call, lease, events)
            if whole_limit is not None:
                opened.whole = await read_whole(opened, api, whole_limit)
            return opened
        except UpstreamError as exc:
            drop()
            if route.pin_only and route.pin is not None and another_may_answer(exc):
                # The one engine that holds the previous response failed as another would be tried for (refused, a
                # 5xx, broke): the follow-up is to retry shortly, as when it is known to be out (an outside run: the
                # first follow-up after its engine crashed was 502, the next ones 503).
                raise pool.home_unavailable(route.pin) from None
            # Nothing reached a client yet: a stream that broke before its first event may go elsewhere (an answer
            # read whole, before its end).
            if not another_may_answer(exc) or attempt + 1 == attempts or not time_left():
                raise
            last_error = exc
            tried |= ruled_out(pool, instance, exc)
    raise AssertionError("unreachable")  # pragma: no cover


def ruled_out(pool: Pool, instance: Instance, exc: UpstreamError) -> set[str]:
    """The instances a failure of `instance` with `exc` rules out for another try: itself, and when the address
    failed, not only this engine, every instance there: behind a sidecar that died with the request on it, the
    engines beside this one are gone too (a refused connection ejects them, a dropped one does not); and a sidecar
    that answered an error had tried its node's other engines itself (its own retries)."""
    if isinstance(exc, UpstreamConnectError) or instance.published is not None:
        return {instance.key} | {other.key for other in pool.instances if other.url == instance.url}
    return {instance.key}


class Failover:
    """A generation's engine calls that broke after they opened and were taken over elsewhere (a preemptible request's,
    `resume.py`; a flight's, `dedup/flight.py`): at most the model's `retries` of them, the instances their breaks
    ruled out for the rest of the generation (`ruled_out`), and the last break's error, for the call that takes over
    (`open_attempts`' `exclude` and `after`: raised if no other instance can be tried)."""

    __slots__ = ("_error", "_left", "_pool", "excluded")

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._left = pool.config.retries
        self.excluded: frozenset[str] = frozenset()
        self._error: UpstreamError | None = None

    def take(self, exc: UpstreamError, instance: Instance) -> bool:
        """Whether a call to `instance` that broke with `exc` may be taken over elsewhere (`another_may_answer`, within
        the budget); if so, counted, and the instances it rules out remembered."""
        if self._left <= 0 or not another_may_answer(exc):
            return False
        self._left -= 1
        self.excluded |= ruled_out(self._pool, instance, exc)
        self._error = exc
        return True

    def error(self) -> UpstreamError | None:
        """The break the next engine call takes over (once: a later call, after a preemption, takes over none)."""
        error, self._error = self._error, None
        return error


async def _route(
    fleet: Fleet, metrics: GatewayMetrics, pool: Pool, request: RouteRequest
) -> tuple[Pool, Instance, int]:
    """The pool and instance an attempt goes to (`_choose`), after a long prompt's turn (`_take_turn`) or, for a
    request of a class that is not strict, after the first token of a strict request holding every candidate
    (`Held`), at most `HOLD_MAX_S` in all: then routed as if nothing held them. Nothing is held for either wait (but
    the request's scheduler slot), and a cancel or the deadline lands there. Each wait is counted once a request."""
    long_waited = False
    held_since: float | None = None
    while True:
        try:
            choice = _choose(fleet, pool, request)
            if choice is not None:
                return choice
        except Held:
            pass  # (waited for below: no `await` in a handler, see `relay.py`)
        else:
            if not long_waited:
                long_waited = True
                metrics.long_prefill_waits.labels(pool.model).inc()
            try:
                return await _take_turn(fleet, pool, request)
            except Held:
                pass
        now = time.monotonic()
        if held_since is None:
            held_since = now
            metrics.strict_first_token_waits.labels(pool.model).inc()
        left = HOLD_MAX_S - (now - held_since)
        pool = fleet.pools.get(pool.model, pool)
        if left <= 0 or pool.unheld(request):
            # Waited long enough, or the policy takes none of the instances not held (none has room): routed as if
            # nothing held them, rather than waiting for what is already there (which would never suspend).
            request = replace(request, yields=False)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, pool.hold_left(request))):
                await fleet.prefills.wait_until(functools.partial(pool.unheld, request))


def _choose(fleet: Fleet, pool: Pool, request: RouteRequest) -> tuple[Pool, Instance, int] | None:
    """The model's pool as configured now (a reload since the request arrived, or was queued, may have replaced
    it, and its old instances no longer take requests) and its choice of instance; None for a long prompt while
    every candidate is prefilling one (`_take_turn`)."""
    pool = fleet.pools.get(pool.model, pool)
    try:
        instance, cached = pool.choose(request)
    except LongPrefillBusy:
        return None
    return pool, instance, cached


async def _take_turn(fleet: Fleet, pool: Pool, request: RouteRequest) -> tuple[Pool, Instance, int]:
    """A long prompt's wait for a turn (`Pool.is_long`), then its choice (`Held` as `_choose`)."""
    while True:
        pool = fleet.pools.get(pool.model, pool)
        await fleet.prefills.wait_until(functools.partial(pool.long_turn, request))
        choice = _choose(fleet, pool, request)
        if choice is None and pool.long_turn(request):
            # A candidate has no long prefill, yet the policy takes none of them: routed as if turns were off
            # rather than waiting again for a turn that is already there (which would never suspend).
            choice = _choose(fleet, pool, replace(request, stream=False))
        if choice is not None:
            return choice
