"""Priority scheduling, admission and tenants, end to end through the gateway and the simulator.

The simulator's `hold` switch keeps requests at the engine until released, so "the pool is busy" is a
fact the test arranges, not a race it hopes to win; queue states are awaited through the scheduler's
change notification (`PoolScheduler.wait_until`), never polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.admission.tenants import hash_key
from lockgate.records import read_records
from tests.conftest import instance

P0, P1, P2 = 0, 1, 2
QUICK = {"prefill_tps": 1e6, "tpot_ms": 1.0}


def chat(n: int = 0, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"hello {n}"}], "max_tokens": 4, **extra}


def classes(p2_queue: int = 3, p1_queue: int = 100, **p2: Any) -> dict[str, Any]:
    return {
        "preemption": {"enabled": False},  # these tests are about queueing (tests/integration/test_preemption.py)
        "classes": [
            {"name": "P0", "strict": True, "weight": 0.6, "max_queue": 10},
            {"name": "P1", "weight": 0.3, "max_queue": p1_queue},
            {"name": "P2", "weight": 0.1, "max_queue": p2_queue, **p2},
        ],
    }


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str):
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


async def busy_pool(start_sim, start_gateway, **extra: Any):
    """A gateway over one held simulator with one slot, the slot taken by a P2 request."""
    sim = await start_sim(**QUICK)
    sim.control.hold = True
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, max_concurrency=1)]}], **extra)
    return sim, gw, gw.gateway.admission.schedulers["m"]


async def until(scheduler, predicate) -> None:
    async with asyncio.timeout(5):
        await scheduler.wait_until(predicate)


def exchange_of(gw, priority: str):
    return next(e for e in gw.gateway.registry.all() if e.record.priority == priority)


async def records(gw) -> list[dict[str, Any]]:
    await gw.gateway.records.wait_flushed()
    return read_records(gw.gateway.records._path)


def assert_no_leaks(gw) -> None:
    gateway = gw.gateway
    for scheduler in gateway.admission.schedulers.values():
        assert scheduler.core.running_total == 0 and scheduler.core.queued_total == 0
        assert scheduler.statistics()["waiters"] == 0
    for state in gateway.admission.limiter.tenants().values():
        assert state.in_flight == 0 and state.reserved_tokens == 0
    assert len(gateway.registry) == 0
    text = gateway.metrics.render().decode()
    assert "lockgate_invariant_violations_total{" not in text


async def test_p0_admitted_ahead_of_a_full_p2_queue(start_sim, start_gateway, http):
    sim, gw, sched = await busy_pool(start_sim, start_gateway, scheduling=classes(p2_queue=3))
    running = asyncio.create_task(post(http, gw.url, chat(0), **{"x-priority": "P2"}))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    queued = [asyncio.create_task(post(http, gw.url, chat(n), **{"x-priority": "P2"})) for n in range(1, 4)]
    await until(sched, lambda core: core.queued(P2) == 3)
    # The P2 queue is full: an honest 429 with Retry-After, in the OpenAI envelope.
    status, headers, raw = await post(http, gw.url, chat(9), **{"x-priority": "P2"})
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert orjson.loads(raw)["error"]["code"] == "queue_full"
    urgent = asyncio.create_task(post(http, gw.url, chat(99), **{"x-priority": "P0"}))
    await until(sched, lambda core: core.queued(P0) == 1)
    async with http.get(gw.url + "/admin/requests") as resp:
        phases = {(r["priority"], r["phase"]) for r in (await resp.json())["requests"]}
    assert ("P0", "queued") in phases and ("P2", "queued") in phases
    p0_id = exchange_of(gw, "P0").id
    # The running request finishes: the next one to reach the engine is the P0 one.
    sim.release()
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: p0_id in s.stats.open)
    assert sched.core.queued(P2) == 3
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = await asyncio.gather(running, urgent, *queued)
    assert [r[0] for r in results] == [200] * 5
    rows = await records(gw)
    rejected = [r for r in rows if r["status"] == "rejected"]
    assert len(rejected) == 1 and rejected[0]["priority"] == "P2" and rejected[0]["http_status"] == 429
    assert rejected[0]["tenant"] == "default"
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_queue_depth{model="m",priority="P0"} 0.0' in metrics
    assert 'lockgate_rejections_total{priority="P2",reason="queue_full"} 1.0' in metrics
    assert 'lockgate_queue_wait_seconds_count{model="m",priority="P0"} 1.0' in metrics
    assert_no_leaks(gw)


async def test_weighted_shares_between_backlogged_classes(start_sim, start_gateway, http):
    sim, gw, sched = await busy_pool(start_sim, start_gateway, scheduling=classes(p2_queue=100))
    blocker = asyncio.create_task(post(http, gw.url, chat(0), **{"x-priority": "P1"}))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    n = 24
    tasks = []
    for i in range(n):  # interleave arrivals: order of arrival must not decide the shares
        tasks.append(asyncio.create_task(post(http, gw.url, chat(i), **{"x-priority": "P1"})))
        tasks.append(asyncio.create_task(post(http, gw.url, chat(100 + i), **{"x-priority": "P2"})))
    await until(sched, lambda core: core.queued(P1) == n and core.queued(P2) == n)
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(20):
        results = await asyncio.gather(blocker, *tasks)
    assert all(r[0] == 200 for r in results)
    priority = {r["request_id"]: r["priority"] for r in await records(gw)}
    seen = sorted(sim.stats.seen, key=lambda rec: rec.started_at)[1:]  # after the blocker
    order = [priority[rec.request_id] for rec in seen]
    # While both classes are backlogged (the first 32 grants: P1 runs out at 24 = 0.75 * 32),
    # P1 gets 0.3 / (0.3 + 0.1) = 75 % of the slots.
    first = order[:32]
    assert abs(first.count("P1") - 24) <= 1, order
    assert "P2" in order[:8]  # P2 is never starved
    assert_no_leaks(gw)


@pytest.mark.parametrize("how", ["client_disconnect", "timeout", "admin"])
async def test_leaving_while_queued_frees_the_place_at_once(start_sim, start_gateway, http, how):
    extra = {"tenants": [{"name": "default", "tokens_per_minute": 100_000}]}
    sim, gw, sched = await busy_pool(start_sim, start_gateway, scheduling=classes(p2_queue=1), **extra)
    running = asyncio.create_task(post(http, gw.url, chat(0), **{"x-priority": "P2"}))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    headers = {"x-priority": "P2"}
    if how == "timeout":
        headers["x-lockgate-timeout-ms"] = "100"
    waiting = asyncio.create_task(post(http, gw.url, chat(1), **headers))
    await until(sched, lambda core: core.queued(P2) == 1)
    status, _, _ = await post(http, gw.url, chat(2), **{"x-priority": "P2"})
    assert status == 429  # the queue (of one) is full
    queued_ex = next(e for e in gw.gateway.registry.all() if e.phase.value == "queued" and e.record.priority == "P2")
    if how == "client_disconnect":
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    elif how == "admin":
        async with http.delete(f"{gw.url}/admin/requests/{queued_ex.id}") as resp:
            assert resp.status == 200
    await until(sched, lambda core: core.queued(P2) == 0)
    if how != "client_disconnect":
        status, _, raw = await waiting
        assert status == (504 if how == "timeout" else 503)
        assert orjson.loads(raw)["error"]["type"] in ("timeout", "cancelled")
    # The place is free at once: a new request queues instead of getting 429.
    again = asyncio.create_task(post(http, gw.url, chat(3), **{"x-priority": "P2"}))
    await until(sched, lambda core: core.queued(P2) == 1)
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        assert (await running)[0] == 200 and (await again)[0] == 200
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
    rows = {r["request_id"]: r for r in await records(gw)}
    row = rows[queued_ex.id]
    assert row["status"] == "cancelled" and row["cancel_reason"] == how
    assert row["attempts"] == 0 and row["instance"] is None  # it never reached an engine
    assert sim.stats.requests_started == 2  # the one that left never reached the engine
    assert_no_leaks(gw)


async def test_shutdown_answers_queued_at_once(start_sim, start_gateway, http):
    """SIGTERM's path: a queued request gets 503 + Retry-After at once, not at the drain deadline, while
    the running one may finish; both leave exactly one record."""
    sim, gw, sched = await busy_pool(start_sim, start_gateway, scheduling=classes())
    running = asyncio.create_task(post(http, gw.url, chat(0), **{"x-priority": "P2"}))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    waiting = asyncio.create_task(post(http, gw.url, chat(1), **{"x-priority": "P2"}))
    await until(sched, lambda core: core.queued(P2) == 1)
    queued_id = next(e.id for e in gw.gateway.registry.all() if e.phase.value == "queued")
    shutdown = asyncio.create_task(gw.shutdown(drain_s=30))
    async with asyncio.timeout(5):
        status, headers, raw = await waiting
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert orjson.loads(raw)["error"]["type"] == "cancelled"
    assert not running.done() and not shutdown.done()  # the running request is still draining
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        assert (await running)[0] == 200
        await shutdown
    rows = {r["request_id"]: r for r in read_records(gw.gateway.records._path)}
    assert rows[queued_id]["status"] == "cancelled" and rows[queued_id]["cancel_reason"] == "shutdown"
    assert sorted(r["status"] for r in rows.values()) == ["cancelled", "completed"]
    assert sim.stats.requests_started == 1
    assert_no_leaks(gw)


async def test_token_reservation_refunded_on_cancel(start_sim, start_gateway, http):
    sim = await start_sim(prefill_tps=1e6, tpot_ms=20.0)
    limit = 50_000
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "default", "tokens_per_minute": limit, "requests_per_minute": 1000}],
    )
    limiter, tenant = gw.gateway.admission.limiter, gw.gateway.admission.book.default
    body = chat(1, max_tokens=2000, stream=True)
    async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        assert resp.status == 200
        # The whole possible cost is reserved while the request runs.
        reserved = limit - int(resp.headers["x-ratelimit-remaining-tokens"])
        assert reserved >= 2000
        assert resp.headers["x-ratelimit-limit-tokens"] == str(limit)
        assert resp.headers["x-ratelimit-limit-requests"] == "1000"
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                chunks += 1
                if chunks == 3:
                    break
    # Disconnected after a few tokens: the reservation is settled with only what was delivered.
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
    rows = await records(gw)
    delivered = rows[0]["completion_tokens"]
    assert rows[0]["status"] == "cancelled" and 1 <= delivered < 50
    state = limiter.state(tenant, time.monotonic())
    assert state.reserved_tokens == 0 and state.in_flight == 0
    assert state.tokens is not None and limit - state.tokens.level < 100  # not the 2000 reserved
    assert_no_leaks(gw)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["direct", "flight"])
async def test_a_whole_answer_its_client_left_is_charged_for_what_the_engine_generated(
    start_sim, start_gateway, http, temperature
):
    """An outside run: non-streaming requests abandoned shortly before their answers came had the engine generate
    ~1,380 tokens and were charged none (the answer is read whole: nothing was counted), so leaving was a way around
    `tokens_per_minute`. Its engine's work is estimated from the time it ran at the instance's measured speed
    (`Lease.produced`) and charged, on the direct path and for a de-duplication flight's JSON answer alike."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=5.0)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "default", "tokens_per_minute": 100_000, "requests_per_minute": 1000}],
    )
    async with http.post(gw.url + "/v1/chat/completions", json=chat(0, max_tokens=40, stream=True)) as resp:
        await resp.read()  # a stream first: the instance's time per token is measured
    generated = sim.statistics()["tokens_generated"]
    body = {**chat(1, max_tokens=3000), "temperature": temperature}
    left = asyncio.create_task(post(http, gw.url, body))
    async with asyncio.timeout(20):
        await sim.wait_until(lambda s: s.stats.tokens_generated >= generated + 200)  # it is generating
    [ex] = gw.gateway.registry.all()
    allowance = ex.allowance
    assert allowance is not None
    left.cancel()  # the client leaves before its whole answer
    with contextlib.suppress(asyncio.CancelledError):
        await left
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
        await gw.gateway.dedup.flights.wait_until(lambda: len(gw.gateway.dedup.flights) == 0)
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)
    made = sim.statistics()["tokens_generated"] - generated
    rows = await records(gw)
    assert [r["status"] for r in rows] == ["completed", "cancelled"] and rows[1]["completion_tokens"] == 0
    assert rows[1]["prompt_tokens"] == ex.api.estimated_prompt_tokens() > 0  # its record counts the prompt charged
    # What its allowance was settled with (the flight's and its leader's: the most): its prompt and about what the
    # engine made, where it was charged nothing.
    charged = allowance.reservation.used
    assert allowance.reservation.settled and 0.5 * made <= charged <= 1.5 * made + 50, (charged, made)
    assert_no_leaks(gw)


