"""Memory bounds through the gateway: buffers a client or an engine could otherwise grow without limit.

Each test provokes one buffer (a shared stream whose client stops reading, a late joiner past a flight's
history, an answer the client never takes, oversized engine answers) and asserts the bound by the gateway's
own statistics or by what the client receives, never by RSS and never by time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.exchange import Exchange, Registry
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


# --- what an engine sends ----------------------------------------------------------------------------------


def chat_answer(content: str) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def upstream_error(raw: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_engine_answer_over_max_response_bytes_is_a_502(start_gateway, serve_app, http, framing):
    sent_all = asyncio.Event()

    async def engine(request: web.Request) -> web.StreamResponse:
        if framing == "content-length":
            return web.json_response(chat_answer("x" * 200_000))
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for _ in range(1000):  # 16 MB, if nobody stops it
                await response.write(b" " * 16384)
            sent_all.set()
        except ConnectionError:
            pass
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    url = await serve_app(app)
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "retries": 0, "instances": [{"url": url, "engine": "vllm"}]}],
        upstream={"max_response_bytes": 65536},
    )
    async with http.post(gw.url + "/v1/chat/completions", json={**DETERMINISTIC, "max_tokens": 5}) as resp:
        assert resp.status == 502
        error = upstream_error(await resp.read())
    assert error["code"] == "upstream_response_too_large" and "max_response_bytes" in error["message"]
    assert not sent_all.is_set()  # the gateway closed the connection instead of reading it all
    assert gw.gateway is not None
    assert_gateway_clean(gw.gateway)


@pytest.mark.parametrize("whole", [False, True], ids=["endless", "one-write"])
async def test_an_engine_event_over_max_event_bytes_is_a_502(start_gateway, serve_app, http, whole):
    """`endless`: an SSE line that never ends (no newline, ever): the gateway stops at `upstream.max_event_bytes`.
    `one-write`: a 100 KiB event that arrives whole (an outside run: such events passed, the bound held only for an
    event still incomplete after a read). Not tried on the other engine: its answer would cross the bound as well."""
    calls = 0

    async def engine(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            if whole:
                await response.write(b'data: {"choices": [], "x": "' + b"x" * 102400 + b'"}\n\n')
                await response.write(b"data: [DONE]\n\n")
                return response
            await response.write(b"data: ")
            for _ in range(1000):
                await response.write(b"x" * 16384)
        return response

    async def healthy(_: web.Request) -> web.Response:
        return web.Response()

    urls = []
    for _ in range(2):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", engine)
        app.router.add_get("/health", healthy)
        urls.append(await serve_app(app))
    instances = [{"url": url, "engine": "vllm"} for url in urls]
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "retries": 1, "instances": instances}], upstream={"max_event_bytes": 65536}
    )
    body = {**DETERMINISTIC, "max_tokens": 5, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 502
        error = upstream_error(await resp.read())
    assert error["code"] == "upstream_response_too_large" and "max_event_bytes" in error["message"]
    assert calls == 1


@pytest.mark.parametrize("whole", [False, True], ids=["endless", "one-write"])
async def test_an_engine_response_head_over_64_kib_is_a_502(start_gateway, stack, http, whole):
    """`endless`: a head that never ends; `one-write`: a 100 KiB head that arrives whole with its body (an outside run:
    the bound held only for a head still incomplete after a read, so heads up to ~127 KiB were served)."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            while not head.startswith(b"POST"):  # health checks and scrapes get a plain answer
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                head = await reader.readuntil(b"\r\n\r\n")
            await reader.readuntil(b"}")  # the body (JSON)
            if whole:
                body = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]}'
                big = b"X-Big: " + b"a" * (100 * 1024) + b"\r\n"
                writer.write(b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (big, len(body), body))
                await reader.read()  # until the gateway hangs up
            writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
            while True:  # until the gateway hangs up
                writer.write(b"a" * 16384)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "retries": 0, "instances": [{"url": url, "engine": "vllm"}]}]
    )
    async with asyncio.timeout(30):  # bounds a failure only
        async with http.post(gw.url + "/v1/chat/completions", json={**DETERMINISTIC, "max_tokens": 5}) as resp:
            assert resp.status == 502
            assert "head is larger than" in upstream_error(await resp.read())["message"]


