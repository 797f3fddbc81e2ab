"""Memory bounds through the gateway: buffers a client or an engine could otherwise grow without limit.

Each test provokes one buffer (a shared stream whose client stops reading, a late joiner past a flight's
history, an answer the client never takes, oversized engine answers) and asserts the bound by the gateway's
own statistics or by what the client receives, never by RSS and never by time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean, wait_sim_idle

DETERMINISTIC = {"model": "m", "messages": [{"role": "user", "content": "a long story"}], "temperature": 0}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@contextlib.asynccontextmanager
async def silent_client(url: str, body: dict[str, Any]) -> AsyncIterator[socket.socket]:
    """A raw-socket client that sends `body` and never reads the answer (a tiny receive buffer)."""
    payload = orjson.dumps(body)
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
        await loop.sock_sendall(sock, head.encode() + payload)
        yield sock


async def test_a_shared_stream_whose_only_client_stops_reading_stays_within_its_bound(start_sim, start_gateway):
    """The flight stops reading the engine while its client is `flights.max_lag_bytes` behind; past
    `max_history_bytes` it keeps only what is unread. The write timeout (60 s) is not what bounds it."""
    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6, max_model_len=70_000)
    lag, history = 64 * 1024, 256 * 1024
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}], flights={"max_lag_bytes": lag, "max_history_bytes": history}
    )
    assert gw.gateway is not None
    flights = gw.gateway.dedup.flights
    async with silent_client(gw.url, {**DETERMINISTIC, "max_tokens": 60_000, "stream": True}):
        async with asyncio.timeout(30):
            await flights.wait_until(lambda: any(f.waiting_for_readers for f in flights.all()))
        [flight] = flights.all()
        stats = flight.statistics()
        assert stats["buffered_bytes"] <= lag + 4096, stats
        assert stats["lag_bytes"] <= lag + 4096, stats
        # What the client's socket buffers took is not kept: the flight read a bounded part of the answer.
        assert not stats["joinable"] and stats["events_total"] < 50_000, stats
        assert sim.statistics()["requests_finished"] == 0
    # The client left: its flight and the engine call end.
    async with asyncio.timeout(30):
        await flights.wait_until(lambda: len(flights) == 0)
        await wait_sim_idle(sim)
        await gw.gateway.registry.wait_empty()
    assert sim.statistics()["requests_aborted"] == 1
    assert_gateway_clean(gw.gateway)


async def test_a_late_joiner_past_the_history_bound_gets_its_own_engine_call(start_sim, start_gateway, http):
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], flights={"max_history_bytes": 4096})
    assert gw.gateway is not None
    body = {**DETERMINISTIC, "max_tokens": 300, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as first:
        assert first.headers["x-lockgate-cache"] == "miss"
        for _ in range(40):  # ~40 events: well past 4 KiB of history
            await first.content.readuntil(b"\n\n")
        [flight] = gw.gateway.dedup.flights.all()
        assert not flight.joinable
        async with http.post(gw.url + "/v1/chat/completions", json=body) as second:
            assert second.headers["x-lockgate-cache"] == "miss"  # not "coalesced": a flight of its own
            assert sim.statistics()["requests_started"] == 2
            late = await second.read()
        rest = await first.read()
    assert rest.endswith(b"data: [DONE]\n\n") and late.endswith(b"data: [DONE]\n\n")
    assert late.count(b'"finish_reason":"length"') == 1
    # Neither flight kept its whole history: neither result is cached.
    cache = gw.gateway.dedup.cache.statistics()
    assert cache["entries"] == 0, cache
    assert gw.gateway.dedup.flights.statistics()["closed_to_joiners"] == 2


async def test_an_answer_the_client_never_reads_is_recorded_as_cancelled_with_nothing_delivered(
    start_gateway, serve_app, tmp_path, monkeypatch
):
    """A large non-streaming answer whose client never takes the body: closed after the write timeout, and
    its record says so (not `completed` with every token delivered)."""
    content = "word " * 1_600_000  # 8 MB: more than the socket buffers between the gateway and the client

    async def engine(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1_600_000, "total_tokens": 1_600_003},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    url = await serve_app(app)
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "instances": [{"url": url, "engine": "vllm"}]}],
        limits={"write_timeout_ms": 100},
    )
    assert gw.gateway is not None
    records = gw.gateway.records
    submitted = asyncio.Event()
    submit = records.submit

    def watched_submit(record: Any) -> None:
        submit(record)
        submitted.set()

    monkeypatch.setattr(records, "submit", watched_submit)
    async with silent_client(gw.url, {**DETERMINISTIC, "max_tokens": 1_600_000}):
        async with asyncio.timeout(30):  # bounds a failure only: the write timeout ends the wait
            await submitted.wait()
    await records.wait_flushed()
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "client_disconnect")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 0)
    assert_gateway_clean(gw.gateway)
