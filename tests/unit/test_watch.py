"""How long an engine call may wait for its engine's next byte (`Fleet.watch_s`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from lockgate.config import parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.fleet.state import Published
from lockgate.metrics import GatewayMetrics


@pytest.fixture
async def fleet_of(stack: contextlib.AsyncExitStack) -> Callable[..., Fleet]:
    def make(**extra: Any) -> Fleet:
        models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
        config = parse_config({"usage": {"path": ":memory:"}, "models": models, **extra})
        fleet = Fleet(config, GatewayMetrics())
        fleet._build(config)  # not entered: no health probes, no scrapes
        stack.push_async_callback(fleet.aclose)
        return fleet

    return make


async def test_a_stream_and_a_whole_answer_have_their_own_watch_and_a_sidecar_its_queue_more(fleet_of: Any) -> None:
    fleet = fleet_of()
    (instance,) = fleet.instances.values()
    assert (fleet.watch_s(instance, True), fleet.watch_s(instance, False)) == (120.0, 600.0)
    # Behind a sidecar the request may wait in the sidecar's own queue first (a central's call sees nothing then):
    # the longest class queue timeout more (P2's 120 s by default), or no watch while a class queues without end.
    instance.published = Published(node="n", engine_id="e", seq=1, received_at=0.0)
    assert fleet.watch_s(instance, True) == 240.0
    classes = [{"name": "P0", "strict": True, "queue_timeout_ms": None}, {"name": "P1"}]
    unbounded = fleet_of(scheduling={"classes": classes, "default_priority": "P1"})
    (far,) = unbounded.instances.values()
    far.published = instance.published
    assert unbounded.watch_s(far, True) is None


@pytest.mark.parametrize("key", ["stall_timeout_ms", "answer_timeout_ms"])
async def test_zero_is_never(fleet_of: Any, key: str) -> None:
    fleet = fleet_of(upstream={key: 0})
    (instance,) = fleet.instances.values()
    assert fleet.watch_s(instance, key == "stall_timeout_ms") is None
