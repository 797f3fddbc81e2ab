"""The dashboard's pure parts: percentiles from histogram buckets, samples, the bounded ring, metric reading,
the snapshot function, and the feed's fan-out (driven by `tick()`, no clock)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from lockgate.config import DashboardConfig
from lockgate.dashboard.feed import TAIL_ROWS, Feed
from lockgate.dashboard.history import SAMPLE_FIELDS, Buckets, History, Sample, Totals, quantile, sample_between
from lockgate.dashboard.routes import MAX_SAMPLES, history_samples
from lockgate.dashboard.snapshot import build_snapshot, instance_status
from lockgate.dashboard.sources import GatewayState, counter_by, histogram
from lockgate.metrics import GatewayMetrics

BOUNDS = (0.1, 0.5, 1.0)


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 in (0.5, 1.0].
    b = Buckets(BOUNDS, (4, 4, 2, 0))
    assert quantile(b, 0.2) == pytest.approx(0.05)  # rank 2 of 4 in the first bucket
    assert quantile(b, 0.6) == pytest.approx(0.3)  # rank 6: half-way through the second
    assert quantile(b, 0.9) == pytest.approx(0.75)
    assert quantile(Buckets(BOUNDS, (0, 0, 0, 0)), 0.5) is None
    # A quantile in the +Inf bucket is the highest finite bound.
    assert quantile(Buckets(BOUNDS, (1, 0, 0, 9)), 0.99) == 1.0


def test_a_sample_is_the_difference_of_two_readings() -> None:
    before = Totals(100.0, Buckets(BOUNDS, (5, 0, 0, 0)), Buckets(BOUNDS, (5, 0, 0, 0)), {"completed": 5.0})
    now = Totals(
        102.0,
        Buckets(BOUNDS, (5, 10, 0, 0)),
        Buckets(BOUNDS, (9, 0, 0, 0)),
        {"completed": 13.0, "error": 1.0, "timeout": 1.0, "rejected": 2.0, "client_disconnect": 1.0},
    )
    s = sample_between(before, now)
    assert s.t == 102.0
    assert s.rps == 6.5  # 13 finished in 2 s, whatever their status
    assert s.errors_ps == 1.0  # error + timeout
    assert s.rejected_ps == 1.0
    # Only the 10 new latency observations, all in (0.1, 0.5]: the old ones in (0, 0.1] do not count.
    assert s.latency[0] == pytest.approx(0.3)
    assert s.ttft[0] == pytest.approx(0.05)
    assert len(s.row()) == len(SAMPLE_FIELDS)
    idle = sample_between(now, Totals(103.0, now.latency, now.ttft, now.finished))
    assert idle.rps == 0 and idle.latency == (None, None, None)


def test_the_ring_covers_history_s_at_the_configured_interval_within_a_hard_bound() -> None:
    assert history_samples(DashboardConfig()) == 600
    assert history_samples(DashboardConfig(history_s=60, interval_ms=250)) == 240
    assert history_samples(DashboardConfig(history_s=3600, interval_ms=100)) == MAX_SAMPLES
    with pytest.raises(ValidationError):
        DashboardConfig(history_s=86400)


def test_the_history_ring_is_bounded() -> None:
    h = History(3)
    for t in range(10):
        h.add(Sample(float(t), 0.0, 0.0, 0.0, (None,) * 3, (None,) * 3))
    assert len(h) == 3 and h.capacity == 3
    assert [s.t for s in h.all()] == [7.0, 8.0, 9.0]
    assert [s.t for s in h.tail(2)] == [8.0, 9.0]
    assert h.tail(0) == ()
    with pytest.raises(ValueError):
        History(0)


def test_metric_families_are_read_by_label_whatever_other_labels_they_have() -> None:
    m = GatewayMetrics()
    m.request_duration.labels("a", "P1", "completed").observe(0.05)
    m.request_duration.labels("b", "P0", "error").observe(0.3)
    m.request_duration.labels("b", "P0", "error").observe(500.0)  # beyond the last bound: +Inf
    b = histogram(m.request_duration)
    assert sum(b.counts) == 3 and len(b.counts) == len(b.bounds) + 1 and b.counts[-1] == 1
    assert histogram(m.ttft) == Buckets(b.bounds, (0,) * len(b.counts))  # no label set yet: nothing counted
    m.requests.labels("a", "P1", "completed").inc(3)
    m.requests.labels("b", "P0", "completed").inc()
    m.requests.labels("b", "P0", "error").inc()
    assert counter_by(m.requests, "status") == {"completed": 4.0, "error": 1.0}
    m.cancellations.labels("a", "P1", "admin").inc()  # a prometheus-client Counter (with `_created` samples)
    assert counter_by(m.cancellations, "reason") == {"admin": 1.0}

    class Exposed:  # the same family seen only through prometheus-client's `collect()`
        def __init__(self, family: Any) -> None:
            self.collect = family.collect

    # The direct reading of the lock-free families and the generic one agree, label filters included.
    assert histogram(Exposed(m.request_duration)) == b
    assert (
        histogram(m.request_duration, exclude={"status": "error"}).counts
        == histogram(Exposed(m.request_duration), exclude={"status": "error"}).counts
    )
    assert sum(histogram(m.request_duration, exclude={"model": "b"}).counts) == 1
    assert counter_by(Exposed(m.requests), "status") == counter_by(m.requests, "status")


def _instance(name: str, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": name,
        "url": f"http://{name}",
        "engine": "vllm",
        "healthy": True,
        "routable": True,
        "in_flight": 2,
        "max_concurrency": 8,
        "last_error": None,
        "last_probe_age_s": 0.2,
        "ejection": {"ejected": False, "returns_in_s": None},
        "sources": {
            "engine": {
                "age_s": 0.1,
                "stale": False,
                "waiting": 1,
                "running": 2,
                "kv_usage": 0.25,
                "prefix_cache_hits": 30.0,
                "prefix_cache_queries": 120.0,
            }
        },
    }
    raw.update(over)
    return raw


def _state(**over: Any) -> GatewayState:
    values: dict[str, Any] = {
        "at": 1000.0,
        "started_at": 990.0,
        "draining": False,
        "fleet": {
            "instances": [
                _instance("e1"),
                _instance("e2", healthy=False, sources={"engine": None}),
                _instance("e3", ejection={"ejected": True, "returns_in_s": 4.0}),
            ],
            "pools": [
                {"model": "m", "policy": "predicted_ttft", "instances": ["e1", "e2"]},
                {"model": "n", "policy": "round_robin", "instances": ["e2", "e3"]},
            ],
        },
        "admission": {
            "pools": {
                "m": {
                    "capacity": 16,
                    "running": 3,
                    "classes": {
                        "P0": {"queued": 1, "running": 1, "granted": 5, "rejected": 0},
                        "P2": {"queued": 4, "running": 2, "granted": 9, "rejected": 2},
                    },
                }
            }
        },
        "requests": [{"id": "r1"}],
        "requests_total": 7,
        "dedup": {"flights": {"in_flight": 2, "subscribers": 5}, "cache": {"entries": 3}},
        "counters": {
            "requests": {"completed": 10.0},
            "cancellations": {"admin": 1.0},
            "dedup": {"miss": 6.0, "coalesced": 3.0, "hit": 1.0, "semantic_shadow": 4.0},
            "tokens_saved": {"prompt": 10.0},
        },
        "slo": None,
    }
    values.update(over)
    return GatewayState(**values)


def test_the_snapshot_is_a_pure_function_of_the_state() -> None:
    rows = [Sample(999.0, 1.0, 0.0, 0.0, (0.1, 0.2, 0.3), (None, None, None))]
    snap = build_snapshot(_state(), rows, full_history=True)
    assert snap == build_snapshot(_state(), rows, full_history=True)
    assert snap["uptime_s"] == 10.0
    e1, e2, e3 = snap["instances"]
    assert (e1["status"], e1["models"], e1["prefix_hit_rate"], e1["kv_usage"]) == ("healthy", ["m"], 0.25, 0.25)
    assert (e2["status"], e2["models"], e2["metric_age_s"], e2["prefix_hit_rate"]) == ("down", ["m", "n"], None, None)
    assert (e3["status"], e3["returns_in_s"]) == ("ejected", 4.0)
    [pool] = snap["pools"]
    assert (pool["model"], pool["policy"], pool["queued"], pool["capacity"]) == ("m", "predicted_ttft", 5, 16)
    assert [c["name"] for c in pool["classes"]] == ["P0", "P2"]
    assert snap["requests"] == {"total": 7, "shown": [{"id": "r1"}]}
    # Shadow-mode notes are not requests: 4 of 10 served requests spared an engine call.
    assert snap["dedup"]["hit_ratio"] == 0.4 and snap["dedup"]["flights_in_flight"] == 2
    assert snap["cancellations"] == {"admin": 1.0}
    assert snap["history"] == {"fields": list(SAMPLE_FIELDS), "rows": [rows[0].row()], "full": True}
    assert snap["slo"] is None and snap["slo_error"] is None


def test_the_slo_field_is_whatever_the_provider_returned() -> None:
    slo = {"objectives": [{"name": "p0", "status": "met", "budget_remaining": 0.8, "windows": {}}]}
    assert build_snapshot(_state(slo=slo), [], full_history=False)["slo"] == slo


def test_instance_status_words() -> None:
    assert instance_status(True, False, False) == "healthy"
    assert instance_status(True, False, None) == "healthy"  # no engine metrics (an engine without /metrics)
    assert instance_status(True, False, True) == "stale"
    assert instance_status(False, False, False) == "down"
    assert instance_status(True, True, False) == "ejected"


class _Source:
    """Fake metric readings and a renderer that records what it was asked for."""

    def __init__(self) -> None:
        self.t = 0.0
        self.renders: list[tuple[int, bool]] = []

    def totals(self) -> Totals:
        self.t += 1.0
        empty = Buckets(BOUNDS, (0, 0, 0, 0))
        return Totals(self.t, empty, empty, {"completed": self.t})

    def render(self, samples: Any, full: bool) -> bytes:
        self.renders.append((len(samples), full))
        return f"event {len(self.renders)}".encode()


async def test_the_feed_samples_without_rendering_until_someone_subscribes() -> None:
    src = _Source()
    async with Feed(read_totals=src.totals, render=src.render, history_size=60, max_clients=2, interval_s=3600) as feed:
        for _ in range(20):
            feed.tick()
        assert len(feed.history) == 20 and src.renders == []  # nothing built while nobody watches
        with feed.subscribe() as sub:  # type: ignore[union-attr]
            assert await sub.next() == b"event 1" and src.renders == [(20, True)]  # the whole history, at once
            waiting = asyncio.ensure_future(sub.next())
            await asyncio.sleep(0)
            assert not waiting.done()  # waits for the next tick
            feed.tick()
            assert await waiting == b"event 2" and src.renders[-1] == (TAIL_ROWS, False)
            # A client that did not ask for three ticks gets the newest event only: nothing queued per client.
            feed.tick()
            feed.tick()
            feed.tick()
            assert await sub.next() == b"event 5"
        assert feed.clients == 0
        await feed.wait_idle()
        feed.tick()
        assert len(src.renders) == 5  # unsubscribed: no rendering again


async def test_the_feed_bounds_its_clients_and_ends_every_stream_on_close() -> None:
    src = _Source()
    feed = Feed(read_totals=src.totals, render=src.render, history_size=60, max_clients=2, interval_s=3600)
    async with feed:
        a, b = feed.subscribe(), feed.subscribe()
        assert a is not None and b is not None and feed.subscribe() is None
        await a.next()
        pending = asyncio.ensure_future(a.next())
        await asyncio.sleep(0)
        feed.close()
        assert await pending is None
        assert await b.next() is None  # not even its first snapshot
        assert feed.subscribe() is None
        a.close()
        b.close()
        await feed.wait_idle()
    assert feed.closed


async def test_the_feed_ticks_on_its_own_and_survives_a_failing_render(caplog: pytest.LogCaptureFixture) -> None:
    src = _Source()
    calls = 0

    def render(samples: Any, full: bool) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return b"ok %d" % calls

    async with Feed(read_totals=src.totals, render=render, history_size=60, max_clients=1, interval_s=0.01) as feed:
        with feed.subscribe() as sub:  # type: ignore[union-attr]
            assert await sub.next() == b"ok 1"
            async with asyncio.timeout(10):
                assert await sub.next() == b"ok 3"  # the second tick's render failed; the ticker went on
    assert "dashboard tick failed" in caplog.text
