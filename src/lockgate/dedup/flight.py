"""A flight: one upstream generation shared by every client asking for the same fingerprint.

Theory of operation
-------------------
A `Flight` owns its engine call — the routing lease, the `UpstreamCall` and the task that reads the
stream — and keeps every event it has read in a broadcast buffer (`events`). Clients hold a
`Subscription`: an async iterator that replays the buffer from the start and then follows the live
tail, so a late joiner ends with exactly the content of a solo run. The call never belongs to a client:
a subscriber leaving (the leader included) only removes its subscription.

Subscribing and unsubscribing are synchronous. When the last subscriber leaves a running flight, the
model's cancel policy decides, at once:
- `immediate`: abort the engine call (its connection is closed now), release the lease, leave the
  registry — the next identical request starts a fresh call;
- `cache_partial`: the same, but the output so far is kept as a partial result;
- `finish_and_cache`: nothing happens; the flight finishes detached (still joinable) into the cache.

A flight ends in one synchronous step, so a new identical request always sees exactly one of: the
running flight, or (after success) its cached result, or (after failure/abort) nothing. An upstream
error fails every subscriber with that same error. Nothing but the flight itself removes it from the
registry (the "waiter removes the entry" bug cannot happen).

The buffer is not bounded beyond the generation itself (max_tokens): slow subscribers never slow the
engine down; they read from the buffer at their own pace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from ..attempt import Opened, open_attempts
from ..errors import Cancelled, GatewayError, ShuttingDown
from ..routing.policies import RouteRequest
from ..upstream import UpstreamCall
from .cache import Result
from .fingerprint import Fingerprint

if TYPE_CHECKING:
    from ..fleet.pool import Fleet, Instance, Lease, Pool
    from ..metrics import GatewayMetrics
    from ..wire import ApiRequest

log = logging.getLogger(__name__)


class FlightState(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


class FlightOwner(Protocol):
    """What a flight tells its registry (synchronously) when it ends."""

    def flight_completed(self, flight: Flight, result: Result) -> None: ...

    def flight_failed(self, flight: Flight) -> None: ...

    def flight_abandoned(self, flight: Flight, partial: Result | None) -> None: ...

    def flight_changed(self, flight: Flight) -> None: ...


class Flight:
    def __init__(
        self,
        owner: FlightOwner,
        flight_id: str,
        key: Fingerprint,
        pool: Pool,
        api: ApiRequest,
        route: RouteRequest,
        fleet: Fleet,
        metrics: GatewayMetrics,
    ) -> None:
        self.owner = owner
        self.id = flight_id
        self.key = key
        self.pool = pool
        #: The upstream request (always streaming) and how to route it (the leader's prompt and headers).
        self.api = api
        self.route = route
        self.cancel_policy = pool.config.cancel_policy
        self._fleet = fleet
        self._metrics = metrics
        self.state = FlightState.RUNNING
        self.events: list[dict[str, Any]] = []
        self.error: GatewayError | None = None
        self.subscribers = 0
        self.subscribed_total = 0
        self.instance: Instance | None = None
        self.started = time.perf_counter()
        self.task: asyncio.Task[None] | None = None
        #: Called with the result when the flight completes (the semantic cache adds it).
        self.on_completed: Callable[[Result], None] | None = None
        self._lease: Lease | None = None
        self._call: UpstreamCall | None = None
        self._nbytes = 0
        self._changed = asyncio.Event()

    # --- subscribers (synchronous) -------------------------------------------------------------
    def subscribe(self) -> Subscription:
        self.subscribers += 1
        self.subscribed_total += 1
        self.owner.flight_changed(self)
        return Subscription(self)

    def _unsubscribe(self) -> bool:
        """A subscriber left. Returns True if this aborted the engine call."""
        self.subscribers -= 1
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

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the engine call (owned by the flight's task) -------------------------------------------
    async def run(self) -> None:
        """The flight's task body: never raises except CancelledError."""
        opened = events = None
        try:
            opened = await self._open()
            events = opened.events()
            async for event in events:
                self.events.append(event)
                self._nbytes += 64 + len(orjson.dumps(event))
                self._notify()
            self._complete()
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
            if events is not None:
                await events.aclose()
            if opened is not None:
                await opened.aclose()
            self._release()

    def _hold(self, lease: Lease, call: UpstreamCall) -> None:
        self._lease, self._call, self.instance = lease, call, lease.instance

    async def _open(self) -> Opened:
        return await open_attempts(
            self._fleet,
            self._metrics,
            self.pool,
            self.api,
            self.route,
            self.id,
            hold=self._hold,
            drop=self._release,
            time_left=lambda: True,
        )

    # --- ending (synchronous, exactly once) ------------------------------------------------------
    def _result(self, *, complete: bool) -> Result:
        usage = next((e["usage"] for e in reversed(self.events) if isinstance(e.get("usage"), dict)), None)
        prompt = completion = 0
        if usage is not None:
            prompt = _int(usage.get("prompt_tokens"))
            completion = _int(usage.get("completion_tokens"))
        return Result(
            events=tuple(self.events),
            nbytes=self._nbytes,
            prompt_tokens=prompt,
            completion_tokens=completion,
            complete=complete,
            instance=self.instance.name if self.instance is not None else None,
        )

    def _complete(self) -> None:
        if self.state is not FlightState.RUNNING:
            return
        self.state = FlightState.COMPLETED
        self._release()
        self.owner.flight_completed(self, self._result(complete=True))
        self._notify()

    def _fail(self, error: GatewayError) -> None:
        if self.state is not FlightState.RUNNING:
            return
        self.state = FlightState.FAILED
        self.error = error
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

    def _release(self) -> bool:
        """Close the engine call (if open) and release the lease. Idempotent."""
        call, self._call = self._call, None
        lease, self._lease = self._lease, None
        aborted = call.abort() if call is not None else False
        if lease is not None:
            lease.release()
        return aborted

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "fingerprint": self.key.hex(),
            "model": self.api.model,
            "state": self.state.value,
            "subscribers": self.subscribers,
            "events": len(self.events),
            "instance": self.instance.name if self.instance is not None else None,
            "age_ms": round((time.perf_counter() - self.started) * 1000, 1),
        }