async def test_a_stream_its_client_left_in_its_prefill_is_charged_its_prompt(start_sim, start_gateway, http):
    """An outside run: streamed requests of 2,400-token prompts, each dropped in its prefill (no token yet), were
    charged nothing: ~19,000 prompt tokens a second processed under a limit of 50 a second. The engine prefilled
    them: a client that leaves after its prompt was sent is charged that prompt."""
    sim = await start_sim(**QUICK)
    sim.control.hold = True  # (sent, never answered: in its prefill, as the engine sees it)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "default", "tokens_per_minute": 100_000, "requests_per_minute": 1000}],
    )
    prompt = "word " * 2000  # ~2,500 tokens at the gateway's estimate
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "stream": True}
    left = asyncio.create_task(post(http, gw.url, body))
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.requests_started == 1)
    [ex] = gw.gateway.registry.all()
    allowance = ex.allowance
    assert allowance is not None
    estimate = ex.api.estimated_prompt_tokens()
    left.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await left
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
    [row] = await records(gw)
    assert (row["status"], row["cancel_reason"], row["completion_tokens"]) == ("cancelled", "client_disconnect", 0)
    assert allowance.reservation.settled and allowance.reservation.used == estimate > 2000
    # Its usage record counts the prompt it was charged (an outside run: a 12,000-token prompt left in its prefill was
    # charged, and its record said 0 prompt tokens).
    assert row["prompt_tokens"] == estimate
    assert_no_leaks(gw)


