"""`lockgate.http` against real servers on loopback: aiohttp apps, and raw asyncio servers for protocol edges.

No sleeps: tests wait on events set by the servers, or turn the loop (`until`) until a state is reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from lockgate.http import ConnectError, DisconnectedError, HttpPool, ProtocolError, StalledError
from lockgate.http.connection import HIGH_WATER, MAX_HEAD_BYTES, WRITE_PIECE

RawHandler = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Turn the loop (I/O is polled at every turn) until `condition` holds."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request (head, body) with a Content-Length body, or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    return head, await reader.readexactly(int(match.group(1)) if match else 0)


async def serve_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await read_request(reader) is not None:
        writer.write(OK)


@dataclass
class Raw:
    url: str = ""
    #: Connections accepted so far (handlers get their 1-based index).
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


@pytest.fixture
def raw_server(stack: contextlib.AsyncExitStack) -> Callable[[RawHandler], Awaitable[Raw]]:
    async def start(handler: RawHandler, *, sndbuf: int | None = None) -> Raw:
        raw = Raw()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw.connections += 1
            task = asyncio.current_task()
            assert task is not None
            raw.tasks.add(task)
            if sndbuf is not None:
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            try:
                await handler(raw.connections, reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            except asyncio.CancelledError:
                pass  # stopped by the fixture (on 3.11, a cancelled connection task is logged as an error)
            finally:
                writer.close()
                raw.tasks.discard(task)

        server = await asyncio.start_server(on_connection, "127.0.0.1", 0)

        async def stop() -> None:
            server.close()
            for task in list(raw.tasks):
                task.cancel()
            await asyncio.gather(*raw.tasks, return_exceptions=True)
            await server.wait_closed()

        stack.push_async_callback(stop)
        raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return raw

    return start


@pytest.fixture
def open_pool(stack: contextlib.AsyncExitStack) -> Callable[..., HttpPool]:
    def open_(url: str, **kwargs: float) -> HttpPool:
        pool = HttpPool(url, **kwargs)  # type: ignore[arg-type]
        stack.push_async_callback(pool.aclose)
        return pool

    return open_


def peer_app() -> web.Application:
    """`/peer` answers with the client's port (one per connection); `/close` too, with Connection: close."""

    async def peer(request: web.Request) -> web.Response:
        assert request.transport is not None
        return web.Response(text=str(request.transport.get_extra_info("peername")[1]))

    async def closing(request: web.Request) -> web.Response:
        response = await peer(request)
        response.force_close()
        return response

    app = web.Application()
    app.router.add_route("*", "/peer", peer)
    app.router.add_route("*", "/close", closing)
    return app


def assert_clean(pool: HttpPool, *, idle: int) -> None:
    stats = pool.statistics()
    assert (stats.idle, stats.in_use, stats.waiting, stats.slots) == (idle, 0, 0, idle)


# -- bodies ---------------------------------------------------------------------------------------------------


async def test_content_length_body_and_request_head(serve_app: Callable[..., Awaitable[str]], open_pool) -> None:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen = {"path": request.path_qs, "host": request.host, "x": request.headers.get("X-Test")}
        return web.json_response({"body": body.decode(), "length": request.content_length, **seen})

    app = web.Application()
    app.router.add_post("/base/echo", echo)
    url = await serve_app(app)
    pool = open_pool(url + "/base/")
    response = await pool.request("POST", "/echo?q=1", b'{"a":1}', [("X-Test", "yes")])
    assert response.status == 200
    assert response.content_type == "application/json"
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert orjson.loads(await response.read()) == {
        "body": '{"a":1}',
        "length": 7,
        "path": "/base/echo?q=1",
        "host": url.removeprefix("http://"),
        "x": "yes",
    }
    assert_clean(pool, idle=1)


