"""`respond.stream_events` over a real HTTP connection: events that are already here share one write,
and nothing written waits for the source when the source would wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from lockgate.edge.server import HttpServer, Reply, Request, StreamResponse
from lockgate.records import UsageRecord
from lockgate.respond import stream_events
from lockgate.wire import Endpoint, validate


class FakeExchange:
    """What the writer touches of an `Exchange`."""

    def __init__(self) -> None:
        self.api = validate(
            Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        )
        self.record = UsageRecord(request_id="r", tenant="t", model="m", endpoint="chat", stream=True)
        self.response: StreamResponse | None = None
        self.phase: Any = None
        self.answered = False

    def first_token(self) -> None:
        pass


def chunk(text: str) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


async def test_a_batch_is_flushed_before_the_source_waits(stack: Any) -> None:
    gate = asyncio.Event()  # the source's "network": nothing more until the client saw the first batch
    state = {"ready": True}

    async def source() -> AsyncIterator[dict[str, Any]]:
        yield chunk("a")
        yield chunk("b")
        state["ready"] = False  # the next event (invisible to the client) is the last one at hand
        yield {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 2}}
        await gate.wait()
        state["ready"] = True
        yield chunk("c")

    writes: list[bytes] = []

    async def handler(request: Request) -> Reply:
        ex = FakeExchange()
        response = await stream_events(ex, request, source(), {}, ready=lambda: state["ready"])  # type: ignore[arg-type]
        writes.append(b"done")
        return response

    server = HttpServer(handler, max_body_bytes=1024)
    await server.start("127.0.0.1", 0)
    stack.push_async_callback(server.shutdown, 5.0)
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/") as resp:
            async with asyncio.timeout(5):
                first = b""
                while b'"b"' not in first:
                    first += await resp.content.readany()
            assert b'"a"' in first and b"[DONE]" not in first  # "a" and "b" arrived while the source waits
            gate.set()
            rest = await resp.read()
        assert b'"c"' in rest and rest.endswith(b"data: [DONE]\n\n")
    finally:
        gate.set()  # never leave the handler waiting (a failing run must not hang the app's cleanup)
    assert writes == [b"done"]
