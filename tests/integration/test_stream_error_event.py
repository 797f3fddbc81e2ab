"""An engine that fails after its stream began reports it as an event, then `[DONE]` (vLLM and SGLang: `{"error":
{...}}`, older vLLM `{"object": "error", ...}`). The client must see an error, never a clean end: no `[DONE]` after
the truncated answer, a 502 for a client that wanted the whole answer, a record that says `error`, and nothing
kept for de-duplication. An error event naming a 4xx status is the request's fault: it does not count against the
engine's health."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.records import read_records
from tests.integration.fake_engines import chat_chunk

ERROR_EVENTS = {
    "vllm": b'{"error":{"message":"engine exploded","type":"InternalServerError","param":null,"code":500}}',
    "vllm_old": b'{"object":"error","message":"engine exploded","type":"InternalServerError","param":null,"code":500}',
    "client_fault": b'{"error":{"message":"bad grammar","type":"BadRequestError","param":null,"code":400}}',
}


async def _engine(
    serve_app: Any, error_event: bytes, calls: list[dict[str, Any]], hold: asyncio.Event | None = None
) -> str:
    """A fake engine whose every answer is a stream of two tokens, then `error_event` and `[DONE]` (after `hold`
    is set, when given)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(text="") if request.path == "/metrics" else web.json_response({})
        body = await request.json()
        calls.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chat_chunk("a") + chat_chunk(" b"))
        if hold is not None:
            await hold.wait()
        await response.write(b"data: " + error_event + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return str(await serve_app(app))


def _request(temperature: float) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": temperature,
        "stream": True,
    }


@pytest.mark.parametrize("form", ["vllm", "vllm_old"])
async def test_an_error_event_ends_the_clients_stream_with_an_error_not_done(start_gateway, serve_app, tmp_path, form):
    calls: list[dict[str, Any]] = []
    url = await _engine(serve_app, ERROR_EVENTS[form], calls)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}])
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json=_request(1.0)) as resp:
            assert resp.status == 200  # the stream had begun: the error comes as its last event
            raw = await resp.read()
        assert b'"content":"a"' in raw and b"[DONE]" not in raw
        last = orjson.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "upstream_stream_error"
        assert "engine exploded" in last["error"]["message"]
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert 'lockgate_upstream_errors_total{instance="e",kind="stream"} 1.0' in metrics
    await gw.gateway.records.wait_flushed()
    (row,) = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "error"


async def test_a_failed_flight_fails_every_subscriber_and_is_not_kept(start_gateway, serve_app):
    calls: list[dict[str, Any]] = []
    hold = asyncio.Event()
    url = await _engine(serve_app, ERROR_EVENTS["vllm"], calls, hold)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    flights = gw.gateway.dedup.flights

    async def joined(n: int) -> None:
        async with asyncio.timeout(5):
            await flights.wait_until(lambda: flights.statistics()["subscribers"] == n)

    async def send(http: aiohttp.ClientSession, stream: bool) -> tuple[int, str | None, bytes]:
        async with http.post(gw.url + "/v1/chat/completions", json={**_request(0.0), "stream": stream}) as resp:
            return resp.status, resp.headers.get("x-lockgate-cache"), await resp.read()

    async with aiohttp.ClientSession() as http:
        streamed = asyncio.create_task(send(http, True))
        await joined(1)
        whole = asyncio.create_task(send(http, False))  # joins the streaming flight: its answer is assembled
        await joined(2)
        hold.set()
        status, cache, raw = await streamed
        assert (status, cache) == (200, "miss")
        assert b'"content":"a"' in raw and b"[DONE]" not in raw and b'"upstream_stream_error"' in raw
        status, cache, raw = await whole
        assert status == 502
        assert orjson.loads(raw)["error"]["code"] == "upstream_stream_error"
        status, cache, raw = await send(http, True)  # the same request again: a new flight, not the failed one
        assert (status, cache) == (200, "miss") and b"[DONE]" not in raw
    assert len(calls) == 2


async def test_an_error_event_naming_a_client_error_does_not_count_against_the_engine(
    start_gateway, serve_app, tmp_path
):
    """The engine refused the request itself mid-stream (a 4xx in its error event): not the engine's failure, the
    request is recorded `rejected` (it was an `error` against the success objective), and a preemptible one is not
    taken over by another engine, which would refuse it too."""
    calls: list[dict[str, Any]] = []
    urls = [await _engine(serve_app, ERROR_EVENTS["client_fault"], calls) for _ in range(2)]
    instances = [{"url": url, "engine": "vllm", "name": f"e{n}"} for n, url in enumerate(urls)]
    gw = await start_gateway([{"name": "m", "instances": instances}])
    async with aiohttp.ClientSession() as http:
        for priority in ("P1", "P2"):
            async with http.post(
                gw.url + "/v1/chat/completions", json=_request(1.0), headers={"x-priority": priority}
            ) as resp:
                raw = await resp.read()
            assert b"bad grammar" in raw and b"[DONE]" not in raw
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert 'kind="stream"' not in metrics and len(calls) == 2
    await gw.gateway.records.wait_flushed()
    assert [row["status"] for row in read_records(str(tmp_path / "usage.sqlite3"))] == ["rejected", "rejected"]


def test_only_an_error_is_an_error_event():
    from lockgate.errors import stream_error

    assert stream_error({"choices": [], "error": None}) is None
    assert stream_error({"choices": []}) is None
    assert stream_error({"error": "overloaded"}) == ("overloaded", None)  # TGI's form
    assert stream_error({"object": "error", "message": "m", "code": 503}) == ("m", 503)
    assert stream_error({"error": {"message": "x" * 2000, "code": 400}}) == ("x" * 500, 400)
    assert stream_error({"error": {"code": True}}) == ("the engine reported an error", None)


@pytest.mark.parametrize("status", [429, 503])
async def test_an_engines_retry_after_reaches_the_client(status: int, serve_app: Any, start_gateway: Any) -> None:
    """An engine (or a hosted provider behind `engine: openai`) that says when to come back: the client is told the
    same (its SDK otherwise backs off 0.5-1 s and hammers it), with the engine's status and body."""
    body = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limited"}}

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(body, status=status, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    url = await serve_app(app)
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "retries": 0, "instances": [{"url": url, "engine": "openai"}]}]
    )
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=request) as resp:
        assert resp.status == status and resp.headers["Retry-After"] == "7"
        assert orjson.loads(await resp.read()) == body


@pytest.mark.parametrize("dedup", ["off", "deterministic"])
async def test_an_engines_200_without_an_answer_is_a_502_not_a_success(
    dedup: str, serve_app: Any, start_gateway: Any
) -> None:
    """An outside run: an engine (or a proxy in front of one) answering 200 `{}` was served as a success (the SDK's
    `choices` was None) and recorded `completed`; a stream from it was already a 502."""

    async def empty(request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", empty)
    app.router.add_post("/v1/embeddings", empty)
    app.router.add_get("/v1/models", models)  # health checks
    url = await serve_app(app)
    gw = await start_gateway(
        [{"name": "m", "dedup": dedup, "retries": 0, "instances": [{"url": url, "engine": "openai"}]}]
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        for path, body, field in (
            ("chat/completions", chat, "choices"),
            ("embeddings", {"model": "m", "input": "x"}, "data"),
        ):
            async with http.post(f"{gw.url}/v1/{path}", json=body) as resp:
                assert resp.status == 502, await resp.text()
                error = orjson.loads(await resp.read())["error"]
                assert error["code"] == "upstream_protocol_error" and f"without `{field}`" in error["message"]