async def test_chunked_body_arrives_incrementally(serve_app: Callable[..., Awaitable[str]], open_pool) -> None:
    second = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await second.wait()
        await response.write(b"second")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    pool = open_pool(await serve_app(app))
    response = await pool.request("GET", "/stream", b"")
    assert response.headers["transfer-encoding"] == "chunked"
    chunks = response.chunks()
    assert await anext(chunks) == b"first"
    assert not second.is_set()  # the first piece came before the server wrote the second
    second.set()
    assert await anext(chunks) == b"second"
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)
    assert_clean(pool, idle=1)  # iterating to the end released the connection for reuse


async def test_follow_hands_each_read_to_a_callback_until_it_answers(raw_server, open_pool) -> None:
    """`follow(step)`: the body is taken in the connection's callback, once per read that carried body, with no
    task waking per piece; the task waits once, until `step` returns something (here: at the body's end)."""
    written = [asyncio.Event() for _ in range(3)]

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for n, piece in enumerate((b"one", b"two", b"three")):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await written[n].wait()  # the client took the piece before the next is written
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    pool = open_pool((await raw_server(handler)).url)
    response = await pool.request("GET", "/", b"")
    pieces: list[bytes] = []

    def step() -> str | None:
        piece = response.next_nowait()
        if piece is None:
            return None  # nothing new: go on following
        if piece == b"":
            return "end"
        written[len(pieces)].set()
        pieces.append(piece)
        return None

    assert await response.follow(step) == "end"
    assert pieces == [b"one", b"two", b"three"]
    assert_clean(pool, idle=1)  # the end released the connection for reuse


async def test_follow_raises_what_the_step_raised_and_stops_on_close(raw_server, open_pool) -> None:
    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nbad\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    pool = open_pool((await raw_server(handler)).url)
    response = await pool.request("GET", "/", b"")

    def step() -> None:
        if response.next_nowait() is not None:
            raise ValueError("a bad piece")

    with pytest.raises(ValueError, match="a bad piece"):
        await response.follow(step)  # the piece is already buffered or arrives: the step raises either way
    response.close()
    calls = 0

    def counting() -> None:
        nonlocal calls
        calls += 1

    follower = asyncio.ensure_future(response.follow(counting))
    await until(lambda: response._listener is not None)
    response.close()  # stops following: the listener is gone, nothing calls it again
    assert response._listener is None and calls == 1  # the step at once, for what had arrived
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follower
    assert_clean(pool, idle=0)


async def test_a_step_that_ends_its_own_wait_leaves_no_error_behind(raw_server, open_pool) -> None:
    """A step may end the wait it runs for: its write to a client that has gone closes that client's connection,
    whose handler task — the one awaiting `follow` — is cancelled then and there. The step's result then has
    nowhere to go: nothing may raise into the connection's callback (it was logged as a fatal transport error
    per read, and the engine connection closed)."""
    following = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await following.wait()  # the piece comes once the client waits in `follow`: its step runs in the callback
        writer.write(b"3\r\none\r\n")
        await writer.drain()
        await reader.read()

    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        pool = open_pool((await raw_server(handler)).url)
        response = await pool.request("GET", "/", b"")
        follower: asyncio.Future[str] | None = None

        def step() -> str | None:
            if response.next_nowait() is None:
                return None
            assert follower is not None
            follower.cancel()  # what the client's connection_lost does to the handler task
            return "written"

        follower = asyncio.ensure_future(response.follow(step))
        await until(lambda: response._listener is not None)
        following.set()
        with pytest.raises(asyncio.CancelledError):
            await follower
        await until(lambda: response._listener is None)
        assert errors == []
        response.close()
    finally:
        loop.set_exception_handler(None)


async def test_http10_and_read_until_close_are_not_reused(raw_server, open_pool) -> None:
    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            if b" /v10 " in request[0]:  # HTTP/1.0 without keep-alive; the server would keep the socket open
                writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
            else:  # no length, not chunked: the body ends when the server closes
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
                await writer.drain()
                writer.write(b"close")
                return

    raw = await raw_server(handler)
    pool = open_pool(raw.url)
    for _ in range(2):
        assert await (await pool.request("GET", "/v10", b"")).read() == b"ok"
        assert_clean(pool, idle=0)
    assert raw.connections == 2
    response = await pool.request("GET", "/eof", b"")
    assert response.content_type == "text/plain"
    assert await response.read() == b"until close"
    assert_clean(pool, idle=0)
    assert raw.connections == 3


