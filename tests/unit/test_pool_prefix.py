"""The pool's choice: a sole candidate needs no policy; prompts are hashed into the prefix index only for
policies that look at cached prefixes."""

from __future__ import annotations

import pytest

from lockgate.config import parse_config
from lockgate.errors import Unavailable
from lockgate.fleet.instance import Instance, Lease
from lockgate.fleet.pool import Pool
from lockgate.metrics import GatewayMetrics
from lockgate.routing.factory import make_policy
from lockgate.routing.policies import InstanceView, Policy, PoolSnapshot, RouteRequest
from lockgate.routing.prefix import UNTOUCHED_ROOM
from lockgate.wire import Endpoint, parse_request


def pool(policy: str) -> Pool:
    config = parse_config({"models": [{"name": "m", "routing": policy, "instances": [{"url": "http://127.0.0.1:1"}]}]})
    [model] = config.models
    instance = Instance(model.instances[0], None, "http://127.0.0.1:1")  # type: ignore[arg-type]
    return Pool(model, [instance], {instance.key: "m"}, make_policy(model.routing), metrics=GatewayMetrics())


@pytest.mark.parametrize(
    ("policy", "indexed"),
    [("least_load", False), ("round_robin", False), ("predicted_ttft", True), ("cache_aware", True)],
)
def test_prompts_are_indexed_only_for_prefix_aware_policies(policy: str, indexed: bool) -> None:
    p = pool(policy)
    api = parse_request(
        Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 300 + b'"}]}'
    )
    route = p.route_request(api)
    instance, _ = p.choose(route)
    assert instance.key == p.instances[0].key
    assert bool(route.blocks) is indexed
    assert (len(p.index) > 0) is indexed


class RefusingPolicy:
    name = "refusing"
    uses_prefix = True

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        raise AssertionError("a sole candidate needs no policy")


def two_instance_pool(policy: Policy) -> Pool:
    config = parse_config(
        {"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:2"}]}]}
    )
    [model] = config.models
    instances = [Instance(spec, None, spec.url) for spec in model.instances]  # type: ignore[arg-type]
    return Pool(model, instances, {i.key: "m" for i in instances}, policy, metrics=GatewayMetrics())


def test_a_sole_candidate_is_chosen_without_a_snapshot_and_sized_by_its_cached_prefix() -> None:
    p = two_instance_pool(RefusingPolicy())
    down, up = p.instances
    down.healthy = False
    api = parse_request(
        Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "' + b"y" * 1200 + b'"}]}'
    )
    route = p.route_request(api)
    assert p.choose(route) == (up, 0)  # nothing cached yet
    instance, cached = p.choose(route)  # the same prompt again: its blocks are now indexed there
    assert instance is up and 0 < cached <= route.prompt_tokens
    retry = RouteRequest(route.model, exclude=frozenset({up.key}), prompt_tokens=route.prompt_tokens)
    p.policy = make_policy("least_load")
    with pytest.raises(Unavailable):
        p.choose(retry)  # the only routable instance was tried already


def test_several_candidates_go_to_the_policy() -> None:
    p = two_instance_pool(make_policy("round_robin"))
    route = p.route_request(
        parse_request(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    )
    assert {p.choose(route)[0].key for _ in range(4)} == {i.key for i in p.instances}
    with pytest.raises(AssertionError):
        two_instance_pool(RefusingPolicy()).choose(route)


def chat_route(p: Pool, content: str) -> RouteRequest:
    api = parse_request(
        Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "' + content.encode() + b'"}]}'
    )
    return p.route_request(api)


@pytest.mark.parametrize("shared", [True, False])
def test_the_pool_measures_how_much_of_its_prompts_caches_hold(shared: bool) -> None:
    """`PoolSnapshot.reuse`: 1.0 until measured, then the share of routed prompts' tokens found cached
    somewhere (what makes evicting a cached prefix cost anything later)."""
    p = two_instance_pool(make_policy("predicted_ttft"))
    assert p.snapshot().reuse == 1.0
    system = "a long shared system prompt " * 40
    for n in range(64):
        p.choose(chat_route(p, (system if shared else "") + f"question {n} " * (1 if shared else 60)))
    if shared:
        assert p.snapshot().reuse > 0.8
    else:
        assert p.snapshot().reuse < 0.05


