"""`lockgate serve --workers 2`: two processes on one port, each a replica of the cluster; SIGTERM to the
supervisor stops both, which exit cleanly. Without a `cluster:` section (or a fixed port) it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from lockgate.config import parse_config
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from lockgate.workers import WorkersError, run_workers
from tests.cluster.support import central_config, poll_until, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer, free_port


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


async def test_two_workers_share_a_port_as_replicas(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("workers")
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("m",), fast=True)))
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / "s.sqlite3"), "node-w")), role="sidecar"
        )
    )
    port = free_port()
    config: dict[str, Any] = central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))
    config["listen"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / "central.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lockgate", "serve", "--config", str(path), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, env=env(),
    )  # fmt: skip
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(30):
            for _ in range(2):
                while b"lockgate listening on" not in await proc.stdout.readline():
                    assert not proc.stdout.at_eof(), "a worker exited early"
        session = await stack.enter_async_context(aiohttp.ClientSession())

        async def both_replicas_ready() -> bool:
            async with session.get(url + "/admin/fleet") as resp:
                cluster = (await resp.json())["cluster"]
            return len(cluster["replicas"]) == 2 and [n["node"] for n in cluster["nodes"]] == ["node-w"]

        await poll_until(both_replicas_ready, what="two replicas that see the sidecar")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(6):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.stdout.read()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    names = await asyncio.to_thread(lambda: {p.name for p in tmp_path.glob("c.sqlite3.worker-*")})
    assert {"c.sqlite3.worker-0", "c.sqlite3.worker-1"} <= names  # one usage database per worker


def test_workers_need_a_cluster_and_a_port() -> None:
    alone = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]})
    with pytest.raises(WorkersError, match="needs a configuration file with a `cluster:` section"):
        run_workers(alone, "alone.yaml", 2, host=None, port=None)
    clustered = parse_config({"cluster": {"name": "c"}, "listen": {"port": 0}})
    with pytest.raises(WorkersError, match="needs a TCP port"):
        run_workers(clustered, "c.yaml", 2, host=None, port=None)