async def test_no_body_for_204_head_and_informational(serve_app, raw_server, open_pool) -> None:
    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=b"0123456789")

    app = web.Application()
    app.router.add_get("/empty", empty)
    app.router.add_get("/sized", sized)  # aiohttp answers HEAD too, with Content-Length and no body
    pool = open_pool(await serve_app(app))
    response = await pool.request("GET", "/empty", b"")
    assert (response.status, await response.read()) == (204, b"")
    assert_clean(pool, idle=1)
    response = await pool.request("HEAD", "/sized", b"")
    assert (response.status, response.headers["content-length"], await response.read()) == (200, "10", b"")
    assert_clean(pool, idle=0)  # llhttp cannot be told about HEAD: such connections are not reused
    assert await (await pool.request("GET", "/sized", b"")).read() == b"0123456789"

    async def continuing(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK)
        await serve_forever(reader, writer)

    pool = open_pool((await raw_server(continuing)).url)
    response = await pool.request("POST", "/", b"x")
    assert (response.status, "link" in response.headers, await response.read()) == (200, False, b"ok")
    assert_clean(pool, idle=1)


# -- keep-alive -----------------------------------------------------------------------------------------------


async def test_keepalive_reuses_the_last_released_connection(serve_app, open_pool) -> None:
    pool = open_pool(await serve_app(peer_app()))
    first = await pool.request("GET", "/peer", b"")
    second = await pool.request("GET", "/peer", b"")  # the first is still held: a second connection
    port1, port2 = await first.read(), await second.read()
    assert port1 != port2
    assert_clean(pool, idle=2)
    for _ in range(2):
        assert await (await pool.request("GET", "/peer", b"")).read() == port2  # LIFO
    assert_clean(pool, idle=2)


async def test_connection_close_is_not_reused(serve_app, open_pool) -> None:
    pool = open_pool(await serve_app(peer_app()))
    response = await pool.request("GET", "/close", b"")
    assert response.headers["connection"] == "close"
    port1 = await response.read()
    assert_clean(pool, idle=0)
    assert await (await pool.request("GET", "/peer", b"")).read() != port1


async def test_idle_connection_closed_by_server_is_discarded(raw_server, open_pool) -> None:
    async def one_response(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)  # keep-alive by default, then closed by the server while idle

    raw = await raw_server(one_response)
    pool = open_pool(raw.url)
    assert await (await pool.request("GET", "/", b"")).read() == b"ok"
    await until(lambda: pool.idle == 0)
    assert_clean(pool, idle=0)
    assert await (await pool.request("GET", "/", b"")).read() == b"ok"
    assert raw.connections == 2


async def test_expired_idle_connections_are_closed(raw_server, open_pool) -> None:
    eof = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_forever(reader, writer)
        eof.set()

    raw = await raw_server(handler)
    lazy = open_pool(raw.url, keepalive_s=0)  # expired at every checkout
    for _ in range(2):
        assert await (await lazy.request("GET", "/", b"")).read() == b"ok"
    assert raw.connections == 2
    swept = open_pool(raw.url, keepalive_s=0.01)  # the sweep closes it with no further request
    assert await (await swept.request("GET", "/", b"")).read() == b"ok"
    eof.clear()
    async with asyncio.timeout(5):
        await eof.wait()
    assert_clean(swept, idle=0)


async def test_stale_keepalive_connection_is_retried_once(raw_server, open_pool) -> None:
    requests: list[int] = []

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            requests.append(index)
            if index == 1 and requests.count(1) == 2:
                return  # closed "as the client wrote": no response byte
            writer.write(OK)

    raw = await raw_server(handler)
    pool = open_pool(raw.url)
    assert await (await pool.request("POST", "/", b"a")).read() == b"ok"
    assert await (await pool.request("POST", "/", b"b")).read() == b"ok"
    assert requests == [1, 1, 2]
    assert_clean(pool, idle=1)