def test_predicted_ttft_charges_eviction_by_how_much_caches_are_reused() -> None:
    """A full cache evicts prefixes that will be prefilled again only if prompts reuse what caches hold:
    with nothing reused, a full instance is as good as one with room, and load decides."""
    request = RouteRequest("m", prompt_tokens=1000)
    full = InstanceView("a", "a", True, 0, 16, prefill_tps=10_000, cache_room=0)
    roomy = InstanceView("b", "b", True, 2, 16, prefill_tps=10_000, cache_room=5_000)
    policy = make_policy("predicted_ttft")

    def chosen(reuse: float) -> str:
        view = policy.choose(request, PoolSnapshot("m", (full, roomy), reuse))
        assert view is not None
        return view.key

    assert chosen(1.0) == "b"  # evicting 1000 tokens of hot prefixes costs their prefill again
    assert chosen(0.0) == "a"  # nothing is reused: equal predictions, the emptier instance


def test_an_instance_sent_nothing_yet_is_not_charged_for_evicting() -> None:
    """Cache sizes unknown (a cold start): an instance the gateway has sent nothing to holds nothing of ours, so a
    prompt placed there evicts nothing. A second request for a prefix still being prefilled on the first instance
    then ties with a fresh prefill on the untouched one and goes there (the emptier), instead of queueing behind
    that prefill on an engine whose speed nothing has measured yet (`bench routing` bursty/slow: the first ten
    requests for the hot prefix queued on the slow engine, TTFT 190-250 ms)."""
    p = two_instance_pool(make_policy("predicted_ttft"))
    system = "a long shared system prompt " * 80
    first = chat_route(p, system + "question 1")
    home, cached = p.choose(first)
    assert cached == 0
    Lease(home, GatewayMetrics(), first.prompt_tokens, first.prompt_tokens)  # sent, unanswered
    assert p.index.room(home.key) is None
    other = next(i for i in p.instances if i is not home)
    assert p.index.room(other.key) == UNTOUCHED_ROOM
    second, _ = p.choose(chat_route(p, system + "question 2"))
    assert second is other
    assert p.index.room(other.key) is None  # it holds a prompt now: an unknown cache counts as full again


