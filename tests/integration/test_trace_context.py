"""A client's W3C trace context reaches the engine and the usage record."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

from lockgate.records import read_records

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_traceparent_is_forwarded_and_recorded_and_an_invalid_one_dropped(start_gateway, serve_app, tmp_path):
    seen: list[dict[str, str]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body: dict[str, object] = {"id": "x", "object": "chat.completion", "model": "m", "choices": [], "usage": None}
        return web.json_response(body)

    async def models(request: web.Request) -> web.Response:  # the health check of the `openai` dialect
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    app.router.add_get("/v1/models", models)
    gw = await start_gateway([{"name": "m", "instances": [{"url": await serve_app(app), "engine": "openai"}]}])
    assert gw.gateway is not None
    data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as http:
        for traceparent, request_id in [(TRACEPARENT, "good"), ("00-not-a-trace", "bad")]:
            headers = {"traceparent": traceparent, "tracestate": "congo=t61rcWkgMzE", "x-request-id": request_id}
            async with http.post(gw.url + "/v1/chat/completions", data=data, headers=headers) as resp:
                assert resp.status == 200
    assert seen[0]["traceparent"] == TRACEPARENT and seen[0]["tracestate"] == "congo=t61rcWkgMzE"
    assert "traceparent" not in seen[1] and "tracestate" not in seen[1]
    await gw.gateway.records.wait_flushed()
    rows = {r["client_request_id"]: r for r in read_records(str(tmp_path / "usage.sqlite3"))}
    assert rows["good"]["traceparent"] == TRACEPARENT
    assert rows["bad"]["traceparent"] is None
