"""De-duplication through the gateway: flights shared by streaming and non-streaming clients, their
cancel policies, errors, and the completed-result cache.

The engine is held (`SimControl.hold`) so that every client has subscribed before the engine produces
anything; tests wait on conditions (`Flights.wait_until`, `SimServer.wait_until`), never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.test_priority import records

BODY = {"model": "m", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12, "temperature": 0}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def gateway(start_sim, start_gateway, *, tpot_ms: float = 2.0, **model: Any):
    sim = await start_sim(tpot_ms=tpot_ms)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)], **model}])
    return sim, gw


def chat_text(raw: bytes) -> str:
    content: str = orjson.loads(raw)["choices"][0]["message"]["content"]
    return content


def stream_text(raw: bytes) -> tuple[str, set[str]]:
    text, ids = [], set()
    for line in raw.split(b"\n\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = orjson.loads(line[6:])
        assert "error" not in event, event
        ids.add(event["id"])
        for choice in event["choices"]:
            text.append(choice["delta"].get("content") or "")
    assert raw.endswith(b"data: [DONE]\n\n")
    return "".join(text), ids


async def call(http, url: str, body: dict[str, Any], **headers: str) -> tuple[int, Any, bytes]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


async def solo(sim, http, body: dict[str, Any]) -> str:
    """The content of the same request sent straight to the engine."""
    async with http.post(sim.url + "/v1/chat/completions", json={**body, "stream": False}) as resp:
        return chat_text(await resp.read())


async def wait_subscribers(gw, n: int) -> None:
    flights = gw.gateway.dedup.flights
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["subscribers"] == n)


async def join_in_order(gw, http, body: dict[str, Any], kinds: tuple[bool, ...]) -> list[asyncio.Task[Any]]:
    """Clients sent one after the other, each subscribed before the next is sent: the first one leads, so
    what kind of flight runs (streaming or JSON) does not depend on which request the gateway parsed first."""
    tasks = []
    for n, stream in enumerate(kinds, 1):
        tasks.append(asyncio.create_task(call(http, gw.url, {**body, "stream": stream})))
        await wait_subscribers(gw, n)
    return tasks


def text_of(raw: bytes, stream: bool) -> str:
    return stream_text(raw)[0] if stream else chat_text(raw)


async def test_identical_requests_share_one_engine_call(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway)
    sim.control.hold = True
    kinds = [True, False, True, False, True, False]
    # A streaming leader: its flight streams, and non-streaming clients join it too.
    tasks = await join_in_order(gw, http, BODY, tuple(kinds))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    assert sim.statistics()["requests_started"] == 1
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = await asyncio.gather(*tasks)
    expected = await solo(sim, http, BODY)
    ids: set[str] = set()
    for stream, (status, _, raw) in zip(kinds, results, strict=True):
        assert status == 200
        assert text_of(raw, stream) == expected
        ids |= stream_text(raw)[1] if stream else {orjson.loads(raw)["id"]}
    assert len(ids) == len(kinds)  # every client has its own response id
    assert sorted(h["x-lockgate-cache"] for _, h, _ in results) == ["coalesced"] * 5 + ["miss"]
    # Each names the engine that produced the answer, the streaming leader too (it starts following the flight
    # before the engine call has opened).
    engines = {h.get("x-lockgate-instance") for _, h, _ in results}
    assert len(engines) == 1 and None not in engines
    assert sim.statistics()["requests_started"] == 2  # the flight, and the solo reference call
    # A late identical request is served from the completed-result cache, as a normal SSE stream.
    status, headers, raw = await call(http, gw.url, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["x-lockgate-cache"] == "hit"
    assert stream_text(raw)[0] == expected and b'"usage":{"prompt_tokens"' in raw
    assert sim.statistics()["requests_started"] == 2
    await gw.gateway.records.wait_flushed()
    rows = read_records(gw.gateway.records._path)
    assert sorted(r["served_by"] for r in rows) == ["coalesced"] * 5 + ["hit", "miss"]
    assert {r["instance"] for r in rows if r["served_by"] != "hit"} == engines  # a cache hit used no engine
    # The leader's record counts the flight's engine call; the others made none of their own.
    assert sorted((r["served_by"], r["attempts"]) for r in rows) == [("coalesced", 0)] * 5 + [("hit", 0), ("miss", 1)]
    async with http.get(gw.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    outcomes = {s.labels["outcome"]: s.value for s in families["lockgate_dedup"].samples if s.name.endswith("_total")}
    assert outcomes["coalesced"] == 5 and outcomes["hit"] == 1 and outcomes["miss"] == 1
    saved = {
        s.labels["kind"]: s.value
        for s in families["lockgate_dedup_upstream_tokens_saved"].samples
        if s.name.endswith("_total")
    }
    assert saved["completion"] == 6 * 12


async def test_late_joiner_mid_stream_gets_the_full_content(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, tpot_ms=30.0)
    body = {**BODY, "max_tokens": 12, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as first:
        await first.content.readuntil(b"\n\n")  # the stream is live
        async with http.get(gw.url + "/admin/flights") as resp:
            listing = await resp.json()
        (flight,) = listing["flights"]
        assert flight["model"] == "m" and flight["state"] == "running" and flight["subscribers"] == 1
        async with http.get(gw.url + "/admin/requests") as resp:
            (leader,) = (await resp.json())["requests"]
        assert leader["phase"] == "streaming" and leader["instance"] == sim.url  # the flight's, while it streams
        assert listing["statistics"]["cache"]["entries"] == 0
        late = await call(http, gw.url, body)
        rest = await first.read()
    assert late[0] == 200 and late[1]["x-lockgate-cache"] in ("coalesced", "hit")
    expected = await solo(sim, http, body)
    assert stream_text(late[2])[0] == expected
    assert sim.statistics()["requests_started"] == 2
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_leader_leaving_mid_stream_does_not_affect_followers(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, tpot_ms=20.0)
    sim.control.hold = True
    body = {**BODY, "max_tokens": 16}
    got_first = asyncio.Event()

    async def lead() -> None:
        async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.headers["x-lockgate-cache"] == "miss"
            while b'"content":""' in await resp.content.readuntil(b"\n\n"):
                pass  # the role chunk carries no content yet
            got_first.set()
            # Leaving here closes the connection mid-stream.

    leader_task = asyncio.create_task(lead())
    await wait_subscribers(gw, 1)
    followers = [asyncio.create_task(call(http, gw.url, {**body, "stream": s})) for s in (True, False)]
    await wait_subscribers(gw, 3)
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        await got_first.wait()
        await leader_task
        results = await asyncio.gather(*followers)
    expected = await solo(sim, http, body)
    assert [text_of(raw, s) for s, (_, _, raw) in zip((True, False), results, strict=True)] == [expected] * 2
    stats = sim.statistics()
    assert stats["requests_started"] == 2 and stats["requests_aborted"] == 0


async def test_a_leader_that_left_is_charged_what_it_received_not_what_its_follower_got(start_sim, start_gateway, http):
    """A flight's tokens were charged to its leader's allowance whole, also those produced for a client that followed
    it to the end after the leader left, which that client's tenant is charged itself: one generation charged twice
    (an outside run: a pair of requests charged ~208 tokens shared, 120 sent apart). The leader is charged what it
    received; the tokens a flight produces while no client follows it stay its leader's
    (`test_a_detached_flight_is_its_tenants_work_until_it_ends`)."""
    sim = await start_sim(tpot_ms=50.0)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}], tenants=[{"name": "default", "tokens_per_minute": 10**6}]
    )
    sim.control.hold = True
    body = {**BODY, "max_tokens": 16, "stream": True}
    got_first = asyncio.Event()

    async def lead() -> None:
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            while b'"content":""' in await resp.content.readuntil(b"\n\n"):
                pass  # the role chunk carries no content yet
            got_first.set()  # leaving here closes the connection mid-stream

    leader = asyncio.create_task(lead())
    await wait_subscribers(gw, 1)
    [ex] = gw.gateway.registry.all()
    allowance = ex.allowance
    follower = asyncio.create_task(call(http, gw.url, body))
    await wait_subscribers(gw, 2)
    sim.control.hold = False
    sim.release()
    flights = gw.gateway.dedup.flights
    async with asyncio.timeout(10):
        await leader
        status, _, raw = await follower
        await flights.wait_until(lambda: len(flights) == 0)
    assert status == 200 and len(stream_text(raw)[0]) > 0
    rows = {r["request_id"]: r for r in await records(gw)}
    lead_row = rows[ex.id]
    assert lead_row["status"] == "cancelled" and lead_row["completion_tokens"] < 16
    assert allowance is not None and allowance.reservation.settled
    # What the flight produced while the leader followed it: what it read, and what was on its way when it left (a
    # token every 50 ms; the whole generation is 16).
    received = lead_row["prompt_tokens"] + lead_row["completion_tokens"]
    assert received <= allowance.reservation.used <= received + 8


async def held_then_abandoned(sim, gw, http, body: dict[str, Any], kinds: tuple[bool, ...] = (True, False)) -> None:
    """Clients (streaming or not, as `kinds` says; two by default) join a held flight, then all leave."""
    sim.control.hold = True
    tasks = await join_in_order(gw, http, body, kinds)
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_subscribers(gw, 0)
    sim.control.hold = False


async def test_all_leave_immediate_aborts_upstream_and_next_request_starts_fresh(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, cancel_policy="immediate")
    await held_then_abandoned(sim, gw, http, BODY)
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)
    flights = gw.gateway.dedup.flights
    assert len(flights) == 0
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["tasks"] == 0)
    status, headers, raw = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "miss"
    assert chat_text(raw) == await solo(sim, http, BODY)
    assert sim.statistics()["requests_started"] == 3
    assert gw.gateway.fleet.instances[sim.url].in_flight == 0


async def test_all_leave_finish_and_cache_makes_the_next_request_a_hit(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, cancel_policy="finish_and_cache")
    await held_then_abandoned(sim, gw, http, BODY)
    flights = gw.gateway.dedup.flights
    assert len(flights) == 1  # detached, still running
    sim.release()
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: len(flights) == 0)
    status, headers, raw = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "hit"
    assert chat_text(raw) == await solo(sim, http, BODY)
    stats = sim.statistics()
    assert stats["requests_started"] == 2 and stats["requests_aborted"] == 0


async def test_all_leave_cache_partial_aborts_and_keeps_what_exists(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, tpot_ms=50.0, cancel_policy="cache_partial")
    body = {**BODY, "max_tokens": 40, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
    await wait_subscribers(gw, 0)
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)
    dedup = gw.gateway.dedup
    key = next(iter(dedup.cache._entries))
    partial = dedup.cache._entries[key][0]
    assert not partial.complete and len(partial.events) >= 2
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["x-lockgate-cache"] == "miss"  # a partial is never served


async def test_upstream_error_fails_every_subscriber_and_removes_the_flight(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, retries=0)
    sim.control.hold = True
    sim.control.reset_prob = 1.0
    kinds = (True, False, True)
    tasks = await join_in_order(gw, http, BODY, kinds)
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = await asyncio.gather(*tasks)
    codes = set()
    for status, _, raw in results:
        if status == 200:  # the stream had started: it ends with an error event, never [DONE]
            assert not raw.endswith(b"data: [DONE]\n\n")
            last = [line for line in raw.split(b"\n\n") if line][-1]
            codes.add(orjson.loads(last[6:])["error"]["code"])
        else:
            assert status == 502
            codes.add(orjson.loads(raw)["error"]["code"])
    assert codes == {"upstream_protocol_error"}
    assert len(gw.gateway.dedup.flights) == 0 and len(gw.gateway.dedup.cache) == 0
    sim.control.reset_prob = 0.0
    status, headers, _ = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "miss"
    assert sim.statistics()["requests_started"] == 2


async def test_a_flight_the_engine_refused_names_the_instance_it_went_to(start_sim, start_gateway, http):
    """As on the direct path, an error after an instance was tried names it (header and record), though the
    flight's call never opened."""
    sim, gw = await gateway(start_sim, start_gateway, retries=0)
    sim.control.fail_status = 400
    status, headers, _ = await call(http, gw.url, BODY)
    assert status == 400 and headers["x-lockgate-instance"] == sim.url
    # And its de-duplication outcome, as every answer of a de-duplicated request says it (an outside run: engine
    # errors of de-duplicated requests had no `x-lockgate-cache`).
    assert headers["x-lockgate-cache"] == "miss"
    await gw.gateway.records.wait_flushed()
    (row,) = read_records(gw.gateway.records._path)
    assert (row["status"], row["instance"], row["served_by"]) == ("rejected", sim.url, "miss")


