"""Engine idle time while there was work for it, from the engines' own busy signals, sampled.

Waste is an engine running nothing while requests for its model wait (in the gateway's admission queue or
inside another engine of the same pool): that is what the objective counts. Each sample looks at every engine
once: one with a fresh scraped running-request count (the vLLM, SGLang, TGI and llama.cpp dialects export
one) counts as busy when it runs something, and as idle when it runs nothing *while its model had requests
waiting*; an idle engine whose model had nothing waiting is not counted (an idle fleet without demand is not
wasting anything, and would otherwise burn the budget every night). One without a fresh signal (an
OpenAI-compatible server, a failed or stale scrape) or out of service (unhealthy, retired) is not counted
either, so an engine that exports nothing leaves the objective unknown rather than met. Samples are kept in
memory for the longest window up to `MAX_HORIZON_S` (the usage records know nothing of engine busyness, so
longer windows, the SLO period among them, are unknown).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping
from typing import TYPE_CHECKING

from .objectives import Counts

if TYPE_CHECKING:
    from ..fleet.instance import Instance
    from ..fleet.pool import Pool

#: Samples are kept for at most this long (6 h: the default ticket alert's long window).
MAX_HORIZON_S = 6 * 3600


def busy_and_idle(
    instances: Iterable[Instance], now: float, stale_after_s: float, wanted: Container[str]
) -> tuple[int, int]:
    """(busy, idle) engines among `instances` whose busy signal is fresh at `now` (monotonic); an engine
    running nothing counts as idle only when its key is in `wanted` (its model had requests waiting)."""
    busy = idle = 0
    for instance in instances:
        load = instance.engine_load
        if load is None or load.running is None or not instance.healthy or instance.retired:
            continue
        if load.age(now) > stale_after_s:
            continue
        if load.running > 0:
            busy += 1
        elif instance.key in wanted:
            idle += 1
    return busy, idle


def waiting_for(pools: Iterable[Pool], queued: Callable[[str], int], now: float, stale_after_s: float) -> set[str]:
    """Keys of the engines whose model has requests waiting: `queued(model)` at the gateway's admission, or
    in the fresh scraped queue of any engine of its pool."""
    wanted: set[str] = set()
    for pool in pools:
        if queued(pool.model) > 0 or any(_engine_queue(i, now, stale_after_s) > 0 for i in pool.instances):
            wanted.update(i.key for i in pool.instances)
    return wanted


def _engine_queue(instance: Instance, now: float, stale_after_s: float) -> float:
    load = instance.engine_load
    if load is None or load.waiting is None or load.age(now) > stale_after_s:
        return 0.0
    return load.waiting


class IdleSamples:
    """A bounded ring of samples `(monotonic time, busy engines, idle engines)`.

    Bound: `horizon_s / interval_s + 1` samples (with the defaults, 6 h at one sample every 5 s: 4,321)."""

    __slots__ = ("_samples", "horizon_s")

    def __init__(self, horizon_s: float, interval_s: float) -> None:
        self.horizon_s = min(horizon_s, MAX_HORIZON_S)
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=math.ceil(self.horizon_s / interval_s) + 1)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, now: float, busy: int, idle: int) -> None:
        self._samples.append((now, busy, idle))

    def counts(self, now: float, windows: Mapping[str, int]) -> dict[str, Counts]:
        """Engine samples (events) and idle ones (bad) per window; windows beyond the horizon are left out
        (unknown). A window longer than the samples so far counts what there is."""
        out: dict[str, Counts] = {}
        for name, seconds in windows.items():
            if seconds > self.horizon_s:
                continue
            since = now - seconds
            busy = idle = 0
            for at, b, i in reversed(self._samples):
                if at < since:
                    break
                busy += b
                idle += i
            out[name] = Counts(events=busy + idle, bad=idle)
        return out
