"""The acceptance run of issue 12 with real processes: a real etcd, 2 sidecars (`lockgate sidecar`) with 2
simulated engines each, 2 central replicas (`lockgate serve`); requests alternate between the replicas.

A sidecar killed with SIGKILL: the streams in flight through it end with a clean SSE error and a usage
record at their replica; its engines leave both replicas within the lease TTL; requests meanwhile all
succeed (a refused connection ejects every engine behind that sidecar at once, and the request is
retried elsewhere before its first byte). It restarts and its engines return. etcd stops: the replicas
keep serving on the last-known fleet and say so (`lockgate_cluster_connected 0`); etcd returns: they
resynchronise on their own. No other request fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from lockgate.records import read_records
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import central_config, poll_until, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer, free_port
from tests.integration.cancel_support import StreamReader


class Lockgate:
    """One `lockgate serve|sidecar` child process on a fixed port (so that a restart keeps its address)."""

    def __init__(self, command: str, config: dict[str, Any], path: Path) -> None:
        self.command = command
        self.port = free_port()
        config["listen"] = {"host": "127.0.0.1", "port": self.port}
        path.write_text(yaml.safe_dump(config))
        self.config_path = path
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lockgate", self.command, "--config", str(self.config_path),
            stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):
            while b"lockgate listening on" not in await self.proc.stdout.readline():
                assert not self.proc.stdout.at_eof(), f"{self.command} exited early"

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
            assert self.proc.stdout is not None
            await self.proc.stdout.read()
            await self.proc.wait()
        self.proc = None


def chat(content: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def fleet_view(session: aiohttp.ClientSession, central: Lockgate) -> dict[str, Any]:
    async with session.get(central.url + "/admin/fleet") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def test_two_replicas_two_sidecars_kill_restart_and_etcd_outage(
    stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    stack.callback(etcd.stop)
    name = unique_cluster("accept")
    sims = [await stack.enter_async_context(SimServer(SimConfig(models=("m",), seed=i, tpot_ms=10))) for i in range(4)]
    sidecars = [
        Lockgate(
            "sidecar",
            sidecar_config(etcd.url, name, sims[2 * n : 2 * n + 2], str(tmp_path / f"s{n}.sqlite3"), node=f"node-{n}"),
            tmp_path / f"sidecar{n}.yaml",
        )
        for n in range(2)
    ]
    centrals = [
        Lockgate("serve", central_config(etcd.url, name, str(tmp_path / f"c{n}.sqlite3")), tmp_path / f"c{n}.yaml")
        for n in range(2)
    ]
    for proc in [*sidecars, *centrals]:
        stack.push_async_callback(proc.stop, signal.SIGKILL)
    await asyncio.gather(*(p.start() for p in [*sidecars, *centrals]))
    session = await stack.enter_async_context(aiohttp.ClientSession())

    async def routable_everywhere(n: int) -> None:
        views: list[dict[str, Any]] = []

        async def ok() -> bool:
            views[:] = [await fleet_view(session, c) for c in centrals]
            return all(sum(i["routable"] for i in v["instances"]) == n for v in views)

        await poll_until(ok, what=f"{n} routable engines at both replicas")

    await routable_everywhere(4)

    sent = 0
    failures: list[tuple[int, bytes]] = []

    async def alternate(count: int) -> None:
        nonlocal sent
        for _ in range(count):
            central = centrals[sent % 2]
            sent += 1
            async with session.post(central.url + "/v1/chat/completions", json=chat(f"q{sent}")) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    failures.append((resp.status, raw))

    await alternate(8)

    # Streams in flight on every engine, then SIGKILL one sidecar.
    readers: list[tuple[str, StreamReader]] = []
    responses: list[aiohttp.ClientResponse] = []
    for n in range(8):
        resp = await session.post(
            centrals[n % 2].url + "/v1/chat/completions", json=chat(f"long {n}", stream=True, max_tokens=300)
        )
        responses.append(resp)
        assert resp.status == 200
        reader = StreamReader(resp)
        await reader.read_tokens(1)
        readers.append((resp.headers["x-lockgate-instance"], reader))
    on_killed = [r for instance, r in readers if instance.startswith("node-0/")]
    survivors = [r for instance, r in readers if not instance.startswith("node-0/")]
    assert on_killed and survivors
    await sidecars[0].stop(signal.SIGKILL)
    # The streams finish in the background while the rest goes on (the survivors take ~3 s).
    streams = asyncio.gather(*(reader.read_to_end() for _, reader in readers))
    await alternate(6)  # at once: the replicas have not heard of the death yet
    await routable_everywhere(2)  # the lease expired: node-0's engines left both replicas
    await alternate(6)

    await sidecars[0].start()
    await routable_everywhere(4)
    await alternate(6)

    # etcd goes away: last-known state, said in metrics; etcd returns: resynchronised.
    etcd.stop()

    async def connected(central: Lockgate) -> bool:
        return bool((await fleet_view(session, central))["cluster"]["connected"])

    for central in centrals:

        async def disconnected(c: Lockgate = central) -> bool:
            return not await connected(c)

        await poll_until(disconnected, what="the replica to notice etcd is gone")
        async with session.get(central.url + "/metrics") as resp:
            assert "lockgate_cluster_connected 0.0" in await resp.text()
    await alternate(6)
    etcd.start()
    for central in centrals:
        await poll_until(lambda c=central: connected(c), what="the replica to reconnect")  # type: ignore[misc]
    await routable_everywhere(4)
    await alternate(6)

    assert failures == [], failures
    async with asyncio.timeout(20):
        await streams
    for reader in on_killed:
        assert not reader.done and reader.errors(), "a broken stream ends with an SSE error, never [DONE]"
    for reader in survivors:
        assert reader.done and not reader.errors()
    for resp in responses:
        resp.release()
    for central in centrals:
        await central.stop()
    records = [r for n in range(2) for r in read_records(str(tmp_path / f"c{n}.sqlite3"))]
    assert len(records) == sent + len(readers)
    broken = [r for r in records if r["status"] != "completed"]
    assert len(broken) == len(on_killed)
    assert all(r["status"] == "error" and r["instance"].startswith("node-0/") for r in broken), broken
    assert orjson.dumps(sorted(r["model"] for r in records)) == orjson.dumps(["m"] * len(records))