class Subscription:
    """One client's view of a flight: replay, then the live tail. `close()` is idempotent."""

    __slots__ = ("_closed", "_position", "flight")

    def __init__(self, flight: Flight) -> None:
        self.flight = flight
        self._position = 0
        self._closed = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> dict[str, Any]:
        flight = self.flight
        while True:
            if self._closed:
                raise Cancelled("The subscription was closed.")
            if self._position < len(flight.events):
                event = flight.events[self._position]
                self._position += 1
                return event
            if flight.state is FlightState.COMPLETED:
                raise StopAsyncIteration
            if flight.error is not None:
                raise flight.error
            if flight.state is not FlightState.RUNNING:
                raise Cancelled("The upstream generation was stopped.")
            await flight.wait_changed()

    def ready(self) -> bool:
        """Whether the next step will not wait: an event is buffered, or the flight has ended (the
        writer may then coalesce its writes)."""
        return self._position < len(self.flight.events) or self.flight.state is not FlightState.RUNNING

    async def wait_done(self) -> list[dict[str, Any]]:
        """Every event of the generation, once it has completed (non-streaming clients)."""
        flight = self.flight
        while flight.state is FlightState.RUNNING:
            await flight.wait_changed()
        if flight.state is FlightState.COMPLETED:
            return flight.events
        raise flight.error or Cancelled("The upstream generation was stopped.")

    def close(self) -> bool:
        """Leave the flight. Returns True if this aborted the engine call (last subscriber, `immediate`)."""
        if self._closed:
            return False
        self._closed = True
        return self.flight._unsubscribe()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
