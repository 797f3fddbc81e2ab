"""A non-streaming answer on the direct path is the engine's own bytes when there is nothing to rewrite (the body
names the model the client asked for), and is rewritten with the client's model name when the engine names another."""

from __future__ import annotations

from typing import Any

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


async def test_a_whole_answer_without_usage_is_recorded_with_estimates(start_gateway, serve_app, tmp_path):
    """An outside run: an engine (or provider) that sent no `usage`, or one with counts that are none (strings,
    negatives), had its answers recorded as 0 prompt and 0 completion tokens, and the tenant charged nothing for the
    output (streams were estimated). Now estimated: ~4 characters a token, at least one per choice with output."""
    from lockgate.records import read_records

    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world, twenty chars"}}]
        },
        "/v1/completions": {"choices": [{"index": 0, "text": "hi"}], "usage": {"prompt_tokens": "12"}},
        "/v1/embeddings": {"data": [{"index": 0, "embedding": [0.1], "object": "embedding"}], "usage": None},
    }

    async def engine(request: web.Request) -> web.Response:
        if request.method == "POST":
            return web.json_response({"id": "x", "model": "m", **bodies[request.path]})
        return web.Response(text="") if request.path == "/metrics" else web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    asks = {
        "/v1/chat/completions": CHAT,
        "/v1/completions": {"model": "m", "prompt": "a prompt of some forty characters length", "temperature": 1},
        "/v1/embeddings": {"model": "m", "input": "sixteen chars.."},
    }
    answers = {}
    async with aiohttp.ClientSession() as http:
        for path, body in asks.items():
            async with http.post(gw.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                answers[path] = await resp.json()
    # Counts that are none reach no client: the record's (an SDK got `prompt_tokens='12'`); no usage stays none.
    assert answers["/v1/completions"]["usage"] == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    assert "usage" not in answers["/v1/chat/completions"] and answers["/v1/embeddings"]["usage"] is None
    await gw.gateway.records.wait_flushed()
    rows = {
        r["endpoint"]: (r["prompt_tokens"], r["completion_tokens"])
        for r in read_records(str(tmp_path / "usage.sqlite3"))
    }
    assert rows == {"chat": (rows["chat"][0], 6), "completions": (10, 1), "embeddings": (3, 0)}, rows
    assert rows["chat"][0] > 0


async def test_a_stream_ended_right_after_its_done_line_is_complete(start_gateway, serve_app, tmp_path):
    """An outside run: an engine that closed its body right after `data: [DONE]\\n` (no blank line) had every
    complete stream end in an error event ("ended the stream without [DONE]"), recorded as an error."""
    from lockgate.records import read_records

    async def engine(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(text="") if request.path == "/metrics" else web.json_response({})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m"}
        await response.write(b"data: " + orjson.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}}]}))
        await response.write(b"\n\ndata: [DONE]\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    async with (
        aiohttp.ClientSession() as http,
        http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp,
    ):
        text = await resp.text()
    assert resp.status == 200 and text.endswith("data: [DONE]\n\n") and "error" not in text, text
    await gw.gateway.records.wait_flushed()
    (row,) = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "completed", row


async def test_an_engine_that_redirects_is_named_as_such(start_gateway, serve_app, start_sim):
    """An outside run: an engine answering 301/307 (an `http://` URL its proxy sends to `https://`) had its redirect's
    body read as an answer: 502 "not JSON" or "ended without [DONE]", naming nothing to fix. The redirect is said, and
    the request goes to another instance."""

    async def engine(request: web.Request) -> web.Response:
        if request.method == "POST":
            raise web.HTTPTemporaryRedirect("https://engine.example/v1/chat/completions")
        return web.Response(text="") if request.path == "/metrics" else web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [{"url": url, "engine": "vllm"}]}])
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            async with http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 502, error
            assert "answered 307, a redirect to https://engine.example/v1/chat/completions" in error["message"], error
    sim = await start_sim()
    both = [{"url": url, "engine": "vllm", "name": "redirects"}, {"url": sim.url, "engine": "vllm", "name": "sim"}]
    gw = await start_gateway([{"name": "m", "routing": "round_robin", "instances": both}])
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200 and resp.headers["x-lockgate-instance"] == "sim"
