"""`LoopFamily` exports exactly what prometheus-client's own counter and histogram would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.metrics import LoopFamily

BUCKETS = (0.005, 0.01, 0.025, 0.1, 1.0)
VALUES = [0.0, 0.001, 0.005, 0.0050001, 0.01, 0.02, 0.025, 0.5, 1.0, 3.0, 0.005]


def samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample as (name, sorted labels, value), `_created` left out (LoopFamily has none)."""
    out = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.add((s.name, tuple(sorted(s.labels.items())), s.value))
    return out


def test_histogram_and_counter_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = LoopFamily("t_seconds", "doc", ["model"], ours, buckets=BUCKETS)
    reference = Histogram("t_seconds", "doc", ["model"], buckets=BUCKETS, registry=theirs)
    count = LoopFamily("t_requests", "doc", ["model", "status"], ours)
    reference_count = Counter("t_requests", "doc", ["model", "status"], registry=theirs)
    for n, value in enumerate(VALUES):
        model = "a" if n % 3 else "b"
        hist.labels(model).observe(value)
        reference.labels(model).observe(value)
        count.labels(model, "completed").inc()
        reference_count.labels(model, "completed").inc()
    count.labels("a", "error").inc(2)
    reference_count.labels("a", "error").inc(2)
    assert samples(ours) == samples(theirs)
    assert ("t_seconds_bucket", (("le", "0.005"), ("model", "a")), 3.0) in samples(ours)  # 0.005 counts in le=0.005


def test_a_family_without_children_still_describes_itself() -> None:
    registry = CollectorRegistry()
    LoopFamily("t_empty", "doc", ["model"], registry)
    text = generate_latest(registry).decode()
    assert "# TYPE t_empty_total counter" in text
