"""Every phase x every cause of an early end: the engine's connection closes, nothing leaks, one honest record.

Phases: before the first byte (the engine holds the request in prefill), mid-stream, non-streaming (the
engine is generating). Causes: client disconnect, deadline, admin cancel, shutdown. Every wait is on an
event bounded by `asyncio.timeout`; the deadline is made to expire "now" by rescheduling the request's
own `asyncio.Timeout` (the real mechanism, without a race against the clock).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.exchange import Exchange
from lockgate.records import read_records
from lockgate.server import GatewayServer
from lockgate.sim import SimServer
from tests.conftest import instance
from tests.integration.cancel_support import (
    StreamReader,
    assert_gateway_clean,
    body,
    cancel_and_wait,
    counter,
    total,
    wait_sim_idle,
)

SIM = {"prefill_tps": 1e6, "tpot_ms": 2.0}
PHASES = ["prefill_stream", "prefill_whole", "mid_stream", "whole"]
CAUSES = ["client_disconnect", "timeout", "admin", "shutdown"]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def _only_exchange(gw: GatewayServer) -> Exchange:
    assert gw.gateway is not None
    exchanges = gw.gateway.registry.all()
    assert len(exchanges) == 1
    return exchanges[0]


async def _trigger(cause: str, ex: Exchange, gw: GatewayServer, http: aiohttp.ClientSession) -> None:
    if cause == "timeout":
        assert ex.timeout is not None
        ex.timeout.reschedule(asyncio.get_running_loop().time())
    elif cause == "admin":
        async with http.get(f"{gw.url}/admin/requests") as resp:
            [listed] = (await resp.json())["requests"]
        assert listed["id"] == ex.id and listed["model"] == "m" and listed["instance"]
        assert listed["client_request_id"] == "client-7"  # how an operator finds a client's request
        assert listed["phase"] == ("streaming" if ex.response is not None else "connecting")
        assert listed["age_ms"] >= 0 and listed["completion_tokens"] >= (3 if ex.response is not None else 0)
        async with http.delete(f"{gw.url}/admin/requests/{ex.id}") as resp:
            assert resp.status == 200 and (await resp.json())["cancelled"] is True
        async with http.delete(f"{gw.url}/admin/requests/lg-unknown") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    elif cause == "shutdown":
        await gw.shutdown(drain_s=0)
    else:  # pragma: no cover
        raise AssertionError(cause)


EXPECTED = {  # cause -> (HTTP status before any byte, error type, error code)
    "timeout": (504, "timeout", "deadline_exceeded"),
    "admin": (503, "cancelled", "cancelled"),
    "shutdown": (503, "cancelled", "cancelled"),
}


@pytest.mark.parametrize("cause", CAUSES)
@pytest.mark.parametrize("phase", PHASES)
async def test_cancel_matrix(phase: str, cause: str, start_sim, start_gateway, http, tmp_path) -> None:
    sim: SimServer = await start_sim(**SIM)
    gw: GatewayServer = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    assert gw.gateway is not None
    gateway = gw.gateway
    stream = phase in ("prefill_stream", "mid_stream")
    if phase.startswith("prefill"):
        sim.control.hold_next = 1
    reader: StreamReader | None = None
    outcome: dict[str, Any] = {}
    headers = {"x-lockgate-timeout-ms": "60000", "x-request-id": "client-7"}

    async def client() -> None:
        nonlocal reader
        async with http.post(gw.url + "/v1/chat/completions", json=body(stream), headers=headers) as resp:
            outcome["status"] = resp.status
            outcome["headers"] = resp.headers.copy()
            if resp.status == 200 and stream:
                reader = StreamReader(resp)
                if phase == "mid_stream":
                    await reader.read_tokens(3)
                    reached.set()
                    await mid.wait()
                    if cause == "client_disconnect":
                        resp.close()
                        return
                await reader.read_to_end()
            else:
                outcome["body"] = await resp.read()

    mid, reached = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(client())
    try:
        async with asyncio.timeout(5):
            # Bring the request to its phase.
            if phase.startswith("prefill"):
                await sim.wait_held(1)
            elif phase == "mid_stream":
                waiter = asyncio.create_task(reached.wait())
                await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if task.done():
                    task.result()  # surface the client's failure
            else:
                await sim.wait_until(lambda s: any(r.completion_tokens >= 2 for r in s.stats.open.values()))
            ex = await _only_exchange(gw)
            request_id = ex.id
            assert not task.done()
            # End it.
            if cause == "client_disconnect":
                if phase == "mid_stream":
                    mid.set()
                    await task
                else:
                    await cancel_and_wait(task)
            else:
                mid.set()
                trigger = asyncio.create_task(_trigger(cause, ex, gw, http))
                await task
                await trigger
            # The engine saw its connection closed, and nothing more is generated.
            rec = await sim.wait_ended(request_id)
            assert rec["outcome"] == "aborted", rec
            assert rec["tokens_after_disconnect"] <= 1, rec
            await wait_sim_idle(sim)
            await gateway.registry.wait_empty()
            if cause != "shutdown":
                await gateway.records.wait_flushed()
    finally:
        if not task.done():
            await cancel_and_wait(task)
    assert_gateway_clean(gateway)
    assert counter(gateway.metrics.cancellations, reason=cause) == 1
    assert sum(counter(gateway.metrics.cancellations, reason=r) for r in CAUSES) == 1
    # The disconnect-to-upstream-closed histogram saw this abort.
    assert total(gateway.metrics.abort_latency, "_count") == 1

    # What the client got.
    if cause != "client_disconnect":
        status, type_, code = EXPECTED[cause]
        if phase == "mid_stream":
            assert outcome["status"] == 200 and reader is not None
            assert not reader.done, "a cancelled stream must never end with [DONE]"
            errors = reader.errors()
            assert len(errors) == 1 and errors[0]["type"] == type_ and errors[0]["code"] == code
        else:
            assert outcome["status"] == status, outcome
            error = orjson.loads(outcome["body"])["error"]
            assert error["type"] == type_ and error["code"] == code
            if cause == "shutdown":
                assert "shutting down" in error["message"]
                assert int(outcome["headers"]["Retry-After"]) >= 1
            # An operator's cancel is final: the OpenAI SDKs retry a 503 (twice, by default) unless told not to.
            assert outcome["headers"].get("x-should-retry") == ("false" if cause == "admin" else None)

    # One record, with the right status, reason and delivered tokens.
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["request_id"] == request_id
    assert row["status"] == "cancelled" and row["cancel_reason"] == cause
    assert row["stream"] == stream
    if phase == "mid_stream":
        assert reader is not None
        if cause == "client_disconnect":
            # Written to the socket >= read by the client; never more than the engine generated.
            assert reader.tokens <= row["completion_tokens"] <= rec["completion_tokens"]
        else:
            assert row["completion_tokens"] == reader.tokens >= 3
        # The engine never reported the prompt's length (its usage chunk comes last): output was delivered, so
        # the prompt is counted at the gateway's estimate, not as 0.
        assert row["prompt_tokens"] > 0
    elif cause in ("client_disconnect", "timeout"):
        # Nothing delivered, but the engine had the prompt: a client that left (or whose deadline passed) once it was
        # sent is charged it, and its record counts it (an outside run: a record of 0 prompt tokens where the
        # tenant was charged 12,000).
        assert row["completion_tokens"] == 0 and row["prompt_tokens"] > 0
    else:
        assert row["completion_tokens"] == 0 and row["prompt_tokens"] == 0  # the gateway's choice: nothing charged
        assert row["first_token_at"] is None


async def test_real_deadline_header_before_first_byte(start_sim, start_gateway, http) -> None:
    """The `x-lockgate-timeout-ms` header, end to end, with a held engine: 504 and an aborted upstream."""
    sim = await start_sim(**SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    assert gw.gateway is not None
    sim.control.hold_next = 1
    async with asyncio.timeout(5):
        async with http.post(
            gw.url + "/v1/chat/completions", json=body(True), headers={"x-lockgate-timeout-ms": "50"}
        ) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["type"] == "timeout"
        await wait_sim_idle(sim)
        await gw.gateway.records.wait_flushed()
    assert sim.statistics()["requests_aborted"] == 1
    assert_gateway_clean(gw.gateway)
    assert counter(gw.gateway.metrics.cancellations, reason="timeout") == 1


# The queued phase (lockgate's own scheduler) is covered in test_priority.py: disconnect, deadline and
# admin in `test_leaving_while_queued_frees_the_place_at_once`, shutdown in `test_shutdown_answers_queued_at_once`.
