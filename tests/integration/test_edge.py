"""The HTTP edge: errors in the OpenAI envelope, headers, health, metrics, unix sockets."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import instance

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def post(http, url, body, **headers):
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(url + "/v1/chat/completions", data=data, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


def error_of(raw: bytes) -> dict[str, Any]:
    body = orjson.loads(raw)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


async def test_malformed_json_is_400_and_never_reaches_engine(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    status, _, raw = await post(http, gw.url, b"{oops")
    assert status == 400
    assert error_of(raw)["type"] == "invalid_request_error"
    status, _, raw = await post(http, gw.url, {"model": "m", "messages": "hi"})
    assert status == 400 and error_of(raw)["param"] == "messages"
    assert sim.statistics()["requests_started"] == 0
    # ... and the gateway keeps serving.
    status, _, _ = await post(http, gw.url, CHAT)
    assert status == 200


async def test_request_id_and_instance_headers(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, name="eng-a")]}])
    status, headers, _ = await post(http, gw.url, CHAT, **{"x-request-id": "client-42"})
    assert status == 200
    assert headers["x-request-id"] == "client-42"
    assert headers["x-lockgate-instance"] == "eng-a"
    status, headers, _ = await post(http, gw.url, CHAT)
    assert headers["x-request-id"].startswith("lg-")
    status, headers, _ = await post(http, gw.url, {**CHAT, "model": "zzz"}, **{"x-request-id": "r2"})
    assert status == 404 and headers["x-request-id"] == "r2"


async def test_every_response_carries_a_request_id_and_only_served_ones_an_instance(start_sim, start_gateway, http):
    dead = {"url": f"http://127.0.0.1:{closed_port()}", "engine": "vllm", "name": "dead"}
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [dead]}])
    routes = ["GET /health", "GET /v1/models", "GET /admin/fleet", "GET /nope", "PUT /v1/models"]
    for route in [*routes, "DELETE /admin/requests/x", "POST /admin/reload"]:
        method, path = route.split()
        async with http.request(method, gw.url + path, headers={"x-request-id": "mine"}) as resp:
            assert resp.headers["x-request-id"] == "mine", route
            assert "x-lockgate-instance" not in resp.headers
    async with http.get(gw.url + "/health") as resp:
        assert resp.headers["x-request-id"].startswith("lg-")
    # No instance to serve it (the health check found nothing listening): the client's id, no instance.
    status, headers, _ = await post(http, gw.url, CHAT, **{"x-request-id": "mine"})
    assert status == 503 and headers["x-request-id"] == "mine" and "x-lockgate-instance" not in headers
    # Believed healthy but unreachable: the error names the instance tried.
    gw.gateway.fleet.instances[dead["url"]].healthy = True
    status, headers, _ = await post(http, gw.url, CHAT, **{"x-request-id": "mine"})
    assert status == 502 and headers["x-request-id"] == "mine" and headers["x-lockgate-instance"] == "dead"
    # Errors the edge server answers itself (here: headers too large) carry one too.
    async with http.get(gw.url + "/health", headers={"x-big": "x" * 20000}) as resp:
        assert resp.status == 431 and resp.headers["x-request-id"].startswith("lg-")


async def test_unhealthy_fleet_503_with_retry_after_and_connect_failure_502(start_gateway, http):
    url = f"http://127.0.0.1:{closed_port()}"
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [{"url": url, "engine": "vllm"}]}])
    fleet = gw.gateway.fleet
    await fleet.probe_all()
    # The health check found nothing listening: the gateway says so honestly.
    status, headers, raw = await post(http, gw.url, CHAT)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert error_of(raw)["code"] == "no_healthy_instance"
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 503
    # Believed healthy but unreachable: 502, and the failure takes it out again (passive health).
    fleet.instances[url].healthy = True
    status, _, raw = await post(http, gw.url, CHAT)
    assert status == 502 and error_of(raw)["code"] == "upstream_unreachable"
    assert fleet.instances[url].healthy is False
    # What failed to connect where is the operator's to see (`/admin/fleet`), not the client's.
    assert error_of(raw)["message"].endswith(": the connection was refused.")
    assert "Errno" not in raw.decode() and "Errno" in str(fleet.instances[url].last_error)


async def test_retry_before_first_byte_goes_to_another_instance(start_sim, start_gateway, http):
    sim = await start_sim()
    dead = {"url": f"http://127.0.0.1:{closed_port()}", "engine": "vllm", "name": "dead"}
    gw = await start_gateway(
        [{"name": "m", "routing": "round_robin", "retries": 1, "instances": [dead, instance(sim, name="live")]}]
    )
    for _ in range(2):
        status, headers, _ = await post(http, gw.url, CHAT)
        assert status == 200 and headers["x-lockgate-instance"] == "live"


async def test_upstream_error_status_and_body_pass_through(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with http.post(sim.url + "/sim/control", json={"fail_status": 500}) as resp:
        assert resp.status == 200
    status, _, raw = await post(http, gw.url, CHAT)
    assert status == 500
    assert error_of(raw)["message"]


@pytest.mark.parametrize("engine_key", [None, "engine-key"])
async def test_authorization_never_forwarded(start_gateway, serve_app, http, engine_key):
    """The client's key never reaches the engine; an instance's own `api_key` does, as a Bearer token."""
    seen: list[dict[str, str]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"id": "x", "object": "chat.completion", "model": "m", "choices": [], "usage": None})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app.router.add_get("/v1/models", models)
    engine_url = await serve_app(app)
    spec = {"url": engine_url, "engine": "openai", **({"api_key": engine_key} if engine_key else {})}
    gw = await start_gateway([{"name": "m", "instances": [spec]}])
    status, _, _ = await post(http, gw.url, CHAT, Authorization="Bearer client-secret-key")
    assert status == 200
    assert seen and seen[0].get("Authorization") == (f"Bearer {engine_key}" if engine_key else None)
    assert seen[0]["Content-Type"] == "application/json"
    assert all("client-secret-key" not in v for v in seen[0].values())


async def test_unix_socket_instance(start_sim, start_gateway, http, tmp_path):
    sock = str(tmp_path / "engine.sock")
    await start_sim(uds=sock)
    gw = await start_gateway([{"name": "m", "instances": [{"url": f"unix://{sock}", "engine": "vllm"}]}])
    status, _, raw = await post(http, gw.url, CHAT)
    assert status == 200
    assert orjson.loads(raw)["choices"][0]["message"]["content"]


async def test_health_ready_metrics_and_unknown_paths(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    await post(http, gw.url, CHAT)
    async with http.get(gw.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["lockgate_requests"].samples
    assert any(s.labels == {"model": "m", "priority": "P1", "status": "completed"} and s.value == 1 for s in samples)
    assert "lockgate_request_duration_seconds" in families
    async with http.get(gw.url + "/nope") as resp:
        assert resp.status == 404 and error_of(await resp.read())["type"] == "invalid_request_error"
    async with http.get(gw.url + "/v1/chat/completions") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"  # RFC 9110: a 405 says what is allowed
    async with http.post(gw.url + "/v1/models") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "GET, HEAD"


async def test_gateway_listens_on_a_unix_socket(start_sim, tmp_path):
    from lockgate.config import parse_config
    from lockgate.server import GatewayServer

    sim = await start_sim()
    path = str(tmp_path / "lockgate.sock")
    config = parse_config(
        {
            "listen": {"unix": path},
            "usage": {"path": str(tmp_path / "u.sqlite3")},
            "models": [{"name": "m", "instances": [instance(sim)]}],
        }
    )
    async with GatewayServer(config) as gw:
        assert gw.url == f"unix://{path}"
        connector = aiohttp.UnixConnector(path=path)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.post("http://localhost/v1/chat/completions", json=CHAT) as resp,
        ):
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"]


async def test_configured_edge_limits_answer_in_the_openai_envelope(start_sim, start_gateway, http):
    """`limits.max_header_bytes` and `limits.keepalive_timeout_ms` reach the edge server."""
    import asyncio

    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        limits={"max_header_bytes": 2048, "keepalive_timeout_ms": 200},
    )
    status, _, raw = await post(http, gw.url, CHAT, **{"x-padding": "p" * 3000})
    assert status == 431
    assert error_of(raw)["code"] == "headers_too_large"
    assert sim.statistics()["requests_started"] == 0
    status, _, _ = await post(http, gw.url, CHAT, **{"x-padding": "p" * 500})
    assert status == 200
    # An idle keep-alive connection is closed by the gateway after the configured time.
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        async with asyncio.timeout(5):
            rest = await reader.read()  # until the gateway closes the idle connection
        assert rest.endswith(b'{"status":"ok"}')
    finally:
        writer.close()


async def test_a_client_that_stops_reading_its_stream_is_gone_and_its_engine_request_aborted(
    start_sim, start_gateway, tmp_path
):
    """`limits.write_timeout_ms`: a streaming client that takes nothing for that long (the gateway's buffers
    toward it stay full) ends like a disconnect: engine request aborted, slot and records clean."""
    import asyncio

    from lockgate.records import read_records
    from tests.integration.cancel_support import assert_gateway_clean, wait_sim_idle

    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6)
    limits = {"write_timeout_ms": 100, "send_buffer_bytes": 65536}
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], limits=limits)
    payload = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 30000, "stream": True}
    )
    host, port = gw.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
        await loop.sock_sendall(sock, head.encode() + payload)
        async with asyncio.timeout(30):  # bounds a failure only: the gateway's deadline ends the wait
            await sim.wait_until(lambda s: s.stats.requests_started == 1)
            await wait_sim_idle(sim)
    stats = sim.statistics()
    assert stats["requests_aborted"] == 1 and stats["requests_finished"] == 0, stats
    assert gw.gateway is not None
    assert_gateway_clean(gw.gateway)
    await gw.gateway.records.wait_flushed()
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "client_disconnect")
    # What reached the buffers toward it before the timeout started: the transport's 64 KiB, the kernel's send buffer
    # (`limits.send_buffer_bytes`, doubled by Linux) and the client's small receive buffer, ~130 bytes a token (left to
    # the kernel, its send buffer grew to megabytes: an outside run saw ~14,000 tokens generated for such a client).
    assert 0 < row["completion_tokens"] < (64 + 2 * 64 + 16) * 1024 // 100, row["completion_tokens"]
    # The stream's send waited on the client (until the write timeout gave up): the backpressure SLI.
    families = {f.name: f for f in text_string_to_metric_families(gw.gateway.metrics.render().decode())}
    samples = {s.name: s.value for s in families["lockgate_stream_backpressure_seconds"].samples}
    assert samples["lockgate_stream_backpressure_seconds_count"] == 1
    assert samples["lockgate_stream_backpressure_seconds_sum"] >= 0.09


async def test_a_timeout_header_that_is_not_plain_digits_is_refused_with_its_own_code(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for value in ("1_000", "+5", "-5", "0", "1e3", "abc", "9" * 20):
        status, _, raw = await post(http, gw.url, body, **{"x-lockgate-timeout-ms": value})
        error = error_of(raw)
        assert (status, error["code"], error["param"]) == (400, "invalid_timeout", "x-lockgate-timeout-ms"), value
    status, _, _ = await post(http, gw.url, body, **{"x-lockgate-timeout-ms": "5000"})
    assert status == 200


async def test_a_body_not_received_in_time_is_408_in_the_openai_envelope(start_sim, start_gateway):
    sim = await start_sim()
    limits = {"body_timeout_ms": 100, "header_timeout_ms": 3_600_000}  # the body deadline decides, not the hour
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], limits=limits)
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
        async with asyncio.timeout(10):
            raw = await reader.read()  # the gateway answers and closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert error_of(body)["code"] == "request_timeout"
    assert sim.statistics()["requests_started"] == 0


async def _raw_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> tuple[int, bytes]:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    return int(head.split()[1]), await reader.readexactly(length)


async def test_connections_over_the_limit_are_refused_and_counted(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], limits={"max_connections": 1})
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        assert (await _raw_get(reader, writer, "/health"))[0] == 200  # the one allowed, open and accepted
        refused_reader, refused_writer = await asyncio.open_connection(host, int(port))
        try:
            answer = await refused_reader.read()
        finally:
            refused_writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and error_of(body)["code"] == "too_many_connections"
        status, metrics = await _raw_get(reader, writer, "/metrics")
        assert status == 200 and b"lockgate_client_connections_refused_total 1.0" in metrics
    finally:
        writer.close()


async def test_a_failure_after_admission_carries_the_tenants_rate_limit_headers(start_gateway, http):
    """Noticed in an earlier session: 503/504 after admission carried no `x-ratelimit-*` while every answer did, so a
    client backing off by them lost track of its allowance exactly when it failed."""
    from lockgate.admission.tenants import hash_key

    url = f"http://127.0.0.1:{closed_port()}"
    tenant = {"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 60}
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [{"url": url}]}], tenants=[tenant])
    await gw.gateway.fleet.probe_all()  # nothing listens: no healthy instance
    status, headers, raw = await post(http, gw.url, CHAT, Authorization="Bearer sk-acme")
    assert status == 503 and error_of(raw)["code"] == "no_healthy_instance" and int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "60" and "x-ratelimit-remaining-requests" in headers


@pytest.mark.parametrize(("sent", "kept"), [("mine-1", True), ("caf\u00e9", False), ("r" * 201, False)])
async def test_a_clients_request_id_is_echoed_only_when_short_and_printable_ascii(
    start_sim, start_gateway, http, sent, kept
):
    """A client's `x-request-id` is echoed and recorded; one that is not printable ASCII (a Latin-1 byte was echoed
    back raw) or is too long is replaced by the gateway's own."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with http.post(
        gw.url + "/v1/chat/completions", data=orjson.dumps(CHAT), headers={"x-request-id": sent}
    ) as resp:
        assert resp.status == 200
        echoed = resp.headers["x-request-id"]
    assert (echoed == sent) if kept else echoed.startswith("lg-")
