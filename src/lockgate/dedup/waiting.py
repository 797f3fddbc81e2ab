"""Requests waiting to lead a flight: each waits for a slot at its pool's scheduler, or for something that serves
it without one.

A request that would lead a new flight while every slot of its pool is taken waits (`Coalescer.serve`). While it
waits, it is woken to look again when:
- a flight it may join starts for its fingerprint (an identical request got a slot first; a streaming request only
  joins a streaming flight, `Flights.get`): it leaves the queue and joins;
- a result is stored for its fingerprint (a flight it could not join completed): it leaves the queue with a hit;
- the identical request it waits behind leaves without leading (see below): it looks for its own place.

An identical request arriving while another is already queued to lead — of the same class or a more urgent one,
whose flight it could join — waits behind that one without a ticket of its own: duplicates then take one place in
the queue, not one each (nor a 429 `queue_full` for places that would have cost nothing). Its wait is bounded by its
own queue deadline, counted from its arrival (`Slot.wait_behind`); if the one ahead leaves without leading, it queues
in the scheduler by its arrival time, not behind those that came after it.

Every entry belongs to one request, which removes it in its own `finally`: at most one entry per request in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from ..changes import Changes
from .fingerprint import Fingerprint


@dataclass(slots=True)
class _Waiter:
    #: Whether the request streams (it may then join only a streaming flight).
    stream: bool
    #: Its class when it holds a ticket in the queue; None when it waits behind another without one.
    klass: int | None


class Waiting:
    __slots__ = ("_by_key", "_changes")

    def __init__(self) -> None:
        self._by_key: dict[Fingerprint, dict[asyncio.Future[None], _Waiter]] = {}
        #: Tests wait on it; free while nobody does.
        self._changes = Changes()

    def __len__(self) -> int:
        """Requests waiting."""
        return sum(len(waiting) for waiting in self._by_key.values())

    def ahead(self, key: Fingerprint, stream: bool, klass: int) -> bool:
        """Whether a request is queued to lead a flight for `key` that a request (`stream`ing or not, of class
        `klass`) may wait behind: of its class or a more urgent one, and whose flight it could join."""
        waiting = self._by_key.get(key)
        if waiting is None:
            return False
        return any(w.klass is not None and w.klass <= klass and (w.stream or not stream) for w in waiting.values())

    def add(self, key: Fingerprint, stream: bool, klass: int | None) -> asyncio.Future[None]:
        """A request starts waiting (`klass`: None without a ticket); the future is done when it should look again."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._by_key.setdefault(key, {})[woken] = _Waiter(stream, klass)
        self._changes.notify()
        return woken

    def remove(self, key: Fingerprint, woken: asyncio.Future[None]) -> None:
        """The request stopped waiting, whatever the reason. If it held a ticket, those waiting behind it without
        one look again (it may have left without leading: one of them then takes its place in the queue)."""
        waiting = self._by_key.get(key)
        if waiting is None:
            return
        waiter = waiting.pop(woken, None)
        self._changes.notify()
        if not waiting:
            del self._by_key[key]
        elif waiter is not None and waiter.klass is not None:
            for other, behind in waiting.items():
                if behind.klass is None:
                    _wake(other)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds, re-checked whenever a request starts or stops waiting (tests)."""
        await self._changes.wait_until(predicate)

    def flight_started(self, key: Fingerprint, stream: bool) -> None:
        """Wake the requests that may join this flight."""
        for woken, waiter in self._by_key.get(key, {}).items():
            if stream or not waiter.stream:
                _wake(woken)

    def stored(self, key: Fingerprint) -> None:
        """A result for `key` was stored: it serves every request waiting for one, as a streaming flight would."""
        self.flight_started(key, stream=True)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
