"""`respond.stream_events` over a real HTTP connection: events that are already here share one write,
and nothing written waits for the source when the source would wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

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


async def test_the_direct_path_writes_a_stream_from_the_engine_connections_callbacks(
    start_sim, start_gateway, stack
) -> None:
    """`respond.pump`: after its first event, a direct-path stream is written from the engine connection's data
    callback, read by read; the request's task waits once (in `Response.follow`) for the whole rest, instead of
    waking up per chunk (`Response.wait`)."""
    from lockgate import awaitpoints
    from tests.conftest import instance

    awaits: list[str] = []

    async def seen(name: str, data: object) -> None:
        if name.startswith("Response."):
            awaits.append(name)

    stack.enter_context(awaitpoints.installed(seen))
    sim = await start_sim(prefill_tps=1e6, tpot_ms=5.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 12, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n")
    # Each event exactly once, whatever read brought it (a reader that gave a read's events twice was caught
    # by nothing else: most tests' engines answer in one or two reads).
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    tokens = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 12, [e["choices"] for e in events]
    # The task waited for the first event, then once for the whole rest: the 11 tokens after the first (5 ms
    # apart, most in a read of their own) were written from the callbacks of the reads that brought them.
    assert "Response.follow" in awaits and awaits.count("Response.follow") == 1, awaits
    assert "Response.wait" not in awaits[awaits.index("Response.follow") :], awaits


def sse_event(text: str) -> bytes:
    payload = {
        "id": "e",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def through_gateway(start_gateway: Any, serve_app: Any, writes: list[bytes]) -> tuple[int, bytes, list[Any]]:
    """An engine that answers a stream as `writes` (one write each), a gateway in front of it: the client's
    status, its bytes, and the events among them."""
    from aiohttp import web

    async def engine(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in writes:
            await response.write(data)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    url = await serve_app(app)
    instances = [{"url": url, "engine": "vllm"}]
    gw = await start_gateway([{"name": "m", "dedup": "off", "retries": 0, "instances": instances}])
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
    return resp.status, raw, [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]


def contents(events: list[Any]) -> list[str]:
    return [e["choices"][0]["delta"]["content"] for e in events if e.get("choices")]


async def test_events_before_a_malformed_one_in_the_same_read_reach_the_client_then_an_error(
    start_gateway, serve_app
) -> None:
    """The pump takes every event a read brought at once (`UpstreamEvents.take`): when one of them is not JSON,
    those before it are still written, and the stream then ends with an SSE error (never `[DONE]`)."""
    malformed = sse_event("second") + sse_event("third") + b"data: {not json\n\n" + sse_event("never")
    status, raw, events = await through_gateway(start_gateway, serve_app, [sse_event("first"), malformed])
    assert status == 200 and contents(events) == ["first", "second", "third"]
    assert events[-1]["error"]["message"].endswith("sent an event that is not JSON.") and b"[DONE]" not in raw


async def test_events_that_came_with_the_first_in_one_read_are_not_lost(start_gateway, serve_app) -> None:
    """Opening reads the stream up to its first event with choices; the rest of that read (taken with it) is
    written first by the pump, then what later reads bring."""
    writes = [sse_event("a") + sse_event("b") + sse_event("c"), sse_event("d") + b"data: [DONE]\n\n"]
    status, raw, events = await through_gateway(start_gateway, serve_app, writes)
    assert status == 200 and contents(events) == ["a", "b", "c", "d"] and raw.endswith(b"data: [DONE]\n\n")


async def test_a_null_event_is_skipped(start_gateway, serve_app) -> None:
    """llama.cpp opens the stream of a batched prompt (`prompt: ["a", "b"]`) with `data: null`: it carries nothing,
    and the gateway answered 502 "not a JSON object" for every batched prompt sent to llama.cpp."""
    writes = [b"data: null\n\n", sse_event("first") + sse_event("second"), b"data: [DONE]\n\n"]
    status, raw, events = await through_gateway(start_gateway, serve_app, writes)
    assert status == 200 and contents(events) == ["first", "second"] and raw.endswith(b"data: [DONE]\n\n")
    assert b"null" not in raw.split(b"\n\n")[0]