async def test_disconnect_on_a_fresh_connection_is_not_retried(raw_server, open_pool) -> None:
    async def hang_up(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    raw = await raw_server(hang_up)
    pool = open_pool(raw.url)
    with pytest.raises(DisconnectedError):
        await pool.request("POST", "/", b"x")
    assert raw.connections == 1
    assert_clean(pool, idle=0)

    async def once_then_hang_up(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if index == 1 and await read_request(reader) is not None:
            writer.write(OK)
        await read_request(reader)

    raw = await raw_server(once_then_hang_up)
    pool = open_pool(raw.url)
    assert await (await pool.request("POST", "/", b"x")).read() == b"ok"
    with pytest.raises(DisconnectedError):  # stale, retried on a fresh one, which fails too: no third try
        await pool.request("POST", "/", b"x")
    assert raw.connections == 2
    assert_clean(pool, idle=0)


# -- connecting -----------------------------------------------------------------------------------------------


async def test_connection_refused(open_pool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pool = open_pool(f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectError, match="cannot connect"):
        await pool.request("GET", "/", b"")
    assert_clean(pool, idle=0)


async def test_connect_timeout(open_pool) -> None:
    # A listener with a full accept queue (backlog 0, one connection already queued) drops further SYNs.
    with contextlib.ExitStack() as sockets:
        listener = sockets.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        for _ in range(2):
            filler = sockets.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
        pool = open_pool(f"http://127.0.0.1:{listener.getsockname()[1]}", connect_timeout_s=0.05)
        with pytest.raises(ConnectError, match="timed out"):
            await pool.request("GET", "/", b"")
        assert_clean(pool, idle=0)


async def test_unix_socket(stack: contextlib.AsyncExitStack, tmp_path: Path, open_pool) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), headers={"X-Host": request.host})

    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    path = tmp_path / "engine.sock"
    await web.UnixSite(runner, str(path)).start()
    pool = open_pool(f"unix://{path}")
    for body in (b"one", b"two"):
        response = await pool.request("POST", "/echo", body)
        assert (response.headers["x-host"], await response.read()) == ("localhost", body)
        assert_clean(pool, idle=1)


# -- aborting and cancelling ----------------------------------------------------------------------------------


async def test_close_mid_body_is_seen_by_the_server(raw_server, open_pool) -> None:
    eof = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        if await reader.read() == b"":
            eof.set()

    raw = await raw_server(handler)
    pool = open_pool(raw.url)
    response = await pool.request("GET", "/", b"")
    assert await anext(response.chunks()) == b"x" * 10
    response.close()
    assert_clean(pool, idle=0)  # synchronously
    async with asyncio.timeout(5):
        await eof.wait()
    with pytest.raises(ProtocolError, match="closed"):
        await response.read()
    response.close()  # idempotent
    response.release()


async def test_cancel_while_awaiting_the_head(raw_server, open_pool) -> None:
    received, eof = asyncio.Event(), asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if index == 1:
            await read_request(reader)
            received.set()
            if await reader.read() == b"":
                eof.set()
        else:
            await serve_forever(reader, writer)

    raw = await raw_server(handler)
    pool = open_pool(raw.url, max_connections=1)
    task = asyncio.create_task(pool.request("POST", "/", b"x"))
    await received.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_clean(pool, idle=0)
    async with asyncio.timeout(5):
        await eof.wait()
    assert await (await pool.request("POST", "/", b"y")).read() == b"ok"  # the one slot is free again
    assert raw.connections == 2


async def test_aclose_closes_idle_and_in_use_connections(raw_server, open_pool) -> None:
    eofs: list[int] = []

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab" if b"/part" in request[0] else OK)
        eofs.append(index)

    raw = await raw_server(handler)
    pool = open_pool(raw.url)
    partial = await pool.request("GET", "/part", b"")
    assert await (await pool.request("GET", "/", b"")).read() == b"ok"
    assert (pool.idle, pool.in_use) == (1, 1)
    await pool.aclose()
    assert_clean(pool, idle=0)
    with pytest.raises(ProtocolError):
        await partial.read()
    with pytest.raises(ConnectError, match="closed"):
        await pool.request("GET", "/", b"")
    await until(lambda: len(eofs) == 2)


# -- the connection limit -------------------------------------------------------------------------------------


async def test_max_connections_queue_is_fifo_and_cancelled_waiters_leave(serve_app, open_pool) -> None:
    pool = open_pool(await serve_app(peer_app()), max_connections=1)
    held = await pool.request("GET", "/peer", b"")
    done: list[str] = []

    async def fetch(name: str) -> bytes:
        body: bytes = await (await pool.request("GET", "/peer", b"")).read()
        done.append(name)
        return body

    tasks = {name: asyncio.create_task(fetch(name)) for name in "BCD"}
    await until(lambda: pool.statistics().waiting == 3)
    tasks["C"].cancel()
    await until(lambda: pool.statistics().waiting == 2)
    port = await held.read()
    assert await tasks["B"] == port and await tasks["D"] == port  # one connection throughout
    assert done == ["B", "D"]
    assert tasks["C"].cancelled()
    assert_clean(pool, idle=1)


async def test_waiter_cancelled_after_hand_over_passes_it_on(serve_app, open_pool) -> None:
    pool = open_pool(await serve_app(peer_app()), max_connections=1)
    held = await pool.request("GET", "/peer", b"")
    await until(lambda: held.complete)
    b = asyncio.create_task(pool.request("GET", "/peer", b""))
    c = asyncio.create_task(pool.request("GET", "/peer", b""))
    await until(lambda: pool.statistics().waiting == 2)
    held.release()  # hands the connection to B...
    b.cancel()  # ...which is cancelled before it runs: C must get it
    response = await c
    assert b.cancelled()
    assert (await response.read()).isdigit()
    assert_clean(pool, idle=1)

    # The same with a slot instead of a connection (the held response is closed, not released).
    held = await pool.request("GET", "/peer", b"")
    b = asyncio.create_task(pool.request("GET", "/peer", b""))
    c = asyncio.create_task(pool.request("GET", "/peer", b""))
    await until(lambda: pool.statistics().waiting == 2)
    held.close()
    b.cancel()
    assert (await (await c).read()).isdigit()
    assert b.cancelled()
    assert_clean(pool, idle=1)


# -- malformed responses --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "during"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", "head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "body"),  # then the server closes
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n", "body"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n", "head"),
    ],
    ids=["garbage", "cut-short", "bad-chunk", "upgrade"],
)
async def test_malformed_responses_raise_protocol_error(raw_server, open_pool, answer: bytes, during: str) -> None:
    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    pool = open_pool((await raw_server(handler)).url)
    if during == "head":
        with pytest.raises(ProtocolError):
            await pool.request("GET", "/", b"")
    else:
        response = await pool.request("GET", "/", b"")
        with pytest.raises(ProtocolError):
            await response.read()
        response.release()
    assert_clean(pool, idle=0)


