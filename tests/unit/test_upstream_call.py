"""`UpstreamCall` accounting without a network: an attempt aborted before `open()` stays balanced."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from lockgate.config import InstanceConfig, parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.fleet.instance import Instance
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


async def test_a_retired_instance_stays_open_while_a_call_on_its_connections_runs_for_another_engine() -> None:
    """An outside run (cluster): the central's lease moved to the engine its sidecar served the call on, and when the
    engine the central had picked retired (its node left etcd for a moment), it was closed at once, with its
    connection carrying the other engine's stream: the stream broke (1 in 10 across an etcd stall)."""
    metrics = GatewayMetrics()
    config = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]})
    fleet = Fleet(config, metrics)
    picked = Instance(InstanceConfig(url="http://127.0.0.1:1", engine="vllm"), cast(Any, None), "http://x")
    served = Instance(InstanceConfig(url="http://127.0.0.1:1", engine="vllm"), cast(Any, None), "http://x")
    call = UpstreamCall(fleet, metrics, picked, "/v1/chat/completions", b"{}", "r1", stream=True)
    lease = fleet.lease(picked, "m", 0, 0)
    lease.move(served)  # the sidecar's answer named the other engine
    assert picked.in_flight == 0 and picked.open_calls == 1
    idle = asyncio.create_task(picked.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()  # the call's connection is still the picked instance's
    call.release()
    lease.release()
    async with asyncio.timeout(5):  # bounds a hang only
        await idle
