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
    parts: list[str] = []
    for line in raw.split(b"\n\n"):
        if line.startswith(b"data: {"):
            parts.extend(c["delta"].get("content") or "" for c in orjson.loads(line[6:])["choices"])
    return "".join(parts)


async def one_slot(start_sim, start_gateway, model: dict[str, Any] | None = None, **extra: Any):
    sim = await start_sim(prefill_tps=1e6, tpot_ms=1.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, max_concurrency=1)], **(model or {})}], **extra)
    return sim, gw, gw.gateway.admission.schedulers["m"]


async def slot_taken(sim, gw, http, stream: bool = True, question: str = "first") -> asyncio.Task[Any]:
    """A request that takes the only slot and stays at the (held) engine."""
    sim.control.hold = True
    first = asyncio.create_task(post(http, gw.url, chat(question, stream=stream)))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    return first


async def queued(scheduler, gw, http, body: dict[str, Any], **headers: str) -> asyncio.Task[Any]:
    """A request sent and waiting in the scheduler's queue (one more than before)."""
    before = scheduler.core.queued_total
    task = asyncio.create_task(post(http, gw.url, body, **headers))
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
    assert len(gw.gateway.dedup.waiting) == 0
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
    sim, gw, scheduler = await one_slot(start_sim, start_gateway, scheduling={"preemption": {"enabled": False}})
    first = await slot_taken(sim, gw, http)
    # Two identical requests arrive while the slot is taken and no flight of theirs exists; the second is more
    # urgent, so it does not wait behind the first (`waiting.py`): both queue, each with a ticket.
    a = await queued(scheduler, gw, http, chat("second"))
    b = await queued(scheduler, gw, http, chat("second", stream=True), **{"x-priority": "P0"})
    # The first ends: the slot goes to the P0 request, which leads the flight; the other leaves the queue and joins
    # it, while the engine still holds it.
    sim.release()
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: flights.statistics()["subscribers"] == 2)
    assert scheduler.core.queued_total == 0 and scheduler.core.running_total == 1
    assert len(gw.gateway.dedup.waiting) == 0
    results = await finish(sim, first, a, b)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "coalesced", "miss"]
    assert text(results[1][2], False) == text(results[2][2], True) != ""
    assert sim.statistics()["requests_started"] == 2
    assert_nothing_held(gw, scheduler)


async def test_a_streaming_request_queued_for_a_slot_takes_a_json_flights_result(start_sim, start_gateway, http):
    """A non-streaming leader's flight is one JSON body, which a streaming client cannot join: one queued for a slot
    is not woken when it starts, but when its result is stored, and served from it while the slot goes to the next
    request (it waited for that request's whole generation, or timed out in the queue, while its answer was cached)."""
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    whole = await slot_taken(sim, gw, http, stream=False, question="second")
    other = await queued(scheduler, gw, http, chat("another question"))
    streamed = await queued(scheduler, gw, http, chat("second", stream=True))
    assert scheduler.core.queued_total == 2  # its own ticket: it could not join the JSON flight
    sim.release()  # the JSON flight completes; the slot goes to "another question", held in turn
    async with asyncio.timeout(5):
        status, headers, raw = await streamed
    assert (status, headers["x-lockgate-cache"]) == (200, "hit")
    assert not other.done() and scheduler.core.running_total == 1 and scheduler.core.queued_total == 0
    results = await finish(sim, whole, other)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "miss"]
    assert text(results[0][2], False) == text(raw, True) != ""
    assert sim.statistics()["requests_started"] == 2
    assert_nothing_held(gw, scheduler)


async def test_a_flight_keeps_its_slot_after_its_leader_left(start_sim, start_gateway, http):
    """The slot is the flight's once it starts: when its leader leaves and another client still follows it, the
    engine call goes on and still counts against the pool (it gave the slot back with the leader, and the next
    request was sent to the engine beside it: `max_concurrency` exceeded by one per abandoned leader)."""
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    leader = await slot_taken(sim, gw, http, question="shared")
    follower = asyncio.create_task(post(http, gw.url, chat("shared")))
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: flights.statistics()["subscribers"] == 2)
    leader.cancel()  # the leader's client leaves
    await until(flights, lambda: flights.statistics()["subscribers"] == 1)
    assert scheduler.core.running_total == 1
    later = await queued(scheduler, gw, http, chat("later"))  # queued: the slot is still taken
    async with asyncio.timeout(5):
        await sim.wait_held(1)  # only the flight is at the engine
    results = await finish(sim, follower, later)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["coalesced", "miss"]
    assert_nothing_held(gw, scheduler)