async def test_distinct_or_non_deterministic_requests_are_never_merged(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway)
    sim.control.hold = True
    base = {k: v for k, v in BODY.items() if k != "temperature"}
    bodies = [
        ({**base, "temperature": 0}, "miss"),
        ({**base, "temperature": 0, "stop": ["zzz"]}, "miss"),
        ({**base, "seed": 1}, "miss"),
        ({**base, "seed": 2}, "miss"),
        ({**base, "seed": 1, "temperature": 0.7}, "miss"),
        (base, "bypass"),  # sampled: not reproducible
        (base, "bypass"),
    ]
    tasks = [asyncio.create_task(call(http, gw.url, b)) for b, _ in bodies]
    opted = asyncio.create_task(call(http, gw.url, {**base, "temperature": 0}, **{"Cache-Control": "no-cache"}))
    async with asyncio.timeout(5):
        await sim.wait_held(len(bodies) + 1)  # every one reached the engine on its own
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = await asyncio.gather(*tasks, opted)
    assert [h["x-lockgate-cache"] for _, h, _ in results] == [o for _, o in bodies] + ["bypass"]
    assert all(status == 200 for status, _, _ in results)
    assert sim.statistics()["requests_started"] == len(bodies) + 1


async def test_dedup_off_per_model(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, dedup="off")
    for _ in range(2):
        status, headers, _ = await call(http, gw.url, BODY)
        assert status == 200 and headers["x-lockgate-cache"] == "bypass"
    assert sim.statistics()["requests_started"] == 2


