"""The de-duplication front: decide how an eligible request is served, then serve it.

`plan()` runs for every request and must stay cheap: a mode check and two dict lookups decide
eligibility; only eligible requests are fingerprinted. `serve()` then takes, in one synchronous step,
the first of: a completed result in the cache (`hit`), a flight in progress to join (`coalesced`), or a
new flight to lead (`miss`). Only a leader takes a slot at the scheduler: a hit or a joiner never waits
behind other requests for one (a request queued for a slot joins a flight that starts meanwhile). The
request's `Exchange` holds its subscription and releases it in `_release()`, so a disconnecting client
unsubscribes at once; the flight (not the client) owns the engine call.

A new flight asks the engine for what its leader asked for: a stream for a streaming leader, one JSON
body for a non-streaming one (no stream to read and fold) — unless the model's clients were recently seen
mixing (`Flights.leads_json`), when every flight streams. Non-streaming clients take a JSON flight's
body (each with its own response id); streaming clients never join a JSON flight (they would get
nothing before the whole answer): they join or lead a streaming flight. A completed result of either
kind serves both: events are folded for a non-streaming client, a body becomes a synthesized stream
(`synthesize.py`) for a streaming one.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ..edge.server import Reply, Request
from ..errors import UpstreamError
from ..exchange import Phase
from ..respond import pump, stream_events, whole_body
from ..responses import whole_answer
from ..semantic import MiniLM, SemanticCache
from ..wire import Endpoint
from .cache import Result, ResultCache
from .eligibility import eligible
from .fingerprint import Fingerprint, fingerprint
from .flight import Flight, Subscription
from .flights import Flights
from .metrics import DedupMetrics
from .synthesize import events_of
from .waiting import Waiting

if TYPE_CHECKING:
    from ..attempt import Failover
    from ..config import Config
    from ..exchange import Exchange
    from ..fleet.fleet import Fleet
    from ..fleet.instance import Lease
    from ..metrics import GatewayMetrics
    from ..semantic import Embedder, Probe
    from ..wire import ApiRequest
    from .stoppable import StoppableFlight

CACHE_HEADER = "x-lockgate-cache"


class Slot(Protocol):
    """A request's place at its pool's scheduler (`admission.gate.Slot`), taken only to lead a flight."""

    #: Its class (lower: more urgent).
    klass: int

    def offer(self) -> bool:
        """Ask for it; True if granted at once, else queued (`wait`)."""
        ...

    async def wait(self, unless: asyncio.Future[None] | None = None) -> bool:
        """True once granted; False if `unless` was done first (then no longer queued)."""
        ...

    async def wait_behind(self, woken: asyncio.Future[None]) -> None:
        """Wait with no ticket until `woken` is done, within the request's own queue deadline."""
        ...

    def give_back(self) -> None: ...

    def hand_over(self) -> Callable[[], None]:
        """The granted slot's release, for the flight it now serves."""
        ...

    def regranted(self) -> Callable[[], Awaitable[bool]]:
        """How the flight it serves waits, after a stop, until it is granted again."""
        ...


