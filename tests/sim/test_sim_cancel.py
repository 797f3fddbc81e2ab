"""Client disconnects abort the request in the scheduler at once; fault-injection hooks work.

Every wait is on an event (``SimServer.wait_*``) bounded by ``asyncio.timeout``; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from lockgate.sim import SimServer

LONG = {"model": "m", "prompt": "a long story", "max_tokens": 5000}


def assert_clean(sim: SimServer) -> None:
    st = sim.statistics()
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == 0, st
    assert st["open_requests"] == []
    assert sim.engine is not None
    sim.engine.scheduler.kv.check_invariants()


async def test_disconnect_mid_stream_aborts(
    sim: SimServer, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    body = {**LONG, "stream": True}
    async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": "s1"}) as resp:
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()  # drop the connection mid-stream
    async with asyncio.timeout(5):
        rec = await sim.wait_ended("s1")
    assert rec["outcome"] == "aborted"
    assert 2 <= rec["completion_tokens"] < 100
    assert rec["tokens_after_disconnect"] <= 2
    st = sim.statistics()
    assert st["requests_aborted"] == 1 and st["tokens_after_disconnect"] <= 2
    assert st["abort_latencies_ms"]["count"] == 1
    assert_clean(sim)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_aborted_requests_tokens_are_in_the_engine_metrics(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """vLLM counts `prompt_tokens` and `generation_tokens` per step, an aborted request's too: an outside run found
    the simulator's counters leaving them out (its `/metrics` below its own `/sim/stats`, and below what a gateway
    delivered from it)."""
    body = {**LONG, "stream": True}
    async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": "a1"}) as resp:
        for _ in range(3):
            await resp.content.readuntil(b"\n\n")
        resp.close()
    async with asyncio.timeout(5):
        rec = await sim.wait_ended("a1")
    assert rec["outcome"] == "aborted" and rec["completion_tokens"] >= 3
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:")
    }
    st = sim.statistics()
    assert values["vllm:generation_tokens_total"] == st["tokens_generated"] == rec["completion_tokens"]
    assert values["vllm:prompt_tokens_total"] == st["prompt_tokens"] > 0


async def test_disconnect_while_held_before_first_token(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async def call() -> None:
        async with http.post(
            sim.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
            headers={"x-request-id": "h1", "x-sim-hold": "1"},
        ) as resp:
            await resp.read()

    task = asyncio.create_task(call())
    try:
        async with asyncio.timeout(5):
            await sim.wait_held(1)
        assert sim.statistics()["held"] == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with asyncio.timeout(5):
        rec = await sim.wait_ended("h1")
    assert rec["outcome"] == "aborted" and rec["completion_tokens"] == 0
    assert sim.statistics()["tokens_generated"] == 0
    assert_clean(sim)


async def test_release_lets_held_requests_run(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async def call(i: int) -> dict[str, Any]:
        body = {"model": "m", "prompt": "x", "max_tokens": 3}
        async with http.post(sim.url + "/v1/completions", json=body, headers={"x-sim-hold": "1"}) as resp:
            answer: dict[str, Any] = await resp.json()
            return answer

    tasks = [asyncio.create_task(call(i)) for i in range(3)]
    async with asyncio.timeout(5):
        # the HTTP long-poll works like the in-process waiter
        async with http.get(sim.url + "/sim/wait", params={"held": "3"}) as r:
            assert r.status == 200
        async with http.post(sim.url + "/sim/release") as r:
            assert (await r.json())["released"] == 3
        results = await asyncio.gather(*tasks)
    assert all(r["usage"]["completion_tokens"] == 3 for r in results)
    assert sim.statistics()["requests_finished"] == 3


async def test_non_streaming_disconnect_while_queued(
    make_sim: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(max_num_seqs=1)

    async def call(rid: str) -> None:
        async with http.post(sim.url + "/v1/completions", json=LONG, headers={"x-request-id": rid}) as resp:
            await resp.read()

    first = asyncio.create_task(call("running"))
    queued = asyncio.create_task(call("queued"))
    try:
        async with asyncio.timeout(5):
            await sim.wait_until(lambda s: s.engine is not None and s.engine.scheduler.num_waiting == 1)
            assert sim.engine is not None and sim.engine.scheduler.num_running == 1
            queued.cancel()
            rec = await sim.wait_ended("queued")
        assert rec["outcome"] == "aborted" and rec["completion_tokens"] == 0
        assert sim.engine.scheduler.num_waiting == 0
        # the running non-streaming request aborts too, while it is generating
        first.cancel()
        async with asyncio.timeout(5):
            rec = await sim.wait_ended("running")
        assert rec["outcome"] == "aborted" and 0 < rec["completion_tokens"] < 5000
        assert rec["tokens_after_disconnect"] <= 2
    finally:
        for t in (first, queued):
            t.cancel()
        await asyncio.gather(first, queued, return_exceptions=True)
    assert sim.statistics()["requests_aborted"] == 2
    assert_clean(sim)


async def test_disconnect_during_long_prefill(
    make_sim: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(prefill_tps=2000.0, max_num_batched_tokens=64)  # 1000-token prompt: ~0.5 s of prefill
    body = {"model": "m", "prompt": " ".join(["w"] * 1000), "max_tokens": 4}
    task = asyncio.create_task(http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": "p"}))
    try:
        async with asyncio.timeout(5):
            await sim.wait_until(lambda s: s.engine is not None and s.engine.scheduler.num_running == 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    async with asyncio.timeout(5):
        rec = await sim.wait_ended("p")
    assert rec["outcome"] == "aborted" and rec["completion_tokens"] == 0
    assert_clean(sim)


async def test_reset_after_tokens_header(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {**LONG, "stream": True}
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            sim.url + "/v1/completions", json=body, headers={"x-sim-reset-after-tokens": "3", "x-request-id": "r"}
        ) as resp:
            async for chunk in resp.content.iter_any():
                got += chunk
    assert got.count(b"data: ") == 3 and b"[DONE]" not in got
    rec = sim.stats.find("r")
    assert rec is not None and rec.outcome == "reset"
    # non-streaming: the connection drops before any answer
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with http.post(sim.url + "/v1/completions", json=LONG, headers={"x-sim-reset-after-tokens": "2"}) as r:
            await r.read()
    assert sim.statistics()["requests_reset"] == 2
    assert_clean(sim)


async def test_status_header_and_reset_probability(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/completions", json=LONG, headers={"x-sim-status": "503"}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == 503
    async with http.post(sim.url + "/sim/control", json={"reset_prob": 1.0}) as r:
        assert r.status == 200
    with pytest.raises(aiohttp.ClientError):
        async with http.post(sim.url + "/v1/completions", json={**LONG, "max_tokens": 5}) as r:
            await r.read()
    st = sim.statistics()
    assert st["requests_failed"] == 1 and st["requests_reset"] == 1
    assert_clean(sim)


async def test_shutdown_with_requests_in_flight_is_clean(
    make_sim: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    task = asyncio.create_task(http.post(sim.url + "/v1/completions", json=LONG, headers={"x-request-id": "z"}))
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.engine is not None and s.engine.scheduler.num_running == 1)
        await sim.aclose()
        await sim.aclose()  # idempotent
    await asyncio.gather(task, return_exceptions=True)
    rec = sim.stats.find("z")
    assert rec is not None and rec.outcome == "aborted"
    assert_clean(sim)


async def test_many_disconnects_under_load_leave_nothing_behind(
    make_sim: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(max_num_seqs=8, num_kv_blocks=64, block_size=4)
    body = {"model": "m", "prompt": " ".join(["x"] * 30), "max_tokens": 200, "stream": True}

    async def call(i: int) -> None:
        async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": f"L{i}"}) as resp:
            for _ in range(i % 3 + 1):
                await resp.content.readuntil(b"\n\n")
            resp.close()

    async def queued(i: int) -> None:
        async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": f"Q{i}"}) as resp:
            await resp.read()

    waiting = [asyncio.create_task(queued(i)) for i in range(4)]
    try:
        await asyncio.gather(*(call(i) for i in range(12)))
    finally:
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: not s.stats.open)
    st = sim.statistics()
    assert st["requests_aborted"] == 16 and st["tokens_after_disconnect"] <= 16, {
        k: v for k, v in st.items() if k != "requests_seen"
    }
    assert_clean(sim)
