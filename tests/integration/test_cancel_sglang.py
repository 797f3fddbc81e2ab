"""SGLang notices a closed connection late, so the gateway also calls `POST /abort_request` with the rid
it sent — before the first byte (the engine is in prefill) as well as mid-stream."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.integration.cancel_support import assert_gateway_clean, body, cancel_and_wait


class FakeSGLang:
    def __init__(self) -> None:
        self.received: asyncio.Queue[str] = asyncio.Queue()
        self.aborted: asyncio.Queue[str] = asyncio.Queue()
        self.stream_first = False
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/abort_request", self.abort)
        self.app.router.add_get("/health", self.health)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        payload: dict[str, Any] = await request.json()
        self.received.put_nowait(payload["rid"])
        if self.stream_first:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "hi"}}],
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await asyncio.Event().wait()  # generate forever (until the connection goes)
        raise AssertionError("unreachable")

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.put_nowait((await request.json())["rid"])
        return web.json_response({"ok": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


@pytest.mark.parametrize("phase", ["before_first_byte", "mid_stream"])
async def test_sglang_abort_request_on_disconnect(phase, start_gateway) -> None:
    engine = FakeSGLang()
    engine.stream_first = phase == "mid_stream"
    runner = web.AppRunner(engine.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "sglang"}]}])
        assert gw.gateway is not None
        got_first = asyncio.Event()

        async def client() -> None:
            async with (
                aiohttp.ClientSession() as http,
                http.post(gw.url + "/v1/chat/completions", json=body(True)) as resp,
            ):
                await resp.content.readline()
                got_first.set()
                await resp.read()

        task = asyncio.create_task(client())
        try:
            async with asyncio.timeout(5):
                rid = await engine.received.get()
                if phase == "mid_stream":
                    await got_first.wait()
                await cancel_and_wait(task)
                assert await engine.aborted.get() == rid
                await gw.gateway.registry.wait_empty()
        finally:
            await cancel_and_wait(task)
        assert_gateway_clean(gw.gateway)
    finally:
        await runner.cleanup()