class Coalescer:
    def __init__(
        self,
        config: Config,
        metrics: GatewayMetrics,
        fleet: Fleet,
        *,
        clock: Callable[[], float] = time.monotonic,
        embedder: Embedder | None = None,
    ) -> None:
        rc = config.result_cache
        self._clock = clock
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._closed = False
        #: Every client served from a flight or the cache gets its own response id: this prefix and a counter.
        self._response_prefix = os.urandom(6).hex()
        self._response_count = itertools.count(1)
        self.cache = ResultCache(
            max_entries=rc.max_entries,
            max_bytes=rc.max_bytes,
            ttl_ms=rc.ttl_ms,
            max_entry_bytes=rc.max_entry_bytes,
            clock=clock,
            on_stored=self._stored,
        )
        self.flights = Flights(fleet, metrics, self.cache, config.flights, clock=clock)
        #: A non-streaming client's answer, assembled from a flight's events, may not be larger than this.
        self.max_response_bytes = config.upstream.max_response_bytes
        self.metrics = DedupMetrics(metrics.registry)
        self.metrics.bind(lambda: len(self.flights), lambda: len(self.cache), lambda: self.cache.nbytes)
        #: Requests waiting for a slot to lead a flight (`waiting.py`).
        self.waiting = Waiting()
        #: Semantic caches of the models that configure one (loading the embedding model once).
        self.semantic: dict[str, SemanticCache] = {}
        configured = [m for m in config.models if m.semantic is not None and m.dedup != "off"]
        if configured:
            shared = embedder or MiniLM()
            for model in configured:
                sc = model.semantic
                assert sc is not None
                cache = self.semantic[model.name] = SemanticCache(
                    shared,
                    threshold=sc.threshold,
                    shadow=sc.shadow,
                    max_entries=sc.max_entries,
                    ttl_ms=sc.ttl_ms,
                    max_bytes=sc.max_bytes,
                    clock=clock,
                )
                self.metrics.bind_semantic(model.name, cache.entries, cache.bytes_held)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        await self.flights.aclose()

    # --- expiry of cached results ----------------------------------------------------------------
    def _stored(self, key: Fingerprint) -> None:
        """A result was stored: those waiting to lead a flight for it are served by it; its expiry is timed."""
        self.waiting.stored(key)
        self._arm_sweep()

    def _arm_sweep(self) -> None:
        """Make sure a timer drops the cache's oldest entry when it expires (one timer at a time)."""
        if self._sweep_timer is not None or self._closed:
            return
        expiry = self.cache.next_expiry()
        if expiry is not None:
            delay = max(0.0, expiry - self._clock())
            self._sweep_timer = asyncio.get_running_loop().call_later(delay, self.sweep)

    def sweep(self) -> None:
        """Drop the expired results now (the timer's callback), and wait for the next expiry."""
        self._sweep_timer = None
        self.cache.sweep()
        self._arm_sweep()

    # --- the decision (synchronous, on every request) -------------------------------------------
    def plan(self, ex: Exchange, cache_control: str | None) -> Fingerprint | None:
        """The request's fingerprint if it may be de-duplicated, else None (its outcome `bypass`; an eligible
        request's is `miss` until something serves it: `Exchange.dedup_outcome`)."""
        api = ex.api
        # Flights share token streams: embeddings (one body) are not coalesced.
        if not api.endpoint.generates or not eligible(ex.pool.config.dedup, api.body, cache_control):
            ex.dedup_outcome = "bypass"
            return None
        ex.dedup_outcome = "miss"
        return fingerprint(ex.scope, api.endpoint, api.body)

    # --- serving ---------------------------------------------------------------------------------
    async def serve(
        self,
        ex: Exchange,
        http_request: Request,
        key: Fingerprint,
        slot: Slot,
        before_send: Callable[[Lease, bool], None] | None = None,
        stoppable: StoppableFlight | None = None,
    ) -> Reply:
        """Serve `ex` from a cached result, a flight in progress, the semantic cache, or else a new flight that it
        leads: only then does it take `slot` (its place at the scheduler, handed over to the flight), and
        `before_send` goes with the flight's engine calls (see `attempt.open_attempts`). While it waits for the slot,
        something may serve it without one (`_wait_to_lead`). `stoppable`, the slot's tag for a preemptible class, is
        given the flight it leads (`dedup.stoppable`). A non-streaming client whose flight broke after a streaming one
        was sent part of it starts over (`Flight.again`): as a new flight's leader or another's client."""
        failover: Failover | None = None
        while True:
            try:
                return await self._serve(ex, http_request, key, slot, before_send, stoppable, failover)
            except _Again as again:
                failover = again.failover
                ex.detach()  # (its subscription to the broken flight)
                ex.record.instance = None

    async def _serve(
        self,
        ex: Exchange,
        http_request: Request,
        key: Fingerprint,
        slot: Slot,
        before_send: Callable[[Lease, bool], None] | None,
        stoppable: StoppableFlight | None,
        failover: Failover | None,
    ) -> Reply:
        joined = self._join(ex, key)
        if joined is not None:
            return await self._respond(ex, http_request, *joined)
        semantic = self.semantic.get(ex.pool.model)
        probe: Probe | None = None
        if semantic is not None:
            probe = await semantic.probe(ex.scope, ex.api)
            joined = self._join(ex, key)  # the world may have changed while the text was embedded
            if joined is None and probe is not None:
                joined = self._semantic_hit(ex, semantic, probe)
            if joined is not None:
                return await self._respond(ex, http_request, *joined)
        joined = await self._wait_to_lead(ex, key, slot, semantic, probe)
        if joined is not None:
            return await self._respond(ex, http_request, *joined)
        # Lead a new flight (synchronously after the last check: nobody can start a second one).
        # (A response's flight always streams: a stored result is then its events, replayed as they came.)
        api = ex.api
        stream = api.stream or not api.endpoint.chunked or not self.flights.leads_json(ex.pool.model)
        flight = self.flights.start(
            key,
            ex.pool,
            upstream_request(ex.api, stream=stream),
            ex.pool.route_request(ex.api, http_request.headers, ex.urgent, ex.yields),
            before_send,
            failover,
        )
        flight.release_slot = slot.hand_over()  # the flight's engine call holds the slot, even once its leader left
        if stoppable is not None:
            chat_continuation = all(i.continues_chat for i in ex.pool.instances)
            stoppable.attach(flight, slot.regranted(), chat_continuation=chat_continuation)
        if ex.allowance is not None:
            flight.settle_allowance = ex.allowance.share()  # and counts as the tenant's work until it ends
        self.waiting.flight_started(key, stream)
        if semantic is not None and probe is not None:
            flight.on_completed = functools.partial(semantic.add, probe)
        return await self._respond(ex, http_request, "miss", self._subscribe(ex, flight), None)

    async def _wait_to_lead(
        self, ex: Exchange, key: Fingerprint, slot: Slot, semantic: SemanticCache | None, probe: Probe | None
    ) -> tuple[str, Any, Result | None] | None:
        """Take `slot` to lead a flight: None once it is granted, or what serves the request without one if that
        comes first (`waiting.py`: a flight to join, a result stored), the slot then given back. Waits behind an
        identical request queued to lead, without a ticket of its own."""
        while True:
            behind = self.waiting.ahead(key, ex.api.stream, slot.klass)
            if not behind and slot.offer():
                return None
            woken = self.waiting.add(key, ex.api.stream, None if behind else slot.klass)
            try:
                granted = False
                if behind:
                    await slot.wait_behind(woken)
                else:
                    granted = await slot.wait(woken)
            finally:
                self.waiting.remove(key, woken)
            joined = self._join(ex, key)
            if joined is None and semantic is not None and probe is not None and not semantic.shadow:
                joined = self._semantic_hit(ex, semantic, probe)
            if joined is not None:
                slot.give_back()
                return joined
            if granted:
                return None
            # Woken, but nothing to join (a flight ended before it could, the request ahead left): look again.

    def _semantic_hit(self, ex: Exchange, semantic: SemanticCache, probe: Probe) -> tuple[str, Any, Result] | None:
        """A completed answer to a paraphrase (None also in shadow mode, where a would-be hit is only counted)."""
        hit = semantic.lookup(probe)
        if hit is None:
            return None
        if semantic.shadow:
            self.metrics.outcome("semantic_shadow")
            return None
        # (An outside run: the answer's usage counted the other question's prompt, and so did the record and the
        # tenant's token limits. At the gateway's estimate of ~4 characters a token, the difference of the two texts.)
        ex.prompt_tokens_delta = round((len(probe.text) - len(hit.text)) / 4)
        return "semantic", self._replay(ex, hit.result), hit.result

    def _join(self, ex: Exchange, key: Fingerprint) -> tuple[str, Any, Result | None] | None:
        """A cached result or a flight in progress for this fingerprint (synchronous)."""
        result = self.cache.get(key)
        if result is not None:
            return "hit", self._replay(ex, result), result
        flight = self.flights.get(key, stream=ex.api.stream)
        if flight is not None:
            return "coalesced", self._subscribe(ex, flight), None
        return None

    @staticmethod
    def _replay(ex: Exchange, result: Result) -> _Replay | None:
        """A completed result as a stream, for a streaming client (None for a non-streaming one)."""
        if not ex.api.stream:
            return None
        body = result.body
        return _Replay(result.events if body is None else events_of(ex.api.endpoint, body))

    @staticmethod
    def _subscribe(ex: Exchange, flight: Flight) -> Subscription:
        subscription = flight.subscribe()
        ex.subscribe(subscription)
        ex.phase = Phase.CONNECTING
        return subscription

    async def _respond(
        self,
        ex: Exchange,
        http_request: Request,
        outcome: str,
        source: Any,
        cached: Result | None,
    ) -> Reply:
        ex.record.served_by = ex.dedup_outcome = outcome
        # On every answer, the engine's errors included (the exchange's error response carries these headers).
        ex.response_headers[CACHE_HEADER] = outcome
        if cached is not None:
            ex.served_from = cached.instance
        if ex.api.stream:
            response = await self._stream(ex, http_request, source)
        elif cached is not None:
            body = cached.body
            response = self._whole(ex, body, cached.events if body is None else (), source, cached.finished_at)
        elif source.flight.stream:
            try:
                events = await source.wait_done(self.max_response_bytes)
            except UpstreamError:
                again = source.flight.again
                if again is None:
                    raise
                raise _Again(again) from None
            response = self._whole(ex, None, events, source, source.flight.finished_at)
        else:
            response = self._whole(ex, await source.wait_body(), (), source)
        if ex.prompt_tokens_delta:
            ex.record.prompt_tokens = max(1, ex.record.prompt_tokens + ex.prompt_tokens_delta)
        if outcome != "miss":
            self.metrics.saved(ex.record.prompt_tokens, ex.record.completion_tokens)
        return response

    @staticmethod
    def _headers(ex: Exchange, source: Any) -> dict[str, str]:
        """The answer's headers; a flight's client also records the engine that produced it (known by now: the
        headers go out with the answer's first byte)."""
        headers = {"x-request-id": ex.record.client_request_id or ex.id, **ex.response_headers}
        if isinstance(source, Subscription) and source.flight.served_by is not None:  # (a cache hit used none)
            ex.served_by(source.flight.served_by)
            headers["x-lockgate-instance"] = source.flight.served_by
        return headers

    def _whole(
        self,
        ex: Exchange,
        body: dict[str, Any] | None,
        events: tuple[dict[str, Any], ...] | list[dict[str, Any]],
        source: Any,
        finished_at: float | None = None,
    ) -> Reply:
        """A non-streaming answer from a shared body (copied: every client gets its own id) or from events (ended at
        `finished_at`, wall clock)."""
        endpoint = ex.api.endpoint
        if body is not None:  # (a completion: a response's flight always streams)
            out = {**body, "id": self._response_id(endpoint)}
        else:
            # A response keeps the engine's id (the one it may have stored, for follow-ups): no id of ours.
            response_id = self._response_id(endpoint) if endpoint.chunked else None
            out = whole_answer(ex.api, events, response_id, finished_at=finished_at)
        return whole_body(ex, out, self._headers(ex, source))

    async def _stream(self, ex: Exchange, http_request: Request, source: Subscription | _Replay) -> Reply:
        headers = self._headers(ex, source)
        if isinstance(source, _Replay):
            own_id = self._response_id(ex.api.endpoint)
            return await stream_events(ex, http_request, source, headers, response_id=own_id, ready=source.ready)
        # A streaming flight's leader sees the engine's stream as it is (its id included): the engine's bytes go
        # out unchanged where its view leaves an event unchanged, as on the direct path. Written from the
        # flight's callbacks, as each event arrives.
        response_id = None if source.passes_through else self._response_id(ex.api.endpoint)
        return await pump(ex, http_request, source, headers, response_id=response_id, instance=source.instance)

    def _response_id(self, endpoint: Endpoint) -> str:
        """A response id unique to this gateway's run (a random prefix and a counter: no system call)."""
        prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
        return f"{prefix}{self._response_prefix}{next(self._response_count):x}"

    def forget_response(self, engine_id: str) -> None:
        """A stored response was deleted (`DELETE /v1/responses/{id}` through this gateway): cached results carrying
        its id go, and none carrying it is stored for a TTL (a flight still running), so that no later identical
        request is handed an id that no longer exists."""
        self.cache.forget_mentioning(b'"' + engine_id.encode() + b'"')

    def forget_models(self, models: Iterable[str]) -> None:
        """Models a reload removed: their semantic caches go with them (one added again under the name, perhaps in
        front of other engines, must not answer from the answers of before; a new cache needs a restart)."""
        for model in models:
            if self.semantic.pop(model, None) is not None:
                self.metrics.unbind_semantic(model)

    def statistics(self) -> dict[str, Any]:
        statistics = {"flights": self.flights.statistics(), "cache": self.cache.statistics()}
        if self.semantic:
            statistics["semantic"] = {model: cache.statistics() for model, cache in self.semantic.items()}
        return statistics


