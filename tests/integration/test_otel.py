"""OpenTelemetry export (extra `otel`): one span per request, parented by the client's trace context,
and named to the engine as its parent. Skipped when the SDK is not installed (`make test` installs it)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lockgate.observe.config import TracingConfig
from lockgate.observe.otel import Tracer
from lockgate.observe.trace import parse_traceparent
from tests.conftest import instance

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_one_span_per_request_between_the_client_and_the_engine(start_gateway, serve_app):
    seen: list[dict[str, str]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body: dict[str, object] = {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        return web.json_response(body)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    app.router.add_get("/v1/models", models)
    gw = await start_gateway([{"name": "m", "instances": [{"url": await serve_app(app), "engine": "openai"}]}])
    assert gw.gateway is not None
    exporter = InMemorySpanExporter()
    gw.gateway.tracer = Tracer(TracingConfig(otel=True), exporter=exporter)
    data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as http:
        for headers in ({"traceparent": TRACEPARENT}, {}):
            async with http.post(gw.url + "/v1/chat/completions", data=data, headers=headers) as resp:
                assert resp.status == 200
    joined, fresh = exporter.get_finished_spans()
    # The client's trace continues through the gateway's span to the engine.
    assert joined.name == "chat m"
    assert f"{joined.context.trace_id:032x}" == TRACE_ID
    assert joined.parent is not None and f"{joined.parent.span_id:016x}" == "00f067aa0ba902b7"
    parsed = parse_traceparent(seen[0]["traceparent"])
    assert parsed is not None and parsed[0] == TRACE_ID and parsed[1] == f"{joined.context.span_id:016x}"
    attributes = dict(joined.attributes or {})
    assert attributes["gen_ai.request.model"] == "m" and attributes["lockgate.status"] == "completed"
    assert attributes["gen_ai.usage.input_tokens"] == 5 and attributes["http.response.status_code"] == 200
    # Without a client trace the gateway starts one, and still names its span to the engine.
    assert fresh.parent is None
    parsed = parse_traceparent(seen[1]["traceparent"])
    assert parsed is not None and parsed[0] == f"{fresh.context.trace_id:032x}"


async def test_the_gateway_starts_and_stops_with_the_otlp_exporter(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tracing={"otel": True, "endpoint": "http://127.0.0.1:9/v1/traces"},
    )
    assert gw.gateway is not None and gw.gateway.tracer is not None
