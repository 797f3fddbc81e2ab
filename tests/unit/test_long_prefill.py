"""Long prompts take turns per instance (`routing.long_prefill_ms`): at most one long streamed prompt is
outstanding on an instance (sent, first token not back), so that a short request sent there waits inside the
engine for at most one long prefill, not a queue of them; a long request meeting a long prefill on every
candidate waits in the gateway for the first of them to be answered."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.attempt import _route
from lockgate.config import parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.fleet.pool import LongPrefillBusy
from lockgate.metrics import GatewayMetrics
from lockgate.routing.policies import InstanceView, PoolSnapshot, RouteRequest

LONG, SHORT = 2000, 8  # prompt tokens: 250 ms and 1 ms of prefill at the default 8,000 tokens/s (the bar: 100 ms)


def fleet_of(instances: int, long_prefill_ms: int = 100) -> Fleet:
    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "routing": {"policy": "least_load", "long_prefill_ms": long_prefill_ms},
                    "instances": [{"url": f"http://127.0.0.1:{n + 1}"} for n in range(instances)],
                }
            ]
        }
    )
    fleet = Fleet(config, GatewayMetrics())
    fleet._build(config)  # not entered: no health probes, no scrapes
    return fleet


def request(tokens: int, *, stream: bool = True) -> RouteRequest:
    return RouteRequest("m", "", prompt_tokens=tokens, stream=stream)


def waits(fleet: Fleet) -> float:
    return fleet._metrics.long_prefill_waits.labels("m")._value.get()  # type: ignore[no-any-return]


async def test_a_long_prompt_goes_where_no_long_prefill_is_outstanding_and_short_ones_are_never_held() -> None:
    fleet = fleet_of(2)
    try:
        pool = fleet.pools["m"]
        a, b = pool.instances
        busy_with_shorts = [fleet.lease(b, "m", SHORT, SHORT) for _ in range(3)]
        first, _ = pool.choose(request(LONG))
        assert first is a and pool.is_long(a, LONG) and not pool.is_long(a, SHORT)
        long_a = fleet.lease(a, "m", LONG, LONG, long=True)
        # The least loaded instance is still `a` (1 request against 3), but it is prefilling a long prompt.
        second, _ = pool.choose(request(LONG))
        assert second is b
        long_b = fleet.lease(b, "m", LONG, LONG, long=True)
        with pytest.raises(LongPrefillBusy):
            pool.choose(request(LONG))
        assert not pool.long_turn(request(LONG))
        short, _ = pool.choose(request(SHORT))  # a short request is never held
        assert short is a
        whole, _ = pool.choose(request(LONG, stream=False))  # nor one answered whole (it could not give a turn back)
        assert whole is a
        long_a.first_token()  # `a`'s long prompt is prefilled: its turn is free
        assert pool.long_turn(request(LONG)) and pool.choose(request(LONG))[0] is a
        for lease in (long_a, long_b, *busy_with_shorts):
            lease.release()
        assert a.own.long_pending == b.own.long_pending == 0
    finally:
        await fleet.aclose()


async def test_a_long_request_waits_for_a_turn_and_a_cancel_leaves_nothing_behind() -> None:
    fleet = fleet_of(2)
    try:
        pool = fleet.pools["m"]
        a, b = pool.instances
        long_a = fleet.lease(a, "m", LONG, LONG, long=True)
        long_b = fleet.lease(b, "m", LONG, LONG, long=True)
        metrics = fleet._metrics
        waiting = asyncio.create_task(_route(fleet, metrics, pool, request(LONG)))
        cancelled = asyncio.create_task(_route(fleet, metrics, pool, request(LONG)))
        await asyncio.sleep(0)  # one loop iteration: both tasks take their first step, up to the wait (asserted next)
        assert not waiting.done() and not cancelled.done() and waits(fleet) == 2
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        long_b.release()  # ended before its first token (a failed or cancelled attempt): its turn is free too
        async with asyncio.timeout(5):
            chosen_pool, instance, _ = await waiting
        assert chosen_pool is pool and instance is b
        assert fleet.prefills._waiting == 0  # no waiter left behind
        long_a.release()
        assert a.own.long_pending == b.own.long_pending == 0
    finally:
        await fleet.aclose()


class OnlyFirst:
    """A policy that takes the first instance or nothing (as a policy may refuse every instance it finds full)."""

    name = "only-first"
    uses_prefix = False

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        first = snapshot.instances[0]
        return None if first.key in request.exclude else first


async def test_a_turn_the_policy_will_not_take_does_not_hold_the_request_for_good() -> None:
    """Another instance is free of long prefills, but the policy takes none but the busy one: the request goes
    there rather than wait for a turn that is already there (the loop would never suspend)."""
    fleet = fleet_of(2)
    try:
        pool = fleet.pools["m"]
        pool.policy = OnlyFirst()
        a, _ = pool.instances
        long_a = fleet.lease(a, "m", LONG, LONG, long=True)
        with pytest.raises(LongPrefillBusy):
            pool.choose(request(LONG))
        assert pool.long_turn(request(LONG))
        async with asyncio.timeout(5):
            _, instance, _ = await _route(fleet, fleet._metrics, pool, request(LONG))
        assert instance is a
        long_a.release()
    finally:
        await fleet.aclose()


async def test_long_prefill_ms_0_holds_nothing() -> None:
    fleet = fleet_of(1, long_prefill_ms=0)
    try:
        pool = fleet.pools["m"]
        [a] = pool.instances
        assert not pool.is_long(a, 100 * LONG)
        lease = fleet.lease(a, "m", LONG, LONG, long=pool.is_long(a, LONG))
        assert pool.choose(request(LONG))[0] is a
        lease.release()
    finally:
        await fleet.aclose()


async def test_a_follow_up_stays_with_its_engine_even_behind_a_long_prefill() -> None:
    """A long streamed follow-up (`previous_response_id`) whose engine prefills another long prompt waits its turn
    there: moved to another instance, it reached an engine that does not hold the response it continues (a 404)."""
    fleet = fleet_of(2)
    try:
        pool = fleet.pools["m"]
        a, _ = pool.instances
        long_a = fleet.lease(a, "m", LONG, LONG, long=True)
        follow_up = RouteRequest("m", "", prompt_tokens=LONG, stream=True, pin=a.key, pin_only=True)
        assert pool.choose(follow_up)[0] is a
        long_a.release()
    finally:
        await fleet.aclose()
