"""The dashboard's routes on a real gateway in front of simulators: the page and its files, the SSE feed of
snapshots, and how a feed ends (client gone, shutdown, a client that does not read). The browser test is in
test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.server import GatewayServer
from tests.conftest import instance

FAST = {"interval_ms": 100}


async def _gateway(start_sim: Any, start_gateway: Any, *, count: int = 2, **dashboard: Any) -> GatewayServer:
    sims = [await start_sim(tpot_ms=0.0, prefill_tps=1e6) for _ in range(count)]
    server: GatewayServer = await start_gateway(
        [{"name": "m", "instances": [instance(s, name=f"e{i}") for i, s in enumerate(sims)]}],
        dashboard={**FAST, **dashboard},
    )
    return server


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """(event name, parsed data) for each SSE event of the response."""
    name, data = "message", b""
    async for line in response.content:
        line = line.rstrip(b"\r\n")
        if not line:
            yield name, orjson.loads(data)
            name, data = "message", b""
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data += line[5:].strip()


async def _until(events: AsyncIterator[tuple[str, Any]], ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    async with asyncio.timeout(10):  # bounds a failure only: snapshots come every 100 ms
        async for name, snap in events:
            if name == "snapshot" and ok(snap):
                return dict(snap)
    raise AssertionError("the stream ended first")


async def test_the_page_and_its_files_have_their_types_and_cache_headers(start_sim, start_gateway) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1)
    async with aiohttp.ClientSession(gw.url) as http:
        async with http.get("/dashboard") as r:
            page = await r.text()
            assert r.status == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
            assert r.headers["Cache-Control"] == "no-cache"
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            etag = r.headers["ETag"]
        async with http.get("/dashboard", headers={"If-None-Match": etag}) as r:
            assert r.status == 304 and await r.read() == b""
        async with http.head("/dashboard") as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) == len(page.encode())
        urls = re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page)
        assert sorted(u.split("?")[0] for u in urls) == ["/dashboard/static/app.css", "/dashboard/static/app.js"]
        for url in urls:
            async with http.get(url) as r:
                body = await r.read()
                kind = "text/javascript" if url.split("?")[0].endswith(".js") else "text/css"
                assert r.status == 200 and r.headers["Content-Type"] == f"{kind}; charset=utf-8" and body
                assert r.headers["Cache-Control"] == "public, max-age=31536000, immutable"  # a versioned URL
            async with http.get(url.split("?")[0]) as r:
                assert r.status == 200 and r.headers["Cache-Control"] == "no-cache" and await r.read() == body
        for missing in ("/dashboard/static/nope.js", "/dashboard/static/../../config.py", "/dashboard/static/"):
            async with http.get(missing) as r:
                assert r.status == 404
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post("/dashboard/events") as r:
            assert r.status == 405
        # Every response carries an x-request-id (the client's own if it sent one), the stream's too.
        for path in ("/dashboard", urls[0], "/dashboard/static/nope.js", "/dashboard/events"):
            async with http.get(path, headers={"x-request-id": "mine"}) as r:
                assert r.headers["x-request-id"] == "mine", path


async def test_the_feed_sends_the_fleet_at_once_then_reflects_traffic(start_sim, start_gateway) -> None:
    gw = await _gateway(start_sim, start_gateway)
    async with aiohttp.ClientSession(gw.url) as http, http.get("/dashboard/events") as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert r.headers["Cache-Control"] == "no-store"
        events = _events(r)
        name, first = await anext(events)
        assert name == "snapshot" and first["history"]["full"] is True
        assert [i["name"] for i in first["instances"]] == ["e0", "e1"]
        assert all(i["status"] == "healthy" and i["models"] == ["m"] for i in first["instances"])
        assert [c["name"] for c in first["pools"][0]["classes"]] == ["P0", "P1", "P2"]
        assert first["slo"] is None and first["requests"] == {"total": 0, "shown": []}

        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
        for _ in range(3):  # identical and deterministic: the first leads, the others hit the result cache
            async with http.post("/v1/chat/completions", json=body) as done:
                assert done.status == 200
        fields = first["history"]["fields"]

        def reflected(s: dict[str, Any]) -> bool:
            rows = [dict(zip(fields, row, strict=True)) for row in s["history"]["rows"]]
            return s["finished"].get("completed") == 3 and any(row["rps"] > 0 for row in rows)

        snap = await _until(events, reflected)
        assert snap["history"]["full"] is False
        assert snap["dedup"]["outcomes"]["miss"] == 1 and snap["dedup"]["outcomes"]["hit"] == 2
        assert snap["dedup"]["hit_ratio"] == pytest.approx(2 / 3, abs=1e-3)


async def test_requests_in_flight_and_the_slo_provider_appear_in_snapshots(start_sim, start_gateway) -> None:
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], dashboard=FAST)
    assert gw.gateway is not None
    objectives = {"objectives": [{"name": "p0-success", "status": "met", "budget_remaining": 0.9, "windows": {}}]}
    gw.gateway.slo_provider = lambda: objectives
    body = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 5}
    sim.control.hold_next = 1
    async with aiohttp.ClientSession(gw.url) as http, http.get("/dashboard/events") as r:
        events = _events(r)

        async def post() -> bytes:
            async with http.post("/v1/chat/completions", json=body) as held:
                return await held.read()

        held = asyncio.ensure_future(post())
        snap = await _until(events, lambda s: s["requests"]["total"] == 1)
        [shown] = snap["requests"]["shown"]
        assert shown["model"] == "m" and shown["priority"] == "P1"
        assert snap["slo"] == objectives
        async with http.delete(f"/admin/requests/{shown['id']}") as cancel:
            assert (await cancel.json())["cancelled"] is True
        assert b"cancelled by an administrator" in await held

        def broken() -> dict[str, Any]:
            raise RuntimeError("no usage database")

        gw.gateway.slo_provider = broken
        snap = await _until(events, lambda s: s["slo_error"] is not None)
        assert snap["slo"] is None and "no usage database" in snap["slo_error"]
        assert snap["cancellations"] == {"admin": 1.0}


async def test_a_dashboard_that_goes_away_leaves_the_feed(start_sim, start_gateway) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1)
    assert gw.gateway is not None and gw.gateway.dashboard is not None
    feed = gw.gateway.dashboard.feed
    async with aiohttp.ClientSession(gw.url) as http, http.get("/dashboard/events") as r:
        await anext(_events(r))
        assert feed.clients == 1
    async with asyncio.timeout(10):
        await feed.wait_idle()
    built = feed.events_built
    feed.tick()
    assert feed.events_built == built  # nobody watching: no snapshot is built
    stats = feed.statistics()
    assert stats["clients"] == 0 and stats["history_capacity"] == 3600  # 600 s at 100 ms is 6,000: capped
    assert 1 <= stats["history_samples"] <= stats["history_capacity"]


async def test_open_dashboards_end_at_shutdown_without_holding_it(start_sim, start_gateway, caplog) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1)
    caplog.set_level(logging.WARNING, logger="lockgate.edge.server")
    async with aiohttp.ClientSession(gw.url) as http, http.get("/dashboard/events") as r:
        events = _events(r)
        await anext(events)
        shutdown = asyncio.ensure_future(gw.shutdown(drain_s=30))
        names = [name async for name, _ in events]  # the stream ends (EOF) without the client doing anything
        assert names[-1] == "end"
        async with asyncio.timeout(10):
            await shutdown
    # The HTTP server did not have to abort a connection at its deadline: the stream ended on its own.
    assert "aborting" not in caplog.text


async def test_more_dashboards_than_allowed_get_503(start_sim, start_gateway) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1, max_clients=1)
    async with aiohttp.ClientSession(gw.url) as http, http.get("/dashboard/events") as first:
        await anext(_events(first))
        async with http.get("/dashboard/events") as second:
            assert second.status == 503 and "Retry-After" in second.headers
            assert second.headers["x-request-id"].startswith("lg-")
            error = (await second.json())["error"]
            assert error["code"] == "too_many_dashboards" and "max_clients" in error["message"]


async def test_a_dashboard_that_does_not_read_costs_at_most_one_event_beyond_the_transport_buffer(
    start_sim, start_gateway
) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1)
    assert gw.gateway is not None and gw.gateway.dashboard is not None
    feed = gw.gateway.dashboard.feed
    event = b"event: snapshot\ndata: " + b"x" * 1_000_000 + b"\n\n"
    feed._render = lambda samples, full: event  # big events fill the buffers toward the client quickly
    host, port = gw.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")
        with feed.subscribe() as ticks:  # type: ignore[union-attr]  # an in-process watcher: wakes on each tick
            async with asyncio.timeout(20):  # bounds a failure only
                while feed.events_skipped < 3:
                    await ticks.next()
        [connection] = gw._http.live  # type: ignore[union-attr]
        high_water = connection.transport.get_write_buffer_limits()[1]
        assert connection.transport.get_write_buffer_size() <= high_water + len(event) + 64
    async with asyncio.timeout(10):
        await feed.wait_idle()


async def test_the_dashboard_can_be_turned_off(start_sim, start_gateway) -> None:
    gw = await _gateway(start_sim, start_gateway, count=1, enabled=False)
    assert gw.gateway is not None and gw.gateway.dashboard is None
    async with aiohttp.ClientSession(gw.url) as http:
        for path in ("/dashboard", "/dashboard/events", "/dashboard/static/app.js"):
            async with http.get(path) as r:
                assert r.status == 404
