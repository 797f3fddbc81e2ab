"""The scheduler's synchronous core: which queued request gets the next free slot of a model pool.

Theory of operation: a pool has `capacity` slots (the sum of its instances' `max_concurrency`). A
request takes a `Ticket` of one priority class; `offer()` either grants it a slot at once, queues it,
or rejects it (its class queue is full). Whenever a slot frees (`release()`) or capacity grows, the
core grants queued tickets until no slot is free or nothing eligible waits, and returns the granted
tickets so that the async shell (`gate.py`) can wake their owners. Nothing here awaits, reads a
clock or touches I/O: the time is passed in, so every decision is a pure state transition.

Order of service:
- classes marked `strict` (P0 by default) are served first, in class order, whenever they have work;
- the other classes share what is left by stride scheduling on virtual finish times: each class has
  a `pass` (the virtual time its next grant starts) that grows by `1 / weight` per grant; the
  backlogged class whose next grant would *finish* first (`pass + 1/weight`) goes next (ties: the
  more urgent class). Ordering by finish rather than start keeps every class within about one grant
  of its exact share. A class that was idle rejoins at the current virtual time, so idling never
  banks credit and no backlogged class is ever starved;
- within a class, first come, first served;
- a class never runs more than its `max_running` slots (None: no limit beyond capacity);
- `reserve` slots are headroom only strict classes may take: without preemption, this is what lets a
  P0 arrival start at once while the other classes keep the rest of the pool busy;
- the *adaptive strict reserve* (`strict_window_s`): while strict work was seen within the window,
  the shared classes together hold at most `capacity - need` slots, where `need` is the peak strict
  demand (running + queued, counted at each strict arrival) over the last one to two half-windows,
  capped so that the shared classes keep at least half the pool (and always one slot). A steady P0
  trickle thus finds its slot free however hard P2 floods, without stopping anyone; preemption is
  left for bursts beyond the recent peak. When strict traffic stops, the reserve lapses within one
  window and the shared classes get the whole pool back.

Preemption: `running_newest_first(klass)` lists a class's running tickets, most recently granted
first; a preemption policy (`preemption.choose_victim`) picks one, its owner stops the work, and
`requeue()` gives the slot back (granting the waiting strict ticket) and puts the ticket at the head of
its class's queue, so that the stopped request resumes before later arrivals of its class. Its class's
share is not charged again when it resumes (it was when first granted): however often strict work stops
one class, the weighted shares of the shared classes' requests stay as configured.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """One priority class, as the scheduler sees it."""

    name: str
    weight: float = 1.0
    strict: bool = False
    #: Requests that may wait in this class's queue (0: never queue, reject when no slot is free).
    max_queue: int = 1024
    #: Slots this class may hold at once (None: any free slot).
    max_running: int | None = None
    #: How long a request may wait in the queue before it is shed (None: until its own deadline).
    queue_timeout_s: float | None = None


class TicketState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Ticket:
    """One request's place in a pool's schedule. Identity object; state owned by the core."""

    __slots__ = ("granted_at", "klass", "offered_at", "resumed", "seq", "state", "tag")

    def __init__(self, klass: int, tag: Any = None) -> None:
        self.klass = klass
        self.tag = tag
        self.state: TicketState | None = None
        self.seq = 0
        self.offered_at = 0.0
        self.granted_at: float | None = None
        #: Re-queued by a preemption: its next grant continues work its class was charged for already.
        self.resumed = False

    @property
    def running(self) -> bool:
        """It holds a slot (read where a check before an `await` would have narrowed `state`)."""
        return self.state is TicketState.RUNNING

    def __repr__(self) -> str:
        return f"Ticket(klass={self.klass}, seq={self.seq}, state={self.state})"


@dataclass(slots=True)  # one per request: not frozen (its __init__ is ~5x slower); never mutated
class Offer:
    """What `offer()` decided. `granted` lists every ticket granted as a consequence (normally the
    offered one when `admitted`)."""

    admitted: bool
    queued: bool
    retry_after_s: float | None = None
    granted: tuple[Ticket, ...] = ()

    @property
    def rejected(self) -> bool:
        return not (self.admitted or self.queued)


#: The hold time assumed before any request has finished (for Retry-After estimates).
_INITIAL_HOLD_S = 1.0
_EWMA = 0.2


class SchedulerCore:
    def __init__(
        self,
        classes: Sequence[ClassSpec],
        capacity: int,
        *,
        reserve: int = 0,
        strict_window_s: float | None = None,
    ) -> None:
        if not classes:
            raise ValueError("at least one priority class")
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        for spec in classes:
            if not spec.strict and spec.weight <= 0:
                raise ValueError(f"class {spec.name}: weight must be > 0")
        self.classes = tuple(classes)
        if reserve < 0:
            raise ValueError("reserve must be >= 0")
        self.capacity = capacity
        #: Slots that only strict classes may take.
        self.reserve = reserve
        n = len(classes)
        self._queues: list[deque[Ticket]] = [deque() for _ in range(n)]
        self._running: list[dict[int, Ticket]] = [{} for _ in range(n)]  # seq -> ticket, grant order
        self._running_total = 0
        self._pass = [0.0] * n
        self._vtime = 0.0
        self._seq = itertools.count(1)
        self._strict = [i for i, c in enumerate(classes) if c.strict]
        self._shared = [i for i, c in enumerate(classes) if not c.strict]
        self.granted_total = [0] * n
        #: Per class: requests its queue refused, full (`offer`) or at their queue deadline (`PoolScheduler`).
        self.rejected_total = [0] * n
        #: Per class: how long its requests hold a slot (EWMA, seconds; None until one has finished). Short P0
        #: requests do not shorten the wait told to P2 behind long P2 requests.
        self.hold_s: list[float | None] = [None] * n
        if strict_window_s is not None and strict_window_s <= 0:
            raise ValueError("strict_window_s must be > 0")
        #: Adaptive strict reserve (None: off): peak strict demand per half-window, current and previous.
        self.strict_window_s = strict_window_s
        self._peak_now = 0
        self._peak_prev = 0
        self._bucket_start = 0.0
        #: Slots the shared classes leave to strict ones right now (see the module docstring).
        self.strict_need = 0

    # --- transitions -----------------------------------------------------------------------------
    def grant_at_once(self, ticket: Ticket, now: float) -> bool:
        """Offer a new ticket and grant it at once if nobody waits and a slot is free for its class
        (what `offer` and `_dispatch` would decide): the uncontended common case, without an `Offer`.
        Returns False, having changed nothing, when the ticket must go through `offer`."""
        k = ticket.klass
        if ticket.state is not None or not 0 <= k < len(self.classes):
            return False
        if self.strict_window_s is not None:
            self._observe(k, now)
        if any(self._queues) or not self._free_for(k):
            return False
        self._grant(self._take(ticket, now), ticket, now)
        return True

    def _observe(self, k: int, now: float) -> None:
        """Adaptive strict reserve: age the half-window peaks; a strict arrival counts its demand."""
        self._age(now)
        if self.classes[k].strict:
            demand = 1 + sum(len(self._running[s]) + len(self._queues[s]) for s in self._strict)
            if demand > self._peak_now:
                self._peak_now = demand
        self._set_need()

    def _age(self, now: float) -> None:
        """Start a new half-window when the current one is over (a peak lives one to two half-windows)."""
        window = self.strict_window_s
        assert window is not None
        elapsed = now - self._bucket_start
        if elapsed >= window / 2:
            self._peak_prev = self._peak_now if elapsed < window else 0
            self._peak_now = 0
            self._bucket_start = now

    def _set_need(self) -> None:
        peak = max(self._peak_now, self._peak_prev)
        capacity = self.capacity
        self.strict_need = max(0, min(peak, capacity - 1, math.ceil(capacity / 2))) if peak else 0

    def _take(self, ticket: Ticket, now: float) -> int:
        """Number a new ticket; a class that was idle rejoins at the current virtual time."""
        if ticket.state is not None:
            raise ValueError(f"{ticket!r} was already offered")
        k = ticket.klass
        if not 0 <= k < len(self.classes):
            raise ValueError(f"no priority class {k}")
        ticket.seq = next(self._seq)
        ticket.offered_at = now
        if not self._queues[k] and k in self._shared:
            self._pass[k] = max(self._pass[k], self._vtime)  # rejoin at the current virtual time
        return k

    def offer(self, ticket: Ticket, now: float, arrived: float | None = None) -> Offer:
        """A new request asks for a slot. It is granted now, queued, or rejected (queue full). `arrived`: when the
        request began waiting, if earlier (it waited behind an identical request that left without a slot): it
        takes its place in its class's queue by that time, and its queue deadline counts from it."""
        if self.grant_at_once(ticket, now):
            return Offer(admitted=True, queued=False, granted=(ticket,))
        k = self._take(ticket, now)
        queue = self._queues[k]
        if arrived is None or arrived >= now:
            queue.append(ticket)
        else:
            ticket.offered_at = arrived
            place = len(queue)
            while place and queue[place - 1].offered_at > arrived:
                place -= 1
            queue.insert(place, ticket)
        ticket.state = TicketState.QUEUED
        granted = tuple(self._dispatch(now))
        if ticket.state is TicketState.RUNNING:
            return Offer(admitted=True, queued=False, granted=granted)
        if len(queue) > self.classes[k].max_queue:
            queue.remove(ticket)  # the request just offered is the one refused (wherever it took its place)
            ticket.state = TicketState.DONE
            self.rejected_total[k] += 1
            return Offer(admitted=False, queued=False, retry_after_s=self.retry_after(k), granted=granted)
        return Offer(admitted=False, queued=True, granted=granted)

    def release(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The ticket's owner is done (finished, failed, cancelled while queued or running).
        Idempotent. Returns the tickets granted in consequence."""
        state = ticket.state
        if state is TicketState.QUEUED:
            ticket.state = TicketState.DONE
            self._queues[ticket.klass].remove(ticket)
            # A queued ticket leaving can unblock nothing but its class's successors, which wait
            # for a slot anyway; no grant can follow from it.
            return []
        if state is TicketState.RUNNING:
            ticket.state = TicketState.DONE
            del self._running[ticket.klass][ticket.seq]
            self._running_total -= 1
            if ticket.granted_at is not None:
                held = max(0.0, now - ticket.granted_at)
                last = self.hold_s[ticket.klass]
                self.hold_s[ticket.klass] = held if last is None else last + _EWMA * (held - last)
            if self.strict_window_s is not None and now - self._bucket_start >= self.strict_window_s / 2:
                self._age(now)
                self._set_need()
            if not any(self._queues):
                return []  # nobody waits: the freed slot has no taker (the uncontended common case)
            return self._dispatch(now)
        return []

    def requeue(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A running ticket was preempted: free its slot and queue it again at the head of its class
        (never rejected: it was admitted once). Returns the tickets granted in consequence."""
        if ticket.state is not TicketState.RUNNING:
            raise ValueError(f"{ticket!r} is not running")
        del self._running[ticket.klass][ticket.seq]
        self._running_total -= 1
        k = ticket.klass
        queue = self._queues[k]
        if not queue and k in self._shared:
            self._pass[k] = max(self._pass[k], self._vtime)
        ticket.state = TicketState.QUEUED
        ticket.offered_at = now
        ticket.granted_at = None
        ticket.resumed = True
        queue.appendleft(ticket)
        return self._dispatch(now)

    def set_capacity(self, capacity: int, now: float) -> list[Ticket]:
        """Change the pool's size (instances added, removed); grows take effect at once."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        if self.strict_window_s is not None:
            self._set_need()
        return self._dispatch(now)

    # --- queries ---------------------------------------------------------------------------------
    def queued(self, klass: int) -> int:
        return len(self._queues[klass])

    def running(self, klass: int) -> int:
        return len(self._running[klass])

    @property
    def running_total(self) -> int:
        return self._running_total

    @property
    def queued_total(self) -> int:
        return sum(len(q) for q in self._queues)

    def running_newest_first(self, klass: int) -> Iterator[Ticket]:
        """The running tickets of a class, most recently granted first (preemption candidates)."""
        return reversed(self._running[klass].values())

    def retry_after(self, klass: int) -> float:
        """An honest estimate of when a request of this class could get a slot: the requests that
        would be served before it, times the mean hold time, spread over the pool's slots; at most the
        class's queue timeout (all that waits in its queue now is served or shed by then)."""
        own = self.queued(klass) + 1
        spec = self.classes[klass]
        if klass in self._strict:
            ahead = own + sum(self.queued(k) for k in self._strict if k < klass)
        else:
            ahead = own + sum(self.queued(k) for k in self._strict)
            # While this class drains its `own` entries, the other shared classes that are backlogged get their
            # shares: taken as staying backlogged (counting only what they had queued said 38 s to a P2 flood behind
            # a P1 backlog its clients kept up, and P2 requests admitted then waited 49-60 s).
            for k in self._shared:
                if k != klass and self.queued(k):
                    ahead += math.ceil(own * self.classes[k].weight / spec.weight)
        slots = max(1, self.capacity if klass in self._strict else self.capacity - self.reserve)
        limit = spec.max_running
        if limit is not None:
            slots = max(1, min(slots, limit))
        estimate = math.ceil(ahead / slots) * self.mean_hold_s
        # (A few long requests make the mean hold time long: a full P1 queue with a 6 s timeout was told 64 s.)
        return estimate if spec.queue_timeout_s is None else min(estimate, spec.queue_timeout_s)

    @property
    def mean_hold_s(self) -> float:
        """How long a slot is held now: the running requests' classes' hold times, weighted by how many run (the
        slots that free are theirs); 1 s before any request has finished."""
        known = [h for h in self.hold_s if h is not None]
        if not known:
            return _INITIAL_HOLD_S
        fallback = max(known)  # a class not measured yet: assume the longest seen, not the guess
        total = weighted = 0.0
        for klass, running in enumerate(self._running):
            if running:
                hold = self.hold_s[klass]
                total += len(running)
                weighted += len(running) * (fallback if hold is None else hold)
        return weighted / total if total else fallback

    def statistics(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "running": self._running_total,
            "classes": {
                spec.name: {
                    "queued": len(self._queues[i]),
                    "running": len(self._running[i]),
                    "granted": self.granted_total[i],
                    "rejected": self.rejected_total[i],
                }
                for i, spec in enumerate(self.classes)
            },
            "mean_hold_s": self.mean_hold_s,
        }

    # --- the one decision ------------------------------------------------------------------------
    def _eligible(self, k: int) -> bool:
        return bool(self._queues[k]) and self._below_class_limit(k)

    def _below_class_limit(self, k: int) -> bool:
        limit = self.classes[k].max_running
        return limit is None or len(self._running[k]) < limit

    def _next_class(self) -> int | None:
        for k in self._strict:
            if self._eligible(k):
                return k
        if not self._shared_room():
            return None  # only the strict classes' headroom is left
        best: int | None = None
        best_finish = 0.0
        for k in self._shared:
            if self._eligible(k):
                finish = self._pass[k] + 1.0 / self.classes[k].weight
                if best is None or finish < best_finish:
                    best, best_finish = k, finish
        return best

    def _free_for(self, k: int) -> bool:
        """A slot is free for class `k` (its own limit, and the strict classes' reserve for the others)."""
        if self.classes[k].strict:
            return self._running_total < self.capacity and self._below_class_limit(k)
        return self._shared_room() and self._below_class_limit(k)

    def _shared_room(self) -> bool:
        """The shared classes may take one more slot: the static reserve and the adaptive one allow it."""
        if self._running_total >= self.capacity - self.reserve:
            return False
        need = self.strict_need
        if not need:
            return True
        strict_running = sum(len(self._running[s]) for s in self._strict)
        return self._running_total - strict_running < self.capacity - need

    def _dispatch(self, now: float) -> list[Ticket]:
        granted: list[Ticket] = []
        while self._running_total < self.capacity:
            k = self._next_class()
            if k is None:
                break
            ticket = self._queues[k].popleft()
            self._grant(k, ticket, now)
            granted.append(ticket)
        return granted

    def _grant(self, k: int, ticket: Ticket, now: float) -> None:
        if not self.classes[k].strict:
            self._vtime = self._pass[k]
            if ticket.resumed:
                ticket.resumed = False  # charged when first granted: the class's share counts requests, once
            else:
                self._pass[k] += 1.0 / self.classes[k].weight
        ticket.state = TicketState.RUNNING
        ticket.granted_at = now
        self._running[k][ticket.seq] = ticket
        self._running_total += 1
        self.granted_total[k] += 1
