"""The failure knob: `SimServer.fail()` and `SimConfig.fail_after_s` crash the engine mid-run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from lockgate.sim import SimServer

STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True}


async def test_fail_breaks_streams_in_flight_then_answers_503(
    make_sim: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(tpot_ms=20.0)
    async with http.post(sim.url + "/v1/chat/completions", json=STREAM) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        assert sim.fail() == 1
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # the connection is reset: no [DONE]
    async with http.get(sim.url + "/health") as health:
        assert health.status == 503
    async with http.post(sim.url + "/v1/chat/completions", json={**STREAM, "stream": False}) as again:
        assert again.status == 503
        assert (await again.json())["error"]["message"]
    assert sim.statistics()["running"] == 0 and sim.failed


async def test_fail_after_s_crashes_on_its_own(make_sim: Callable[..., Awaitable[SimServer]]) -> None:
    sim = await make_sim(fail_after_s=0.05)
    async with asyncio.timeout(10):
        await sim.wait_until(lambda s: s.failed)
    assert sim.control.fail_status == 503 and not sim.control.healthy


def test_fail_after_s_must_not_be_negative() -> None:
    from lockgate.sim import SimConfig

    with pytest.raises(ValueError, match="fail_after_s"):
        SimConfig(fail_after_s=-1.0)