async def test_instances_that_left_are_remembered_for_the_grace_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The departures a pool keeps (`Pool.left_lately`) are those within `DEPARTED_GRACE_S`: older ones go at the
    next departure (the memory is bounded by what left within the grace)."""
    from lockgate.fleet import pool as pool_module
    from tests.unit.test_long_prefill import fleet_of

    fleet = fleet_of(3)
    try:
        pool = fleet.pools["m"]
        a, b, _ = pool.instances
        pool.discard(a.key)
        assert pool.left_lately(a.key) and not pool.left_lately(b.key)
        monkeypatch.setattr(pool_module, "DEPARTED_GRACE_S", 0.0)  # (a's departure is past the grace now)
        pool.discard(b.key)
        assert not pool.left_lately(a.key) and a.key not in pool._departed
    finally:
        await fleet.aclose()


def test_a_reproducible_request_carries_the_tokens_its_prompts_blocks_cover() -> None:
    """`RouteRequest.repeat_tokens` (`cost.PredictedTTFT`'s tie rule): set for temperature 0 or a seed, 0 for a
    sampled request; what an instance that was sent this very prompt holds of it (its full blocks)."""
    p = pool("predicted_ttft")
    content = b"z" * 1000  # 15 full blocks of 64 characters and a part
    for extra, reproducible in ((b"", False), (b', "temperature": 0', True), (b', "seed": 3', True)):
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "' + content + b'"}]' + extra + b"}"
        route = p.route_request(parse_request(Endpoint.CHAT, raw))
        if not reproducible:
            assert route.repeat_tokens == 0
            continue
        instance, _ = p.choose(route)  # its blocks are indexed there now
        assert route.repeat_tokens == len(route.blocks) * 16 and p.choose(route) == (instance, route.repeat_tokens)


def test_an_instance_counts_the_leases_a_p0_may_have_stopped() -> None:
    """The leases of a preemptible class's requests (`Lease.stoppable`, marked before they are sent) are what a P0
    routed to a full instance can have stopped there (`InstanceView.stoppable`): counted while they last, where they
    move, once each."""
    p = two_instance_pool(make_policy("predicted_ttft"))
    first, second = p.instances
    p2 = Lease(first, GatewayMetrics())
    p0 = Lease(first, GatewayMetrics())
    p2.stoppable()
    p2.stoppable()
    assert (first.in_flight, first.stoppable) == (2, 1)
    assert first.view().stoppable == 1
    p2.move(second)  # (a sidecar served it on another of its engines)
    assert (first.stoppable, second.stoppable) == (0, 1)
    p2.release()
    p2.stoppable()  # (released: no longer counted)
    p0.release()
    assert (first.in_flight, first.stoppable, second.in_flight, second.stoppable) == (0, 0, 0, 0)


def test_an_instance_counts_the_stoppable_leases_still_waiting_for_their_first_token() -> None:
    """Of the stoppable leases, those whose first token has not come back wait in the engine: a P0 sent there has them
    stopped at no cost (`InstanceView.stoppable_waiting`). Counted until their first token or their end, where they
    move, and at a replacement at the same URL (`Instance.hand_over`)."""
    p = two_instance_pool(make_policy("predicted_ttft"))
    first, second = p.instances
    waiting, answered = Lease(first, GatewayMetrics()), Lease(first, GatewayMetrics())
    answered.first_token()
    waiting.stoppable()
    answered.stoppable()
    assert (first.stoppable, first.stoppable_waiting, first.view().stoppable_waiting) == (2, 1, 1)
    waiting.move(second)
    assert (first.stoppable_waiting, second.stoppable_waiting) == (0, 1)
    first.retired = True
    first.hand_over(second)  # (a reload replaced `first` by `second`: what runs there counts on `second` too)
    assert (second.stoppable, second.stoppable_waiting) == (2, 1)
    waiting.first_token()
    assert (second.stoppable, second.stoppable_waiting) == (2, 0)
    later = Lease(second, GatewayMetrics())
    later.stoppable()
    assert second.stoppable_waiting == 1
    later.release()  # (ended before its first token: no longer waiting)
    waiting.release()
    answered.release()
    assert (first.stoppable, first.stoppable_waiting, second.stoppable, second.stoppable_waiting) == (0, 0, 0, 0)


def test_a_whole_answer_cut_short_is_estimated_from_its_own_prefill() -> None:
    """What the engine generated for a whole (non-streamed) answer whose client left before it came (`Lease.produced`,
    charged to its tenant): the time since it was sent, less its own prefill and a step, at the measured time per
    token. Less the instance's mean first-token time instead, a request left in the prefill of its 30,000-token prompt
    was charged 33 tokens, and a short one after a long prompt had raised that mean 35 of its 73 (an outside run)."""
    p = two_instance_pool(make_policy("predicted_ttft"))
    first = p.instances[0]
    own = first.own
    own.tpot.add(0.02, 0.0)
    own.prefill_tps.add(10_000.0, 0.0)
    own.ttft.add(0.78, 0.0)  # (a long prompt's first token, just before)
    long = Lease(first, GatewayMetrics(), 30_000, 30_000, whole=True)
    assert long.produced(long.sent_at + 0.7) == 0  # still in its 3 s of prefill
    long.release()
    short = Lease(first, GatewayMetrics(), 8, 8, whole=True)
    assert short.produced(short.sent_at + 1.5) == 73  # (1.5 s - 0.8 ms of prefill - a step) / 20 ms
    short.release()