async def test_a_reservation_counts_every_choice(start_sim, start_gateway, http):
    """`max_tokens` bounds each of `n` choices (and of a completion's `best_of`): the reservation is n times it,
    so a request that may use more than the tenant's tokens per minute is refused before any engine runs it."""
    sim = await start_sim(**QUICK)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "default", "tokens_per_minute": 600, "requests_per_minute": 1000}],
    )

    async def complete(**extra: Any) -> tuple[int, Any, bytes]:
        body = {"model": "m", "prompt": "hi", "max_tokens": 100, **extra}
        async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body)) as resp:
            return resp.status, resp.headers.copy(), await resp.read()

    # A batched prompt (strings or token-id lists) is a generation for each: 8 x 100 as well.
    for extra in ({"n": 8}, {"best_of": 8}, {"prompt": ["h"] * 8}, {"prompt": [[1, 2]] * 8}):
        status, headers, raw = await complete(**extra)
        assert status == 429, raw
        error = orjson.loads(raw)["error"]
        assert error["code"] == "tokens_exceed_limit", error
        assert 800 < int(error["message"].split("at least ")[1].split()[0]) < 820, error
        assert headers["x-should-retry"] == "false"
    assert sim.stats.requests_started == 0
    # One choice of the same size fits, and reserves a single max_tokens.
    status, headers, _ = await complete()
    assert status == 200 and int(headers["x-ratelimit-remaining-tokens"]) == 600 - 101


