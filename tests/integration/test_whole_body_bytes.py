"""A non-streaming answer on the direct path is the engine's own bytes when there is nothing to rewrite (the body
names the model the client asked for), and is rewritten with the client's model name when the engine names another."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

#: Spaces after separators and a key order of its own: re-encoding the parsed body would change these bytes.
ENGINE_BODY = (
    b'{"id": "chatcmpl-engine", "object": "chat.completion", "created": 1, "model": "%s", '
    b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], '
    b'"usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}'
)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1}


async def _answer(start_gateway, serve_app, engine_model: bytes) -> bytes:
    async def engine(request: web.Request) -> web.Response:
        if request.method == "POST":
            return web.Response(body=ENGINE_BODY % engine_model, content_type="application/json")
        if request.path == "/metrics":
            return web.Response(text="")
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        assert resp.headers["x-lockgate-cache"] == "bypass"  # the direct path (a sampled request)
        return await resp.read()


async def test_the_engines_bytes_pass_through_when_the_model_is_the_clients(start_gateway, serve_app):
    assert await _answer(start_gateway, serve_app, b"m") == ENGINE_BODY % b"m"


async def test_another_model_name_is_rewritten_to_the_clients(start_gateway, serve_app):
    body = await _answer(start_gateway, serve_app, b"/models/served-name")
    assert body != ENGINE_BODY % b"/models/served-name"
    assert orjson.loads(body) == {**orjson.loads(ENGINE_BODY % b"/models/served-name"), "model": "m"}
