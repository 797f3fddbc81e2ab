"""A flight: one upstream generation shared by every client asking for the same fingerprint.

Theory of operation
-------------------
A `Flight` owns its engine call — the routing lease, the `UpstreamCall` and the task that reads it.
A flight asks the engine for what its leader asked for:
- a *streaming* flight (`stream`) keeps the events it has read in a broadcast buffer (`events`). Clients
  hold a `Subscription` that replays the buffer from the start and then follows the live tail, so a late
  joiner ends with exactly the content of a solo run. Streaming clients follow it (`follow`/`take`: each
  event is written to every subscriber caught up with it in the callback that brought it to the flight,
  no task woken per event); non-streaming ones iterate it (the events folded into one body);
- a *JSON* flight (not `stream`) asks for one completion body (no stream, nothing to assemble) and
  hands that same body to every subscriber (`Subscription.wait_body()`) and to the result cache. Only
  non-streaming clients join it: a streaming client must not wait for the whole answer before its first
  token, so it leads a streaming flight of its own (the registry keeps one of each per fingerprint).
  An engine that only aborts streams (`stream_upstream_always`, llama.cpp) is still read as a stream,
  assembled into the body by the flight.
The call never belongs to a client: a subscriber leaving (the leader included) only removes its
subscription.

Bounds (memory a client or the engine could otherwise grow without limit), in bytes of events:
- backpressure: after each event, while the slowest current subscriber is more than `max_lag_bytes`
  behind, the flight stops reading the engine (its connection's buffers fill, so the engine is held
  back too) until that subscriber reads on or leaves;
- history: the buffer keeps every event, for late joiners and for the result, until it holds more
  than `max_history_bytes`. Then the flight closes to joiners (its registry forgets it, so an
  identical request leads a flight of its own), keeps only the events some subscriber has not read
  yet, and yields no result (nothing cached, no partial).
The lag is checked against a floor (what the slowest subscriber had read when last computed); the
minimum over the subscribers is only recomputed when the floor is `max_lag_bytes` behind, so the
common per-event cost is one addition and one comparison.

Subscribing and unsubscribing are synchronous. When the last subscriber leaves a running flight, the
model's cancel policy decides, at once:
- `immediate`: abort the engine call (its connection is closed now), release the lease, leave the
  registry — the next identical request starts a fresh call;
- `cache_partial`: the same, but the output so far is kept as a partial result (a JSON flight has none);
- `finish_and_cache`: nothing happens; the flight finishes detached (still joinable) into the cache.

A flight of a preemptible class that nobody joined may be stopped for a strict request (`stop`, through
`dedup.stoppable`): its engine call is aborted at once, and once its slot is granted again it sends (as `<id>-p<n>`)
the same request if nothing had come back yet, else — a streaming flight that can be continued
(`preemption.blocker`) — the continuation of what it received (`preemption.continuation`), whose events a
`Transcript` folds into the one generation its subscribers and its result see (the first call's id, no second role
chunk, usage restated), as a preempted request of the direct path is resumed. A JSON flight that has its answer, a
flight that cannot be continued once it has output, or one another client joined, is not stopped.

A flight ends in one synchronous step, so a new identical request always sees exactly one of: the
running flight, or (after success) its cached result, or (after failure/abort) nothing. An upstream
error fails every subscriber with that same error. Nothing but the flight itself removes it from the
registry (the "waiter removes the entry" bug cannot happen).

"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from bisect import bisect_right
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from ..admission.preemption import Plan, Stopped, StopSignal, Transcript, blocker, continuation, plan
from ..answer import EngineAnswer, EngineReads
from ..assemble import count_of, usage_of
from ..errors import Cancelled, DeadlineExceeded, GatewayError, ShuttingDown, UpstreamError, UpstreamTooLarge
from ..http.connection import listener_of
from .cache import Result
from .fingerprint import Fingerprint

if TYPE_CHECKING:
    from ..attempt import Failover
    from ..fleet.instance import Lease
    from ..upstream import UpstreamCall, UpstreamEvents
    from ..wire import ApiRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The most of its events (in the engine's bytes) one `Subscription.take()` returns: a late joiner's replay is
#: written a batch at a time, each waiting for the client to drain when it is slow.
TAKE_BYTES = 64 * 1024


class FlightState(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


class FlightOwner(Protocol):
    """What a flight tells its registry (synchronously) when it ends."""

    def flight_completed(self, flight: Flight, result: Result | None) -> None: ...

    def flight_closed_to_joiners(self, flight: Flight) -> None: ...

    def flight_failed(self, flight: Flight) -> None: ...

    def flight_abandoned(self, flight: Flight, partial: Result | None) -> None: ...

    def flight_changed(self, flight: Flight) -> None: ...

    def flight_stopped(self, flight: Flight) -> None: ...

    def flight_resumed(self, flight: Flight) -> None: ...


#: Opens a flight's engine call (`Flights`: `attempt.open_attempts` over the model's pool, after what its `Failover`
#: ruled out), given the id the engine sees, the request to send (the flight's, or its continuation after a stop or a
#: break), what to do with each attempt's lease and call (hold them, so that the flight can abort the call) and with
#: a failed attempt's (drop them).
OpenEngine = Callable[
    [str, "ApiRequest", Callable[["Lease", "UpstreamCall"], None], Callable[[], object]], Awaitable[EngineAnswer]
]


class Flight:
    def __init__(
        self,
        owner: FlightOwner,
        flight_id: str,
        key: Fingerprint,
        api: ApiRequest,
        open_engine: OpenEngine,
        *,
        cancel_policy: str,
        max_response_bytes: int,
        max_lag_bytes: int = 1 << 20,
        max_history_bytes: int = 4 << 20,
        deadline_s: float | None = None,
        failover: Failover | None = None,
    ) -> None:
        self.owner = owner
        #: Its engine calls that broke midway and were taken over elsewhere (`_fails_over`; None: none may be), shared
        #: with `open_engine`, which opens the next call after what they ruled out.
        self._failover = failover
        #: The model's `timeout_ms`: no client of the flight waits longer, and a flight run on for the cache
        #: (`finish_and_cache`, every client gone) holds its slot no longer than that on a stuck engine.
        self.deadline_s = deadline_s
        self.id = flight_id
        self.key = key
        #: The upstream request (the leader's prompt and headers), and how to open its engine call.
        self.api = api
        self._open_engine = open_engine
        #: A streaming flight (events, joinable by every client) or a JSON one (one body, non-streaming clients).
        self.stream = api.stream
        #: The engine's completion, once a JSON flight has completed.
        self.body: dict[str, Any] | None = None
        #: The model's `cancel_policy` (see the module docstring).
        self.cancel_policy = cancel_policy
        #: A JSON flight's limit on its body (`upstream.max_response_bytes`).
        self.max_response_bytes = max_response_bytes
        self.state = FlightState.RUNNING
        #: The events kept: the whole generation while `joinable`, afterwards what is still unread.
        self.events: list[dict[str, Any]] = []
        #: The engine's bytes of each kept event (its JSON), cumulative bytes at the end of each, and whether it
        #: carries a token (parallel to `events`). The result is packed from the engine's bytes (no encoding again),
        #: and the leader writes them as they are (pass-through).
        self._payloads: list[bytes] = []
        self._ends: list[int] = []
        self._contents: list[bool] = []
        #: Index (in the whole generation) and byte offset of `events[0]`.
        self._base = 0
        self._base_bytes = 0
        #: Times the generation started over (`_start_over`): a non-streaming subscriber drops what it collected.
        self.epoch = 0
        self.max_lag_bytes = max_lag_bytes
        self.max_history_bytes = max_history_bytes
        #: New subscribers are accepted (the buffer still holds the whole generation).
        self.joinable = True
        self._subscriptions: set[Subscription] = set()
        #: Bytes the slowest subscriber had read when last computed, and its position.
        self._floor_bytes = 0
        self._floor_position = 0
        #: Set while the reader waits for the slowest subscriber (backpressure).
        self._reader_waiter: asyncio.Future[None] | None = None
        self.waits = 0
        self.error: GatewayError | None = None
        self.subscribers = 0
        self.subscribed_total = 0
        #: The instance the flight's engine call went to (once an attempt started: a failure names it too), then,
        #: once the call opened, the engine that serves it (`UpstreamCall.served_by`: behind a sidecar, its choice).
        self.served_by: str | None = None
        #: Engine calls started for it (a retry elsewhere is one more): its leader's record counts them.
        self.attempts = 0
        self.started = time.perf_counter()
        self.task: asyncio.Task[None] | None = None
        #: When it completed (wall clock): each of its answers' `completed_at` where the engine gave none, cached too.
        self.finished_at: float | None = None
        #: Set when its engine call broke after a streaming client was sent part of the generation, within the model's
        #: retries: its non-streaming clients, sent nothing, start it over elsewhere with this (`Coalescer.serve`).
        self.again: Failover | None = None
        #: Called with the result when the flight completes (the semantic cache adds it).
        self.on_completed: Callable[[Result], None] | None = None
        #: Releases its leader's slot at the pool's scheduler (`Slot.hand_over`) when the flight ends, however it
        #: ends (`Flights._forget`): its engine call counts against the pool's capacity after its leader left, too.
        self.release_slot: Callable[[], None] | None = None
        #: Tells its leader's rate-limit allowance (`Allowance.share`) what the flight used when it ends
        #: (`Flights._forget`): its prompt and what it produced for its leader (`leader_tokens`), whether it reached
        #: an engine, and what it produced for no client (`unattended_tokens`).
        self.settle_allowance: Callable[[int, bool, int], None] | None = None
        #: Tokens produced while no client followed it (a `finish_and_cache` flight, the moments before an abort), and
        #: what it had produced when its last client left (None: a client follows it).
        self._unattended = 0
        self._alone_from: int | None = None
        #: Its first subscriber while it follows, and what it had produced when that one left (None: it has not).
        self._leader: Subscription | None = None
        self._leader_until: int | None = None
        #: Token-bearing events received (one token each, as the transcript of a preempted request counts them).
        self.tokens = 0
        #: Tokens its engine calls produced (`Lease.produced`: also a whole answer's, estimated when it was cut short).
        self.engine_tokens = 0
        #: How to wait for its slot to be granted again after a stop (`dedup.stoppable`: only a flight of a preemptible
        #: class has one), and the stops so far.
        self.regranted: Callable[[], Awaitable[object]] | None = None
        self.stops = 0
        #: Why a streaming flight of a preemptible class could not be continued from partial output (None: it can),
        #: and its output folded over its engine calls (`resumable`: None for any other flight).
        self._blocker: str | None = None
        self._transcript: Transcript | None = None
        #: The engine call under way follows events already delivered (a continuation): its events are folded.
        self._folding = False
        #: Stopped, its engine call aborted, until its slot is granted again (`requeued`): then sent again; the task's
        #: awaits of its engine call, which a stop interrupts (`StopSignal`).
        self._stopped = False
        self._signal = StopSignal()
        self._lease: Lease | None = None
        self._call: UpstreamCall | None = None
        #: The engine call once opened (closed when the flight's task ends).
        self._opened: EngineAnswer | None = None
        self._nbytes = 0
        #: A JSON flight's body as the engine sent it (None: assembled from a stream), packed as its result.
        self._body_bytes: bytes | None = None
        #: The flight's loop (the registry sets it when it starts the task; else looked up when needed).
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Subscribers waiting for the next event or the end: one bare future each, none when nobody waits.
        self._waiters: list[asyncio.Future[None]] = []
        #: Subscribers following the flight (`Subscription.follow`): called at each event or the end, in the
        #: callback that brought it, so that a subscriber caught up writes it to its client without a task.
        self._followers: list[Callable[[], None]] = []
        #: The first subscriber (the leader), while it is there: it gets the engine's bytes of each event
        #: (`_payloads`), which it may write as they are (pass-through).
        self._raw_reader: Subscription | None = None

    # --- subscribers (synchronous) -------------------------------------------------------------
    def subscribe(self) -> Subscription:
        """A new subscriber, replaying from the start. Only while `joinable`."""
        if not self.joinable:
            raise RuntimeError("this flight takes no new subscribers")
        self.subscribers += 1
        self.subscribed_total += 1
        if self._alone_from is not None:
            self._unattended += self.produced() - self._alone_from
            self._alone_from = None
        subscription = Subscription(self)
        self._subscriptions.add(subscription)
        if self.subscribed_total == 1:
            self._leader = subscription
        if self.subscribed_total == 1 and self.stream:
            self._raw_reader = subscription  # the leader, subscribed before the first event
        if self._floor_bytes:
            self._floor_bytes = self._floor_position = 0  # the slowest subscriber now starts at 0
        self.owner.flight_changed(self)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> bool:
        """A subscriber left. Returns True if this aborted the engine call."""
        self.subscribers -= 1
        self._subscriptions.discard(subscription)
        if subscription is self._leader:
            self._leader = None
            self._leader_until = self.produced()
        if not self.subscribers:
            self._alone_from = self.produced()
        if subscription is self._raw_reader:
            self._raw_reader = None
        self._wake_reader()
        self.owner.flight_changed(self)
        if self.subscribers > 0 or self.state is not FlightState.RUNNING:
            return False
        if self.cancel_policy == "finish_and_cache":
            return False
        partial = self._result(complete=False) if self.cancel_policy == "cache_partial" else None
        aborted = self._stop(FlightState.ABORTED)
        self.owner.flight_abandoned(self, partial)
        return aborted

    @property
    def done(self) -> bool:
        return self.state is not FlightState.RUNNING

    def raise_if_stopped(self) -> None:
        """For a subscriber about to wait for more: a flight that failed raises its error, one stopped
        otherwise raises `Cancelled` (a completed one is the caller's to handle first)."""
        if self.error is not None:
            raise self.error
        if self.state is not FlightState.RUNNING:
            raise Cancelled("The upstream generation was stopped.")

    def wait_changed(self) -> asyncio.Future[None]:
        """A future done at the next event or the end (callers check the state first, then await it: no
        await between). A bare future rather than an `asyncio.Event`: this runs for every event a
        subscriber waits for."""
        waiter = (self.loop or asyncio.get_running_loop()).create_future()
        self._waiters.append(waiter)
        return waiter

    def _notify(self) -> None:
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                if not waiter.done():  # a subscriber cancelled while waiting left its future cancelled
                    waiter.set_result(None)
        # A follower is removed by its own task, never from here or from what it calls: no copy needed.
        for follower in self._followers:
            follower()

    # --- the engine call (owned by the flight's task) -------------------------------------------
    async def run(self) -> None:
        """The flight's task body: never raises except CancelledError."""
        try:
            if self.deadline_s is None:
                await self._relay()
            else:
                async with asyncio.timeout(self.deadline_s):
                    await self._relay()
        except TimeoutError:
            self._fail(DeadlineExceeded("The shared generation exceeded its model's timeout_ms."))
        except GatewayError as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            if self.state is FlightState.RUNNING:
                self._fail(ShuttingDown("The gateway is shutting down; the request was stopped."))
            raise
        except Exception as exc:  # a bug: fail the subscribers rather than leave them hanging
            log.exception("flight %s failed", self.id)
            self._fail(GatewayError(f"Internal error in the gateway: {exc.__class__.__name__}"))
        finally:
            opened, self._opened = self._opened, None
            if opened is not None:
                opened.close()  # synchronous: no await in a `finally` (see setup.py)
            self._release()

    async def _relay(self) -> None:
        """Open the engine call and keep what it sends until its end (`run` decides how the flight ends); after a
        stop, wait for the slot and open it again (or its continuation)."""
        while True:
            if self._stopped:
                assert self.regranted is not None
                await self.regranted()
                self._stopped = False
                self.owner.flight_resumed(self)  # joinable again, now that it runs
            try:
                opened = await self._signal.engine(self._open())
                self._opened = opened
                if not self.stream:
                    whole = opened.whole  # read while opening: an answer that broke midway was tried elsewhere
                    assert whole is not None
                    self.body, self._body_bytes = whole
                    self._nbytes = 64 + opened.call.received
                    self._complete()
                    return
                # The engine is read from its connection's callback, read by read (`UpstreamEvents.follow`): the task
                # wakes only when a bound needs it to wait for the slowest subscriber, and at the end.
                events = opened.events
                assert events is not None  # a streaming flight's engine call is a stream
                step = functools.partial(self._step, events)  # called per read: no Python frame of its own
                while not await self._signal.engine(events.follow(step)):
                    await self._keep_within_bounds()
                    if self._stopped:  # stopped while it waited for a subscriber: its call is closed already
                        raise Stopped
                self._complete()
                return
            except Stopped:
                stopped, self._opened = self._opened, None
                if stopped is not None:
                    stopped.close()
            except UpstreamError as exc:
                if not self._fails_over(exc):
                    raise

    def _fails_over(self, exc: UpstreamError) -> bool:
        """A streaming flight's engine call that broke after it opened (its engine died, hung or failed midway):
        whether the flight goes on elsewhere, as after a stop (sent again while nothing was delivered, else continued
        from what it delivered, for a flight that can be: `resumable`), within its `Failover`. Its subscribers see one
        stream. False: the error stands (every subscriber gets it)."""
        opened, failover = self._opened, self._failover
        if opened is None or failover is None:
            return False
        how = Plan.RESTART if not self._base and not self.events else self._resume_plan()
        if how is None and not any(subscription.whole for subscription in self._subscriptions):
            return False
        if not failover.take(exc, opened.lease.instance):
            return False
        if how is None:
            # Its streaming clients get the error; its non-streaming ones, sent nothing, start it over elsewhere (an
            # outside run: a whole answer that joined a stream got 502 where, alone, it was retried).
            self.again = failover
            return False
        self._opened = None
        opened.close()
        self._release()
        if how is Plan.RESTART:
            self._start_over()
        return True

    def _untold(self) -> bool:
        """Whether no client has been sent any of the generation, so that it may start over from scratch: every
        subscriber there answers a non-streaming client (`wait_done`: its answer is made at the end) or has taken
        nothing. (An outside run: a non-streaming Responses request, whose flight streams from the engine,
        got 502 when its engine broke midway, where the direct path tried another instance; and a P2 one was never
        preempted, P0 waiting a whole generation behind it.)"""
        return all(subscription.whole or not subscription._position for subscription in self._subscriptions)

    def _start_over(self) -> None:
        """Forget the generation kept so far (`_untold`): the next engine call makes it again, from its first event."""
        if not self._base and not self.events:
            return
        self.events, self._payloads, self._ends, self._contents = [], [], [], []
        self._base = self._base_bytes = self._nbytes = self.tokens = 0
        self._floor_bytes = self._floor_position = 0
        self.epoch += 1
        for subscription in self._subscriptions:
            subscription._position = 0
        if self._transcript is not None:
            self._transcript = Transcript(self.api.endpoint, keep_events=False, max_chars=self.max_response_bytes)

    def _step(self, stream: UpstreamEvents | EngineReads) -> bool | None:
        """Keep every event the engine has sent so far and wake the subscribers waiting for one: True at the end
        of the stream, False when a bound is crossed (the task then waits for the slowest subscriber), None to
        go on. Raises what broke the stream, after keeping the events before the break.

        `stream`: the engine call's events, named beside their protocol (which tests' fake engines satisfy) so that
        the compiled build calls `take()` and reads `ended` and `broken` natively when they are `UpstreamEvents`
        (mypyc's union decomposition: a type check, then the native call; the protocol alone is reached through
        generic lookups)."""
        taken = stream.take()
        if taken and self._transcript is not None:
            taken = self._fold(taken)
        if taken:
            events, payloads, ends, contents = self.events, self._payloads, self._ends, self._contents
            nbytes = self._nbytes
            tokens = self.tokens
            for event, raw, content in taken:
                nbytes += 64 + len(raw)  # sized by the engine's bytes, not by serialising the event again
                events.append(event)
                payloads.append(raw)
                ends.append(nbytes)
                contents.append(content)
                if content:
                    tokens += 1
            self._nbytes = nbytes
            self.tokens = tokens
            self._notify()
        if stream.ended:
            return True
        if stream.broken:
            stream.take()  # raises why, now that the events before the break are kept
        if self._nbytes - self._floor_bytes > self.max_lag_bytes or (
            self.joinable and self._nbytes > self.max_history_bytes
        ):
            return False
        return None

    def _fold(self, taken: list[tuple[dict[str, Any], bytes, bool]]) -> list[tuple[dict[str, Any], bytes, bool]]:
        """The events of an engine call as the one generation shows them (`Transcript.take`): the first call's as they
        came (the transcript keeps their text, for a continuation), a continuation's rewritten (their bytes encoded
        again) or dropped."""
        transcript = self._transcript
        assert transcript is not None
        if not self._folding:
            for event, _, _ in taken:
                transcript.take(event)  # (the first call's events come back unchanged)
            return taken
        folded = []
        for event, _, content in taken:
            out = transcript.take(event)
            if out is not None:
                folded.append((out, orjson.dumps(out), content))
        return folded

    # --- the bounds (see the module docstring) -------------------------------------------------------
    def _consumed(self, position: int) -> int:
        """Bytes of the generation before event `position` (which must be kept, or the end)."""
        index = position - self._base
        return self._ends[index - 1] if index > 0 else self._base_bytes

    def _update_floor(self) -> None:
        position = min((s._position for s in self._subscriptions), default=self._base + len(self.events))
        self._floor_position = position
        self._floor_bytes = self._consumed(position)
        if not self.joinable:
            self._drop_read(position)

    def _drop_read(self, position: int) -> None:
        """Forget the events before `position` (every subscriber has read them)."""
        count = position - self._base
        if count > 0:
            self._base_bytes = self._ends[count - 1]
            del self.events[:count]
            del self._payloads[:count]
            del self._ends[:count]
            del self._contents[:count]
            self._base = position

    async def _keep_within_bounds(self) -> None:
        """Close to joiners past the history bound; wait while the slowest subscriber lags too far."""
        if self.joinable and self._nbytes > self.max_history_bytes:
            self.joinable = False
            self.owner.flight_closed_to_joiners(self)
        self._update_floor()
        while self._nbytes - self._floor_bytes > self.max_lag_bytes and self.state is FlightState.RUNNING:
            self.waits += 1
            waiter = self._reader_waiter = asyncio.get_running_loop().create_future()
            self.owner.flight_changed(self)
            try:
                await waiter
            finally:
                self._reader_waiter = None
            self._update_floor()

    def _wake_reader(self) -> None:
        waiter = self._reader_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def waiting_for_readers(self) -> bool:
        """The flight has stopped reading its engine until its slowest subscriber catches up."""
        return self._reader_waiter is not None

    def statistics(self) -> dict[str, Any]:
        """The flight's buffer: `buffered_bytes` kept now, `lag_bytes` of the slowest subscriber (as last
        computed), events and bytes of the whole generation so far."""
        return {
            "events_total": self._base + len(self.events),
            "bytes_total": self._nbytes,
            "events_buffered": len(self.events),
            "buffered_bytes": self._nbytes - self._base_bytes,
            "lag_bytes": self._nbytes - self._floor_bytes,
            "joinable": self.joinable,
            "waiting_for_readers": self.waiting_for_readers,
            "waits": self.waits,
        }

    def waiting_since(self) -> float | None:
        """Since when its engine call has waited with nothing to show (`time.monotonic()`, `Lease.waiting_since`); None
        while no call is out or its first event has come (a stream that stops after that is the stall timeout's)."""
        return None if self._lease is None else self._lease.waiting_since()

    @property
    def lease(self) -> Lease | None:
        """The lease of its engine call now (None between calls)."""
        return self._lease

    # --- stopping for a more urgent request (synchronous, called by the scheduler) -------------------
    def resumable(self, regranted: Callable[[], Awaitable[object]], *, chat_continuation: bool) -> None:
        """Make the flight stoppable (`dedup.stoppable`, before its task runs): `regranted` waits for its slot after a
        stop; `chat_continuation`: every instance of its pool can continue a final assistant message."""
        self.regranted = regranted
        if self.stream:
            self._blocker = blocker(self.api, chat_continuation=chat_continuation)
            self._transcript = Transcript(self.api.endpoint, keep_events=False, max_chars=self.max_response_bytes)

    def _plan(self) -> Plan | None:
        """How the flight would go on if stopped now (`preemption.plan`); None: it must not be stopped. Only with an
        engine call out, and nobody but its leader ever subscribed (a joiner might be more urgent than the flight)."""
        call = self._call
        if self.regranted is None or self.state is not FlightState.RUNNING or call is None or call.finished:
            return None  # (a finished call: its end is read, the flight completes at its task's next step)
        if self.subscribed_total > 1 or self.body is not None:
            return None
        if not self._base and not self.events:
            return Plan.RESTART  # nothing kept: sent again as it was
        return self._resume_plan()

    def _resume_plan(self) -> Plan | None:
        """How a flight with output goes on: continued from it (`preemption.plan`), else started over if no client was
        sent any of it (`_untold`), else not at all (None)."""
        transcript = self._transcript
        if transcript is None:  # (not resumable: its output cannot be continued)
            return Plan.RESTART if self._untold() else None
        return plan(self._blocker, transcript, self.api.max_tokens, sent=not self._untold())

    def stoppable(self) -> bool:
        """Whether the flight may be stopped now (`_plan`)."""
        return self._plan() is not None

    def stop(self) -> Plan:
        """Abort the engine call now (the engine sees it at once); the flight sends it again, or its continuation, once
        its slot is granted again (`regranted`)."""
        how = self._plan()
        if how is None:
            raise RuntimeError("stop() on a flight that is not stoppable")
        self.stops += 1
        self._stopped = True
        charged = self.engine_tokens
        self._release()
        if how is Plan.RESTART:
            # What the stopped call produced is thrown away and produced again: not its leader's to pay for.
            self.engine_tokens = charged
            self._start_over()
        # Waiting for its slot, it takes no joiners: an identical request (perhaps more urgent) leads its own.
        self.owner.flight_stopped(self)
        self._signal.stop(self.task)
        return how

    def redo_tokens(self) -> int:
        """Tokens the engine prefills again when the flight goes on: its prompt, and what it produced so far."""
        transcript = self._transcript
        return self.api.estimated_prompt_tokens() + (transcript.tokens if transcript is not None else self.tokens)

    def _hold(self, lease: Lease, call: UpstreamCall) -> None:
        self._lease, self._call = lease, call
        self.served_by = call.instance.name
        self.attempts += 1

    async def _open(self) -> EngineAnswer:
        # After a stop, an engine never sees two calls with one id (SGLang aborts by id).
        upstream_id = f"{self.id}-p{self.stops}" if self.stops else self.id
        api = self.api
        transcript = self._transcript
        if transcript is not None:
            transcript.start_attempt()
            # Events were delivered already: this call's are folded into them (no second role chunk, the first id).
            self._folding = self._base + len(self.events) > 0
            if transcript.tokens:
                api = continuation(api, transcript.text, transcript.tokens)
        opened = await self._open_engine(upstream_id, api, self._hold, self._release)
        self.served_by = opened.call.served_by
        return opened

    # --- ending (synchronous, exactly once) ------------------------------------------------------
    def _result(self, *, complete: bool) -> Result | None:
        """The generation as a result; None once the history bound dropped part of it (or for a JSON flight
        that has no body yet: a partial one has nothing to keep)."""
        if not self.joinable:
            return None
        if not self.stream:
            body = self.body
            if body is None:
                return None
            usage = body.get("usage")
            return Result(
                events=(),
                nbytes=self._nbytes,
                prompt_tokens=count_of(usage.get("prompt_tokens")) if isinstance(usage, dict) else 0,
                completion_tokens=count_of(usage.get("completion_tokens")) if isinstance(usage, dict) else 0,
                complete=complete,
                instance=self.served_by,
                body=body,
                packed_body=self._body_bytes,
                finished_at=self.finished_at,
            )
        usage = usage_of(self.events)
        prompt = completion = 0
        if usage is not None:
            prompt = count_of(usage.get("prompt_tokens"))
            completion = count_of(usage.get("completion_tokens"))
        payloads = self._payloads
        return Result(
            packed_events=b"[" + b",".join(payloads) + b"]" if payloads else None,  # each a JSON object
            nbytes=self._nbytes,
            prompt_tokens=prompt,
            completion_tokens=completion,
            complete=complete,
            instance=self.served_by,
            finished_at=self.finished_at,
        )

    def _complete(self) -> None:
        if self.state is not FlightState.RUNNING:
            return
        self.state = FlightState.COMPLETED
        self.finished_at = time.time()
        self._wake_reader()
        self._release()
        self.owner.flight_completed(self, self._result(complete=True))
        self._notify()

    def _fail(self, error: GatewayError) -> None:
        if self.state is not FlightState.RUNNING:
            return
        self.state = FlightState.FAILED
        self.error = error
        self._wake_reader()
        self._release()
        self.owner.flight_failed(self)
        self._notify()

    def abort(self, error: GatewayError) -> bool:
        """Stop the flight now (shutdown): subscribers get `error`. Returns True if upstream was open."""
        if self.state is not FlightState.RUNNING:
            return False
        self.error = error
        aborted = self._stop(FlightState.FAILED)
        self.owner.flight_failed(self)
        self._notify()
        return aborted

    def _stop(self, state: FlightState) -> bool:
        self.state = state
        aborted = self._release()
        if self.task is not None and not self.task.done():
            self.task.cancel("lockgate: flight stopped")
        return aborted

    def produced(self) -> int:
        """Tokens its engine calls have produced so far (`Lease.produced`)."""
        lease = self._lease
        return self.engine_tokens + (lease.produced(time.monotonic()) if lease is not None else 0)

    def leader_tokens(self) -> int:
        """Tokens it produced while its leader followed it (all of them if it never left): its leader's tenant is
        charged them (`Flights._forget`) with `unattended_tokens`; what its other clients received, each one's own
        tenant is. Charged the whole generation, a leader that left while another client followed on was charged what
        that client was charged too (an outside run: a pair charged ~208 tokens shared, 120 sent apart)."""
        return self.produced() if self._leader_until is None else self._leader_until

    def unattended_tokens(self) -> int:
        """Tokens it produced while no client followed it (`leader_tokens`)."""
        alone = self._alone_from
        return self._unattended + (max(0, self.produced() - alone) if alone is not None else 0)

    def _release(self) -> bool:
        """Close the engine call (if open) and release the lease. Idempotent."""
        call, self._call = self._call, None
        lease, self._lease = self._lease, None
        aborted = call.abort() if call is not None else False
        if lease is not None:
            self.engine_tokens += lease.produced(time.monotonic())
            lease.release()
        return aborted

    @property
    def requeued(self) -> bool:
        """Stopped by a preemption, it waits for its slot again (`stop`): its clients wait with it."""
        return self._stopped and self.state is FlightState.RUNNING

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "fingerprint": self.key.hex(),
            "model": self.api.model,
            "stream": self.stream,
            # (A stopped flight waiting for its slot again read "running": an outside run.)
            "state": "queued" if self.requeued else self.state.value,
            "stops": self.stops,
            "subscribers": self.subscribers,
            "events": self._base + len(self.events),
            "buffered_bytes": self._nbytes - self._base_bytes,
            "joinable": self.joinable,
            "waiting_for_readers": self.waiting_for_readers,
            "instance": self.served_by,
            "age_ms": round((time.perf_counter() - self.started) * 1000, 1),
        }


