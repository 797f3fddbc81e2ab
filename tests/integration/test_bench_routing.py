"""`lockgate bench routing`, shrunk: traces are deterministic and shaped, cells run and count cache hits."""

from __future__ import annotations

import itertools

import pytest

from lockgate.bench import routing, workloads


def test_traces_are_deterministic_and_shaped() -> None:
    shape = workloads.Shape(rate=50, duration_s=2.0)
    for family in workloads.FAMILIES:
        trace = workloads.MAKERS[family](shape)
        assert trace and trace == workloads.MAKERS[family](shape), family
        assert all(a.at <= b.at for a, b in itertools.pairwise(trace))
    agent = workloads.agent_trace(shape)
    # Later turns of a conversation extend its earlier prompt (agent and chat families).
    for trace in (agent, workloads.chat_trace(shape)):
        by_user: dict[str, list[workloads.TraceRequest]] = {}
        for r in trace:
            by_user.setdefault(r.user, []).append(r)
        pairs = [(a, b) for turns in by_user.values() for a, b in itertools.pairwise(turns)]
        extended = [(a, b) for a, b in pairs if len(b.messages) > len(a.messages)]
        assert extended and all(b.messages[: len(a.messages)] == a.messages for a, b in extended)
    bursty = workloads.bursty_trace(shape)
    hot = bursty[0].messages[0]["content"]
    share = sum(r.messages[0]["content"] == hot for r in bursty) / len(bursty)
    assert 0.6 < share < 0.95
    # Bursts: the first half-second (1.8x the rate) holds far more arrivals than the second (0.2x).
    assert sum(r.at < 0.5 for r in bursty) > 3 * sum(0.5 <= r.at < 1.0 for r in bursty)
    # No sharing: the uniform family's working set is (nearly) all of its prompt tokens.
    uniform = workloads.uniform_trace(shape)
    total = sum(len(workloads.prompt_words(r)) for r in uniform)
    assert workloads.working_set_tokens(uniform) > 0.9 * total
    rag = workloads.rag_trace(shape)
    assert workloads.working_set_tokens(rag) < 0.5 * sum(len(workloads.prompt_words(r)) for r in rag)


def test_fleet_configurations_size_caches_against_the_working_set() -> None:
    shape = workloads.Shape(rate=50, duration_s=2.0)
    trace = workloads.agent_trace(shape)
    fleet = routing.Fleet()
    ws_blocks = workloads.working_set_tokens(trace) // fleet.block_size
    small = routing.sim_configs("small", fleet, trace, 2.0)
    large = routing.sim_configs("large", fleet, trace, 2.0)
    assert len(small) == fleet.instances and small[0].num_kv_blocks < ws_blocks < large[0].num_kv_blocks
    slow = routing.sim_configs("slow", fleet, trace, 2.0)
    assert slow[0].prefill_tps < slow[1].prefill_tps == fleet.prefill_tps and slow[0].tpot_ms > slow[1].tpot_ms
    failing = routing.sim_configs("failing", fleet, trace, 2.0)
    assert failing[0].fail_after_s == 1.0 and all(c.fail_after_s is None for c in failing[1:])


async def test_a_short_run_reports_hits_latencies_and_verdicts() -> None:
    shape = workloads.Shape(rate=25, duration_s=0.8, system_words=300, users=8)
    results = await routing.run(["agent"], ["small"], ["round_robin", "predicted_ttft"], shape)
    # The default runs twice on the same trace: the second run measures the bench's own noise.
    assert [(r.label, r.errors) for r in results] == [
        ("round_robin", 0),
        ("predicted_ttft", 0),
        ("predicted_ttft#2", 0),
    ]
    assert all(len(r.ttfts) == r.requests > 0 and 0 < r.hit_rate < 1 for r in results)
    assert "predicted_ttft#2" in routing.report(results)
    ((text, status),) = routing.verdicts(results)
    assert text.startswith("agent/small: predicted_ttft hit") and "noise (default run twice): hit" in text
    assert status in ("PASS", "NOISE", "MISS")


async def test_a_failing_instance_breaks_only_its_own_requests() -> None:
    shape = workloads.Shape(rate=40, duration_s=1.0, system_words=200, users=8)
    fleet = routing.Fleet(instances=2)
    (result,) = await routing.run(["uniform"], ["failing"], ["round_robin"], shape, fleet, repeat=False)
    # Requests after the crash are retried on the healthy instance; only streams in flight there break.
    assert result.errors < result.requests / 4 and len(result.ttfts) == result.requests - result.errors


