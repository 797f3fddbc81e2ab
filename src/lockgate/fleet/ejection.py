"""Passive outlier ejection for one instance: a sync state machine over failures, probes and time.

Theory of operation: request attempts report their outcome. `consecutive_failures` failures in a row
(connect errors, broken streams, 5xx) eject the instance for a backoff that doubles with each ejection
in a row (`base`, `2 base`, `4 base`, ... up to `max`). When the backoff has passed, the health loop
probes the instance; a successful probe returns it to the pool, a failed one ejects it again for
twice as long. An instance that served a request successfully after its return and stayed in the pool
for longer than its last backoff starts over at `base` (one that never answered since does not: an
engine that fails everything it is sent keeps doubling). Failures reported while it is ejected
(attempts still finishing there) change nothing. The caller passes `now` (monotonic seconds), so
tests drive time by hand.

An engine can go silent while its health check still passes (it accepts calls and never answers):
an ejection whose failures include such a call (`silent`) asks for a stronger probe, an answer to a
real request (`Fleet`'s answer probe), before the instance returns.

Passive signals never empty a pool (like Envoy's `max_ejection_percent`): when the failures call for an
ejection, the caller's `may_eject` decides (see `ejection_allowed`, evaluated over every pool the instance
serves). Refused, the instance stays in with its failure count at the threshold, so the next failure asks
again (and is counted in `held_back`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..routing.config import EjectionConfig


def ejection_allowed(members: int, ejected: int, routable_others: int, max_percent: int) -> bool:
    """Whether one more instance of a pool of `members` may be ejected on passive signals, with `ejected`
    of them ejected already and `routable_others` others still taking traffic: never the last routable
    one, and never more than `max_percent` of the pool (rounded down: a pool of one is never ejected,
    of two or three at most one at a time at 50%)."""
    return routable_others >= 1 and (ejected + 1) * 100 <= members * max_percent


class Ejection:
    __slots__ = (
        "_base",
        "_max",
        "_served",
        "_silence",
        "_threshold",
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "held_back",
        "returned_at",
        "silent",
    )

    def __init__(self, config: EjectionConfig | None = None) -> None:
        config = config or EjectionConfig()
        self._threshold = config.consecutive_failures
        self._base = config.base_ms / 1000
        self._max = max(config.max_ms, config.base_ms) / 1000
        self.consecutive_failures = 0
        self.ejections = 0  # ejections in a row: the backoff's exponent
        self.ejected_until: float | None = None
        self.returned_at: float | None = None
        #: Ejections the failures called for but `may_eject` refused (the pool needed the capacity).
        self.held_back = 0
        #: A request succeeded since the instance last returned (or since it started).
        self._served = False
        #: The failures in a row so far include a call the engine went silent in.
        self._silence = False
        #: The current ejection's failures included such a call: it returns only after answering a real request.
        self.silent = False

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def backoff(self) -> float:
        """The length of the current (or last) ejection."""
        return min(self._max, self._base * 2.0 ** max(0, self.ejections - 1))

    def failure(self, now: float, may_eject: Callable[[], bool] | None = None, *, silent: bool = False) -> bool:
        """A request attempt failed (`silent`: the engine went silent in it). Returns True if this ejected the
        instance. `may_eject` is asked only when the failures call for an ejection; if it says no, the instance
        stays in."""
        if self.ejected:
            return False
        self._silence = self._silence or silent
        self.consecutive_failures = min(self.consecutive_failures + 1, self._threshold)
        if self.consecutive_failures < self._threshold:
            return False
        if may_eject is not None and not may_eject():
            self.held_back += 1
            return False
        self._eject(now)
        return True

    def eject_now(self, now: float) -> bool:
        """A failure that leaves no doubt (nothing listening): eject without waiting for more."""
        if self.ejected:
            return False
        self._eject(now)
        return True

    def success(self) -> None:
        if not self.ejected:
            self.consecutive_failures = 0
            self._silence = False
            self._served = True

    def probe_due(self, now: float) -> bool:
        return self.ejected_until is not None and now >= self.ejected_until

    def probed(self, ok: bool, now: float) -> bool:
        """The result of a probe made once `probe_due`. Returns True if the instance is back."""
        if not self.ejected:
            return False
        if ok:
            self.ejected_until = None
            self.returned_at = now
            self.consecutive_failures = 0
            self._served = self._silence = self.silent = False
            return True
        self.ejections += 1
        self.ejected_until = now + self.backoff()
        return False

    def _eject(self, now: float) -> None:
        if self.returned_at is not None and self._served and now - self.returned_at > self.backoff():
            self.ejections = 0  # it served, and behaved for longer than its last time out: start over
        self.ejections += 1
        self.ejected_until = now + self.backoff()
        self.consecutive_failures = 0
        self.silent, self._silence = self._silence, False
