"""A strict request (P0) waiting for its first token holds its instance: requests of a preemptible class (P2) whose
prompt takes the engine longer than a step to prefill are not sent there meanwhile (`OwnAccounting.held`), they wait in
the gateway (`attempt._route`); the engine's step is measured from streams still decoding before any ended
(`OwnAccounting.decoding`), and a P0 is priced by the first tokens of an engine whose step is not measured yet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from lockgate.attempt import _route
from lockgate.config import parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.fleet.instance import Instance, Lease
from lockgate.fleet.pool import Held, Pool
from lockgate.fleet.state import HOLD_MAX_S, STEP_TOKENS, OwnAccounting
from lockgate.metrics import GatewayMetrics
from lockgate.routing.cost import predict_ttft
from lockgate.routing.policies import InstanceView, RouteRequest

LONG, SHORT = 2000, 8  # prompt tokens: 250 ms and 1 ms of prefill at the default 8,000 tokens/s; the step: 10 ms


def fleet_of(instances: int) -> Fleet:
    """Instances whose 10 ms step is measured; not entered: no health probes, no scrapes."""
    urls = [{"url": f"http://127.0.0.1:{n + 1}"} for n in range(instances)]
    config = parse_config({"models": [{"name": "m", "instances": urls}]})
    built = Fleet(config, GatewayMetrics())
    built._build(config)
    for instance in built.pools["m"].instances:
        instance.own.tpot.add(0.010, 0.0)
    return built


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    built = fleet_of(1)
    try:
        yield built
    finally:
        await built.aclose()


def p2(tokens: int) -> RouteRequest:
    return RouteRequest("m", "", prompt_tokens=tokens, stream=True, yields=True)


def held_by_p0(fleet: Fleet) -> tuple[Pool, Instance, Lease]:
    """The pool, its instance, and the lease of a P0 sent there and waiting for its first token."""
    pool = fleet.pools["m"]
    (a,) = pool.instances
    p0 = fleet.lease(a, "m", SHORT, SHORT)
    p0.hold()
    return pool, a, p0


def waits(fleet: Fleet) -> float:
    return fleet._metrics.strict_first_token_waits.labels("m")._value.get()  # type: ignore[no-any-return]


def test_a_strict_request_holds_its_instance_until_its_first_token_or_its_end_at_most_a_while() -> None:
    own = OwnAccounting()
    turns: list[None] = []
    own.on_turn = lambda: turns.append(None)
    answered, ended, whole = own.start(SHORT, 10.0), own.start(SHORT, 10.5), own.start(SHORT, 10.5, whole=True)
    assert own.held(10.5) == 0.0
    own.hold(answered, 10.5)
    own.hold(answered, 10.5)  # once
    own.hold(ended, 10.5)
    own.hold(whole, 10.5)  # its first token is never seen: it holds nothing
    assert own.urgent_pending == 2
    assert own.held(10.5) == pytest.approx(HOLD_MAX_S - 0.0)  # from the latest one's sending (10.5)
    assert own.held(10.5 + HOLD_MAX_S) == 0.0  # an engine that answers nothing that long is not waited on
    own.first_token(answered, 11.0)
    assert own.urgent_pending == 1 and own.held(11.0) > 0 and len(turns) == 1
    own.end(ended, 11.1, 0)
    assert own.urgent_pending == 0 and own.held(11.1) == 0.0 and len(turns) == 2


def test_a_strict_requests_due_time_does_not_count_what_was_stopped_for_it() -> None:
    """Its backlog was what was queued ahead of it when its lease was taken; the less urgent prompts stopped for it
    before it went (`Admission.make_room`) are not ahead of it any more."""
    own = OwnAccounting()
    own.tpot.add(0.010, 0.0)
    p2s = [own.start(LONG, 0.0) for _ in range(4)]
    p0 = own.start(SHORT, 0.0)
    assert p0.backlog == 4 * LONG
    for attempt in p2s:
        own.end(attempt, 0.0, 0)
    own.hold(p0, 0.0)
    assert p0.backlog == 0
    due = own.first_token_due(p0)
    assert due is not None and due == pytest.approx(SHORT / own.rate + 3 * 0.010)


def test_before_any_stream_ended_the_step_is_measured_from_streams_decoding() -> None:
    """A flood of long generations: no stream ends for seconds, and their TTFT (queue and prefill) is no step."""
    own = OwnAccounting()
    attempt = own.start(LONG, 0.0)
    own.first_token(attempt, 4.0)
    assert own.step_s() == 4.0 and own.measured_step() is None  # only an upper bound so far
    assert not own.exceeds_step(LONG)  # no step measured: nothing is stopped or held on a guess
    own.decoding(attempt, STEP_TOKENS, 4.0 + 0.060 * (STEP_TOKENS - 1))
    assert own.measured_step() == pytest.approx(0.060) and own.step_s() == pytest.approx(0.060)
    assert own.exceeds_step(LONG) and not own.exceeds_step(SHORT)
    own.tpot.add(0.050, 5.0)  # a stream ended: its TPOT is the step from now on
    assert own.step_s() == pytest.approx(0.050)


async def test_a_lease_samples_the_step_once_at_its_eighth_token(fleet: Fleet) -> None:
    (a,) = fleet.pools["m"].instances
    a.own.tpot = type(a.own.tpot)()  # nothing measured
    lease = fleet.lease(a, "m", SHORT, SHORT)
    lease.first_token()
    lease.produced_tokens(1)
    assert a.own.live_tpot.samples == 0
    lease.produced_tokens(STEP_TOKENS)
    lease.produced_tokens(STEP_TOKENS)
    assert a.own.live_tpot.samples == 1 and lease.completion_tokens == 1 + 2 * STEP_TOKENS
    assert a.view().tpot_s == a.own.live_tpot.value  # what routing sees before any stream ended
    lease.release()


async def test_a_p2_with_a_long_prompt_is_not_sent_where_a_p0_waits_for_its_first_token(fleet: Fleet) -> None:
    pool, a, p0 = held_by_p0(fleet)
    with pytest.raises(Held):
        pool.choose(p2(LONG))
    assert a.in_flight == 1  # nothing taken for it
    assert pool.choose(p2(SHORT))[0] is a  # a prompt shorter than a step delays the P0 less than that
    assert pool.choose(replace(p2(LONG), yields=False))[0] is a  # nor is a request of another class held
    assert pool.choose(replace(p2(LONG), pin=a.key))[0] is a  # nor one whose engine was chosen elsewhere
    p0.first_token()
    assert pool.choose(p2(LONG))[0] is a
    p0.release()


async def test_a_held_p2_waits_in_the_gateway_and_goes_at_the_p0s_first_token(fleet: Fleet) -> None:
    pool, a, p0 = held_by_p0(fleet)
    routed = asyncio.create_task(_route(fleet, fleet._metrics, pool, p2(LONG)))
    cancelled = asyncio.create_task(_route(fleet, fleet._metrics, pool, p2(LONG)))
    await asyncio.sleep(0)  # both wait
    assert not routed.done() and not cancelled.done() and waits(fleet) == 2
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    p0.first_token()
    async with asyncio.timeout(5):
        _, instance, _ = await routed
    assert instance is a and waits(fleet) == 2  # counted once each
    p0.release()
    assert a.in_flight == 0 and a.own.urgent_pending == 0


async def test_a_p2_goes_to_an_instance_no_p0_holds_rather_than_wait() -> None:
    fleet = fleet_of(2)
    try:
        pool = fleet.pools["m"]
        a, b = pool.instances
        blocks = tuple(range(64))  # the prompt, cached on `a` only: the policy's choice
        pool.index.insert(a.key, blocks)
        request = replace(p2(LONG), blocks=blocks)
        assert pool.choose(request)[0] is a
        p0 = fleet.lease(a, "m", SHORT, SHORT)
        p0.hold()
        assert not pool.choose(request)[1]  # cached there, but its prefill is short there: not held
        resent = replace(request, resent=True)  # stopped before its first token: the engine may have only part of it
        assert pool.choose(resent)[0] is b and pool.unheld(resent)
        p0_b = fleet.lease(b, "m", SHORT, SHORT)
        p0_b.hold()
        with pytest.raises(Held):
            pool.choose(resent)
        assert not pool.unheld(resent)
        for lease in (p0, p0_b):
            lease.release()
    finally:
        await fleet.aclose()


async def test_a_held_p2_waits_at_most_the_hold_in_all(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """P0 requests that keep coming while an old one waits for its first token keep the instance held: the P2 request
    is routed anyway once it has waited `HOLD_MAX_S` (here 10 ms) in all."""
    monkeypatch.setattr("lockgate.attempt.HOLD_MAX_S", 0.01)
    pool, a, stuck = held_by_p0(fleet)
    async with asyncio.timeout(5):
        _, instance, _ = await _route(fleet, fleet._metrics, pool, p2(LONG))
    assert instance is a and a.own.held(time.monotonic()) > 0 and waits(fleet) == 1
    stuck.release()


def _view(**fields: object) -> InstanceView:
    base = InstanceView(key="a", name="a", healthy=True, in_flight=0, max_concurrency=8)
    return replace(base, **fields)  # type: ignore[arg-type]


def test_a_p0_prices_an_engine_without_a_measured_step_by_its_first_tokens() -> None:
    """Judged by its peers' 5 ms step, an engine whose first tokens take 0.9 s looked as fast as they are."""
    urgent = RouteRequest("m", "", prompt_tokens=40, urgent=True)
    slow = _view(ttft_s=0.9, prefill_tps=3000.0)
    assert predict_ttft(slow, urgent, 8000.0, 0.005) > 0.9
    assert predict_ttft(slow, replace(urgent, urgent=False), 8000.0, 0.005) < 0.1  # (other classes: the peers' step)


def test_a_p0_counts_the_queue_of_an_engine_that_has_answered_nothing_yet() -> None:
    """The P2 requests waiting there cannot be called overdue (nothing measured): they are not stopped for it, and a
    flood's first P0 sent behind 34 of them waited 8 s."""
    urgent = RouteRequest("m", "", prompt_tokens=40, urgent=True)
    fields = {"in_flight": 34, "pending": 34, "stoppable": 34, "stoppable_waiting": 34, "queued_prompt_tokens": 68_000}
    fresh = _view(**fields)
    assert predict_ttft(fresh, urgent, 8000.0, 0.005) > 8.0
    measured = _view(**fields, ttft_s=0.5)
    assert predict_ttft(measured, urgent, 8000.0, 0.005) < 1.0
