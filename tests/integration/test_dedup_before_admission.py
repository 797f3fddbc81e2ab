"""De-duplication before a slot: a cached result, a semantic hit or a flight to join needs no place at the
scheduler, so none of them waits behind the requests that hold the pool's slots; the tenant's rate limit still
comes first. A request already queued for a slot joins an identical flight that starts while it waits.

One engine with one slot (`max_concurrency: 1`), held (`SimControl.hold`) so that "the slot is taken" is a fact
the test arranges; queue states are awaited through the scheduler's change notification, never polled. Each
`asyncio.timeout` is a guard against a hang (what the old order did: the hit waited for the held slot).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from lockgate.admission.tenants import hash_key
from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.test_priority import http, post

__all__ = ["http"]  # the fixture


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, **extra}


def text(raw: bytes, stream: bool) -> str:
    if not stream:
        content: str = orjson.loads(raw)["choices"][0]["message"]["content"]
        return content
    parts = []
    for line in raw.split(b"\n\n"):
        if line.startswith(b"data: {"):
            parts.extend(c["delta"].get("content") or "" for c in orjson.loads(line[6:])["choices"])
    return "".join(parts)


async def one_slot(start_sim, start_gateway, **extra: Any):
    sim = await start_sim(prefill_tps=1e6, tpot_ms=1.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, max_concurrency=1)]}], **extra)
    return sim, gw, gw.gateway.admission.schedulers["m"]


async def slot_taken(sim, gw, http, stream: bool = True) -> asyncio.Task[Any]:
    """A request that takes the only slot and stays at the (held) engine."""
    sim.control.hold = True
    first = asyncio.create_task(post(http, gw.url, chat("first", stream=stream)))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    return first


async def queued(scheduler, gw, http, body: dict[str, Any]) -> asyncio.Task[Any]:
    """A request sent and waiting in the scheduler's queue (one more than before)."""
    before = scheduler.core.queued_total
    task = asyncio.create_task(post(http, gw.url, body))
    await until(scheduler, lambda core: core.queued_total == before + 1)
    return task


async def until(waitable, predicate) -> None:
    async with asyncio.timeout(5):
        await waitable.wait_until(predicate)


async def finish(sim, *tasks: asyncio.Task[Any]) -> list[tuple[int, Any, bytes]]:
    """Let the engine go; every request's (status, headers, body), each answered 200."""
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = list(await asyncio.gather(*tasks))
    assert [r[0] for r in results] == [200] * len(tasks)
    return results


def assert_nothing_held(gw, scheduler) -> None:
    assert scheduler.core.running_total == 0 and scheduler.core.queued_total == 0
    assert scheduler.statistics()["waiters"] == 0
    assert gw.gateway.dedup._awaiting == {}
    assert len(gw.gateway.registry) == 0


async def test_hits_and_joiners_take_no_slot(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    status, headers, cached = await post(http, gw.url, chat("cached question"))
    assert (status, headers["x-lockgate-cache"]) == (200, "miss")
    # A streamed request takes the only slot and stays at the engine.
    sim.control.hold = True
    leader = asyncio.create_task(post(http, gw.url, chat("held question", stream=True)))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    assert scheduler.core.running_total == 1
    # The cached answer is served now, not after the held request.
    async with asyncio.timeout(5):
        status, headers, raw = await post(http, gw.url, chat("cached question", stream=True))
    assert (status, headers["x-lockgate-cache"]) == (200, "hit")
    assert text(raw, True) == text(cached, False)
    # An identical request joins the held flight at once (it would have queued for the slot).
    joiner = asyncio.create_task(post(http, gw.url, chat("held question")))
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: flights.statistics()["subscribers"] == 2)
    assert scheduler.core.queued_total == 0 and scheduler.core.running_total == 1
    (_, h1, r1), (_, h2, r2) = await finish(sim, leader, joiner)
    assert (h1["x-lockgate-cache"], h2["x-lockgate-cache"]) == ("miss", "coalesced")
    assert text(r1, True) == text(r2, False) != ""
    assert sim.statistics()["requests_started"] == 2  # the cached question once, the held question once
    await gw.gateway.records.wait_flushed()
    rows = read_records(gw.gateway.records._path)
    assert sorted(r["served_by"] for r in rows) == ["coalesced", "hit", "miss", "miss"]
    assert {r["status"] for r in rows} == {"completed"}
    assert_nothing_held(gw, scheduler)


