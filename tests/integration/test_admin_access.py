"""Admin access: `/admin/*`, `/dashboard` and (if configured) `/metrics` need an admin key."""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from lockgate import awaitpoints
from lockgate.admission.tenants import hash_key
from tests.conftest import instance

TENANTS = [{"name": "acme", "keys": [hash_key("tenant-key")]}]
ADMIN = {"keys": [hash_key("admin-key")]}


def admin_routes(gateway: Any) -> list[tuple[str, str]]:
    """Every operator route the gateway serves (from its route table: routes added later are covered),
    plus the cancel route and the dashboard."""
    routes = [(m, p) for m, p in gateway._route_table if p.startswith("/admin") and m != "HEAD"]
    assert ("GET", "/admin/requests") in routes
    return [*routes, ("DELETE", "/admin/requests/lg-unknown"), ("GET", "/dashboard"), ("GET", "/dashboard/x.js")]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def call(http: aiohttp.ClientSession, method: str, url: str, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with http.request(method, url, headers=headers) as resp:
        raw = await resp.read()
        is_json = resp.content_type == "application/json"
        return resp.status, orjson.loads(raw) if is_json else {}


async def test_tenant_keys_get_403_and_the_admin_key_200_on_every_admin_route(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS, admin=ADMIN)
    assert gw.gateway is not None
    async with aiohttp.ClientSession() as http:
        for method, path in admin_routes(gw.gateway):
            url = gw.url + path
            status, body = await call(http, method, url, "tenant-key")
            assert status == 403 and body["error"]["type"] == "permission_error", (path, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
            for key in (None, "wrong-key"):
                status, body = await call(http, method, url, key)
                assert status == 401 and body["error"]["type"] == "authentication_error", (path, key, body)
            status, body = await call(http, method, url, "admin-key")
            if method == "GET" and (path.startswith("/admin") or path == "/dashboard"):
                assert status == 200, (path, status, body)
            else:  # past the gate: the route's own answer (no such request, nothing to reload, no dashboard)
                assert status in (400, 404), (path, status, body)
        # The admin key is not a tenant key; /metrics stays open unless configured otherwise.
        assert (await call(http, "GET", gw.url + "/metrics", "tenant-key"))[0] == 200
        async with http.post(
            gw.url + "/v1/chat/completions",
            data=orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            headers={"Authorization": "Bearer admin-key"},
        ) as resp:
            assert resp.status == 401


async def test_metrics_can_require_an_admin_key(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=TENANTS,
        admin={**ADMIN, "metrics_require_key": True},
    )
    async with aiohttp.ClientSession() as http:
        assert (await call(http, "GET", gw.url + "/metrics", None))[0] == 401
        assert (await call(http, "GET", gw.url + "/metrics", "tenant-key"))[0] == 403
        async with http.get(gw.url + "/metrics", headers={"Authorization": "Bearer admin-key"}) as resp:
            assert resp.status == 200 and "lockgate_requests" in await resp.text()
        assert (await call(http, "GET", gw.url + "/health", None))[0] == 200


async def test_tenant_keys_without_an_admin_key_close_the_admin_api(start_sim, start_gateway):
    """The safe default: no one (tenant or anonymous, loopback or not) may list or cancel requests."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS)
    async with aiohttp.ClientSession() as http:
        for key in (None, "tenant-key"):
            for method, path in [("GET", "/admin/requests"), ("DELETE", "/admin/requests/x"), ("GET", "/dashboard")]:
                status, body = await call(http, method, gw.url + path, key)
                assert status == 403 and body["error"]["code"] == "admin_keys_not_configured", (path, body)
                assert "admin.keys" in body["error"]["message"]


async def test_an_admin_key_alone_guards_admin_routes_of_an_open_gateway(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], admin=ADMIN)
    async with aiohttp.ClientSession() as http:
        assert (await call(http, "GET", gw.url + "/admin/fleet", None))[0] == 401
        assert (await call(http, "GET", gw.url + "/admin/fleet", "admin-key"))[0] == 200
        async with http.post(
            gw.url + "/v1/chat/completions",
            data=orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ) as resp:
            assert resp.status == 200


async def test_a_browser_is_asked_for_basic_credentials_and_may_send_the_key_as_password(start_sim, start_gateway):
    """A browser cannot send a bearer token when it opens /dashboard: its 401 asks for Basic credentials, which
    the browser then sends with the page's own requests (/admin/* included)."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS, admin=ADMIN)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/dashboard") as resp:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Basic ")
        async with http.get(gw.url + "/admin/fleet") as resp:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer ")
        for user, password in [("ops", "admin-key"), ("admin-key", "")]:
            async with http.get(gw.url + "/admin/fleet", headers=basic(user, password)) as resp:
                assert resp.status == 200
        async with http.get(gw.url + "/dashboard", headers=basic("ops", "tenant-key")) as resp:
            assert resp.status == 403
        async with http.get(gw.url + "/admin/fleet", headers={"Authorization": "Basic !!not-base64"}) as resp:
            assert resp.status == 401


async def test_a_reload_that_adds_tenant_keys_closes_the_admin_api_at_once(stack, start_sim, tmp_path):
    """The gate reads the tenant book in force: an open gateway that gains tenant keys by a reload is no longer
    open to anyone; the new tenant's tokens are counted under its own name."""
    from lockgate.config import load_config
    from lockgate.server import GatewayServer

    sim = await start_sim()
    path = tmp_path / "gw.yaml"
    head = f"listen: {{host: 127.0.0.1, port: 0}}\nusage: {{path: '{tmp_path / 'u.sqlite3'}'}}\n"
    head += f"models: [{{name: m, instances: [{{url: '{sim.url}', engine: vllm}}]}}]\n"
    path.write_text(head)
    server = await stack.enter_async_context(GatewayServer(load_config(path), config_path=path))
    assert server.gateway is not None
    async with aiohttp.ClientSession() as http:
        assert (await call(http, "GET", server.url + "/admin/requests", None))[0] == 200
        path.write_text(head + f"tenants: [{{name: newco, keys: ['{hash_key('newco-key')}']}}]\n")
        assert (await call(http, "POST", server.url + "/admin/reload", None))[0] == 200
        status, body = await call(http, "GET", server.url + "/admin/requests", None)
        assert status == 403 and body["error"]["code"] == "admin_keys_not_configured"
        assert (await call(http, "GET", server.url + "/admin/requests", "newco-key"))[0] == 403
        assert (await call(http, "GET", server.url + "/metrics", None))[0] == 200
        data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        async with http.post(server.url + "/v1/chat/completions", data=data, headers=bearer("newco-key")) as resp:
            assert resp.status == 200
    assert 'lockgate_completion_tokens_total{model="m",tenant="newco"} 2.0' in server.gateway.metrics.render().decode()
    # The same reload with an admin key: the operator keeps the admin API, reload included (`admin` applied only at
    # a restart locked the operator out of `/admin/reload` itself: an outside run).
    path.write_text(
        head
        + f"tenants: [{{name: newco, keys: ['{hash_key('newco-key')}']}}]\n"
        + f"admin: {{keys: ['{hash_key('ops-key')}']}}\n"
    )
    async with aiohttp.ClientSession() as http:
        status, body = await call(http, "POST", server.url + "/admin/reload", None)  # (still closed: no key yet)
        assert status == 403
    assert server.gateway.reloader is not None
    diff = await server.gateway.reloader.reload()  # (SIGHUP's way)
    assert diff.admin_changed and "admin" not in diff.restart_required
    async with aiohttp.ClientSession() as http:
        assert (await call(http, "GET", server.url + "/admin/requests", "ops-key"))[0] == 200
        assert (await call(http, "POST", server.url + "/admin/reload", "ops-key"))[0] == 200
        assert (await call(http, "GET", server.url + "/admin/requests", "newco-key"))[0] == 403
        # `metrics_require_key` by a reload guards `/metrics` at once (the route table kept it open), and back.
        tenants = f"tenants: [{{name: newco, keys: ['{hash_key('newco-key')}']}}]\n"
        for required, anonymous in ((True, 401), (False, 200)):
            path.write_text(
                head
                + tenants
                + f"admin: {{keys: ['{hash_key('ops-key')}'], metrics_require_key: {str(required).lower()}}}\n"
            )
            assert (await call(http, "POST", server.url + "/admin/reload", "ops-key"))[0] == 200
            assert (await call(http, "GET", server.url + "/metrics", None))[0] == anonymous
            assert (await call(http, "GET", server.url + "/metrics", "ops-key"))[0] == 200


async def test_an_open_dashboard_feed_ends_when_a_reload_revokes_its_key(stack, start_sim, tmp_path):
    """An outside run: a `/dashboard/events` stream opened with an admin key went on sending the fleet, tenants and
    requests in flight every second after a reload rotated the key (or removed `admin:`), while a new request with
    the same key was refused. The gate in force is asked before each event: the stream ends with `event: end`
    (`"reason": "unauthorized"`); a key that is still valid keeps its stream."""
    from lockgate.config import load_config
    from lockgate.server import GatewayServer

    sim = await start_sim()
    path = tmp_path / "gw.yaml"
    head = f"listen: {{host: 127.0.0.1, port: 0}}\nusage: {{path: '{tmp_path / 'u.sqlite3'}'}}\n"
    head += f"models: [{{name: m, instances: [{{url: '{sim.url}', engine: vllm}}]}}]\n"
    head += "dashboard: {interval_ms: 100}\n"
    head += f"tenants: [{{name: acme, keys: ['{hash_key('tenant-key')}']}}]\n"

    def admin(*keys: str) -> str:
        return "admin: {keys: [" + ", ".join(f"'{hash_key(k)}'" for k in keys) + "]}\n"

    path.write_text(head + admin("old-key", "kept-key"))
    server = await stack.enter_async_context(GatewayServer(load_config(path), config_path=path))
    assert server.gateway is not None and server.gateway.reloader is not None

    async def first_event(http: aiohttp.ClientSession, key: str) -> tuple[aiohttp.ClientResponse, Any]:
        resp = await http.get(server.url + "/dashboard/events", headers=bearer(key))
        assert resp.status == 200
        lines = aiter(resp.content)
        assert (await anext(lines)).startswith(b"event: snapshot")
        return resp, lines

    async def ending(lines: Any) -> bytes:
        """The stream's `end` event's data line (the snapshots before it skipped)."""
        async with asyncio.timeout(10):  # bounds a failure only: events come every 100 ms
            async for line in lines:
                if line.startswith(b"event: end"):
                    return bytes(await anext(lines)).strip()
        raise AssertionError("the stream ended without an end event")

    async with aiohttp.ClientSession() as http:
        old, old_lines = await first_event(http, "old-key")
        kept, kept_lines = await first_event(http, "kept-key")
        path.write_text(head + admin("kept-key", "new-key"))  # `old-key` rotated out
        await server.gateway.reloader.reload()
        assert await ending(old_lines) == b'data: {"reason": "unauthorized"}'
        assert (await call(http, "GET", server.url + "/admin/requests", "old-key"))[0] == 401
        # The key still in force keeps its stream: events go on after the reload.
        for _ in range(3):
            async with asyncio.timeout(10):
                while not (await anext(kept_lines)).startswith(b"event: snapshot"):
                    pass
        path.write_text(head)  # no admin keys at all: the admin routes close (403) to everyone
        await server.gateway.reloader.reload()
        assert await ending(kept_lines) == b'data: {"reason": "unauthorized"}'
        old.close()
        kept.close()


async def _answer(
    http: aiohttp.ClientSession, url: str, auth: dict[str, str], method: str, path: str, **headers: str
) -> tuple[int, str | None]:
    """The status and error code of `method path` with the credentials `auth` and `headers`."""
    async with http.request(method, url + path, headers={**auth, **headers}) as resp:
        body = orjson.loads(await resp.read())
        return resp.status, body.get("error", {}).get("code") if isinstance(body, dict) else None


async def test_another_sites_page_cannot_change_anything_with_a_browsers_cached_credentials(start_sim, start_gateway):
    """Cross-site request forgery: the dashboard's Basic login is cached by the browser and sent with any request to
    this origin, also a form another site posts here. A change (reload, cancel) from another site's page is refused
    (403 `cross_site_request`); the dashboard's own requests, API clients (no Origin) and reads pass. The same holds
    on an open gateway, where no key is needed at all."""
    sim = await start_sim()
    for admin in (ADMIN, None):
        extra = {"tenants": TENANTS, "admin": admin} if admin is not None else {}
        gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], **extra)
        own = gw.url  # http://127.0.0.1:<port>: what the dashboard's page sends as its Origin
        host = own.split("://")[1]
        auth = basic("ops", "admin-key") if admin is not None else {}
        async with aiohttp.ClientSession() as http:
            status = functools.partial(_answer, http, own, auth)
            for method, path in (("POST", "/admin/reload"), ("DELETE", "/admin/requests/lg-unknown")):
                forged = [
                    {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
                    {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site", "Origin": own},  # another subdomain's page
                ]
                for headers in forged:
                    assert await status(method, path, **headers) == (403, "cross_site_request"), (path, headers)
                # Past the check: the route's own answer (nothing to reload, no such request).
                for headers in ({}, {"Origin": own}, {"Origin": own, "Sec-Fetch-Site": "same-origin"}):
                    assert (await status(method, path, **headers))[0] in (400, 404), (path, headers)
                behind_proxy = {"Origin": "https://gw.example", "Host": host, "X-Forwarded-Host": "gw.example"}
                assert (await status(method, path, **behind_proxy))[0] in (400, 404)
            assert (await status("GET", "/admin/requests", Origin="http://evil.example"))[0] == 200


def counting_engine(more: asyncio.Event) -> web.Application:
    """An engine that streams three tokens at once, then its end once `more` is set."""

    async def engine(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            event = {"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")

        await chunk({"role": "assistant", "content": ""})
        for word in ("one", " two", " three"):
            await chunk({"content": word})
        await more.wait()
        await chunk({}, "stop")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    app.router.add_get("/health", health)
    return app


async def test_an_answer_assembled_from_an_engine_stream_shows_its_tokens_while_generating(start_gateway, serve_app):
    """A non-streaming P2 request is read from its engine as a stream (to be resumable): while the engine generates,
    `GET /admin/requests` shows it `generating` with the tokens so far (it showed `connecting` and 0 until the end)."""
    more = asyncio.Event()
    gw = await start_gateway(
        [{"name": "m", "instances": [{"url": await serve_app(counting_engine(more)), "engine": "vllm"}]}]
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 10}
    # The gateway's engine client waits for more (`Response.wait`) each time it has read all that came: a look then.
    waiting = asyncio.Event()

    async def hook(name: str, data: object) -> None:
        if name == "Response.wait":
            waiting.set()

    async with aiohttp.ClientSession() as http, asyncio.timeout(5):
        with awaitpoints.installed(hook):
            post = http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-priority": "P2"})
            task = asyncio.create_task(post)
            listed: dict[str, Any] = {}
            while listed.get("completion_tokens") != 3:  # the engine's three tokens reach the gateway
                await waiting.wait()
                waiting.clear()
                async with http.get(gw.url + "/admin/requests") as resp:
                    listed = next(iter((await resp.json())["requests"]), {})
        assert listed["phase"] == "generating" and listed["stream"] is False
        more.set()
        async with await task as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "one two three"


async def test_a_non_streaming_client_of_a_shared_call_shows_its_tokens_while_generating(start_gateway, serve_app):
    """An outside run: a non-streaming client that joined a streaming flight showed `connecting` in `GET
    /admin/requests` for the whole generation. It shows `generating` and the shared call's tokens."""
    more = asyncio.Event()
    gw = await start_gateway(
        [{"name": "m", "instances": [{"url": await serve_app(counting_engine(more)), "engine": "vllm"}]}]
    )
    assert gw.gateway is not None
    flights = gw.gateway.dedup.flights
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 10, "temperature": 0}
    async with aiohttp.ClientSession() as http, asyncio.timeout(5):
        leader = await http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True})
        await flights.wait_until(lambda: any(f.tokens == 3 for f in flights._running))
        joiner = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body))
        await flights.wait_until(lambda: flights.statistics()["subscribers"] == 2)
        async with http.get(gw.url + "/admin/requests") as resp:
            listed = {r["stream"]: r for r in (await resp.json())["requests"]}
        assert (listed[False]["phase"], listed[False]["completion_tokens"]) == ("generating", 3)
        assert listed[True]["phase"] == "streaming"
        more.set()
        async with await joiner as resp:
            assert resp.status == 200 and resp.headers["x-lockgate-cache"] == "coalesced"
            assert (await resp.json())["choices"][0]["message"]["content"] == "one two three"
        await leader.read()
        leader.release()