def upstream_request(api: ApiRequest, *, stream: bool) -> ApiRequest:
    """The request a flight sends: a stream with usage (whoever joins later asks for usage or not), or one
    JSON body (which carries its usage) for a non-streaming leader: its own request (validation refuses
    `stream_options` without `stream`)."""
    if not stream:
        assert not api.stream, "a streaming leader's flight streams"
        return api
    body = {k: v for k, v in api.body.items() if k not in ("stream", "stream_options")}
    body["stream"] = True
    return api.streamed_with_usage(body)


class _Again(Exception):
    """A non-streaming client's flight broke after a streaming client of it was sent part of the generation
    (`Flight.again`): it starts over elsewhere, the break counted against the same retries."""

    def __init__(self, failover: Failover) -> None:
        super().__init__("the flight broke: started over")
        self.failover = failover


class _Replay:
    """A cached result's events as an async iterator (the same interface as a subscription)."""

    __slots__ = ("_events", "_index")

    def __init__(self, events: tuple[dict[str, Any], ...]) -> None:
        self._events = events
        self._index = 0

    def __aiter__(self) -> _Replay:
        return self

    def ready(self) -> bool:
        return True  # a replay never waits: its next step is an event or the end

    async def __anext__(self) -> dict[str, Any]:
        if self._index >= len(self._events):
            raise StopAsyncIteration
        self._index += 1
        return self._events[self._index - 1]
