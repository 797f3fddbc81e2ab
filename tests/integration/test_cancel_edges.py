"""Edges of ending a request: upstream failure mid-stream, two causes at once, records that must not drop."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from lockgate import awaitpoints
from lockgate.exchange import Exchange
from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.cancel_support import (
    StreamReader,
    assert_gateway_clean,
    body,
    counter,
    wait_sim_idle,
)

SIM = {"prefill_tps": 1e6, "tpot_ms": 1.0}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_upstream_reset_mid_stream_gives_sse_error_never_done_and_no_retry(
    start_sim, start_gateway, http, tmp_path
) -> None:
    # Two instances and a retry budget: a retry after the first byte would land on the healthy one.
    broken, healthy = await start_sim(**SIM), await start_sim(**SIM)
    gw = await start_gateway(
        [
            {
                "name": "m",
                "routing": "round_robin",
                "retries": 2,
                "instances": [instance(broken, name="broken"), instance(healthy, name="healthy")],
            }
        ]
    )
    assert gw.gateway is not None
    broken.control.reset_after_tokens = 4
    async with asyncio.timeout(5):
        async with http.post(gw.url + "/v1/chat/completions", json=body(True, max_tokens=50)) as resp:
            assert resp.status == 200 and resp.headers["x-lockgate-instance"] == "broken"
            reader = StreamReader(resp)
            await reader.read_to_end()
        await gw.gateway.records.wait_flushed()
    assert not reader.done, "a broken stream must never end with a fake [DONE]"
    errors = reader.errors()
    assert len(errors) == 1 and errors[0]["code"] == "upstream_protocol_error"
    # What broke it, not the client's exception class (a newcomer's run: "broke the stream: ProtocolError").
    assert errors[0]["message"].startswith("Instance broken broke the stream: connection lost during the response")
    assert reader.events[-1] == {"error": errors[0]}
    assert 1 <= reader.tokens <= 4
    assert healthy.statistics()["requests_started"] == 0, "no retry after the first byte"
    assert broken.statistics()["requests_reset"] == 1
    assert_gateway_clean(gw.gateway)
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "error" and row["cancel_reason"] is None
    assert row["completion_tokens"] == reader.tokens and row["http_status"] == 200 and row["attempts"] == 1


async def test_reset_before_first_byte_is_a_clean_502(start_sim, start_gateway, http) -> None:
    sim = await start_sim(**SIM)
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [instance(sim)]}])
    assert gw.gateway is not None
    sim.control.reset_after_tokens = 0
    async with asyncio.timeout(5):
        async with http.post(gw.url + "/v1/chat/completions", json=body(True, max_tokens=5)) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "upstream_protocol_error"
    assert_gateway_clean(gw.gateway)


async def test_second_cause_while_ending_does_not_relabel_or_write_twice(
    start_sim, start_gateway, http, tmp_path, stack
) -> None:
    """The deadline passes mid-stream; while its error event is being written an admin cancel arrives.
    The first cause wins: one error event (timeout), one record (timeout), one cancellation counted."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    refused: list[bool] = []

    async def write(name: str, data: object) -> None:
        if name == "StreamResponse.write" and isinstance(data, bytes) and b'"deadline_exceeded"' in data:
            for ex in gateway.registry.all():  # through the admin API's handler: it says it did not cancel
                refused.append(orjson.loads(gateway.admin.cancel(ex.id).body)["cancelled"])
            await asyncio.sleep(0)  # let a cancellation land here, if one was requested

    stack.enter_context(awaitpoints.installed(write))
    async with asyncio.timeout(5):
        headers = {"x-lockgate-timeout-ms": "60000"}
        async with http.post(gw.url + "/v1/chat/completions", json=body(True), headers=headers) as resp:
            reader = StreamReader(resp)
            await reader.read_tokens(2)
            [ex] = gateway.registry.all()
            assert isinstance(ex, Exchange) and ex.timeout is not None
            ex.timeout.reschedule(asyncio.get_running_loop().time())
            await reader.read_to_end()
        await wait_sim_idle(sim)
        await gateway.records.wait_flushed()
    assert refused == [False]
    assert [e["code"] for e in reader.errors()] == ["deadline_exceeded"] and not reader.done
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["cancel_reason"] == "timeout"
    assert counter(gateway.metrics.cancellations, reason="timeout") == 1
    assert counter(gateway.metrics.cancellations, reason="admin") == 0
    assert_gateway_clean(gateway)


async def test_shutdown_does_not_hang_on_a_client_that_never_reads(
    start_sim, start_gateway, http, tmp_path, monkeypatch, stack
) -> None:
    """The final SSE error event cannot be written (the client stopped reading): after a grace period the
    request is cut off, the process can exit, and its record is still written."""
    import lockgate.server

    monkeypatch.setattr(lockgate.server, "STOP_GRACE_S", 0.05)
    sim = await start_sim(prefill_tps=1e6, tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    stuck = asyncio.Event()

    async def write(name: str, data: object) -> None:
        if name == "StreamResponse.write" and isinstance(data, bytes) and b'"error"' in data:
            stuck.set()
            await asyncio.Event().wait()  # like a drain() that never returns

    stack.enter_context(awaitpoints.installed(write))
    async with asyncio.timeout(5):
        async with http.post(gw.url + "/v1/chat/completions", json=body(True)) as resp:
            reader = StreamReader(resp)
            await reader.read_tokens(2)
            await gw.shutdown(drain_s=0)
        assert stuck.is_set()
        await wait_sim_idle(sim)
    assert_gateway_clean(gateway)
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "cancelled" and row["cancel_reason"] == "shutdown"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_bug_inside_the_request_path_is_an_error_not_completed(
    stream, start_sim, start_gateway, http, tmp_path, monkeypatch, caplog
) -> None:
    # The bug is planted in a method of a Python class the writers call once a token has reached the client (a
    # stream) or the answer is ready (whole): module globals of `respond` would not do, the compiled build
    # (mypyc) binds those at compile time.
    from lockgate.exchange import Exchange

    sim = await start_sim(**SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    assert gw.gateway is not None
    original = Exchange.first_token

    def broken(self: Exchange) -> None:
        if len(sim.stats.seen) + len(sim.stats.open) >= 1:
            raise KeyError("a bug")
        original(self)

    monkeypatch.setattr(Exchange, "first_token", broken)
    async with asyncio.timeout(5):
        async with http.post(gw.url + "/v1/chat/completions", json=body(stream, max_tokens=5)) as resp:
            raw = await resp.read()
        await wait_sim_idle(sim)
        await gw.gateway.records.wait_flushed()
    if stream:
        assert resp.status == 200 and b"[DONE]" not in raw and b'"internal_error"' in raw
    else:
        assert resp.status == 500 and b'"internal_error"' in raw
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "error"
    assert_gateway_clean(gw.gateway)
    assert any("failed inside the gateway" in r.message for r in caplog.records)