async def test_trailers_are_bounded_with_the_head_and_never_kept(raw_server, open_pool) -> None:
    """An outside run: a chunked body's trailers were taken without bound (each line kept in the connection's header
    dict, a value that never ends buffered by the parser), and as each read counted as the engine's activity no
    stall ended them: RSS +6.8 MB/s. Trailers are bounded with the head (`MAX_HEAD_BYTES`) and not kept: a small
    one does not reach the next response's headers on the same connection either."""
    endless = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-t\r\n\r\n3\r\nabc\r\n0\r\n"
            if request[0].startswith(b"GET /small"):
                writer.write(chunked + b"x-t: 1\r\n\r\n")
            elif request[0].startswith(b"GET /next"):
                writer.write(OK)
            elif request[0].startswith(b"GET /many"):
                writer.write(chunked)
                for n in range(20_000):  # ~400 KB of trailer lines, without end if the client took them
                    writer.write(b"x-t%d: %s\r\n" % (n, b"v" * 12))
                await writer.drain()
                await endless.wait()
            else:  # one trailer value that never ends
                writer.write(chunked + b"x-t: ")
                for _ in range(100):
                    writer.write(b"v" * 4096)
                await writer.drain()
                await endless.wait()

    pool = open_pool((await raw_server(handler)).url)
    response = await pool.request("GET", "/small", b"")
    assert await response.read() == b"abc" and "x-t" not in response.headers
    after = await pool.request("GET", "/next", b"")  # (on the same connection)
    assert "x-t" not in after.headers and after.status == 200
    await after.read()
    for path in ("/many", "/endless"):
        response = await pool.request("GET", path, b"")
        with pytest.raises(ProtocolError, match=f"trailers are larger than {MAX_HEAD_BYTES} bytes"):
            async with asyncio.timeout(10):  # (bounds a failure only: before, the read never ended)
                await response.read()
        response.release()
    endless.set()


