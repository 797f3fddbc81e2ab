"""What the tests' fake engines send, and an engine that hangs."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable

import orjson


def chat_chunk(content: str) -> bytes:
    """One chat chunk's SSE event carrying `content` (a token)."""
    event = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def hung_engine(
    stack: contextlib.AsyncExitStack,
    chunks: int,
    gone: asyncio.Event,
    arrived: asyncio.Event | None = None,
    *,
    pings: bool = False,
    empty_events: bool = False,
    hollow_events: bool = False,
    whole: bool = False,
) -> str:
    """A fake engine (a raw server: it must see the disconnect) whose every stream sends its head and `chunks` tokens,
    then nothing until the gateway closes the connection (then `gone` is set; `arrived` once a stream has begun);
    anything else is answered `{}`. `pings`: keep-alive comments meanwhile, a byte every 10 ms; `empty_events`: events
    that carry nothing (`data: null`, `data: {}`), one every 10 ms; `hollow_events`: chunks with choices but no token
    (an empty delta, an empty content), one every 10 ms."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await next_post(reader, writer)
                if whole:  # a non-streaming answer: its head comes with its end, which never comes
                    assert await reader.read() == b""
                    gone.set()
                    return
                events = b"".join(chat_chunk(c) for c in "ab"[:chunks])
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                if events:
                    writer.write(b"%x\r\n%s\r\n" % (len(events), events))
                if arrived is not None:
                    arrived.set()
                if pings or empty_events or hollow_events:
                    # Keep-alive comments a byte at a time (a proxy in front of a hung engine), or empty events.
                    empty = [b"data: null\n\n", b"data: {}\n\n"]
                    hollow = [
                        b'data: {"choices":[{"index":0,"delta":{}}]}\n\n',
                        b'data: {"choices":[{"index":0,"delta":{"content":""}}]}\n\n',
                    ]
                    pings_ = [b": ping\n\n"[i : i + 1] for i in range(8)]
                    pieces = pings_ if pings else hollow if hollow_events else empty
                    while not reader.at_eof():
                        for piece in pieces:
                            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                            await asyncio.sleep(0.01)  # (the engine's pace)
                        if writer.is_closing():
                            break
                    gone.set()
                    return
                assert await reader.read() == b""  # nothing more, until the gateway closes the connection
                gone.set()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await raw_server(stack, serve)


async def raw_server(
    stack: contextlib.AsyncExitStack,
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> str:
    """A raw server on loopback (a fake engine that must see what the gateway's connection does), closed with `stack`:
    its URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def next_post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """The head of the next POST on a raw connection, its body read; anything else (a health check) answered `{}`."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        if head.startswith(b"POST"):
            return head
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
