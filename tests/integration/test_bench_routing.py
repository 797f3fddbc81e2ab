"""`lockgate bench routing`, shrunk: traces are deterministic, runs complete and count cache hits."""

from __future__ import annotations

import itertools

from lockgate.bench import routing


def test_traces_are_deterministic_and_shaped():
    shape = routing.Shape(rate=50, duration_s=2.0)
    agent = routing.agent_trace(shape)
    assert agent == routing.agent_trace(shape)
    # Later turns of a conversation extend its earlier prompt.
    by_user: dict[str, list[routing.TraceRequest]] = {}
    for r in agent:
        by_user.setdefault(r.user, []).append(r)
    pairs = [(a, b) for turns in by_user.values() for a, b in itertools.pairwise(turns)]
    extended = [(a, b) for a, b in pairs if len(b.messages) > len(a.messages)]
    assert extended and all(b.messages[: len(a.messages)] == a.messages for a, b in extended)
    skewed = routing.skewed_trace(shape)
    hot = skewed[0].messages[0]["content"] if skewed else ""
    share = sum(r.messages[0]["content"] == hot for r in skewed) / len(skewed)
    assert 0.6 < share < 0.95


async def test_a_short_run_reports_hits_and_latencies():
    shape = routing.Shape(rate=25, duration_s=0.8, system_words=300, users=8)
    results = await routing.run(["agent"], ["round_robin", "predicted_ttft"], shape)
    assert [r.errors for r in results] == [0, 0]
    assert all(len(r.ttfts) == r.requests > 0 and 0 < r.hit_rate < 1 for r in results)
    assert "predicted_ttft" in routing.report(results)


def test_index_memory_check_stays_within_bound():
    used, bound, blocks = routing.index_memory_check(20_000, 256 * 1024)
    assert used <= bound and blocks == 256 * 1024 // 200


async def test_a_short_run_through_two_replicas_and_sidecars(etcd_binary: None) -> None:
    """`--replicas 2`: the same trace through a local etcd, two sidecars and two central replicas."""
    shape = routing.Shape(rate=25, duration_s=0.8, system_words=300, users=8)
    results = await routing.run(["agent"], ["predicted_ttft"], shape, replicas=(1, 2))
    assert [(r.replicas, r.errors) for r in results] == [(1, 0), (2, 0)]
    assert all(0 < r.hit_rate < 1 for r in results)
    assert next(text for text, _ in routing.verdicts(results)).startswith("agent: predicted_ttft with 2 replicas")
