"""Reading the gateway's state into plain data for the dashboard (the only impure part of a snapshot).

`read_totals` reads the cumulative metrics a `Sample` is computed from; `gather` reads everything a
snapshot shows (registry, fleet, admission and de-duplication statistics, counters, the SLO provider) into a
`GatewayState`, which `snapshot.build_snapshot` turns into the JSON the page renders. Metric families are
read by label name (the gateway's lock-free `LoopFamily` directly, others through prometheus-client's
`collect()`): adding labels to a family (the SLI work adds `priority`) changes nothing here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..fleet.report import describe_fleet
from ..metrics import LoopFamily
from .history import Buckets, Totals

if TYPE_CHECKING:
    from ..admission.gate import Admission
    from ..dedup.coalescer import Coalescer
    from ..exchange import Registry
    from ..fleet.fleet import Fleet
    from ..metrics import GatewayMetrics

log = logging.getLogger(__name__)

#: Requests in flight listed in a snapshot (the longest-running first); the total is always given.
MAX_REQUESTS_SHOWN = 100

#: What `Gateway.slo_provider` returns: `{"objectives": [{"name", "objective", "target", "status",
#: "budget_remaining", "windows"}]}` (the shape of `GET /admin/slo`), or None when nothing is evaluated.
SloProvider = Callable[[], Mapping[str, Any] | None]


class Observed(Protocol):
    """What a snapshot reads of the gateway (`gateway.Gateway`)."""

    @property
    def started_at(self) -> float: ...

    @property
    def draining(self) -> bool: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def dedup(self) -> Coalescer: ...

    @property
    def slo_provider(self) -> SloProvider | None: ...


class _Collectable(Protocol):
    def collect(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything one snapshot shows, as plain data read at `at` (Unix time)."""

    at: float
    started_at: float
    draining: bool
    fleet: Mapping[str, Any]
    admission: Mapping[str, Any]
    requests: list[dict[str, Any]]
    requests_total: int
    dedup: Mapping[str, Any]
    #: Counter families summed by one label: "requests" (by status), "cancellations" (by reason),
    #: "dedup" (by outcome), "tokens_saved" (by kind).
    counters: Mapping[str, Mapping[str, float]]
    slo: Mapping[str, Any] | None
    slo_error: str | None = None


def _samples(family: _Collectable) -> Iterator[tuple[str, Mapping[str, str], float]]:
    for metric in family.collect():
        for sample in metric.samples:
            yield sample.name, sample.labels, sample.value


def histogram(family: _Collectable, *, exclude: Mapping[str, str] | None = None) -> Buckets:
    """All label sets of a histogram family added up, skipping those whose labels match `exclude`."""
    if isinstance(family, LoopFamily) and family.bounds is not None:
        return _loop_histogram(family, exclude or {})
    cumulative: dict[float, float] = {}
    for name, labels, value in _samples(family):
        if not name.endswith("_bucket"):
            continue
        if exclude and any(labels.get(k) == v for k, v in exclude.items()):
            continue
        bound = float(labels["le"])
        cumulative[bound] = cumulative.get(bound, 0.0) + value
    bounds = sorted(cumulative)
    counts: list[int] = []
    running = 0.0
    for bound in bounds:
        counts.append(int(cumulative[bound] - running))
        running = cumulative[bound]
    if not bounds or bounds[-1] != float("inf"):
        counts.append(0)  # no observation yet: an empty +Inf bucket
    finite = tuple(b for b in bounds if b != float("inf"))
    return Buckets(finite, tuple(counts))


def _loop_histogram(family: LoopFamily, exclude: Mapping[str, str]) -> Buckets:
    """`histogram()` read straight from a `LoopFamily`'s children (the sampler runs this every tick: a sample
    costs ~25 us this way, ~0.7 ms through `collect()`)."""
    bounds = family.bounds
    assert bounds is not None
    names = family.labelnames
    skip = [(names.index(k), v) for k, v in exclude.items() if k in names]
    totals = [0] * (len(bounds) + 1)
    for values, child in family.children():
        if any(values[i] == v for i, v in skip):
            continue
        for i, count in enumerate(child.counts):
            totals[i] += count
    return Buckets(bounds, tuple(totals))


def counter_by(family: _Collectable, label: str) -> dict[str, float]:
    """A counter family's totals grouped by one label's value."""
    out: dict[str, float] = {}
    if isinstance(family, LoopFamily) and family.bounds is None and label in family.labelnames:
        at = family.labelnames.index(label)
        for values, child in family.children():
            out[values[at]] = out.get(values[at], 0.0) + child.value
        return out
    for name, labels, value in _samples(family):
        if not name.endswith("_total"):
            continue
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def read_totals(gateway: Observed) -> Totals:
    """The cumulative metrics a `Sample` is the difference of. TTFT leaves out non-streaming requests
    when the family says which they are (their "first token" is the whole answer)."""
    metrics = gateway.metrics
    return Totals(
        at=time.time(),
        latency=histogram(metrics.request_duration),
        ttft=histogram(metrics.ttft, exclude={"stream": "false"}),
        finished=counter_by(metrics.requests, "status"),
    )


def gather(gateway: Observed, *, max_requests: int = MAX_REQUESTS_SHOWN) -> GatewayState:
    """Read the gateway's state for one snapshot."""
    exchanges = gateway.registry.all()
    listed = sorted(exchanges, key=lambda e: e.started)[:max_requests]
    metrics = gateway.metrics
    slo: Mapping[str, Any] | None = None
    slo_error: str | None = None
    provider = gateway.slo_provider
    if provider is not None:
        try:
            slo = provider()
        except Exception as exc:  # a failing evaluation must not take the dashboard down
            log.warning("the SLO provider failed", exc_info=True)
            slo_error = f"{type(exc).__name__}: {exc}"[:300]
    return GatewayState(
        at=time.time(),
        started_at=gateway.started_at,
        draining=gateway.draining,
        fleet=describe_fleet(gateway.fleet),
        admission=gateway.admission.statistics(),
        requests=[e.describe() for e in listed],
        requests_total=len(exchanges),
        dedup=gateway.dedup.statistics(),
        counters={
            "requests": counter_by(metrics.requests, "status"),
            "cancellations": counter_by(metrics.cancellations, "reason"),
            "dedup": counter_by(gateway.dedup.metrics.outcomes, "outcome"),
            "tokens_saved": counter_by(gateway.dedup.metrics.tokens_saved, "kind"),
        },
        slo=slo,
        slo_error=slo_error,
    )
