"""A preemptible chat generation whose engine breaks midway, behind a sidecar: the central continues it on another
node. The central speaks to sidecars as to OpenAI servers, which do not continue a final assistant message: it must
judge by the engine behind each sidecar (an outside run: chat P2 streams that broke ended in an error event through a
central, while text completions went on)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import orjson

from lockgate.config import parse_config
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import central_config, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer


async def test_a_broken_chat_generation_of_a_preemptible_class_goes_on_at_another_node(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("failover")
    # Every engine drops its connection after 3 tokens: a 5-token answer breaks once, and its 2-token continuation
    # at the other node completes.
    sims = [await stack.enter_async_context(SimServer(SimConfig(models=("m",), seed=n))) for n in range(2)]
    for sim in sims:
        sim.control.reset_after_tokens = 3
    for n, sim in enumerate(sims):
        config = sidecar_config(etcd.url, name, [sim], str(tmp_path / f"s{n}.sqlite3"), f"node-{n}")
        await stack.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(
        lambda f: "m" in f.pools and sum(i.routable for i in f.pools["m"].instances) == 2
    )
    assert all(i.continues_chat for i in central.gateway.fleet.pools["m"].instances)  # vLLM behind each sidecar
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(central.url + "/v1/chat/completions", json=body, headers={"x-priority": "P2"}) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]", raw[-300:]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert sum(1 for c in chunks for choice in c["choices"] if choice["delta"].get("content")) == 5
    assert sum(s.statistics()["requests_started"] for s in sims) == 2  # the broken call, and its continuation
