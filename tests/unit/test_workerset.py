"""`merge_metrics`: several workers' `/metrics` as one exposition, every sample labelled with its worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.workerset import merge_metrics


def exposition(requests: int, ttft: float) -> bytes:
    registry = CollectorRegistry()
    Counter("lockgate_requests", "Requests.", ["status"], registry=registry).labels("completed").inc(requests)
    Histogram("lockgate_ttft_seconds", "TTFT.", buckets=(0.1, 1.0), registry=registry).observe(ttft)
    Gauge("lockgate_client_connections", "Connections.", registry=registry).set(requests)
    return generate_latest(registry)


def test_every_workers_series_is_kept_with_its_worker_label_and_families_stay_whole() -> None:
    merged = merge_metrics({1: exposition(5, 0.5), 0: exposition(3, 0.05)}, unreachable=[2])
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}  # parses: families are whole
    counted = families["lockgate_requests"].samples
    requests = {s.labels["worker"]: s.value for s in counted if s.name == "lockgate_requests_total"}
    assert requests == {"0": 3.0, "1": 5.0}
    assert families["lockgate_requests"].type == "counter"
    buckets = {
        (s.labels["worker"], s.labels["le"]): s.value
        for s in families["lockgate_ttft_seconds"].samples
        if s.name == "lockgate_ttft_seconds_bucket"
    }
    assert buckets[("0", "0.1")] == 1.0 and buckets[("1", "0.1")] == 0.0 and buckets[("1", "1.0")] == 1.0
    assert [s.value for s in families["lockgate_workers_unreachable"].samples] == [1.0]
    assert merged.decode().count("# TYPE lockgate_requests_total counter") == 1
