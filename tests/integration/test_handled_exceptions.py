"""No exception outlives its handler: after a request is cancelled, the thread's "exception being handled"
(`sys.exception()`) is empty again.

A mypyc-compiled coroutine that awaited inside a `finally` or `except` block while a cancellation unwound
through it left that `CancelledError` as the thread's handled exception for good; every later exception in
the process then chained it (and the ones before it) as its `__context__`, and after a 502 the compiled
build answered the next request 500. The pure build passes this test trivially; `make test-compiled` runs it
against the compiled modules (and `tests/unit/test_compiled_modules.py` keeps such awaits out of them).
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp

from tests.conftest import instance
from tests.integration.cancel_support import StreamReader, assert_gateway_clean, body, wait_sim_idle


async def _handled_in_a_new_task() -> BaseException | None:
    async def look() -> BaseException | None:
        return sys.exception()

    return await asyncio.get_running_loop().create_task(look())


async def test_cancelled_requests_leave_no_exception_being_handled(start_sim, start_gateway) -> None:
    sim = await start_sim(prefill_tps=1e6, tpot_ms=5.0)
    gw = await start_gateway([{"name": "m", "dedup": "off", "retries": 0, "instances": [instance(sim)]}])
    assert gw.gateway is not None
    assert await _handled_in_a_new_task() is None
    async with aiohttp.ClientSession() as http, asyncio.timeout(20):
        # A stream the client leaves after its first event (cancellation through the direct path's stream).
        async with http.post(gw.url + "/v1/chat/completions", json=body(True, max_tokens=200)) as resp:
            assert resp.status == 200
            reader = StreamReader(resp)
            await reader.read_tokens(1)
            resp.close()
        await gw.gateway.registry.wait_empty()
        # A whole answer cut by its deadline while the engine generates (cancellation of a non-streaming read).
        async with http.post(
            gw.url + "/v1/chat/completions",
            json=body(False, max_tokens=200),
            headers={"x-lockgate-timeout-ms": "100"},
        ) as resp:
            assert resp.status == 504
        await gw.gateway.registry.wait_empty()
        await wait_sim_idle(sim)
    assert await _handled_in_a_new_task() is None
    assert_gateway_clean(gw.gateway)
