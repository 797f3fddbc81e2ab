"""Credentials in instance URLs: `http://user:password@host` logs in to that engine with HTTP Basic (an explicit
`api_key` wins) and the password shows nowhere the gateway speaks: names, metrics, `/admin/fleet`, the response
header naming the instance, usage rows, error bodies, logs, the startup banner."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import urllib.parse

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.records import read_records
from lockgate.server import _banner

USER, PASSWORD = "alice", "s3cr3t-pw"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def assert_no_secret(text: str, where: str) -> None:
    for secret in (PASSWORD, BASIC.split()[1], f"{USER}:"):
        assert secret not in text, f"{secret!r} in {where}: {text[:2000]}"


@pytest.mark.parametrize("api_key", [None, "sk-engine"])
async def test_userinfo_is_basic_auth_and_never_shown(start_gateway, serve_app, tmp_path, caplog, api_key):
    caplog.set_level(logging.DEBUG)
    seen: list[tuple[str, str | None]] = []
    aborted = asyncio.Event()

    async def engine(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path == "/abort_request":
            aborted.set()
        if request.path == "/metrics":
            return web.Response(text="sglang:num_queue_reqs 0\n")
        if request.method == "POST":
            answer = {
                "id": "x",
                "object": "chat.completion",
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            return web.json_response(answer)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    live = (await serve_app(app)).replace("http://", f"http://{USER}:{PASSWORD}@")
    dead = f"http://{USER}:{PASSWORD}@127.0.0.1:{closed_port()}"
    key = {"api_key": api_key} if api_key else {}
    gw = await start_gateway(
        [
            {"name": "m", "instances": [{"url": live, "engine": "sglang", **key}]},
            {"name": "d", "retries": 0, "instances": [{"url": dead, "engine": "sglang", **key}]},
        ]
    )
    assert gw.gateway is not None
    fleet = gw.gateway.fleet
    await fleet.probe_all()
    assert fleet.scraper is not None
    await fleet.scraper.scrape_all()
    surfaces: dict[str, str] = {"banner": _banner(gw)}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            surfaces["x-lockgate-instance"] = resp.headers["x-lockgate-instance"]
        [dead_instance] = [i for i in fleet.instances.values() if i.name.endswith(dead.rpartition("@")[2])]
        dead_instance.healthy = True  # believed healthy: the request goes there and fails to connect
        async with http.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "d"}) as resp:
            assert resp.status == 502
            surfaces["502 body"] = await resp.text()
        for path in ("/admin/fleet", "/metrics", "/admin/requests", "/v1/models"):
            async with http.get(gw.url + path) as resp:
                surfaces[path] = await resp.text()
    [live_instance] = [i for i in fleet.instances.values() if i is not dead_instance]
    abort = live_instance.dialect.abort_call("r1")
    assert abort is not None
    fleet.send_abort(live_instance, abort)
    await aborted.wait()
    await gw.gateway.records.wait_flushed()
    surfaces["usage rows"] = orjson.dumps(read_records(str(tmp_path / "usage.sqlite3"))).decode()
    surfaces["logs"] = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for where, text in surfaces.items():
        assert_no_secret(text, where)
    # What is shown is the URL without its userinfo.
    assert surfaces["x-lockgate-instance"] == live.replace(f"{USER}:{PASSWORD}@", "")
    assert live.replace(f"{USER}:{PASSWORD}@", "") in surfaces["/admin/fleet"]
    assert live.replace(f"{USER}:{PASSWORD}@", "") in surfaces["banner"]
    # Every call to the engine logged in: generation, health probe, scrape, abort.
    expected = f"Bearer {api_key}" if api_key else BASIC
    assert {path for path, _ in seen} >= {"/v1/chat/completions", "/health", "/metrics", "/abort_request"}
    assert all(auth == expected for _, auth in seen), seen


def _escaped(text: str) -> str:
    """`text` as JSON `\\u` escapes (decoded, the same string)."""
    return "".join(f"\\u{ord(c):04x}" for c in text)


#: How an engine may repeat the credential it got: as it is, or in a form exact replacement does not catch (an outside
#: run got each of these through): the message is then withheld whole.
FORMS = {
    "exact": lambda auth: f"{auth} ({PASSWORD})",
    "lower": lambda auth: auth.lower(),
    "percent": lambda auth: urllib.parse.quote(auth),
    "json_escapes": _escaped,
}


@pytest.mark.parametrize("status", [400, 401, 500, "stream"])
@pytest.mark.parametrize("credential", ["api_key", "userinfo"])
@pytest.mark.parametrize("form", list(FORMS))
async def test_an_engine_repeating_the_gateways_credential_does_not_hand_it_to_the_client(
    start_gateway, serve_app, tmp_path, status, credential, form
):
    """Some engines and proxies repeat the `Authorization` they got in their errors ("Incorrect API key provided:
    Bearer ..."): the client's error, the usage record and `/admin/fleet` get it redacted, or the message withheld
    when the copy is in another form (another case, percent-encoded, JSON escapes)."""

    async def engine(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.json_response({})
        await request.read()
        message = f"Incorrect API key provided: {FORMS[form](request.headers.get('Authorization', ''))}"
        if status == "stream":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            error = b'{"error": {"message": "%s", "type": "InternalServerError", "code": 500}}' % message.encode()
            await response.write(b"data: " + error + b"\n\ndata: [DONE]\n\n")
            return response
        # (Written by hand: the message's JSON escapes are the engine's, not re-encoded.)
        body = f'{{"error": {{"message": "{message}", "type": "error", "code": {status}}}}}'
        return web.Response(text=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    url = await serve_app(app)
    if credential == "userinfo":
        spec = {"url": url.replace("http://", f"http://{USER}:{PASSWORD}@")}
    else:
        spec = {"url": url, "api_key": PASSWORD}
    gw = await start_gateway([{"name": "m", "retries": 0, "instances": [{**spec, "engine": "vllm"}]}])
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": status == "stream"}) as resp:
            answer = await resp.text()
        async with http.get(gw.url + "/admin/fleet") as resp:
            fleet = await resp.text()
    if form == "exact":  # (the rest of the message stays)
        assert "Incorrect API key provided" in answer and "[redacted]" in answer
    else:  # redacted where the form is still exact (a lower-case key lower-cased), else withheld
        assert "[redacted]" in answer or "withheld" in answer
    await gw.gateway.records.wait_flushed()
    rows = orjson.dumps(read_records(str(tmp_path / "usage.sqlite3"))).decode()
    assert "[redacted]" in rows or "withheld" in rows
    for where, text in {"answer": answer, "usage rows": rows, "/admin/fleet": fleet}.items():
        assert_no_secret(text, where)
        assert_no_secret(text.lower(), where + " (lower-cased)")
        assert_no_secret(urllib.parse.unquote(text), where + " (percent-decoded)")
        with contextlib.suppress(orjson.JSONDecodeError):
            assert_no_secret(orjson.dumps(orjson.loads(text)).decode(), where + " (JSON-decoded)")
