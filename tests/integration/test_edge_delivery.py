"""The edge server tells a whole response's owner whether the client took it (`Response.on_sent`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from lockgate.edge.server import Request, Response
from tests.integration.test_edge_server import connect, http, read_response, serving


async def test_on_sent_says_true_once_the_client_has_taken_the_body() -> None:
    told: list[bool] = []

    async def handler(request: Request) -> Response:
        return Response(body=b"x" * 1_000_000, on_sent=told.append)

    async with serving(handler) as server, connect(server) as (reader, writer):
        writer.write(http())
        resp = await read_response(reader)
        assert len(resp.body) == 1_000_000
        writer.write(http())  # the callback ran by the time the next request is answered
        await read_response(reader)
    assert told == [True, True]


async def test_on_sent_says_false_for_a_client_that_never_reads_the_body() -> None:
    told = asyncio.Event()
    delivered: list[bool] = []

    def on_sent(ok: bool) -> None:
        delivered.append(ok)
        told.set()

    async def handler(request: Request) -> Response:
        return Response(body=b"x" * 8_000_000, on_sent=on_sent)

    loop = asyncio.get_running_loop()
    async with serving(handler, write_timeout_s=0.05) as server:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            await loop.sock_sendall(sock, http())
            async with asyncio.timeout(30):  # bounds a failure only: the write timeout ends the wait
                await told.wait()
    assert delivered == [False]


async def test_on_sent_says_false_when_the_response_is_never_written() -> None:
    """The client left while the handler worked: the answer it returns anyway is never written."""
    delivered: list[bool] = []
    started, told = asyncio.Event(), asyncio.Event()

    def on_sent(ok: bool) -> None:
        delivered.append(ok)
        told.set()

    async def handler(request: Request) -> Response:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return Response(body=b"late", on_sent=on_sent)  # swallowed the cancellation, returns anyway

    async with serving(handler) as server:
        async with connect(server) as (_, writer):
            writer.write(http())
            await started.wait()
        async with asyncio.timeout(30):
            await told.wait()
    assert delivered == [False]