def test_index_memory_check_stays_within_bound() -> None:
    used, bound, blocks = routing.index_memory_check(20_000, 256 * 1024)
    assert used <= bound and blocks == 256 * 1024 // 200


async def test_a_short_run_through_two_replicas_and_sidecars(etcd_binary: None) -> None:
    """`--replicas 2`: the same trace through a local etcd, two sidecars and two central replicas."""
    shape = workloads.Shape(rate=25, duration_s=0.8, system_words=300, users=8)
    results = await routing.run(["agent"], ["small"], ["predicted_ttft"], shape, replicas=(1, 2), repeat=False)
    assert [(r.replicas, r.errors) for r in results] == [(1, 0), (2, 0)]
    assert all(0 < r.hit_rate < 1 for r in results)
    first = next(text for text, _ in routing.verdicts(results))
    assert first.startswith("agent/small: predicted_ttft with 2 replicas")
    # Each request's TTFT by hop, from the gateways' usage records and the simulators' own.
    one, two = results
    assert one.hop_names[0] == "client > gateway" and two.hop_names[1] == "central > sidecar"
    for r in results:
        assert len(r.hops) >= r.requests * 3 // 4  # all but those coalesced into another's flight
        assert all(len(h) == len(r.hop_names) and h[r.hop_names.index("engine TTFT")] > 0 for h in r.hops)
        # The segments add up to the client's TTFT (wall-clock stamps of other processes, to a few ms).
        assert all(min(r.ttfts) - 0.005 <= sum(h) <= max(r.ttfts) + 0.005 for h in r.hops)
    # And the CPU each kind of process used meanwhile (/proc for the gateways, this process's own).
    assert set(one.cpu_s) == {"serve", "bench"} and set(two.cpu_s) == {"serve", "sidecar", "bench"}
    assert all(seconds >= 0 for r in results for seconds in r.cpu_s.values())
    text = routing.report(results)
    assert "TTFT by hop" in text and "CPU per request during the replay" in text


def row(policy: str, hit: float, p99: float) -> routing.Row:
    return routing.Row("agent", "small", policy, 1, 3, 600, 0, hit, 0.0, 0.01, p99, 0.0, p99, 100)


def test_a_verdict_is_a_pass_a_miss_or_within_the_rows_own_noise() -> None:
    rr = row("round_robin", 0.50, 0.300)
    best = row("cache_aware", 0.92, 0.100)
    quiet = routing.Noise()
    assert routing.judge(row("predicted_ttft", 0.90, 0.105), [rr, best], quiet)[1] == "PASS"
    # 4 points behind the best hit rate: a miss, unless the default's two runs differed by 1.5 points.
    behind = row("predicted_ttft", 0.88, 0.105)
    assert routing.judge(behind, [rr, best], quiet)[1] == "MISS"
    assert routing.judge(behind, [rr, best], routing.Noise(hit=0.015))[1] == "NOISE"
    # TTFT p99 1.3x the best: within noise only if the repeat moved p99 by more than 20%.
    slow = row("predicted_ttft", 0.92, 0.130)
    assert routing.judge(slow, [rr, best], routing.Noise(p99=0.1))[1] == "MISS"
    assert routing.judge(slow, [rr, best], routing.Noise(p99=0.25))[1] == "NOISE"
    # Worse than round_robin's p99: a miss however close to the best.
    assert routing.judge(row("predicted_ttft", 0.92, 0.31), [rr, row("x", 0.9, 0.3)], quiet)[1] == "MISS"
    # The noise of a row: how far the default's two identical runs differed.
    noise = routing.Noise.between(row("predicted_ttft", 0.90, 0.100), row("predicted_ttft#2", 0.88, 0.120))
    assert noise is not None and noise.hit == pytest.approx(0.02) and noise.p99 == pytest.approx(0.2)
    # Not run twice (`--no-repeat`): the noise is not known, so no NOISE verdict, and the text does not claim 0%
    # (a newcomer read "noise: hit 0.0 points, p99 0%" as measured).
    assert routing.Noise.between(row("predicted_ttft", 0.90, 0.100), None) is None
    text, verdict = routing.judge(behind, [rr, best], None)
    assert verdict == "MISS" and "noise not measured" in text and "p99 0%" not in text