@pytest.mark.parametrize("path", ["flight", "llamacpp", "llamacpp-flight"])
async def test_an_answer_assembled_from_a_stream_is_bounded_too(start_sim, start_gateway, http, path):
    """A non-streaming client gets a 502 past `upstream.max_response_bytes`, whether its answer is a JSON
    flight's body or assembled from a stream (an engine always read as a stream, directly or by a JSON
    flight); the events are not all held first."""
    sim = await start_sim(tpot_ms=0.0)
    model = {"name": "m", "instances": [instance(sim)]}
    if path.startswith("llamacpp"):
        dedup = "deterministic" if path == "llamacpp-flight" else "off"
        model = {"name": "m", "dedup": dedup, "instances": [{"url": sim.url, "engine": "llamacpp"}]}
    gw = await start_gateway([model], upstream={"max_response_bytes": 8192})
    body = {**DETERMINISTIC, "max_tokens": 2000}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 502
        error = upstream_error(await resp.read())
    assert error["code"] == "upstream_response_too_large"
    async with http.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 10}) as resp:
        assert resp.status == 200  # small answers are served as before
    assert gw.gateway is not None
    async with asyncio.timeout(30):
        await wait_sim_idle(sim)
        await gw.gateway.registry.wait_empty()
    assert_gateway_clean(gw.gateway)


async def test_a_stream_gathers_at_most_max_batch_bytes_into_one_write(start_sim, start_gateway, http, client_writes):
    """A cached result is all there at once; it still goes out in writes of bounded size."""
    from lockgate.respond import MAX_BATCH_BYTES

    sim = await start_sim(tpot_ms=0.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    body = {**DETERMINISTIC, "max_tokens": 2000}
    async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200  # fills the result cache with the stream's 2,000 events
        await resp.read()
    written = client_writes(gw.url)
    async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.headers["x-lockgate-cache"] == "hit"
        raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    # The socket writes carry the head, the body in chunked framing, and its last chunk.
    sizes = [len(w) for w in written]
    assert b"".join(written).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and sum(sizes) > len(raw)
    assert len(sizes) > 1 and max(sizes) <= MAX_BATCH_BYTES + 1024, sizes


async def test_oversized_metrics_and_health_answers_are_failed_calls(start_gateway, serve_app):
    """The gateway's side calls to an engine (metrics scrape, health check) read a bounded answer."""
    from lockgate.fleet.bounded import MAX_METRICS_BYTES, MAX_SIDE_BODY_BYTES

    sizes = {"metrics": 100, "health": 2}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 1\n" + "#" * sizes["metrics"] + "\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="x" * sizes["health"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    assert gw.gateway is not None
    fleet = gw.gateway.fleet
    [engine] = fleet.instances.values()
    await fleet.scraper.scrape_all()
    await fleet.probe_all()
    assert engine.scrape_error is None and engine.healthy  # normal answers
    sizes.update(metrics=MAX_METRICS_BYTES + 1, health=MAX_SIDE_BODY_BYTES + 1)
    await fleet.scraper.scrape_all()
    await fleet.probe_all()
    assert engine.scrape_error is not None and "larger than" in engine.scrape_error
    # Read no further than the bound; the check's answer is its status (a provider's model list of more than 64 KiB,
    # the openai dialect's check, is no failure: an outside run saw every instance of such a model ejected).
    assert engine.healthy


@contextlib.contextmanager
def collector_off() -> Any:
    """No garbage collection meanwhile: what a request leaves must be freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def garbage_of_requests() -> list[str]:
    """What a full collection would free now of the gateway's objects (listed by `DEBUG_SAVEALL`, not by weak
    references: the compiled build's flight takes none)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [
            f"{type(o).__module__}.{type(o).__name__}"
            for o in gc.garbage
            if type(o).__module__.startswith(("lockgate.", "httptools."))
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, {}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {}),
        (  # a preemptible class: the direct path's resumable generation
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            {"x-priority": "P2"},
        ),
        ("/v1/chat/completions", {**DETERMINISTIC, "max_tokens": 2}, {}),  # a flight
    ],
    ids=["response", "chat", "chat-p2", "flight"],
)
async def test_a_finished_request_is_freed_without_the_garbage_collector(
    start_sim, start_gateway, http, path, body, headers
):
    """An outside run: a `/v1/responses` request's exchange (its `ResponseNaming` held the exchange's bound method) and
    a preemptible one's (its ticket's tag is its run, which holds the ticket) were reference cycles, each with the
    request's body, freed only by a full collection, which `lockgate serve`'s tuned collector runs rarely: RSS grew by
    1 MB a request with 1 MB bodies. Every path's exchange must go by reference counting."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    seen: list[weakref.ref[Any]] = []
    original_add = Registry.add

    def add(registry: Registry, exchange: Exchange) -> None:
        seen.append(weakref.ref(exchange))
        original_add(registry, exchange)

    with pytest.MonkeyPatch.context() as patch, collector_off():
        patch.setattr(Registry, "add", add)
        for _ in range(2):  # (the first also warms the path up)
            async with http.post(gw.url + path, json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
        await gateway.registry.wait_empty()
        await gateway.records.wait_flushed()
        assert seen and all(ref() is None for ref in seen), [ref() for ref in seen]


@pytest.mark.parametrize("temperature", [1, 0], ids=["direct", "flight"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_request_an_engine_failure_ended_is_freed_without_the_garbage_collector(
    start_sim, start_gateway, http, stream, temperature
):
    """An engine that resets its connections: the error the engine client stored and set on the future its reader
    awaited kept every frame it went through, the request's among them (a reference cycle through the future and
    the stored error). A request ended by an error drops the tracebacks of its error chain (`drop_tracebacks`)."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    async with http.post(sim.url + "/sim/control", json={"reset_prob": 1.0}) as r:
        assert r.status == 200
    seen: list[weakref.ref[Any]] = []
    original_add = Registry.add

    def add(registry: Registry, exchange: Exchange) -> None:
        seen.append(weakref.ref(exchange))
        original_add(registry, exchange)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    body["temperature"] = temperature
    with pytest.MonkeyPatch.context() as patch, collector_off():
        patch.setattr(Registry, "add", add)
        for _ in range(2):
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                answer = await r.read()
                assert (b"upstream" in answer) and (r.status == 200 if stream else r.status == 502), answer
        await gateway.registry.wait_empty()
        await gateway.records.wait_flushed()
        assert seen and all(ref() is None for ref in seen), [ref() for ref in seen]
        assert garbage_of_requests() == []