async def test_tenants_keys_models_and_request_limits(start_sim, start_gateway, http):
    sim = await start_sim(**QUICK)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}, {"name": "other", "instances": [instance(sim)]}],
        tenants=[
            {"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 2, "models": ["m"]},
            {"name": "zed", "keys": [hash_key("sk-zed")], "max_concurrent": 1},
        ],
    )
    # 401 before anything else: even a malformed body is not looked at.
    async with http.post(gw.url + "/v1/chat/completions", data=b"{oops") as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == 'Bearer realm="lockgate"'  # RFC 9110
        assert (await resp.json())["error"]["type"] == "authentication_error"
    status, _, raw = await post(http, gw.url, chat(), Authorization="Bearer sk-wrong")
    assert status == 401 and "sk-wrong" not in raw.decode()
    auth = {"Authorization": "Bearer sk-acme"}
    status, headers, _ = await post(http, gw.url, chat(), **auth)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1"
    status, _, _ = await post(http, gw.url, {**chat(), "model": "other"}, **auth)
    assert status == 404  # not this tenant's model
    status, _, _ = await post(http, gw.url, chat(), **auth)
    assert status == 200
    status, headers, raw = await post(http, gw.url, chat(), **auth)
    assert status == 429 and orjson.loads(raw)["error"]["type"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 30
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in headers
    # zed may hold one request at a time.
    sim.control.hold = True
    zed = {"Authorization": "Bearer sk-zed"}
    first = asyncio.create_task(post(http, gw.url, chat(), **zed))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    status, _, raw = await post(http, gw.url, chat(), **zed)
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "concurrency_limit_exceeded"
    sim.control.hold = False
    sim.release()
    assert (await first)[0] == 200
    rows = await records(gw)
    assert {(r["tenant"], r["status"]) for r in rows} == {
        ("acme", "completed"),
        ("acme", "rejected"),
        ("zed", "completed"),
        ("zed", "rejected"),
    }
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_ratelimit_remaining_requests{tenant="acme"}' in metrics
    assert 'lockgate_rejections_total{priority="P1",reason="rate_limit_requests"} 1.0' in metrics
    assert_no_leaks(gw)


async def test_engine_receives_the_class_as_priority(start_gateway, serve_app, http):
    seen: list[Any] = []

    async def engine(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body.get("priority"))
        if body.get("stream"):  # preemptible (P2) requests are always streamed from the engine
            choice = {"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}
            chunk = orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})
            return web.Response(body=b"data: " + chunk + b"\n\ndata: [DONE]\n\n", content_type="text/event-stream")
        return web.json_response({"id": "x", "object": "chat.completion", "model": "m", "choices": [], "usage": None})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    app.router.add_get("/health", health)
    instances = [{"url": await serve_app(app), "engine": "vllm"}]
    quiet = await start_gateway([{"name": "m", "instances": instances}])
    status, _, _ = await post(http, quiet.url, chat(), **{"x-priority": "P2"})
    assert status == 200  # off by default: a FCFS vLLM rejects any non-zero priority
    # The engine's priority is the gateway's to give: a client's own (a P2 client jumping vLLM's queue) is dropped.
    status, _, _ = await post(http, quiet.url, {**chat(), "priority": -100}, **{"x-priority": "P2"})
    assert status == 200
    gw = await start_gateway([{"name": "m", "instances": instances}], scheduling={"engine_priority": True})
    for header in ("P0", "P2", None):
        extra = {"x-priority": header} if header else {}
        status, _, _ = await post(http, gw.url, {**chat(), "priority": -100}, **extra)
        assert status == 200
    status, _, raw = await post(http, gw.url, chat(), **{"x-priority": "bogus"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "x-priority"
    assert seen == [None, None, 0, 2, 1]
    # Nor to an engine without a priority of its own (a generic OpenAI-compatible server may read one).
    seen.clear()
    generic = await start_gateway(
        [{"name": "m", "instances": [{**instances[0], "engine": "openai"}]}], scheduling={"engine_priority": True}
    )
    status, _, _ = await post(http, generic.url, {**chat(), "priority": -100}, **{"x-priority": "P0"})
    assert status == 200 and seen == [None]


async def test_capacity_follows_the_routable_instances(start_sim, start_gateway, http):
    """An instance that goes unhealthy takes its slots out of the pool: a request then queues instead
    of being pushed onto the busy survivor beyond its max_concurrency; when it returns, it is granted."""
    a, b = await start_sim(**QUICK), await start_sim(**QUICK)
    a.control.hold = b.control.hold = True
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(a, max_concurrency=1), instance(b, max_concurrency=1)]}],
        scheduling=classes(),
    )
    fleet, sched = gw.gateway.fleet, gw.gateway.admission.schedulers["m"]
    b.control.update({"healthy": False})
    await fleet.probe_all()
    assert sched.core.capacity == 1
    first = asyncio.create_task(post(http, gw.url, chat(0)))
    async with asyncio.timeout(5):
        await a.wait_held(1)
    second = asyncio.create_task(post(http, gw.url, chat(1)))
    await until(sched, lambda core: core.queued_total == 1)
    assert a.stats.requests_started == 1 and b.stats.requests_started == 0
    b.control.update({"healthy": True})
    await fleet.probe_all()  # b is back: the pool grows and the queued request is granted, to b
    async with asyncio.timeout(5):
        await b.wait_held(1)
    assert sched.core.capacity == 2 and sched.core.queued_total == 0
    a.control.hold = b.control.hold = False
    a.release()
    b.release()
    async with asyncio.timeout(10):
        assert (await first)[0] == 200 and (await second)[0] == 200
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
    assert_no_leaks(gw)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_preemptible_class_answers_carry_rate_limit_headers(start_sim, start_gateway, http, stream):
    """A P2 request takes the resumable path; its answer still says how much of the tenant's allowance
    is left, like every admitted answer."""
    sim = await start_sim(**QUICK)
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "instances": [instance(sim)]}],
        tenants=[{"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 5}],
    )
    status, headers, _ = await post(
        http, gw.url, chat(stream=stream), Authorization="Bearer sk-acme", **{"x-priority": "P2"}
    )
    assert status == 200
    assert headers["x-ratelimit-limit-requests"] == "5" and headers["x-ratelimit-remaining-requests"] == "4"
    assert headers["x-lockgate-instance"]


async def test_a_request_refused_before_any_engine_costs_no_request(start_sim, start_gateway, http):
    """`requests_per_minute` counts requests that reached an engine (or were served): a full queue's 429 (which an
    SDK retries twice) used up the tenant's allowance, so a client of a busy gateway was then rate-limited too."""
    sim, gw, scheduler = await busy_pool(
        start_sim,
        start_gateway,
        scheduling=classes(p1_queue=0),
        tenants=[{"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 2}],
    )
    auth = {"Authorization": "Bearer sk-acme"}
    first = asyncio.create_task(post(http, gw.url, chat(1), **auth))
    await until(scheduler, lambda core: core.running_total == 1)
    for n in range(3):
        status, _, raw = await post(http, gw.url, chat(10 + n), **auth)
        assert status == 429 and orjson.loads(raw)["error"]["code"] == "queue_full"
    sim.control.hold = False
    sim.release()
    assert (await first)[0] == 200
    status, headers, _ = await post(http, gw.url, chat(2), **auth)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "0"
    status, _, raw = await post(http, gw.url, chat(3), **auth)
    assert status == 429 and orjson.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert_no_leaks(gw)


async def test_the_answer_says_the_priority_it_was_served_at(start_sim, start_gateway, http):
    """A tenant capped at P2 that asks for P0 is served at P2: its answer says so (`x-lockgate-priority`; a newcomer
    found the cap only in the usage records), as does an answer at the tenant's default class."""
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[
            {"name": "batch", "keys": [hash_key("b")], "max_priority": "P2"},
            {"name": "vip", "keys": [hash_key("v")], "max_priority": "P0"},
        ],
    )
    for key, asked, served in (("b", "P0", "P2"), ("v", "P0", "P0"), ("v", None, "P1")):
        headers = {"Authorization": f"Bearer {key}", **({"x-priority": asked} if asked else {})}
        async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(chat()), headers=headers) as resp:
            assert resp.status == 200 and resp.headers["x-lockgate-priority"] == served, (key, asked)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["resumable", "flight"])
async def test_a_preemptible_request_counts_on_its_instance_as_one_a_p0_may_stop(
    start_sim, start_gateway, http, temperature
):
    """Routing prices a P0 at a full instance as a step's wait only for the requests it can have stopped there
    (`InstanceView.stoppable`): a P2 request's engine call counts, on the resumable path and as a flight's leader; a
    P0's does not; none is left counted once they end."""
    sim = await start_sim(**QUICK)
    sim.control.hold = True
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    [engine] = gw.gateway.fleet.instances.values()
    batch = asyncio.create_task(post(http, gw.url, chat(1, temperature=temperature), **{"x-priority": "P2"}))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    urgent = asyncio.create_task(post(http, gw.url, chat(2, temperature=temperature), **{"x-priority": "P0"}))
    async with asyncio.timeout(5):
        await sim.wait_held(2)
    assert (engine.in_flight, engine.stoppable) == (2, 1)
    sim.control.hold = False
    sim.release()
    assert [(await batch)[0], (await urgent)[0]] == [200, 200]
    assert (engine.in_flight, engine.stoppable) == (0, 0)
