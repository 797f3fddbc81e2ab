"""The scheduler's handle on a flight of a preemptible class (`admission.preemption.Preemptee`): the tag of its
leader's slot. Before the flight starts its slot is only queued (nothing to stop); once it runs, a strict request
may stop it (`Flight.stoppable`): its call is aborted, and when the slot is granted again it is sent again (nothing
had come back: a restart that costs no client anything) or continued from what came back (a streaming flight that
can be), as `resume.Resumable` does for a request of the direct path. One that another client joined is not
stopped."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..admission.preemption import Plan

if TYPE_CHECKING:
    from ..fleet.instance import Lease
    from ..records import UsageRecord
    from .flight import Flight


class StoppableFlight:
    __slots__ = ("_flight", "_max", "_record")

    def __init__(self, max_preemptions: int, record: UsageRecord) -> None:
        self._max = max_preemptions
        #: The leader's usage record: its stops are counted there, as a preempted request's own are.
        self._record = record
        self._flight: Flight | None = None

    @property
    def preemptions(self) -> int:
        """Times its flight was stopped so far (`Flight.stops`)."""
        return 0 if self._flight is None else self._flight.stops

    def attach(self, flight: Flight, regranted: Callable[[], Awaitable[object]], *, chat_continuation: bool) -> None:
        """The flight the slot was handed over to, and how it waits for that slot to be granted again after a stop
        (`chat_continuation`: every instance of its pool can continue a final assistant message)."""
        self._flight = flight
        flight.resumable(regranted, chat_continuation=chat_continuation)

    # --- Preemptee (synchronous, called by the scheduler) --------------------------------------
    def preemptible(self) -> bool:
        flight = self._flight
        return flight is not None and self.preemptions < self._max and flight.stoppable()

    def preempt(self) -> Plan:
        flight = self._flight
        if flight is None or not self.preemptible():
            raise RuntimeError("preempt() on a flight that is not stoppable")
        how = flight.stop()
        self._record.preemptions += 1
        if how is Plan.RESTART:
            self._record.restarts += 1
        return how

    def redo_tokens(self) -> int:
        flight = self._flight
        return 0 if flight is None else flight.redo_tokens()

    def placed(self) -> Lease | None:
        flight = self._flight
        return None if flight is None else flight.lease