async def test_a_flight_finishing_for_the_cache_keeps_its_slot(start_sim, start_gateway, http):
    """`cancel_policy: finish_and_cache`: a flight whose only client left runs on to fill the cache, on its slot."""
    sim, gw, scheduler = await one_slot(start_sim, start_gateway, model={"cancel_policy": "finish_and_cache"})
    leader = await slot_taken(sim, gw, http, question="shared")
    leader.cancel()
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: flights.statistics()["subscribers"] == 0)
    assert len(flights) == 1 and scheduler.core.running_total == 1
    later = await queued(scheduler, gw, http, chat("later"))
    [(_, headers, _)] = await finish(sim, later)
    assert headers["x-lockgate-cache"] == "miss"
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: len(flights) == 0)
    status, headers, _ = await post(http, gw.url, chat("shared"))
    assert (status, headers["x-lockgate-cache"]) == (200, "hit")  # what it finished for
    assert_nothing_held(gw, scheduler)


async def test_a_flight_on_a_stuck_engine_gives_its_slot_back_at_the_models_timeout(start_sim, start_gateway, http):
    """A flight run on for the cache holds the slot; on an engine that never answers it held it for good (a pool of
    stuck calls is an outage). It ends at the model's `timeout_ms`, as its clients' requests do."""
    model = {"cancel_policy": "finish_and_cache", "timeout_ms": 300}
    sim, gw, scheduler = await one_slot(start_sim, start_gateway, model=model)
    leader = await slot_taken(sim, gw, http, question="shared")
    leader.cancel()
    flights = gw.gateway.dedup.flights
    await until(flights, lambda: len(flights) == 0)  # the gateway's own timer: 300 ms after the flight started
    assert scheduler.core.running_total == 0
    assert gw.gateway.dedup.flights.statistics()["failed"] == 1
    sim.control.hold = False
    sim.release()
    assert_nothing_held(gw, scheduler)


async def test_duplicates_of_a_queued_request_wait_behind_it_without_a_place(start_sim, start_gateway, http):
    """Identical requests queued while the slot is taken share one place in the queue: with room for one waiting
    request, the others are not refused `queue_full` (they will cost nothing); one engine call serves them all."""
    one_place = {"classes": [{"name": c, "max_queue": 1} for c in ("P0", "P1", "P2")], "preemption": {"enabled": False}}
    sim, gw, scheduler = await one_slot(start_sim, start_gateway, scheduling=one_place)
    first = await slot_taken(sim, gw, http)
    ahead = await queued(scheduler, gw, http, chat("second", stream=True))
    behind = [asyncio.create_task(post(http, gw.url, chat("second", stream=stream))) for stream in (False, True)]
    waiting = gw.gateway.dedup.waiting
    await until(waiting, lambda: len(waiting) == 3)
    assert scheduler.core.queued_total == 1
    status, _, raw = await post(http, gw.url, chat("something else"))  # the one place is taken
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"
    results = await finish(sim, first, ahead, *behind)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "miss", "coalesced", "coalesced"]
    assert sim.statistics()["requests_started"] == 2
    assert_nothing_held(gw, scheduler)


async def test_the_request_behind_takes_the_place_of_one_that_left(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    first = await slot_taken(sim, gw, http)
    ahead = await queued(scheduler, gw, http, chat("second", stream=True))
    behind = asyncio.create_task(post(http, gw.url, chat("second", stream=True)))
    waiting = gw.gateway.dedup.waiting
    await until(waiting, lambda: len(waiting) == 2)
    ahead.cancel()  # the request ahead leaves before it got the slot
    await until(waiting, lambda: len(waiting) == 1)
    await until(scheduler, lambda core: core.queued_total == 1)  # the one behind queued in its place
    results = await finish(sim, first, behind)
    assert [r[1]["x-lockgate-cache"] for r in results] == ["miss", "miss"]
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
    assert headers["x-ratelimit-remaining-requests"] == "0"  # on a de-duplicated answer too
    status, headers, raw = await post(http, gw.url, chat("once"), **auth)
    assert status == 429 and "x-lockgate-cache" not in headers
    assert orjson.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert sim.statistics()["requests_started"] == 1
    assert_nothing_held(gw, scheduler)


async def test_a_client_leaving_while_queued_to_lead_leaves_nothing(start_sim, start_gateway, http):
    sim, gw, scheduler = await one_slot(start_sim, start_gateway)
    first = await slot_taken(sim, gw, http)
    leaving = await queued(scheduler, gw, http, chat("second", stream=True))
    assert len(gw.gateway.dedup.waiting) == 1
    leaving.cancel()  # the client's connection closes while it waits for the slot
    await until(scheduler, lambda core: core.queued_total == 0)
    # Released in one synchronous step with the ticket: the registry entry and the wait for a flight.
    assert len(gw.gateway.registry) == 1 and len(gw.gateway.dedup.waiting) == 0
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