async def test_shutdown_stops_a_detached_flight(start_sim, start_gateway, http):
    sim, gw = await gateway(start_sim, start_gateway, cancel_policy="finish_and_cache")
    await held_then_abandoned(sim, gw, http, BODY)
    flights = gw.gateway.dedup.flights
    assert len(flights) == 1
    async with asyncio.timeout(10):
        await gw.shutdown(drain_s=0)
    assert flights.statistics()["tasks"] == 0 and len(flights) == 0
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)


async def test_events_already_here_go_out_in_one_write(start_sim, start_gateway, http, client_writes):
    """A cached result is all there: its whole stream, [DONE] included, is one write (one send),
    not one per token."""
    sim, gw = await gateway(start_sim, start_gateway)
    status, _, _ = await call(http, gw.url, BODY)  # fills the completed-result cache
    assert status == 200
    writes = client_writes(gw.url)
    status, headers, raw = await call(http, gw.url, {**BODY, "stream": True})
    assert status == 200 and headers["x-lockgate-cache"] == "hit"
    text, _ = stream_text(raw)
    assert text == await solo(sim, http, BODY)
    # One write, which also ends the response (the head went with it: `start(hold_head=True)`; the chunked
    # body's last chunk too).
    assert len(writes) == 1, writes
    assert writes[0].startswith(b"HTTP/1.1 200") and b"data: [DONE]\n\n" in writes[0]
    assert writes[0].endswith(b"0\r\n\r\n")