async def test_invalid_request_line_or_header_is_refused_before_sending(open_pool) -> None:
    pool = open_pool("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="header"):
        await pool.request("GET", "/", b"", [("X-A", "b\r\nX-Injected: 1")])
    with pytest.raises(ValueError, match="request line"):
        await pool.request("GET", "/a b", b"")
    assert_clean(pool, idle=0)


# -- flow control ---------------------------------------------------------------------------------------------


async def test_slow_consumer_pauses_reading(raw_server, open_pool) -> None:
    size, piece = 2 * 1024 * 1024, 64 * 1024
    sent: list[int] = []
    finished = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // piece):
            writer.write(b"x" * piece)
            await writer.drain()
            sent.append(piece)
        finished.set()
        await serve_forever(reader, writer)

    pool = open_pool((await raw_server(handler, sndbuf=64 * 1024)).url)
    response = await pool.request("GET", "/", b"")
    await until(lambda: response.buffered > HIGH_WATER)
    buffered = response.buffered
    (conn,) = pool._in_use
    assert conn.reading_paused
    for _ in range(200):
        await asyncio.sleep(0)
    assert response.buffered == buffered  # nothing more was read while paused...
    assert not finished.is_set()  # ...so the server's drain blocks
    assert sum(sent) < size
    assert len(await response.read()) == size  # reading resumes as the buffer is consumed
    assert finished.is_set()
    assert_clean(pool, idle=1)


async def test_large_request_body_waits_for_the_transport(raw_server, open_pool) -> None:
    size = 16 * 1024 * 1024
    go = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await go.wait()
        match = re.search(rb"(?i)content-length: *(\d+)", head)
        assert match is not None
        body = await reader.readexactly(int(match.group(1)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%d" % (len(str(len(body))), len(body)))
        await serve_forever(reader, writer)

    pool = open_pool((await raw_server(handler)).url)
    task = asyncio.create_task(pool.request("POST", "/", b"y" * size))
    await until(lambda: pool.in_use == 1 and next(iter(pool._in_use)).writing_paused)
    (conn,) = pool._in_use
    assert conn.unsent is not None  # the body is not all handed to the transport...
    assert conn.transport is not None and conn.transport.get_write_buffer_size() <= 2 * WRITE_PIECE  # ...nor copied
    go.set()
    assert await (await task).read() == str(size).encode()
    assert_clean(pool, idle=1)


async def test_early_response_stops_sending_and_is_not_reused(raw_server, open_pool) -> None:
    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig")
        while await reader.read(1 << 16):
            pass

    pool = open_pool((await raw_server(handler)).url)
    response = await pool.request("POST", "/", b"z" * (16 * 1024 * 1024))
    assert (response.status, await response.read()) == (413, b"big")
    assert_clean(pool, idle=0)


async def test_cancel_while_sending_a_large_body(raw_server, open_pool) -> None:
    eof = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # and then reads nothing more until the client gives up
        await eof.wait()

    pool = open_pool((await raw_server(handler)).url)
    task = asyncio.create_task(pool.request("POST", "/", b"y" * (16 * 1024 * 1024)))
    await until(lambda: pool.in_use == 1 and next(iter(pool._in_use)).writing_paused)
    (conn,) = pool._in_use
    head = conn._head
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert conn.closed
    assert_clean(pool, idle=0)
    # The head future nobody awaits any more is cancelled, not failed ("exception was never retrieved").
    assert head is not None and head.cancelled()
    eof.set()


# -- stalls ---------------------------------------------------------------------------------------------------


STALL_S = 0.05


async def test_a_watched_request_fails_as_stalled_when_its_server_goes_silent(raw_server, open_pool) -> None:
    """Before its head and in the middle of its body: the request fails with `StalledError`, the connection is
    closed (the server sees its end) and its slot is free."""
    closed = [asyncio.Event(), asyncio.Event()]

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if index == 2:  # a head and one chunk, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        assert await reader.read() == b""  # the client closed the connection
        closed[index - 1].set()

    pool = open_pool((await raw_server(handler)).url)
    with pytest.raises(StalledError, match=r"sent nothing for 0\.05s"):
        await pool.request("POST", "/", b"{}", watch=STALL_S)
    await closed[0].wait()
    response = await pool.request("POST", "/", b"{}", watch=STALL_S)
    chunks = response.chunks()
    assert await anext(chunks) == b"one"
    with pytest.raises(StalledError):
        await anext(chunks)
    await closed[1].wait()
    assert_clean(pool, idle=0)


async def test_a_head_trickled_a_byte_at_a_time_is_stalled_too(raw_server, open_pool) -> None:
    """An outside run's slow-loris engine sent its response head a byte a second: every read moved the stall watch
    on, and the head's 64 KiB bound would have taken 18 hours. A head that began must be complete within the watch."""
    closed = asyncio.Event()

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
        while not writer.is_closing():
            writer.write(b"v")  # (a header value that never ends: never a complete head)
            await writer.drain()
            await asyncio.sleep(STALL_S / 5)  # (the engine's pace: well within the watch between two bytes)
            if reader.at_eof():
                break
        closed.set()

    pool = open_pool((await raw_server(handler)).url)
    with pytest.raises(StalledError, match=r"did not finish its response head within 0\.05s"):
        async with asyncio.timeout(10):  # (bounds a failure only: before, the request never ended)
            await pool.request("POST", "/", b"{}", watch=STALL_S)
    await closed.wait()
    assert_clean(pool, idle=0)


async def test_neither_an_unwatched_request_nor_one_whose_reading_is_paused_stalls(raw_server, open_pool) -> None:
    """A request not watched waits as long as its server takes (a whole answer that comes at its end); one whose
    reader has not taken what arrived (reading paused: the gateway is the slow one) is not the server's stall, and is
    watched again from the moment its reader resumes. Each survives a check that failed a stalled request after it."""
    size = 2 * HIGH_WATER

    async def handler(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if index == 2:  # part of a large body, more than the client buffers before pausing, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (size + 1) + b"x" * size)
        await reader.read()

    pool = open_pool((await raw_server(handler)).url)
    unwatched = asyncio.create_task(pool.request("POST", "/", b"{}"))
    await until(lambda: pool.in_use == 1)
    paused = await pool.request("POST", "/", b"{}", watch=STALL_S)
    await until(lambda: paused.buffered > HIGH_WATER)
    with pytest.raises(StalledError):  # a third request, watched, on a silent server
        await pool.request("POST", "/", b"{}", watch=STALL_S)
    assert not unwatched.done()
    assert len(paused.next_nowait() or b"") > HIGH_WATER  # it was not failed; its reading resumes
    with pytest.raises(StalledError):  # the rest never comes: now it is the server's stall
        await paused.read()
    unwatched.cancel()
    with pytest.raises(asyncio.CancelledError):
        await unwatched
    assert_clean(pool, idle=0)
