"""`UpstreamCall` accounting without a network: an attempt aborted before `open()` stays balanced."""

from __future__ import annotations

from typing import Any, cast

from lockgate.config import InstanceConfig, parse_config
from lockgate.fleet.instance import Instance
from lockgate.fleet.pool import Fleet
from lockgate.metrics import GatewayMetrics
from lockgate.upstream import UpstreamCall


def test_abort_before_open_leaves_the_gauge_at_zero() -> None:
    metrics = GatewayMetrics()
    config = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]})
    fleet = Fleet(config, metrics)
    instance = Instance(InstanceConfig(url="http://127.0.0.1:1", engine="vllm"), cast(Any, None), "http://x")
    call = UpstreamCall(fleet, metrics, instance, "/v1/chat/completions", b"{}", "r1", stream=True)
    assert instance.open_calls == 1
    assert call.abort() is True and call.abort() is False
    assert instance.open_calls == 0