async def test_a_detached_flight_is_its_tenants_work_until_it_ends(start_sim, start_gateway, http):
    """`finish_and_cache`: every client left, the flight runs on. It still counts against its tenant's
    `max_concurrent` (a client could start any number of generations and leave at once), the tokens it produced are
    charged when it ends, and an administrator can stop it by its id (`DELETE /admin/requests/{id}`)."""
    import time

    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)], "cancel_policy": "finish_and_cache"}],
        tenants=[{"name": "default", "max_concurrent": 1, "tokens_per_minute": 120}],
    )
    gateway_ = gw.gateway
    limiter, tenant = gateway_.admission.limiter, gateway_.admission.book.default
    flights = gateway_.dedup.flights

    await held_then_abandoned(sim, gw, http, BODY, (False,))  # one client: its tenant's max_concurrent is 1
    assert len(flights) == 1 and limiter.state(tenant, time.monotonic()).in_flight == 1
    other = {**BODY, "messages": [{"role": "user", "content": "something else"}]}
    status, _, raw = await call(http, gw.url, other)
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "concurrency_limit_exceeded"

    sim.release()
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: len(flights) == 0)
    # (Read as of the charge, not refilled since; and a slow limit: at 10,000 a minute the bucket refilled 12 tokens in
    # 72 ms, which a loaded machine took between the reservation and the charge, and the check failed 1 run in 6.)
    state = limiter.state(tenant, 0.0)
    assert state.in_flight == 0 and state.reserved_tokens == 0
    assert state.tokens is not None and 120 - state.tokens.level >= 12  # the 12 tokens generated, and the prompt
    status, _, _ = await call(http, gw.url, other)
    assert status == 200

    # Another detached flight, stopped by an administrator: its allowance is settled and its slot freed.
    again = {**BODY, "messages": [{"role": "user", "content": "a third story"}]}
    await held_then_abandoned(sim, gw, http, again, (False,))
    [flight] = flights.all()
    async with http.delete(f"{gw.url}/admin/requests/{flight.id}") as resp:
        assert resp.status == 200 and (await resp.json()) == {"id": flight.id, "cancelled": True}
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: len(flights) == 0)
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)
    assert limiter.state(tenant, time.monotonic()).in_flight == 0
    assert gateway_.admission.schedulers["m"].core.running_total == 0


