"""The pool hashes prompts into its prefix index only for policies that look at cached prefixes."""

from __future__ import annotations

import pytest

from lockgate.config import parse_config
from lockgate.fleet.pool import Instance, Pool
from lockgate.metrics import GatewayMetrics
from lockgate.routing.policies import make_policy
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
    instance, _ = p.choose_view(route)
    assert instance.key == p.instances[0].key
    assert bool(route.blocks) is indexed
    assert (len(p.index) > 0) is indexed
