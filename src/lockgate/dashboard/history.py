"""Per-second samples for the dashboard's plots: a bounded ring, filled from the gateway's own metrics.

Nothing is added to the request path. Once per interval the feed reads the cumulative histograms and
counters the gateway keeps anyway (`Totals`) and turns the difference from the previous reading into one
`Sample`: request rate, error and rejection rates, and latency / TTFT percentiles estimated from the
histogram buckets the way Prometheus' `histogram_quantile` does (linear within a bucket; a quantile in the
+Inf bucket is reported as the highest finite bound). The `History` ring keeps the last `capacity`
samples and drops the oldest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: The quantiles each sample carries, for latency and for TTFT.
QUANTILES = (0.5, 0.95, 0.99)

#: Final statuses (the `status` label of `lockgate_requests`) counted as errors: the request failed.
ERROR_STATUSES = frozenset({"error", "timeout"})
REJECTED_STATUSES = frozenset({"rejected"})


@dataclass(frozen=True, slots=True)
class Buckets:
    """One histogram (all its label sets added up): finite upper bounds and per-bucket counts, the last
    count being the +Inf bucket (so `len(counts) == len(bounds) + 1`)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]

    def minus(self, earlier: Buckets) -> Buckets:
        if earlier.bounds != self.bounds:
            return self  # the histogram changed shape (not expected): count everything as new
        return Buckets(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)))


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative values read from the metrics at one instant (`at`: Unix time)."""

    at: float
    latency: Buckets
    ttft: Buckets
    #: Finished requests by final status (`lockgate_requests`).
    finished: dict[str, float]


@dataclass(frozen=True, slots=True)
class Sample:
    """What happened during one interval ending at `t` (Unix seconds). Rates are per second; latencies
    and TTFTs in seconds, None when no request finished (or started streaming) in the interval."""

    t: float
    rps: float
    errors_ps: float
    rejected_ps: float
    latency: tuple[float | None, ...]  # one per QUANTILES
    ttft: tuple[float | None, ...]

    def row(self) -> list[float | None]:
        """The compact form sent to the page: [t, rps, errors/s, rejected/s, latency p50, p95, p99,
        ttft p50, p95, p99]."""
        return [round(self.t, 3), self.rps, self.errors_ps, self.rejected_ps, *self.latency, *self.ttft]


#: The columns of `Sample.row()`, sent once with the history so that the page does not hard-code them.
SAMPLE_FIELDS = (
    *("t", "rps", "errors_ps", "rejected_ps"),
    *("latency_p50", "latency_p95", "latency_p99", "ttft_p50", "ttft_p95", "ttft_p99"),
)


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of the observations in `buckets`, interpolated linearly inside its bucket (the
    first bucket starts at 0); None when there are none."""
    total = sum(buckets.counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(buckets.counts):
        if count <= 0:
            continue
        if seen + count >= rank:
            if index >= len(buckets.bounds):  # +Inf bucket: no upper bound to interpolate to
                return buckets.bounds[-1] if buckets.bounds else None
            lower = buckets.bounds[index - 1] if index > 0 else 0.0
            upper = buckets.bounds[index]
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return buckets.bounds[-1] if buckets.bounds else None


def _rate(statuses: Iterable[str], now: dict[str, float], before: dict[str, float], dt: float) -> float:
    return round(sum(now.get(s, 0.0) - before.get(s, 0.0) for s in statuses) / dt, 3)


def sample_between(before: Totals, now: Totals) -> Sample:
    """The sample for the interval from `before` to `now` (a pure function)."""
    dt = max(now.at - before.at, 1e-3)
    latency = now.latency.minus(before.latency)
    ttft = now.ttft.minus(before.ttft)
    return Sample(
        t=now.at,
        rps=_rate(now.finished.keys(), now.finished, before.finished, dt),
        errors_ps=_rate(ERROR_STATUSES, now.finished, before.finished, dt),
        rejected_ps=_rate(REJECTED_STATUSES, now.finished, before.finished, dt),
        latency=tuple(_round(quantile(latency, q)) for q in QUANTILES),
        ttft=tuple(_round(quantile(ttft, q)) for q in QUANTILES),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class History:
    """The last `capacity` samples, oldest first. Memory is bounded by `capacity` (one small record a
    sample)."""

    __slots__ = ("_samples",)

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._samples: deque[Sample] = deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        maxlen = self._samples.maxlen
        assert maxlen is not None
        return maxlen

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)

    def __len__(self) -> int:
        return len(self._samples)

    def all(self) -> Sequence[Sample]:
        return tuple(self._samples)

    def tail(self, n: int) -> Sequence[Sample]:
        """The newest `n` samples, oldest first."""
        if n <= 0:
            return ()
        samples = self._samples
        return tuple(samples[i] for i in range(max(0, len(samples) - n), len(samples)))