async def test_a_queued_request_joins_a_flight_that_starts_while_it_waits(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    first = await slot_taken(sim, gw, http)
    # Two identical requests arrive while the slot is taken and no flight of theirs exists: both queue.
    a = await queued(scheduler, gw, http, chat("second", stream=True))
    b = await queued(scheduler, gw, http, chat("second"))
    # The first ends: the slot goes to the head of the queue, which leads the flight; the other leaves the
    # queue and joins it, while the engine still holds it.
    sim.release()
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: flights.statistics()["subscribers"] == 2)
    assert scheduler.core.queued_total == 0 and scheduler.core.running_total == 1
    assert len(gw.gateway.dedup._awaiting) == 0
    results = await finish(sim, first, a, b)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "miss", "coalesced"]
    assert text(results[1][2], True) == text(results[2][2], False) != ""
    assert sim.statistics()["requests_started"] == 2
    assert_nothing_held(gw, scheduler)


async def test_a_streaming_request_queued_for_a_slot_does_not_join_a_json_flight(start_sim, start_gateway, http):
    """A non-streaming leader's flight is one JSON body: a streaming client waiting for a slot is not woken by it
    (it could not join) and leads its own flight once it gets the slot."""
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    first = await slot_taken(sim, gw, http, stream=False)
    whole = await queued(scheduler, gw, http, chat("second"))
    streamed = await queued(scheduler, gw, http, chat("second", stream=True))
    sim.release()  # "first" ends; "second" (JSON) leads and is held; the streaming one stays queued
    await until(scheduler, lambda core: core.queued_total == 1 and core.running_total == 1)
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: len(flights) == 1 and flights.statistics()["subscribers"] == 1)
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    assert scheduler.core.queued_total == 1  # not woken by the JSON flight
    results = await finish(sim, first, whole, streamed)
    # The streaming one got the slot after the JSON flight had completed: its answer came from the cache.
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "miss", "hit"]
    assert text(results[1][2], False) == text(results[2][2], True) != ""
    assert_nothing_held(gw, scheduler)


async def test_the_rate_limit_still_comes_before_the_cache(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(
        start_sim,
        start_gateway,
        tenants=[{"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 1}],
    )
    auth = {"Authorization": "Bearer sk-acme"}
    status, headers, _ = await post(http, gw.url, chat("once"), **auth)
    assert (status, headers["x-lockgate-cache"]) == (200, "miss")
    status, headers, raw = await post(http, gw.url, chat("once"), **auth)
    assert status == 429 and "x-lockgate-cache" not in headers
    assert orjson.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert sim.statistics()["requests_started"] == 1
    assert_nothing_held(gw, scheduler)


async def test_a_client_leaving_while_queued_to_lead_leaves_nothing(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    first = await slot_taken(sim, gw, http)
    leaving = await queued(scheduler, gw, http, chat("second", stream=True))
    assert len(gw.gateway.dedup._awaiting) == 1
    leaving.cancel()  # the client's connection closes while it waits for the slot
    await until(scheduler, lambda core: core.queued_total == 0)
    # Released in one synchronous step with the ticket: the registry entry and the wait for a flight.
    assert len(gw.gateway.registry) == 1 and gw.gateway.dedup._awaiting == {}
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        assert (await first)[0] == 200
    await gw.gateway.records.wait_flushed()
    rows = read_records(gw.gateway.records._path)
    assert sorted((r["status"], r["cancel_reason"]) for r in rows) == [
        ("cancelled", "client_disconnect"),
        ("completed", None),
    ]
    assert_nothing_held(gw, scheduler)
