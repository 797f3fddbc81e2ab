"""Each routing policy on crafted snapshots, including skewed load and a hot prefix."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from lockgate.config import parse_config
from lockgate.routing.affinity import ConsistentHash
from lockgate.routing.config import ConsistentHashOptions, PredictedTTFTOptions, ScoreWeights
from lockgate.routing.cost import CacheAware, PredictedTTFT, Score, predict_ttft, relaxed
from lockgate.routing.factory import make_policy
from lockgate.routing.policies import InstanceView, Policy, PoolSnapshot, PowerOfTwo, RouteRequest


def view(n: int, **kw: Any) -> InstanceView:
    base: dict[str, Any] = {"healthy": True, "in_flight": 0, "max_concurrency": 16}
    base.update(kw)
    return InstanceView(key=f"i{n}", name=f"i{n}", **base)


def snap(*views: InstanceView) -> PoolSnapshot:
    return PoolSnapshot("m", tuple(views))


def pick(policy: Policy, request: RouteRequest, snapshot: PoolSnapshot) -> str:
    """The key of the instance `policy` chooses (the test fails if it chooses none)."""
    chosen = policy.choose(request, snapshot)
    assert chosen is not None
    return chosen.key


REQ = RouteRequest("m", prompt_tokens=1000)


def test_power_of_two_prefers_the_less_loaded_of_its_pair_and_skips_excluded():
    policy = PowerOfTwo(seed=1)
    s = snap(view(0, in_flight=10), view(1, in_flight=0), view(2, in_flight=10))
    picks = Counter(pick(policy, REQ, s) for _ in range(300))
    # i1 wins every pair it is in (2 of 3 pairs); the busy ones only win against each other.
    assert picks["i1"] > 150
    assert pick(policy, replace(REQ, exclude=frozenset({"i0", "i1"})), s) == "i2"
    assert policy.choose(replace(REQ, exclude=frozenset({"i0", "i1", "i2"})), s) is None


def test_power_of_two_uses_engine_reported_queue():
    policy = PowerOfTwo(seed=3)
    s = snap(view(0, in_flight=1, waiting=30, running=16), view(1, in_flight=2))
    assert {pick(policy, REQ, s) for _ in range(20)} == {"i1"}


def test_consistent_hash_keeps_sessions_and_bounds_load():
    policy = ConsistentHash(ConsistentHashOptions(load_factor=1.25))
    idle = snap(view(0), view(1), view(2), view(3))
    homes = {f"user-{u}": pick(policy, replace(REQ, affinity_key=f"user-{u}"), idle) for u in range(40)}
    assert len(set(homes.values())) == 4  # sessions spread over the ring
    for user, home in homes.items():  # and stick
        assert pick(policy, replace(REQ, affinity_key=user), idle) == home
    # The home of one hot session is over the bound: its requests spill to another instance.
    user, home = next(iter(homes.items()))
    n = int(home[1])
    loaded = snap(*(view(k, in_flight=20 if k == n else 2) for k in range(4)))
    assert pick(policy, replace(REQ, affinity_key=user), loaded) != home
    # Removing an instance moves only its own sessions.
    three = snap(*(v for v in idle.instances if v.key != "i3"))
    moved = [u for u, h in homes.items() if h != "i3" and pick(policy, replace(REQ, affinity_key=u), three) != h]
    assert moved == []


def test_consistent_hash_without_a_key_is_least_load():
    policy = ConsistentHash()
    assert pick(policy, REQ, snap(view(0, in_flight=5), view(1, in_flight=1))) == "i1"


def test_score_weights_come_from_config():
    busy_queue = view(0, waiting=10, kv_usage=0.1)
    full_kv = view(1, waiting=0, kv_usage=0.95)
    s = snap(busy_queue, full_kv)
    assert pick(Score(ScoreWeights(queue=2, running=0, kv=1, ttft=0)), REQ, s) == "i1"
    assert pick(Score(ScoreWeights(queue=1, running=0, kv=5, ttft=0)), REQ, s) == "i0"
    slow = snap(view(0, ttft_s=2.0), view(1, ttft_s=0.1))
    assert pick(Score(), REQ, slow) == "i1"


def test_cache_aware_follows_the_prefix_but_falls_back_when_imbalanced_or_full():
    policy = CacheAware()
    s = snap(view(0, cached_tokens=900, in_flight=3), view(1, in_flight=1), view(2, in_flight=2))
    assert pick(policy, REQ, s) == "i0"
    # A miss (short match) goes to the least loaded, never to the "emptiest cache".
    assert pick(policy, replace(REQ, prompt_tokens=5000), s) == "i1"
    # The favoured instance is full: overload fallback.
    full = snap(view(0, cached_tokens=900, in_flight=16), view(1, in_flight=1))
    assert pick(policy, REQ, full) == "i1"
    # Imbalanced fleet (max - min > 32 and max > 1.5 min): shortest queue wins.
    skew = snap(view(0, cached_tokens=900, in_flight=40, max_concurrency=64), view(1, in_flight=2))
    assert pick(policy, REQ, skew) == "i1"


def test_predicted_ttft_prefers_cached_prefix_on_an_idle_fleet():
    policy = PredictedTTFT()
    s = snap(view(0), view(1, cached_tokens=900), view(2))
    assert pick(policy, REQ, s) == "i1"


def test_predicted_ttft_spreads_an_idle_fleet_round_robin():
    policy = PredictedTTFT()
    s = snap(view(0), view(1), view(2))
    assert {pick(policy, REQ, s) for _ in range(3)} == {"i0", "i1", "i2"}


def test_predicted_ttft_hot_prefix_does_not_attract_everything():
    """The instance holding a hot prefix wins until its queue costs more than a cold prefill elsewhere."""
    policy = PredictedTTFT()
    rate = 10_000.0
    # Cold prefill of 1000 tokens elsewhere: 0.1 s. Hot instance: queue of 500 tokens -> 0.05 s + 10 uncached.
    # Both caches have room (an instance of unknown cache size counts as full: see below).
    hot = view(0, cached_tokens=990, queued_prompt_tokens=500, prefill_tps=rate, cache_room=5000)
    cold = view(1, prefill_tps=rate, cache_room=5000)
    assert pick(policy, REQ, snap(hot, cold)) == "i0"
    # The queue there grew past what a cold prefill costs: traffic moves.
    hotter = replace(hot, queued_prompt_tokens=1500)
    assert pick(policy, REQ, snap(hotter, cold)) == "i1"
    # Full batch slots cost a share of the decode time, and a slow instance its own prefill rate.
    full = replace(hot, queued_prompt_tokens=0, in_flight=40, decode_s=1.0)
    assert predict_ttft(full, REQ, rate) > predict_ttft(cold, REQ, rate)
    assert pick(policy, REQ, snap(full, cold)) == "i1"


def test_predicted_ttft_never_sends_an_instance_past_its_limit_while_another_has_room():
    """`max_concurrency` (configured, or the engine's discovered slots) is a ceiling: an outside run saw an instance of
    2 run 4 requests sharing its cached prefix while its neighbour ran none (waiting for a slot there was priced below
    a cold prefill). Past the limit the queue is inside the engine, out of reach of priorities and preemption."""
    policy = PredictedTTFT()
    rate = 10_000.0
    warm = view(0, cached_tokens=990, in_flight=2, max_concurrency=2, prefill_tps=rate, cache_room=5000, decode_s=0.1)
    cold = view(1, prefill_tps=rate, cache_room=5000, max_concurrency=2)
    assert predict_ttft(warm, REQ, rate) < predict_ttft(cold, REQ, rate)  # cheaper, by the estimate
    assert pick(policy, REQ, snap(warm, cold)) == "i1"
    # Every instance full (the pool's admission makes it rare): the estimate decides again.
    assert pick(policy, REQ, snap(warm, replace(cold, in_flight=2))) == "i0"


def test_predicted_ttft_uses_each_instances_measured_prefill_rate():
    policy = PredictedTTFT()
    fast, slow = view(0, prefill_tps=20_000), view(1, prefill_tps=2_000)
    assert pick(policy, REQ, snap(slow, fast)) == "i0"
    # A long prompt cached on the slow instance still wins if the saving is worth it.
    assert pick(policy, REQ, snap(replace(slow, cached_tokens=990), fast)) == "i1"


def test_predicted_ttft_counts_near_equal_predictions_as_equal_and_takes_the_emptier():
    """Identical engines measured a few percent apart: noise in the estimates must not herd requests onto
    the one that measured fastest while it holds more work (seen in `bench routing`, uniform prompts)."""
    policy = PredictedTTFT()
    # Both hold the same part of the prompt (cached nowhere, a rotation decides: the next test).
    quick = view(0, prefill_tps=10_500, in_flight=3, queued_prompt_tokens=0, cached_tokens=200)
    other = view(1, prefill_tps=10_000, in_flight=1, queued_prompt_tokens=0, cached_tokens=200)
    assert predict_ttft(quick, REQ, 10_250) < predict_ttft(other, REQ, 10_250)  # by ~5%
    assert pick(policy, REQ, snap(quick, other)) == "i1"
    # A real difference still decides: a cached prefix, or a rate twice as high.
    assert pick(policy, REQ, snap(replace(quick, cached_tokens=900), other)) == "i0"
    assert pick(policy, REQ, snap(replace(quick, prefill_tps=20_000), other)) == "i0"
    # And exact ties only, when asked.
    exact = PredictedTTFT(PredictedTTFTOptions(near_tie=0.0, near_tie_ms=0.0))
    assert pick(exact, REQ, snap(quick, other)) == "i0"


def test_predicted_ttft_sends_a_reproducible_request_to_the_holder_of_its_whole_prompt_among_ties():
    """Two identical temperature-0 requests through two central replicas: the second found the first's engine
    through the sidecars' residency (its whole prompt held there), but a prompt within a step's worth of prefill
    saves nothing routing weighs, so the emptier node took it and the pair made two engine calls (28 of 28 pairs in
    an outside run). Among near ties a reproducible request goes where its whole prompt is held (the same request may
    be in flight there, or its result); a sampled one, or one held nowhere whole, as before."""
    policy = PredictedTTFT()
    short = RouteRequest("m", prompt_tokens=184)
    holder = view(0, prefill_tps=8_000, tpot_s=0.027, in_flight=1, cached_tokens=176)
    other = view(1, prefill_tps=8_000, tpot_s=0.027, in_flight=0)
    assert pick(policy, short, snap(holder, other)) == "i1"  # a sampled request: the emptier
    repeat = replace(short, repeat_tokens=176)
    assert pick(policy, repeat, snap(holder, other)) == "i0"
    assert pick(policy, repeat, snap(replace(holder, cached_tokens=100), other)) == "i1"  # only part of it
    # Not past a real difference: a holder predicted well behind the other is not taken.
    busy = replace(holder, queued_prompt_tokens=4_000)
    assert pick(policy, repeat, snap(busy, other)) == "i1"


def test_predicted_ttft_rotates_a_prompt_cached_nowhere_among_the_instances_near_the_best():
    """With nothing cached anywhere only the waits differ, and the estimates of them are rough: picking the emptier
    instance sent consecutive arrivals to the same few, whose prefills collided (`bench routing`, uniform prompts: TTFT
    p99 1.05-1.10x `round_robin`'s). Within a step and half the prompt's prefill of the best, the instance chosen
    least recently takes it; an instance the estimates see backlogged stays out."""
    rate, step = 10_000.0, 0.002  # REQ's prefill: 0.1 s, so the window is 0.052 s
    fleet = [view(n, prefill_tps=rate, tpot_s=step, cache_room=10_000) for n in range(3)]
    fleet[0] = replace(fleet[0], in_flight=5)  # more requests decoding there
    fleet[1] = replace(fleet[1], queued_prompt_tokens=300)  # 0.03 s of prefill ahead: inside the window
    backlogged = view(3, prefill_tps=rate, tpot_s=step, cache_room=10_000, queued_prompt_tokens=600)  # 0.06 s
    policy = PredictedTTFT()
    picks = [pick(policy, REQ, snap(*fleet, backlogged)) for _ in range(9)]
    assert picks == ["i0", "i1", "i2"] * 3
    # A prompt cached somewhere is not rotated: the cheaper prediction (the prefix) and near ties the emptier.
    assert pick(policy, REQ, snap(replace(fleet[0], cached_tokens=600), *fleet[1:])) == "i0"
    # Instances that left are forgotten: what the rotation remembers stays within twice the pool.
    for n in range(100):
        pick(policy, REQ, snap(view(100 + n)))
    assert len(policy._chosen) <= 2


def test_predicted_ttft_prices_out_an_engine_that_stopped_answering_or_is_slow_for_its_own_reasons():
    """An outside run: an engine that accepted requests and never answered (its /health fine) had nothing measured
    against it and took every other request, as did one that answered every prompt a fixed 3 s late (short prompts:
    its prefill rate said nothing). A request overdue there by its own estimate, or a floor of recent first-token
    times, prices it out; a request only just sent does not."""
    rate, step = 10_000.0, 0.01
    short = RouteRequest("m", prompt_tokens=20)
    fleet = [view(n, prefill_tps=rate, tpot_s=step, cache_room=10_000) for n in range(2)]
    hung = replace(fleet[1], prefill_tps=0.0, tpot_s=0.0, in_flight=1, pending=1, oldest_wait_s=2.0, oldest_work=20)
    policy = PredictedTTFT()
    assert [pick(policy, short, snap(fleet[0], hung)) for _ in range(4)] == ["i0"] * 4
    just_sent = replace(hung, oldest_wait_s=0.02)  # within its prefill and three steps: not late
    assert {pick(policy, short, snap(fleet[0], just_sent)) for _ in range(4)} == {"i0", "i1"}
    # A whole answer (one body: its first token never seen) is late only past its prefill and four times a whole
    # answer's mean time: one generating for a while is not.
    generating = replace(fleet[1], whole_s=0.5, in_flight=1, pending=1, oldest_whole_wait_s=1.9, oldest_whole_work=20)
    assert predict_ttft(generating, short, rate, step) == predict_ttft(replace(fleet[1], pending=1), short, rate, step)
    # Nothing measured there, no step known anywhere (a fresh fleet serving whole answers): its peers' whole answers.
    stuck = replace(generating, whole_s=0.0, oldest_whole_wait_s=30.0)
    assert predict_ttft(stuck, short, rate, 0.0, default_whole_s=0.5) > 27
    fresh = [replace(fleet[0], tpot_s=0.0, whole_s=0.5), replace(stuck, tpot_s=0.0)]
    assert [pick(policy, short, snap(*fresh)) for _ in range(4)] == ["i0"] * 4
    slow = replace(fleet[1], latency_floor_s=3.0)
    assert [pick(policy, short, snap(fleet[0], slow)) for _ in range(4)] == ["i0"] * 4
    assert predict_ttft(slow, short, rate, step) == pytest.approx(3.0 + 20 / rate + step)
    # A floor within the waits the estimates see does not decide.
    normal = replace(fleet[1], latency_floor_s=0.001, queued_prompt_tokens=100)
    assert predict_ttft(normal, REQ, rate, step) == predict_ttft(replace(normal, latency_floor_s=0.0), REQ, rate, step)
    # It fades as it ages (the rates' half-life): an instance priced out by a bad spell is tried, and measured, again.
    assert predict_ttft(replace(slow, latency_age_s=4.0), short, rate, step, half_life_s=2.0) == pytest.approx(
        0.75 + 20 / rate + step
    )


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "power_of_two", "consistent_hash", "score", "cache_aware", "predicted_ttft"]
)
def test_every_policy_skips_unhealthy_and_excluded(name):
    policy = make_policy(name)
    s = snap(view(0, healthy=False), view(1), view(2, cached_tokens=1000))
    for _ in range(5):
        assert pick(policy, replace(REQ, exclude=frozenset({"i2"}), affinity_key="u"), s) == "i1"
    assert policy.choose(replace(REQ, exclude=frozenset({"i1", "i2"})), s) is None


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "power_of_two", "consistent_hash", "score", "cache_aware", "predicted_ttft"]
)
def test_every_policy_keeps_an_instance_at_its_limit_while_another_has_room(name):
    """An instance's `max_concurrency` is a ceiling for every policy, not only the default: round-robin, power of two,
    score and a session's ring home sent requests past it while a neighbour had free slots (queued inside the
    engine, out of the gateway's priorities). Past it only when every instance is at its limit."""
    policy = make_policy(name)
    # The full one looks best to each policy's own measure: a cached prefix, an empty engine queue, a fast TTFT.
    full = view(0, in_flight=2, max_concurrency=2, cached_tokens=1000, ttft_s=0.01, prefill_tps=50_000.0)
    roomy = view(1, in_flight=3, max_concurrency=8, waiting=4, ttft_s=0.5, prefill_tps=1_000.0)
    sessions = [replace(REQ, affinity_key=f"user-{u}") for u in range(20)]
    assert {pick(policy, request, snap(full, roomy)) for request in sessions} == {"i1"}
    everyone_full = snap(full, replace(roomy, in_flight=8))
    assert {pick(policy, request, everyone_full) for request in sessions} <= {"i0", "i1"}  # still routed


def test_config_accepts_old_and_new_routing_forms():
    base = {"instances": [{"url": "http://127.0.0.1:1"}]}
    old = parse_config({"models": [{"name": "a", "routing": "least_load", **base}]})
    assert old.models[0].routing.policy == "least_load"
    default = parse_config({"models": [{"name": "a", **base}]})
    assert default.models[0].routing.policy == "predicted_ttft"
    new = parse_config(
        {
            "models": [
                {
                    "name": "a",
                    "routing": {
                        "policy": "score",
                        "score": {"queue": 3, "kv": 0},
                        "prefix_index": {"max_bytes": 65536},
                    },
                    **base,
                }
            ],
            "scrape": {"interval_ms": 100},
            "health": {"ejection": {"consecutive_failures": 2}},
        }
    )
    routing = new.models[0].routing
    assert routing.policy == "score" and routing.score.queue == 3 and routing.prefix_index.max_bytes == 65536
    assert make_policy(routing).name == "score"
    assert new.scrape.interval_ms == 100 and new.health.ejection.consecutive_failures == 2


def test_predicted_ttft_judges_an_unmeasured_instance_by_its_measured_peers():
    """A new instance judged by a pessimistic default next to measured peers would never be tried."""
    policy = PredictedTTFT()  # default 8000 tokens/s, far below what the fleet measured
    measured = view(0, prefill_tps=50_000, tpot_s=0.003, queued_prompt_tokens=2000, in_flight=2)
    new = view(1)
    assert pick(policy, REQ, snap(measured, new)) == "i1"


def test_predicted_ttft_relaxes_a_stale_measurement_toward_its_peers():
    """One bad sample (a stall) must not price an instance out for good: never chosen, it would never be
    measured again. Fresh, the slow measurement wins; unrefreshed for a few half-lives, the peers' rate."""
    policy = PredictedTTFT()  # half-life 2 s
    fast = view(0, prefill_tps=40_000, tpot_s=0.002, queued_prompt_tokens=4000, prefill_age_s=0.1, tpot_age_s=0.1)
    stalled = view(1, prefill_tps=2_000, tpot_s=0.05, prefill_age_s=0.1, tpot_age_s=0.1)
    assert pick(policy, REQ, snap(fast, stalled)) == "i0"
    aged = replace(stalled, prefill_age_s=10.0, tpot_age_s=10.0)
    assert pick(policy, REQ, snap(fast, aged)) == "i1"
    # Off (half-life 0): the measurement stands however old.
    frozen = PredictedTTFT(PredictedTTFTOptions(measured_half_life_ms=0))
    assert pick(frozen, REQ, snap(fast, aged)) == "i0"
    # A P0 is never the request that re-tries it (an outside run: 1 P0 in 10 went to an engine 8x slower than its
    # peer on an idle fleet); a request of another class is.
    rotated = PredictedTTFT()
    assert pick(rotated, REQ, snap(fast, stalled)) == "i0"  # (chosen last: a near tie would now go to i1)
    assert pick(rotated, replace(REQ, urgent=True), snap(fast, aged)) == "i0"
    assert pick(rotated, REQ, snap(fast, aged)) == "i1"


def test_a_p0_still_sees_an_instances_latency_floor_fade():
    """The first try of P0 routing by measures as they stand (`RouteRequest.urgent`) froze the latency floor too: a
    floor measured at a flood's start (the engine's queue, not its speed) kept every P0 off that engine, and they
    stacked on the other (`bench priority`: P0 TTFT p99 1.45x, reverted). Only the speeds stand; the floor fades."""
    policy = PredictedTTFT()  # half-life 2 s
    one = view(0, prefill_tps=40_000, tpot_s=0.01, in_flight=3, prefill_age_s=0.1, tpot_age_s=0.1)
    floored = view(1, prefill_tps=40_000, tpot_s=0.01, latency_floor_s=0.4, latency_age_s=0.1)
    urgent = replace(REQ, urgent=True)
    assert pick(policy, urgent, snap(one, floored)) == "i0"
    assert pick(policy, urgent, snap(one, replace(floored, latency_age_s=20.0))) == "i1"


def test_relaxed_halves_the_distance_to_the_peers_each_half_life():
    assert relaxed(0.0, 10.0, 5.0, 2.0) == 10.0  # unmeasured: the peers'
    assert relaxed(2.0, 10.0, 0.0, 2.0) == 2.0
    assert relaxed(2.0, 10.0, 2.0, 2.0) == pytest.approx(6.0)
    assert relaxed(2.0, 10.0, 4.0, 2.0) == pytest.approx(8.0)
    assert relaxed(2.0, 10.0, 4.0, 0.0) == 2.0


def test_predicted_ttft_counts_an_instance_of_unknown_cache_size_as_full():
    """A copy of a prefix placed on a second instance is charged what it will crowd out, unless that
    instance is known to have room for it: cold starts partition prefixes instead of copying them."""
    rate = 10_000.0
    # i0 holds 900 of the 1000 tokens but has 1200 queued (0.12 s); i1 holds nothing.
    holder = view(0, cached_tokens=900, queued_prompt_tokens=1200, prefill_tps=rate)
    unknown = view(1, prefill_tps=rate)
    # i0: 0.12 + 2 x 100 / rate = 0.14 s; i1 (full): 2 x 1000 / rate = 0.2 s.
    assert pick(PredictedTTFT(), REQ, snap(holder, unknown)) == "i0"
    # Known room for the whole prompt: a cold prefill of 0.1 s there beats the queue.
    roomy = replace(unknown, cache_room=5000)
    assert pick(PredictedTTFT(), REQ, snap(holder, roomy)) == "i1"


def test_predicted_ttft_charges_a_long_prompt_the_delay_it_imposes_on_requests_waiting_there():
    """Every request waiting for its first token on an instance (but the one in prefill now) shares an
    engine step with a prompt sent there, or waits behind it: a long prompt goes where fewer wait."""
    rate = 10_000.0
    waiting = view(0, prefill_tps=rate, cache_room=10_000, pending=4, queued_prompt_tokens=40)
    busy = view(1, prefill_tps=rate, cache_room=10_000, pending=1, queued_prompt_tokens=600)
    # Long (1000 tokens): 3 x 0.1 s of delay on i0 outweighs the 0.06 s of work queued on i1.
    assert pick(PredictedTTFT(), REQ, snap(waiting, busy)) == "i1"
    # A short request delays nobody noticeably: it takes the instance with less work ahead.
    short = RouteRequest("m", prompt_tokens=8)
    assert pick(PredictedTTFT(), short, snap(waiting, busy)) == "i0"


def test_predicted_ttft_discounts_a_step_of_a_cached_prefix():
    """A short shared prefix (a chat's system prompt) saves less prefill than one engine step: it must not decide
    where new conversations go, or the one instance that has not cached it gets none of them (seen in `bench routing`,
    chat on small caches with 8 instances: one instance 7% of the requests, TTFT p99 1.64x `cache_aware`'s). A prefix
    worth more than a step still decides, by what it saves beyond the step."""
    rate, step = 10_000.0, 0.01  # a step's worth of prefill: 100 tokens
    new_session = RouteRequest("m", prompt_tokens=160)
    holder = view(0, cached_tokens=80, prefill_tps=rate, tpot_s=step, in_flight=2, cache_room=0)
    other = view(1, prefill_tps=rate, tpot_s=step, in_flight=1, cache_room=0)
    assert predict_ttft(holder, new_session, rate, step) == predict_ttft(other, new_session, rate, step)
    assert pick(PredictedTTFT(), new_session, snap(holder, other)) == "i1"  # equal: the emptier
    # A conversation's history (600 tokens cached of 700) keeps it where it is cached.
    later_turn = RouteRequest("m", prompt_tokens=700)
    home = replace(holder, cached_tokens=600)
    assert predict_ttft(home, later_turn, rate, step) < predict_ttft(other, later_turn, rate, step)
    assert pick(PredictedTTFT(), later_turn, snap(home, other)) == "i0"
    # Unmeasured step (no TPOT anywhere): no discount, the prefix counts whole.
    assert pick(PredictedTTFT(), new_session, snap(replace(holder, tpot_s=0.0), replace(other, tpot_s=0.0))) == "i0"


def test_predicted_ttft_keeps_a_near_tie_where_the_prompt_is_cached():
    """An outside run (each document asked a burst of questions, then never again): while a document's holder was
    busy, a question predicted to come as soon from an idle instance that would prefill the whole document again went
    there, the emptier of the tie: TTFT the same, the hit rate 2.8 points under `cache_aware`'s (3 of 7 seeds past 3).
    Among near ties, the instances holding the most of the prompt beyond a step's worth come first."""
    rate, step = 10_000.0, 0.01
    question = RouteRequest("m", prompt_tokens=2600)
    holder = view(0, cached_tokens=2500, prefill_tps=rate, tpot_s=step, in_flight=2, queued_prompt_tokens=5000)
    idle = view(1, prefill_tps=rate, tpot_s=step, in_flight=0)
    at_holder, elsewhere = predict_ttft(holder, question, rate, step), predict_ttft(idle, question, rate, step)
    assert elsewhere < at_holder <= elsewhere * 1.1  # a near tie, the idle instance ahead by a little
    assert pick(PredictedTTFT(), question, snap(holder, idle)) == "i0"
    # A holder that is really slower loses it.
    assert pick(PredictedTTFT(), question, snap(replace(holder, queued_prompt_tokens=8000), idle)) == "i1"


def test_a_p0_may_go_to_a_fast_instance_whose_slots_less_urgent_work_fills():
    """An outside run, a fast (5 ms a step) and a slow (40 ms) engine under a P2 flood: every P0 went to the slow one,
    the only one with a free slot (~90 ms against ~10 idle). A P0 is priced where the slots are full too (the scheduler
    stops a less urgent request there for it); other requests keep to instances with room."""
    policy = PredictedTTFT()
    full = view(0, prefill_tps=40_000, tpot_s=0.005, decode_s=0.32, in_flight=8, max_concurrency=8, running=8)
    fast = replace(full, stoppable=8)  # its slots held by P2 requests
    slow = view(1, prefill_tps=5_000, tpot_s=0.04, decode_s=2.5, in_flight=3, max_concurrency=8, running=3)
    request = RouteRequest("m", prompt_tokens=12)
    assert pick(policy, request, snap(fast, slow)) == "i1"
    assert pick(policy, replace(request, urgent=True), snap(fast, slow)) == "i0"
    # A second outside run: full of P0s (nothing there to stop), it was priced as a step's wait all the same, and P0s
    # stacked on a fast 2-slot engine five deep, each waiting whole generations (flood p99 122 -> 682 ms).
    two = replace(full, in_flight=2, max_concurrency=2, running=2)
    assert pick(policy, replace(request, urgent=True), snap(two, slow)) == "i1"
    # (Eight slots full of P0s free one every ~40 ms: sooner than the slow engine's step and the half it joins in.)
    assert pick(policy, replace(request, urgent=True), snap(full, slow)) == "i0"
    # A full instance still waits a share of its generations: a P0 takes the free slot of a peer as fast.
    peer = replace(fast, key="i2", name="i2", in_flight=7, running=7, stoppable=7)
    assert pick(policy, replace(request, urgent=True), snap(fast, peer)) == "i2"


def test_a_p0_does_not_rotate_onto_an_engine_steps_slower():
    """A second outside run, P0 traffic alone on two engines, one slowed 12x midway: the "cached nowhere" rotation
    took every instance within one step of the best, the step being the peers' mean, which the slow engine's own
    step widened enough to keep it in: half the P0s went on going there. A P0's step is the fastest one's."""
    policy = PredictedTTFT()
    fast = view(0, prefill_tps=40_000, tpot_s=0.005, prefill_age_s=0.1, tpot_age_s=0.1)
    slow = view(1, prefill_tps=40_000, tpot_s=0.015, prefill_age_s=0.1, tpot_age_s=0.1)  # 3x: within the mean step
    urgent = RouteRequest("m", prompt_tokens=12, urgent=True)
    assert [pick(policy, urgent, snap(fast, slow)) for _ in range(4)] == ["i0"] * 4
    assert {pick(policy, replace(urgent, urgent=False), snap(fast, slow)) for _ in range(4)} == {"i0", "i1"}


def test_a_p0_is_priced_at_an_engine_without_the_less_urgent_requests_waiting_there():
    """An outside run, a fast 4-slot engine and a slow 64-slot one: a flood's first P2s went 60 deep into the fast
    engine before its limit was learned. A P0 sent there has them stopped first (they wait in the engine and lose no
    work, `Admission.make_room`); priced with them, it looked 0.3-0.8 s away and every P0 went to the slow engine for
    7 s (~90-150 ms). Other classes still see the queue."""
    fast = view(
        0,
        prefill_tps=20_000,
        tpot_s=0.006,
        decode_s=0.35,
        in_flight=64,
        max_concurrency=4,
        running=4,
        waiting=60,
        pending=60,
        queued_prompt_tokens=60 * 20,
        stoppable=64,
        stoppable_waiting=60,
        oldest_wait_s=0.02,
        oldest_work=20,
    )
    slow = view(1, prefill_tps=20_000, tpot_s=0.06, decode_s=1.1, in_flight=20, max_concurrency=64, running=20)
    request = RouteRequest("m", prompt_tokens=12)
    urgent = replace(request, urgent=True)
    assert predict_ttft(fast, urgent, 20_000, 0.033) < 0.03 < predict_ttft(fast, request, 20_000, 0.033)
    assert pick(PredictedTTFT(), urgent, snap(fast, slow)) == "i0"
    assert pick(PredictedTTFT(), request, snap(fast, slow)) == "i1"


def test_a_p0_counts_the_step_a_busy_engine_is_in_and_judges_a_full_one_by_the_fastest_step():
    """An outside run, a fast 4-slot engine (6 ms a step) full of P0s next to a slow one running 60 (88 ms a step):
    the slow one was priced at its prefill and one step, but a request arriving there waits for the step under way
    to end first (half a step on average; its first tokens came at ~150 ms), and the fast one had to be sooner by the
    peers' mean step (47 ms) to be taken. 46 of 272 P0s went to the slow engine where a slot on the fast one freed
    within ~70 ms."""
    full = view(0, prefill_tps=20_000, tpot_s=0.006, decode_s=0.28, in_flight=4, max_concurrency=4, running=4)
    slow = view(1, prefill_tps=20_000, tpot_s=0.088, decode_s=4.5, in_flight=60, max_concurrency=64, running=60)
    urgent = RouteRequest("m", prompt_tokens=12, urgent=True)
    idle = replace(slow, in_flight=0, running=0)
    assert predict_ttft(slow, urgent, 20_000) - predict_ttft(idle, urgent, 20_000) == pytest.approx(0.044)
    assert predict_ttft(full, urgent, 20_000) < predict_ttft(slow, urgent, 20_000) - 0.04
    assert pick(PredictedTTFT(), urgent, snap(full, slow)) == "i0"
