"""The access log of a running gateway: one JSON line per finished request, written by the usage writer."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from lockgate.admission.tenants import hash_key
from tests.conftest import instance


async def test_one_line_per_finished_request_without_secrets(start_sim, start_gateway, tmp_path):
    sim = await start_sim()
    path = tmp_path / "access.log"
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, name="eng-a")]}],
        tenants=[{"name": "acme", "keys": [hash_key("sk-tenant-secret")]}],
        access_log={"enabled": True, "path": str(path)},
    )
    assert gw.gateway is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "my private question"}], "max_tokens": 3}
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-tenant-secret"}) as http:
        for stream in (False, True):
            headers = {"x-request-id": f"client-{stream}", "x-priority": "P0"}
            async with http.post(
                gw.url + "/v1/chat/completions", data=orjson.dumps({**body, "stream": stream}), headers=headers
            ) as resp:
                assert resp.status == 200
                await resp.read()
    await gw.gateway.records.wait_flushed()
    text = path.read_text()
    assert "sk-tenant-secret" not in text and "my private question" not in text
    lines = [orjson.loads(line) for line in text.splitlines()]
    assert [line["client_request_id"] for line in lines] == ["client-False", "client-True"]
    for line in lines:
        assert (line["tenant"], line["model"], line["instance"], line["priority"]) == ("acme", "m", "eng-a", "P0")
        assert (line["status"], line["http_status"], line["cancel_reason"]) == ("completed", 200, None)
        assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
        assert 0 < line["ttft_ms"] <= line["duration_ms"]
        assert line["cache"] and line["request_id"].startswith("lg-")


async def test_prompts_are_logged_only_when_enabled(start_sim, start_gateway, tmp_path):
    sim = await start_sim()
    path = tmp_path / "access.log"
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        access_log={"enabled": True, "path": str(path), "include_prompts": True},
    )
    assert gw.gateway is not None
    messages = [{"role": "user", "content": "log me"}]
    async with aiohttp.ClientSession() as http:
        data = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2})
        async with http.post(gw.url + "/v1/chat/completions", data=data) as resp:
            assert resp.status == 200
    await gw.gateway.records.wait_flushed()
    [line] = [orjson.loads(x) for x in path.read_text().splitlines()]
    assert line["prompt"] == messages


async def test_an_access_log_that_cannot_be_opened_stops_the_start_with_one_line(start_sim, tmp_path):
    from lockgate.config import parse_config
    from lockgate.server import GatewayServer, StartupError

    sim = await start_sim()
    path = tmp_path / "missing-dir" / "access.log"
    config = parse_config(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "usage": {"path": str(tmp_path / "usage.sqlite3")},
            "models": [{"name": "m", "instances": [instance(sim)]}],
            "access_log": {"enabled": True, "path": str(path)},
        }
    )
    with pytest.raises(StartupError) as info:
        async with GatewayServer(config):
            pass
    assert str(info.value) == f"cannot open the access log {str(path)!r}: No such file or directory"