@pytest.mark.parametrize("how", ["client-leaves", "deadline"])
async def test_connections_that_end_are_freed_without_the_garbage_collector(start_sim, start_gateway, how):
    """A connection's parser holds its protocol's bound methods: each lost connection, the client's and the engine's
    (aborted when the client left or the deadline passed), was a reference cycle with what its parser and header
    dict were gathering (an outside run: ~0.75 MB for an engine head of tiny header lines at its 64 KiB bound), until
    a full collection. A lost connection lets its parser go."""
    sim = await start_sim(tpot_ms=50.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    headers = {"x-lockgate-timeout-ms": "200"} if how == "deadline" else {}
    with collector_off():
        for _ in range(2):  # (the first also warms the path up)
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
                http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r,
            ):
                await r.content.readuntil(b"\n\n")
                if how == "deadline":
                    await r.read()
                r.close()
            async with asyncio.timeout(10):
                await gateway.registry.wait_empty()
                await wait_sim_idle(sim)
                await gateway.records.wait_flushed()
        assert garbage_of_requests() == []


async def test_a_flight_its_client_left_is_freed_without_the_garbage_collector(start_sim, start_gateway):
    """A cancelled flight's task keeps its CancelledError, whose frames hold the flight, which held the task back: a
    cycle with the request's body and the flight's history, until a full collection."""
    sim = await start_sim(tpot_ms=50.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    flights = gateway.dedup.flights
    with collector_off():
        async with (
            aiohttp.ClientSession() as http,
            http.post(gw.url + "/v1/chat/completions", json={**DETERMINISTIC, "stream": True}) as r,
        ):
            await r.content.readuntil(b"\n\n")
            assert len(flights._running) == 1
            r.close()
        async with asyncio.timeout(10):
            await flights.wait_until(lambda: not flights._running and not flights._tasks)
            await gateway.registry.wait_empty()
            await wait_sim_idle(sim)
        assert garbage_of_requests() == []
