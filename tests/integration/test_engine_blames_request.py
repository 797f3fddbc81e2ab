"""An engine that answers a request's own fault with a 5xx: llama.cpp answers an embedding input longer than its
batch with a 500 ("input (601 tokens) is too large to process"). An outside run: the gateway retried it on the
other engine, ejected both, and the OpenAI SDK's own retries of the 500 multiplied it (five engine calls for one
`embeddings.create`). It is the request's: 400, one engine call, no ejection, no retry (real loopback servers)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

TOO_LARGE = (
    b'{"error":{"code":500,"message":"input (601 tokens) is too large to process. increase the physical batch size '
    b'(current batch size: 512)","type":"server_error"}}'
)


class LlamaEmbeddings:
    """Enough of llama-server: health, slots, and `/v1/embeddings` that refuses inputs over 512 "tokens" with a 500
    (and any request with a 500 of another kind when `broken`)."""

    def __init__(self) -> None:
        self.calls = 0
        self.broken = False
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/props", self.props)
        self.app.router.add_post("/v1/embeddings", self.embeddings)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 2})

    async def embeddings(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        if self.broken:
            return web.json_response({"error": {"code": 500, "message": "model crashed"}}, status=500)
        if len(body["input"].split()) > 512:
            return web.Response(body=TOO_LARGE, status=500, content_type="application/json")
        return web.json_response(
            {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.5]}], "model": "e",
             "usage": {"prompt_tokens": 3, "total_tokens": 3}}
        )  # fmt: skip


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_an_input_too_large_for_the_engine_is_the_requests_fault(serve_app, start_gateway, http) -> None:
    engines = [LlamaEmbeddings(), LlamaEmbeddings()]
    urls = [await serve_app(e.app) for e in engines]
    gw = await start_gateway(
        [{"name": "e", "routing": "round_robin", "instances": [{"url": u, "engine": "llamacpp"} for u in urls]}]
    )
    for _ in range(3):
        async with http.post(gw.url + "/v1/embeddings", json={"model": "e", "input": "hello " * 600}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and "is too large to process" in error["message"], error
    assert sum(e.calls for e in engines) == 3  # one engine call each: not retried on the other engine
    fleet = gw.gateway.fleet
    assert all(fleet.instances[u].routable for u in urls)  # nobody ejected
    metrics = gw.gateway.metrics.render().decode()
    retried = [line for line in metrics.splitlines() if line.startswith('lockgate_upstream_retries_total{model="e"}')]
    assert all(float(line.split()[-1]) == 0 for line in retried), retried
    # A short input is served; an engine's other 500 is still the engine's (retried on the other one).
    async with http.post(gw.url + "/v1/embeddings", json={"model": "e", "input": "hello"}) as resp:
        assert resp.status == 200
    engines[0].broken = True
    for _ in range(2):
        async with http.post(gw.url + "/v1/embeddings", json={"model": "e", "input": "hello"}) as resp:
            assert resp.status == 200
    assert engines[0].calls >= 3  # it was tried (and failed) at least once more
