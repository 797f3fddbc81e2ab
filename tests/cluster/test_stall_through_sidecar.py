"""An engine behind a sidecar that goes silent mid-stream: the sidecar ends its stream with `upstream_stalled`, and the
central passes that code on to its client (it said `upstream_stream_error`, hiding why: an outside run)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import orjson

from lockgate.config import parse_config
from lockgate.server import GatewayServer
from tests.cluster.support import central_config, cluster_section, unique_cluster
from tests.etcd_support import EtcdServer
from tests.integration.fake_engines import hung_engine


async def test_a_stall_behind_a_sidecar_reaches_the_client_as_a_stall(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("stall")
    gone = asyncio.Event()
    url = await hung_engine(stack, 2, gone)
    sidecar = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_ms": 60000},
        "usage": {"path": str(tmp_path / "s.sqlite3")},
        "upstream": {"stall_timeout_ms": 100},
        "models": [{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "frozen"}]}],
        "cluster": cluster_section(etcd.url, name, node="node-0"),
    }
    await stack.enter_async_context(GatewayServer(parse_config(sidecar), role="sidecar"))
    cent = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    assert cent.gateway is not None
    async with asyncio.timeout(15):
        await cent.gateway.fleet.wait_until(lambda f: "m" in f.pools and f.pools["m"].ready())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(cent.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b'"content":"a"' in raw and b"[DONE]" not in raw
    last = orjson.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_stalled", last
    assert "sent nothing for 0.1s" in last["error"]["message"]
    async with asyncio.timeout(5):
        await gone.wait()
