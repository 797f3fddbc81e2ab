"""The registry of flights in progress, keyed by fingerprint; owner of every flight's task.

`Flights` is an async context manager (the `Gateway` holds it): `start()` creates a flight's task and
keeps it; `aclose()` stops the flights still running (detached `finish_and_cache` ones, or any left at
shutdown) and awaits every task. Lookups and starts are synchronous, so "is there a flight for this
fingerprint? if not, start one" cannot interleave with another request doing the same. A flight that
closes to joiners (its history bound) leaves the lookup table at once but stays owned here (`all()`,
`aclose()`) until it ends.

A fingerprint has at most one joinable flight of each kind: a streaming one and a JSON one (see
`flight.py`). A streaming request joins only a streaming flight; a non-streaming request prefers the
JSON flight (one body, nothing to assemble) and else joins the streaming one.

Mixed clients: a streaming flight started while a JSON flight for the same fingerprint runs is a second
engine call for one generation (a *split*). After a split, the model's non-streaming leaders lead
streaming flights (which every client joins) for `MIXED_WINDOW_S`, renewed by every split: a model whose
clients mix pays at most one extra call per window, one whose clients agree gets JSON flights.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..attempt import Failover, Opened, open_attempts
from ..changes import Changes
from ..errors import Cancelled, ShuttingDown
from ..wire import Endpoint
from .cache import Result, ResultCache
from .fingerprint import Fingerprint
from .flight import Flight

#: How long after a split (see the module docstring) a model's non-streaming leaders lead streaming flights.
MIXED_WINDOW_S = 60.0

if TYPE_CHECKING:
    from ..config import FlightsConfig
    from ..fleet.fleet import Fleet
    from ..fleet.instance import Lease
    from ..fleet.pool import Pool
    from ..metrics import GatewayMetrics
    from ..routing.policies import RouteRequest
    from ..upstream import UpstreamCall
    from ..wire import ApiRequest


#: A flight whose engine has shown nothing this long takes no new joiners (`Flights.get`): a long prefill alone on its
#: engine may take that long (a joiner then makes a call of its own: work, not an error); a hung engine takes longer.
STUCK_S = 30.0


class Flights:
    def __init__(
        self,
        fleet: Fleet,
        metrics: GatewayMetrics,
        cache: ResultCache,
        config: FlightsConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        #: Per model, until when its non-streaming leaders lead streaming flights (after a split).
        self._mixed_until: dict[str, float] = {}
        self._metrics = metrics
        self.cache = cache
        #: Whether a finished stored response (the Responses API, `store` not false) is kept for reuse: not where
        #: another process may delete it unseen (a central replica, one of several workers: an outside run deleted a
        #: response through one central and got its id back from the other's cache, then 404 for it). Such a process
        #: still shares the responses in flight.
        self.keeps_stored = True
        self._max_lag_bytes = config.max_lag_bytes if config is not None else 1 << 20
        self._max_history_bytes = config.max_history_bytes if config is not None else 4 << 20
        #: Joinable flights by fingerprint (streaming ones, JSON ones), and every flight still running
        #: (joinable or not).
        self._streams: dict[bytes, Flight] = {}
        self._bodies: dict[bytes, Flight] = {}
        self._running: set[Flight] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Flight ids are this prefix and a counter (`os.urandom` per flight was a system call each).
        self._id_prefix = "lg-f-" + os.urandom(6).hex() + "-"
        #: Several changes per request; free while nobody waits.
        self._changes = Changes()
        self.started = 0
        self.completed = 0
        self.failed = 0
        self.abandoned = 0
        self.closed_to_joiners = 0
        self.splits = 0

    async def __aenter__(self) -> Flights:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __len__(self) -> int:
        return len(self._running)

    def get(self, key: Fingerprint, *, stream: bool) -> Flight | None:
        """The joinable flight a `stream`ing (or non-streaming) request for `key` may join, if any. A flight whose
        engine has shown nothing for `STUCK_S` (`Flight.waiting_since`) takes no more: a client retrying after its own
        timeout joined the call stuck on a hung engine again (until the stall timeout), however idle the others;
        it leads a call of its own instead, routed by what routing sees (the hung engine's lateness)."""
        flight = (
            self._streams.get(key.digest) if stream else self._bodies.get(key.digest) or self._streams.get(key.digest)
        )
        if flight is None:
            return None
        since = flight.waiting_since()
        if since is not None and time.monotonic() - since > STUCK_S:
            flight.joinable = False
            self.flight_closed_to_joiners(flight)
            return self.get(key, stream=stream)  # (the other kind, for a non-streaming request)
        return flight

    def leads_json(self, model: str) -> bool:
        """Whether a non-streaming leader of `model` should lead a JSON flight now (no recent split)."""
        until = self._mixed_until.get(model)
        if until is None:
            return True
        if self._clock() < until:
            return False
        del self._mixed_until[model]
        return True

    def _table(self, flight: Flight) -> dict[bytes, Flight]:
        return self._streams if flight.stream else self._bodies

    def _unlist(self, flight: Flight) -> None:
        """Identical requests no longer find `flight` (if it is still the one listed for its fingerprint)."""
        table = self._table(flight)
        if table.get(flight.key.digest) is flight:
            del table[flight.key.digest]

    def all(self) -> list[Flight]:
        return list(self._running)

    def cancel(self, flight_id: str) -> bool | None:
        """Stop the running flight `flight_id` (an administrator's cancel): its clients, if any are left, get the
        error. None: no such flight; False: it was already ending."""
        flight = next((f for f in self._running if f.id == flight_id), None)
        if flight is None:
            return None
        if flight.done:
            return False
        error = Cancelled("The shared generation was cancelled by an administrator.", final=True)
        error.reason = "admin"
        flight.abort(error)
        return True

    def start(
        self,
        key: Fingerprint,
        pool: Pool,
        api: ApiRequest,
        route: RouteRequest,
        before_send: Callable[[Lease, bool], None] | None = None,
        failover: Failover | None = None,
    ) -> Flight:
        """Start a flight sending `api` (a streaming flight if `api.stream`, else a JSON one); `before_send` goes
        with its engine calls (`attempt.open_attempts`: its leader's class may make room at the engine); `failover`:
        the breaks of an earlier flight of the same generation it takes over (`Flight.again`)."""
        if self._closed:
            raise ShuttingDown("The gateway is shutting down.", retry_after=1)
        table = self._streams if api.stream else self._bodies
        if key.digest in table:
            raise RuntimeError("a flight of this kind for this fingerprint is already running")
        if api.stream and key.digest in self._bodies:
            self.splits += 1  # a second call for one generation: this model's clients mix
            self._mixed_until[pool.model] = self._clock() + MIXED_WINDOW_S
        fleet, metrics = self._fleet, self._metrics

        #: The flight's engine calls that break midway and are taken over elsewhere (`Flight._fails_over`).
        failover = failover or Failover(pool)

        def open_engine(
            flight_id: str, request: ApiRequest, hold: Callable[[Lease, UpstreamCall], None], drop: Callable[[], object]
        ) -> Awaitable[Opened]:
            return open_attempts(
                fleet,
                metrics,
                pool,
                request,
                route,
                flight_id,
                hold=hold,
                drop=drop,
                time_left=lambda: True,
                before_send=before_send,
                whole_limit=None if request.stream else fleet.upstream.max_response_bytes,
                exclude=failover.excluded,
                after=failover.error(),
            )

        flight = Flight(
            self,
            f"{self._id_prefix}{self.started:x}",
            key,
            api,
            open_engine,
            cancel_policy=pool.config.cancel_policy,
            max_response_bytes=fleet.upstream.max_response_bytes,
            max_lag_bytes=self._max_lag_bytes,
            max_history_bytes=self._max_history_bytes,
            deadline_s=pool.config.timeout_ms / 1000 if pool.config.timeout_ms else None,
            failover=failover,
        )
        table[key.digest] = flight
        self._running.add(flight)
        task = asyncio.create_task(flight.run(), name=f"lockgate-flight:{flight.id}")
        flight.task = task
        flight.loop = task.get_loop()
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, flight))
        self.started += 1
        self._changes.notify()
        return flight

    def _task_done(self, flight: Flight, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # An ended task keeps its exception (a cancelled flight's) and that exception's frames, which hold the flight:
        # the flight holding the task back would make a cycle that keeps the request's body and the flight's history
        # until a full garbage collection.
        flight.task = None
        self._changes.notify()

    def _forget(self, flight: Flight, result: Result | None = None) -> None:
        release_slot, flight.release_slot = flight.release_slot, None
        if release_slot is not None:
            release_slot()
        settle, flight.settle_allowance = flight.settle_allowance, None
        if settle is not None:
            # What it produced while its leader followed it and while no client did (`Flight.leader_tokens`; a JSON
            # flight cut short shows no events: its engine's work is estimated, `Lease.produced`), at most what the
            # engine reported for a completed flight; and its prompt with them, the engine's count if it gave one.
            api = flight.api
            led, unattended = api.generable(flight.leader_tokens()), api.generable(flight.unattended_tokens())
            prompt = api.estimated_prompt_tokens()
            if result is not None and result.completion_tokens:
                led, unattended = min(led, result.completion_tokens), min(unattended, result.completion_tokens)
                prompt = result.prompt_tokens or prompt
            settle(prompt + led if led or unattended else 0, flight.attempts > 0, unattended)
        self._unlist(flight)
        self._running.discard(flight)
        self._changes.notify()

    # --- FlightOwner: called synchronously by a flight as it ends ---------------------------------
    def flight_completed(self, flight: Flight, result: Result | None) -> None:
        self.completed += 1
        kept = result if result is not None and self._keeps(flight) else None
        if kept is not None:
            self.cache.put(flight.key, kept)  # before forgetting: a newcomer finds one or the other
        self._forget(flight, result)
        if flight.on_completed is not None and kept is not None and kept.nbytes <= self.cache.max_entry_bytes:
            flight.on_completed(kept)  # the semantic cache: the same per-entry bound

    def flight_closed_to_joiners(self, flight: Flight) -> None:
        """The flight's history outgrew its bound, or it is stuck (`get`): identical requests no longer find it."""
        self._unlist(flight)
        self.closed_to_joiners += 1
        self._changes.notify()

    def flight_stopped(self, flight: Flight) -> None:
        """The flight was stopped for a more urgent request and waits for its slot: identical requests no longer find
        it meanwhile (they would wait behind its class's queue: they lead their own; it still stores its result when
        it completes), until it resumes (`flight_resumed`)."""
        self._unlist(flight)
        self._changes.notify()

    def flight_resumed(self, flight: Flight) -> None:
        """A stopped flight has its slot again and sends its call (or its continuation): identical requests find it
        again, unless one of them leads a flight of its own meanwhile."""
        table = self._table(flight)
        if flight.joinable and flight.key.digest not in table:
            table[flight.key.digest] = flight
        self._changes.notify()

    def flight_failed(self, flight: Flight) -> None:
        self.failed += 1
        self._forget(flight)

    def flight_abandoned(self, flight: Flight, partial: Result | None) -> None:
        self.abandoned += 1
        if partial is not None and partial.has_events and self._keeps(flight):
            self.cache.put(flight.key, partial)
        self._forget(flight)

    def _keeps(self, flight: Flight) -> bool:
        """Whether the flight's result may be kept for reuse (`keeps_stored`)."""
        api = flight.api
        return self.keeps_stored or api.endpoint is not Endpoint.RESPONSES or api.body.get("store") is False

    # --- observation (tests, admin) ---------------------------------------------------------------
    def flight_changed(self, flight: Flight) -> None:
        """A flight's subscribers changed: `wait_until` re-checks."""
        self._changes.notify()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds, re-checked on every change (bound it with `asyncio.timeout`)."""
        await self._changes.wait_until(predicate)

    def statistics(self) -> dict[str, Any]:
        return {
            "in_flight": len(self._running),
            "joinable": len(self._streams) + len(self._bodies),
            "tasks": len(self._tasks),
            "subscribers": sum(f.subscribers for f in self._running),
            "started": self.started,
            "completed": self.completed,
            "failed": self.failed,
            "abandoned": self.abandoned,
            "closed_to_joiners": self.closed_to_joiners,
            "splits": self.splits,
        }

    async def aclose(self) -> None:
        self._closed = True
        for flight in list(self._running):
            flight.abort(ShuttingDown("The gateway is shutting down; the request was stopped."))
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
