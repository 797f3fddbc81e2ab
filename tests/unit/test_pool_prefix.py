"""The pool's choice: a sole candidate needs no policy; prompts are hashed into the prefix index only for
policies that look at cached prefixes."""

from __future__ import annotations

import pytest

from lockgate.config import parse_config
from lockgate.errors import Unavailable
from lockgate.fleet.instance import Instance
from lockgate.fleet.pool import Pool
from lockgate.metrics import GatewayMetrics
from lockgate.routing.factory import make_policy
from lockgate.routing.policies import InstanceView, Policy, PoolSnapshot, RouteRequest
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
