"""Waiting for state to change without polling: `Changes`.

The owner of some state calls `notify()` after each change; `wait_until(predicate)` re-checks its
predicate on every change until it holds (bound it with `asyncio.timeout`). Tests, drains and admin
views use it on the flight registry, the admission gate, the fleet and the simulator's statistics.

Cost: with nobody waiting (the normal case on the request path) `notify()` is one attribute test; a new
`asyncio.Event` is made only when a waiter has to be woken.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    __slots__ = ("_event", "_waiting")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        #: Tasks in `wait_until()`.
        self._waiting = 0

    def notify(self) -> None:
        """The state changed: every waiter re-checks its predicate."""
        if self._waiting:  # else the unset event serves the next waiter as it is
            self._event.set()
            self._event = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every `notify()`."""
        self._waiting += 1
        try:
            while not predicate():
                await self._event.wait()
        finally:
            self._waiting -= 1