async def test_an_operator_cancelling_a_shared_flight_cancels_its_clients_for_the_same_reason(
    start_sim, start_gateway, http, tmp_path
):
    """`DELETE /admin/requests/{flight id}`: every client of the flight ends `cancelled` for reason `admin` (records,
    `lockgate_cancellations_total`), as one request cancelled by its own id does, not as a failure (`error`, which
    the success objective counts against the service)."""
    sim, gw = await gateway(start_sim, start_gateway)
    sim.control.hold = True
    tasks = await join_in_order(gw, http, BODY, (True, True, False))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    [flight] = gw.gateway.dedup.flights.all()
    async with http.delete(f"{gw.url}/admin/requests/{flight.id}") as resp:
        assert resp.status == 200 and (await resp.json())["cancelled"] is True
    async with asyncio.timeout(5):
        results = await asyncio.gather(*tasks)
    assert [status for status, _, _ in results] == [503] * 3  # (the engine was holding: nothing streamed yet)
    assert all(orjson.loads(raw)["error"]["type"] == "cancelled" for _, _, raw in results)
    await gw.gateway.records.wait_flushed()
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert [(r["status"], r["cancel_reason"]) for r in rows] == [("cancelled", "admin")] * 3
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_cancellations_total{model="m",priority="P1",reason="admin"} 3.0' in metrics
    assert 'status="error"' not in metrics.split("lockgate_requests_total")[1].split("# HELP")[0]
    sim.control.hold = False
    sim.release()