async def _send_head(url: str, head: str) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a request's head only (no body yet) and read what the gateway answers (up to its close)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.encode())
    await writer.drain()
    return await reader.read(), reader, writer


async def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(start_sim, start_gateway):
    """An outside run: with tenant keys, a request with an unknown key and `Expect: 100-continue` was told to go on
    (`100 Continue`) and then waited for its body until the header timeout (408); without `Expect`, a 3 MB upload was
    read whole before the 401. The key is now checked when the head arrives: a body that follows is never read."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS, admin=ADMIN)
    for head in (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer wrong\r\nExpect: 100-continue\r\n"
        "Content-Length: 50\r\nContent-Type: application/json\r\n\r\n",
        "POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Length: 3000000\r\n\r\n",  # no key at all
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer wrong\r\nTransfer-Encoding: chunked\r\n\r\n",
        # An operator route: a tenant's key is not the operator's.
        "POST /admin/reload HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer tenant-key\r\nContent-Length: 10\r\n\r\n",
    ):
        answer, _, writer = await _send_head(gw.url, head)  # read() returns: the gateway closed the connection
        writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        assert b"100 Continue" not in answer, head
        head_part, _, body = rest.partition(b"\r\n\r\n")
        error = orjson.loads(body)["error"]
        if "/admin/" in head:
            assert status_line == b"HTTP/1.1 403 Forbidden" and error["type"] == "permission_error"
        else:
            assert status_line == b"HTTP/1.1 401 Unauthorized" and error["type"] == "authentication_error", answer
            assert b"www-authenticate: bearer" in head_part.lower() and b"x-request-id: " in head_part.lower()
            assert b"connection: close" in head_part.lower()
    # A valid key still sends its body and is served (on a connection that stays open).
    async with aiohttp.ClientSession() as http:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(gw.url + "/v1/chat/completions", json=chat, headers=bearer("tenant-key")) as resp:
            assert resp.status == 200
        async with http.post(gw.url + "/v1/chat/completions", json=chat, headers=bearer("wrong")) as resp:
            assert resp.status == 401
        async with http.get(gw.url + "/metrics", headers=bearer("admin-key")) as resp:
            assert 'lockgate_endpoint_requests_total{endpoint="chat",status="rejected"} 2.0' in await resp.text()