class Subscription:
    """One client's view of a flight: replay, then the live tail. `close()` is idempotent."""

    __slots__ = ("_closed", "_position", "backlog", "broken", "ended", "flight", "whole")

    def __init__(self, flight: Flight) -> None:
        self.flight = flight
        self._position = 0
        self._closed = False
        #: After `take()` (plain attributes, not properties: a follower asks after every step): more events are
        #: buffered than it returned (it returns at most `TAKE_BYTES` of them); the generation is over and this
        #: subscriber has taken all of it; the flight stopped without completing and this subscriber has taken
        #: every event before that, so the next `take()` raises why.
        self.backlog = False
        self.ended = False
        self.broken = False
        #: It answers a non-streaming client (`wait_done`): nothing it took was sent before the end.
        self.whole = False

    @property
    def passes_through(self) -> bool:
        """Whether this subscriber gets the engine's own bytes of each event (from `take()`): the leader of a
        streaming flight. It then keeps the engine's response id (the others get their own)."""
        return self.flight._raw_reader is self

    def instance(self) -> str | None:
        """The instance the flight's engine call went to, the engine serving it once the call opened (None before
        any attempt)."""
        return self.flight.served_by

    def attempts(self) -> int:
        """Engine calls the flight started so far."""
        return self.flight.attempts

    def tokens(self) -> int:
        """Tokens the flight's engine call has sent so far (0 for a call answered with one JSON body, until then)."""
        return self.flight.tokens

    def requeued(self) -> bool:
        """`Flight.requeued`."""
        return self.flight.requeued

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> dict[str, Any]:
        flight = self.flight
        while True:
            if self._closed:
                raise Cancelled("The subscription was closed.")
            index = self._position - flight._base
            if index < len(flight.events):
                event = flight.events[index]
                if flight._reader_waiter is not None and self._position == flight._floor_position:
                    flight._wake_reader()  # the slowest subscriber reads on
                self._position += 1
                return event
            if flight.state is FlightState.COMPLETED:
                raise StopAsyncIteration
            flight.raise_if_stopped()
            await flight.wait_changed()

    def take(self) -> list[tuple[dict[str, Any], bytes | None, bool]]:
        """The events buffered past this subscriber's position, without waiting: at most about `TAKE_BYTES` of
        them (at least one), each with the engine's bytes of it for the leader (`passes_through`), None for the
        others, and whether it carries a token; `backlog`, `ended` and `broken` then say what follows. Once the
        flight stopped without completing and everything before was taken, raises why. Not to be mixed with
        iterating."""
        if self._closed:
            raise Cancelled("The subscription was closed.")
        flight = self.flight
        position = self._position
        index = position - flight._base
        events = flight.events
        count = len(events) - index
        state = flight.state
        if count <= 0:
            self.backlog = False
            if state is not FlightState.RUNNING:
                if state is not FlightState.COMPLETED:
                    flight.raise_if_stopped()
                self.ended = True
            return []
        if flight._reader_waiter is not None and position == flight._floor_position:
            flight._wake_reader()  # the slowest subscriber reads on
        leader = flight._raw_reader is self
        if count == 1:  # a live subscriber's usual case: the event the flight has just kept
            stop = index + 1
            out: list[tuple[dict[str, Any], bytes | None, bool]] = [
                (events[index], flight._payloads[index] if leader else None, flight._contents[index])
            ]
        else:
            stop = len(events)
            consumed = flight._consumed(position)
            if flight._ends[-1] - consumed > TAKE_BYTES:
                stop = max(bisect_right(flight._ends, consumed + TAKE_BYTES, index), index + 1)
            contents = flight._contents[index:stop]
            if leader:
                out = list(zip(events[index:stop], flight._payloads[index:stop], contents, strict=True))
            else:
                out = [(e, None, c) for e, c in zip(events[index:stop], contents, strict=True)]
        self._position = position + stop - index
        self.backlog = stop < len(events)
        if state is not FlightState.RUNNING and not self.backlog:
            # Everything is taken: the end, or (a flight stopped otherwise) the next take raises why.
            self.ended = state is FlightState.COMPLETED
            self.broken = not self.ended
        return out

    async def follow(self, step: Callable[[], T | None]) -> T:
        """Call `step` (which takes what is here with `take()`) at once and then at each event of the flight and
        at its end, in the callback that brought it, until it returns something other than None; return that
        (or raise what `step` raised). The subscriber's task waits here once, not once per event."""
        result = step()
        if result is not None:
            return result
        flight = self.flight
        done: asyncio.Future[T] = (flight.loop or asyncio.get_running_loop()).create_future()
        listener = listener_of(step, done)
        flight._followers.append(listener)
        try:
            return await done
        finally:
            flight._followers.remove(listener)

    async def wait_done(self, max_bytes: int | None = None) -> list[dict[str, Any]]:
        """Every event of the generation, once it has completed (non-streaming clients). The events are
        read as they come (so this subscriber never holds the flight back); more than `max_bytes` of
        them is an `UpstreamTooLarge` (502) for this subscriber."""
        flight = self.flight
        self.whole = True
        start = flight._consumed(self._position)
        epoch = flight.epoch
        events: list[dict[str, Any]] = []
        async for event in self:
            if flight.epoch != epoch:  # the generation started over (`Flight._start_over`): collect it again
                epoch, start = flight.epoch, 0
                events.clear()
            events.append(event)
            if max_bytes is not None and flight._consumed(self._position) - start > max_bytes:
                raise UpstreamTooLarge(
                    f"The engine's answer is larger than upstream.max_response_bytes ({max_bytes} bytes)."
                )
        return events

    async def wait_body(self) -> dict[str, Any]:
        """A JSON flight's completion, once it is there (shared: the caller copies what it changes)."""
        flight = self.flight
        while True:
            if self._closed:
                raise Cancelled("The subscription was closed.")
            body = flight.body
            if flight.state is FlightState.COMPLETED and body is not None:
                return body
            flight.raise_if_stopped()
            await flight.wait_changed()

    def close(self) -> bool:
        """Leave the flight. Returns True if this aborted the engine call (last subscriber, `immediate`)."""
        if self._closed:
            return False
        self._closed = True
        return self.flight._unsubscribe(self)
