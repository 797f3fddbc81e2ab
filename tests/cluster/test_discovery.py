"""A central gateway discovers a sidecar's engines through a real etcd and routes to each exact engine
through the sidecar; it keeps serving while etcd is down and resynchronises when etcd returns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.cluster.discovery import Discovery
from lockgate.cluster.keys import EngineRecord, NodeRecord, encode_node, node_key
from lockgate.cluster.store import WatchEvent
from lockgate.config import parse_config
from lockgate.fleet.fleet import GONE_GRACE_S, Fleet
from lockgate.fleet.report import describe_fleet
from lockgate.metrics import GatewayMetrics
from lockgate.server import GatewayServer, StartupError, _banner
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import central_config, eventually, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer


def chat(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3}


def routable(fleet: Fleet, model: str = "m") -> int:
    pool = fleet.pools.get(model)
    return 0 if pool is None else sum(1 for i in pool.instances if i.routable)


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no metric {name}")


async def start_sims(stack: contextlib.AsyncExitStack, n: int) -> list[SimServer]:
    return [await stack.enter_async_context(SimServer(SimConfig(models=("m",), seed=i))) for i in range(n)]


async def test_central_routes_to_each_engine_through_its_sidecar(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lockgate.cluster.discovery")
    name = unique_cluster("discovery")
    sims = await start_sims(stack, 2)
    config = sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="node-a")
    config["cluster"]["engine_choice"] = "central"
    sidecar = GatewayServer(parse_config(config), role="sidecar")
    await stack.enter_async_context(sidecar)
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"), routing="round_robin")))
    )
    assert central.gateway is not None
    fleet = central.gateway.fleet
    await fleet.wait_until(lambda f: routable(f) == 2)
    names = sorted(i.name for i in fleet.pools["m"].instances)
    assert names == ["node-a/engine-0", "node-a/engine-1"]
    # Each says at start what its cluster section makes it do.
    assert f"cluster {name!r}: discovering the sidecars' engines through etcd at {etcd.url}" in _banner(central)
    assert f"cluster {name!r}: publishing these engines through etcd at {etcd.url}" in _banner(sidecar)
    # A sidecar's banner sends clients to the centrals, not to a curl of the sidecar itself (a newcomer's run).
    assert "through the cluster's central gateways" in _banner(sidecar) and "Try it" not in _banner(sidecar)

    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.get(central.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
    seen = []
    for i in range(4):
        async with session.post(central.url + "/v1/chat/completions", json=chat(f"hello {i}")) as resp:
            assert resp.status == 200, await resp.text()
            seen.append(resp.headers["x-lockgate-instance"])
            assert (await resp.json())["choices"][0]["message"]["content"]
    # Round-robin at the central gateway; the sidecar honoured each choice (x-lockgate-engine).
    assert sorted(seen) == ["node-a/engine-0"] * 2 + ["node-a/engine-1"] * 2
    assert [s.statistics()["requests_started"] for s in sims] == [2, 2]

    async with session.get(central.url + "/admin/fleet") as resp:
        report = await resp.json()
    assert report["cluster"]["connected"] is True
    assert [n["node"] for n in report["cluster"]["nodes"]] == ["node-a"]
    sources = report["instances"][0]["sources"]
    assert sources["sidecar"]["node"] == "node-a" and sources["sidecar"]["age_s"] < 5
    async with session.get(central.url + "/metrics") as resp:
        text = await resp.text()
    assert metric(text, "lockgate_cluster_connected") == 1.0
    assert metric(text, "lockgate_cluster_nodes") == 1.0

    # A sidecar that stops cleanly revokes its lease: its engines leave at once, and so does the model
    # nobody configured at the central gateway. For a while its clients are told to retry (a sidecar restarting
    # takes seconds: a 404 ended every request of a single-node model's planned restart, as SDKs do not retry it),
    # then that it does not exist.
    async with session.post(
        central.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}
    ) as r:
        stored = central.url + f"/v1/responses/{(await r.json())['id']}"
    await sidecar.shutdown(drain_s=1)
    await fleet.wait_until(lambda f: "m" not in f.pools)
    async with session.post(central.url + "/v1/chat/completions", json=chat("gone")) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert "left the cluster" in (await resp.json())["error"]["message"]
    # (A stored response made there likewise: it was 404, final to an SDK, while its only sidecar restarted.)
    async with session.get(stored) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "response_unavailable"
    async with session.post(central.url + "/v1/chat/completions", json={**chat("x"), "model": "never"}) as resp:
        assert resp.status == 404
    left, pool = fleet._gone["m"]
    fleet._gone["m"] = (left - GONE_GRACE_S, pool)  # the grace has passed
    async with session.post(central.url + "/v1/chat/completions", json=chat("gone")) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["param"] == "model"
    async with session.get(stored) as resp:
        assert resp.status == 404
    # Idle, its drain published nothing: its last record says it stopped all the same (an outside run saw an idle
    # sidecar's clean stop taken for a lease that expired: 503 for a lease TTL, then 404).
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sidecar node-a ")]
    assert said[-1] == "sidecar node-a left (it stopped)" and not any("lost its key" in m for m in said)


@pytest.mark.parametrize("choice", ["sidecar", "central"])
async def test_who_picks_the_engine_among_a_sidecars_own(
    choice: str, etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """`cluster.engine_choice`: `sidecar` (the default) lets the central's pick choose the node only, and the
    sidecar routes by its own policy; `central` sends each request to the engine the central named. Either
    way the central names the engine that served, in the response and in its usage record."""
    name = unique_cluster("choice")
    sims = await start_sims(stack, 2)
    config = sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="node-c")
    config["models"][0]["routing"] = {"policy": "round_robin"}
    config["cluster"]["engine_choice"] = choice
    await stack.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
    usage = tmp_path / "c.sqlite3"
    # The central hashes every request of one user to the same engine.
    central = GatewayServer(parse_config(central_config(etcd.url, name, str(usage), routing="consistent_hash")))
    await stack.enter_async_context(central)
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: routable(f) == 2)
    session = await stack.enter_async_context(aiohttp.ClientSession())
    seen = []
    for i in range(4):
        async with session.post(central.url + "/v1/chat/completions", json={**chat(f"hi {i}"), "user": "u"}) as resp:
            assert resp.status == 200, await resp.text()
            seen.append(resp.headers["x-lockgate-instance"])
    started = [s.statistics()["requests_started"] for s in sims]
    if choice == "sidecar":
        assert started == [2, 2]  # the sidecar's round robin, whatever the central named
    else:
        assert sorted(started) == [0, 4]
    served = [f"node-c/engine-{n}" for n, count in enumerate(started) for _ in range(count)]
    assert sorted(seen) == served
    # The central's accounting follows the engine that served (its lease moves there when the sidecar's
    # answer names another engine): each engine's timings hold its own answers, no slot is left taken.
    engines = sorted(central.gateway.fleet.pools["m"].instances, key=lambda i: i.name)
    assert [i.own.whole.samples for i in engines] == started
    assert [(i.in_flight, i.own.pending, i.own.queued_prompt_tokens) for i in engines] == [(0, 0, 0)] * 2
    await central.shutdown(drain_s=1)
    with contextlib.closing(sqlite3.connect(usage)) as db:
        recorded = sorted(row[0] for row in db.execute("SELECT instance FROM usage"))
    assert recorded == served


async def test_central_serves_through_an_etcd_outage_and_resyncs(
    stack: contextlib.AsyncExitStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    stack.callback(etcd.stop)
    name = unique_cluster("outage")
    sims = await start_sims(stack, 1)
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="node-b")),
            role="sidecar",
        )
    )
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    assert central.gateway is not None
    discovery = central.cluster
    fleet = central.gateway.fleet
    await fleet.wait_until(lambda f: routable(f) == 1)
    session = await stack.enter_async_context(aiohttp.ClientSession())

    async def ask(content: str) -> int:
        async with session.post(central.url + "/v1/chat/completions", json=chat(content)) as resp:
            await resp.read()
            return resp.status

    etcd.stop()
    await eventually(lambda: not discovery.connected, what="the central gateway to notice etcd is gone")
    assert await ask("during the outage") == 200  # last-known state
    async with session.get(central.url + "/metrics") as resp:
        text = await resp.text()
    assert metric(text, "lockgate_cluster_connected") == 0.0
    assert metric(text, "lockgate_cluster_state_age_seconds") > 0
    async with session.get(central.url + "/admin/fleet") as resp:
        report = await resp.json()
    assert report["cluster"]["connected"] is False
    assert report["cluster"]["nodes"][0]["age_s"] > 0

    said = [r for r in caplog.records if r.name == "lockgate.cluster.discovery"]
    assert [r.levelname for r in said if "watch lost" in r.message] == ["WARNING"]  # once, not every retry

    resyncs = discovery.resyncs
    caplog.set_level(logging.INFO, logger="lockgate.cluster.discovery")
    etcd.start()
    await eventually(lambda: discovery.connected and discovery.resyncs > resyncs, what="resynchronisation")
    assert routable(fleet) == 1
    assert await ask("after the outage") == 200
    # The operator who saw the loss also sees the return.
    assert "etcd watch resumed: 1 sidecar(s) in the fleet" in caplog.text


@pytest.mark.parametrize("bad", [b"not json", b'{"node": "x"}', b'{"node": "x", "url": "ftp://h", "engines": []}'])
def test_unusable_records_are_ignored(bad: bytes) -> None:
    from lockgate.cluster.keys import decode_node

    record = decode_node(bad)
    assert record is None or record.engines == ()


async def test_a_central_authenticates_at_sidecars_with_tenants(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    from lockgate.admission.tenants import hash_key

    name = unique_cluster("auth")
    sims = await start_sims(stack, 1)
    sidecar = sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="node-k")
    sidecar["tenants"] = [{"name": "centrals", "keys": [hash_key("sk-central")]}]
    await stack.enter_async_context(GatewayServer(parse_config(sidecar), role="sidecar"))
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"), api_key="sk-central")))
    )
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: routable(f) == 1)
    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.post(central.url + "/v1/chat/completions", json=chat("with a key")) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_reload_keeps_the_discovered_engines_and_the_limit_shares(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """A central replica's configuration reload (issue 16) rebuilds its pools from the file: the engines
    it discovered stay in theirs, and a tenant added by the reload takes part in the limit split."""
    import yaml

    from lockgate.admission.tenants import hash_key

    name = unique_cluster("reload")
    sims = await start_sims(stack, 2)
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="node-r")),
            role="sidecar",
        )
    )
    data = central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))
    path = tmp_path / "central.yaml"
    path.write_text(yaml.safe_dump(data))
    central = await stack.enter_async_context(GatewayServer(parse_config(data), config_path=path))
    assert central.gateway is not None
    fleet = central.gateway.fleet
    await fleet.wait_until(lambda f: routable(f) == 2)

    assert fleet.pools["m"].config.timeout_ms is None
    data["tenants"] = [{"name": "acme", "keys": [hash_key("sk-acme")], "requests_per_minute": 60}]
    # Settings for the discovered model, added by the reload: they apply (the discovered pool was kept, with
    # defaults, though the reload said the model was added).
    data["models"] = [{"name": "m", "timeout_ms": 4321}]
    path.write_text(yaml.safe_dump(data))
    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.post(central.url + "/admin/reload") as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["changes"]["models"]["added"] == ["m"]
    assert routable(fleet) == 2
    assert fleet.pools["m"].config.timeout_ms == 4321
    headers = {"Authorization": "Bearer sk-acme"}
    async with session.post(central.url + "/v1/chat/completions", json=chat("after"), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    assert central.cluster.limits.shares() == {"acme": 1.0}


async def test_a_sidecars_discovered_concurrency_limit_reaches_the_centrals(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """The limit a sidecar discovers from its engine's queue (`fleet/capacity.py`) is what it publishes, and
    what a central routes and admits by (its pool's capacity)."""
    name = unique_cluster("limit")
    (sim,) = await start_sims(stack, 1)
    side = await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / "s.sqlite3"), node="n")), role="sidecar"
        )
    )
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    assert side.gateway is not None and central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: routable(f) == 1)
    (remote,) = central.gateway.fleet.pools["m"].instances
    (engine,) = side.gateway.fleet.pools["m"].instances
    assert remote.max_concurrency == engine.max_concurrency == 256  # the ceiling, until discovered
    # The engine runs 3 and queues 4: the first such scrape holds the limit at 3 (the discovery window), the
    # second confirms it (saturated at 3).
    assert engine.concurrency.observe(3, 4, 3)
    engine.concurrency.observe(3, 4, 3)
    assert engine.max_concurrency == 3
    scheduler = central.gateway.admission.schedulers["m"]
    await eventually(lambda: remote.max_concurrency == 3 and scheduler.core.capacity == 3, what="the published limit")


async def test_a_sidecar_that_restarts_gets_traffic_again(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """A node that leaves (its sidecar stops: a restart, a rolling upgrade) and comes back under its old name
    rejoins the model's pool, while the model stayed served by another node all along."""
    name = unique_cluster("rejoin")
    sims = await start_sims(stack, 2)

    def sidecar(node: str, sim: SimServer, port: int = 0) -> GatewayServer:
        config = sidecar_config(etcd.url, name, [sim], str(tmp_path / f"{node}.sqlite3"), node=node)
        config["listen"]["port"] = port
        return GatewayServer(parse_config(config), role="sidecar")

    first = await stack.enter_async_context(sidecar("node-a", sims[0]))
    await stack.enter_async_context(sidecar("node-b", sims[1]))
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"), routing="round_robin")))
    )
    assert central.gateway is not None
    fleet = central.gateway.fleet
    await fleet.wait_until(lambda f: routable(f) == 2)
    port = int(first.url.rsplit(":", 1)[1])
    await first.shutdown(drain_s=1)
    await fleet.wait_until(lambda f: [i.name for i in f.pools["m"].instances] == ["node-b/engine-0"])
    await stack.enter_async_context(sidecar("node-a", sims[0], port))  # the same node again, at its address
    await fleet.wait_until(lambda f: routable(f) == 2)
    session = await stack.enter_async_context(aiohttp.ClientSession())
    seen = set()
    for i in range(4):
        async with session.post(central.url + "/v1/chat/completions", json=chat(f"again {i}")) as resp:
            assert resp.status == 200, await resp.text()
            seen.add(resp.headers["x-lockgate-instance"])
    assert seen == {"node-a/engine-0", "node-b/engine-0"}


async def test_a_request_on_a_sidecar_that_dies_is_retried_on_another_node(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """A non-streaming request in flight through a sidecar that dies (its connection drops before an answer) is
    retried before its first byte, and not on the engine beside it behind the same dead sidecar."""
    name = unique_cluster("crash")
    sims = await start_sims(stack, 3)
    dying = GatewayServer(
        parse_config(sidecar_config(etcd.url, name, sims[:2], str(tmp_path / "a.sqlite3"), node="node-a")),
        role="sidecar",
    )
    await stack.enter_async_context(dying)
    central_cfg = central_config(etcd.url, name, str(tmp_path / "c.sqlite3"), routing="round_robin")
    central = await stack.enter_async_context(GatewayServer(parse_config(central_cfg)))
    assert central.gateway is not None
    fleet = central.gateway.fleet
    await fleet.wait_until(lambda f: routable(f) == 2)
    other = sidecar_config(etcd.url, name, sims[2:], str(tmp_path / "b.sqlite3"), node="node-b")
    await stack.enter_async_context(GatewayServer(parse_config(other), role="sidecar"))
    await fleet.wait_until(lambda f: routable(f) == 3)
    assert [i.name for i in fleet.pools["m"].instances] == ["node-a/engine-0", "node-a/engine-1", "node-b/engine-0"]
    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.post(central.url + "/v1/chat/completions", json=chat("first")) as resp:
        assert resp.headers["x-lockgate-instance"] == "node-a/engine-0"  # round robin: the next goes to engine-1
    sims[0].control.hold = sims[1].control.hold = True
    held = asyncio.create_task(session.post(central.url + "/v1/chat/completions", json=chat("held")))
    async with asyncio.timeout(10):
        await sims[1].wait_held(1)
    # node-a dies: it takes no new connection and its open ones drop (what a killed process does to them).
    assert dying._http is not None
    dying._http.stop_accepting()
    for connection in list(dying._http.live):
        connection.abort()
    async with asyncio.timeout(10):
        resp = await held
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-lockgate-instance"] == "node-b/engine-0"
    resp.release()


async def test_a_sidecar_that_answered_an_error_is_not_asked_again_through_its_other_engine(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """An outside run: both engines behind one sidecar died; the sidecar answered 503 (it had tried both), and the
    central's one retry went to the other engine behind that same sidecar, which answered the same: clients got 503
    while another node was healthy. A sidecar's failure rules out its address for the retry, as a dropped
    connection does."""
    name = unique_cluster("node-error")
    sims = await start_sims(stack, 3)
    for node, engines in (("node-a", sims[:2]), ("node-b", sims[2:])):
        config = sidecar_config(etcd.url, name, engines, str(tmp_path / f"{node}.sqlite3"), node=node)
        await stack.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
    central_cfg = central_config(etcd.url, name, str(tmp_path / "c.sqlite3"), routing="round_robin")
    central = await stack.enter_async_context(GatewayServer(parse_config(central_cfg)))
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: routable(f) == 3)
    sims[0].control.fail_status = sims[1].control.fail_status = 503
    session = await stack.enter_async_context(aiohttp.ClientSession())
    for i in range(4):  # round robin: each engine of node-a is the first choice of some of them
        async with session.post(central.url + "/v1/chat/completions", json=chat(f"failing node {i}")) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-lockgate-instance"] == "node-b/engine-0"


async def test_a_node_whose_key_expired_keeps_its_engines_for_a_lease_ttl_unless_it_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside run: after etcd stalled past the lease TTL (or lost its data), every node key expired and the
    centrals dropped every engine before the sidecars re-registered ~50 ms later: clients got 404
    `model_not_found` (which SDKs do not retry) for a model served by live sidecars, and every engine was rebuilt.
    Now a node whose key went without it stopping keeps its engines (taking no requests) for one lease TTL; a
    sidecar that stopped (its record said draining) leaves at once."""
    config = parse_config(central_config("http://127.0.0.1:1", unique_cluster("grace"), str(tmp_path / "c.sqlite3")))
    assert config.cluster is not None
    fleet = Fleet(config, GatewayMetrics())
    discovery = Discovery(config.cluster, fleet)
    key = node_key(config.cluster.name, "node-g")
    record = NodeRecord("node-g", "http://127.0.0.1:9", (EngineRecord("e0", "engine-0", ("m",)),), seq=1)

    def put(node: NodeRecord) -> WatchEvent:
        return WatchEvent("put", key, encode_node(node), 0)

    gone = WatchEvent("delete", key, b"", 0)
    try:
        discovery.apply([put(record)], 0.0)
        (engine,) = fleet.pools["m"].instances
        assert engine.routable
        discovery.apply([gone], 0.0)  # the lease expired
        assert fleet.pools["m"].instances == [engine] and not engine.routable  # 503 for now, not 404
        discovery.apply([put(record)], 0.0)  # it re-registered
        assert fleet.pools["m"].instances == [engine] and engine.routable and not engine.retired  # the same engine
        # The return is said as the failure was (an outside run: a log reader saw the whole fleet go, never come back).
        said = [(r.levelname, r.message) for r in caplog.records if "engine-0" in r.message]
        assert [level for level, _ in said] == ["WARNING", "WARNING"] and "is now healthy" in said[1][1], said
        discovery.apply([gone], 0.0)
        async with asyncio.timeout(30):  # bounds a hang only: it leaves at the lease TTL's timer
            await fleet.wait_until(lambda f: "m" not in f.pools)
        assert engine.retired
        discovery.apply([put(record)], 0.0)
        assert fleet.pools["m"].instances[0] is not engine  # back after it left: a new engine
        discovery.apply([put(dataclasses.replace(record, draining=True)), gone], 0.0)
        assert "m" not in fleet.pools  # a sidecar that stopped leaves at once
        # A watch still open to an etcd that stopped answering the lease: not connected, and why (it showed none).
        discovery.watching, discovery.registration.connected = True, False
        discovery.registration.last_error = "keepalive timed out"
        assert discovery.describe()["last_error"] == "keepalive timed out"
    finally:
        await discovery.aclose()
        await fleet.aclose()


async def test_a_second_sidecar_under_a_running_ones_node_name_refuses_to_start(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """An outside run: a second sidecar given the same `cluster.node` started silently; every central swapped the
    node between the two URLs at each publication (~600 engine rebuilds in 20 s), and stopping one took the
    other's key with it. The same sidecar stopped and started again registers as before."""
    name = unique_cluster("dup")
    sims = await start_sims(stack, 1)

    def sidecar(usage: str, port: int = 0) -> GatewayServer:
        config = sidecar_config(etcd.url, name, sims, str(tmp_path / usage), node="node-d")
        config["listen"]["port"] = port
        return GatewayServer(parse_config(config), role="sidecar")

    first = await stack.enter_async_context(sidecar("a.sqlite3"))
    with pytest.raises(StartupError, match="node 'node-d' is published by a running sidecar at"):
        async with sidecar("b.sqlite3"):
            pass
    # One that publishes seldom (its record unchanged for a while) is alive all the same: its key outlives a TTL.
    slow = first.cluster
    slow.registration.republish_s = 30.0
    with pytest.raises(StartupError, match="node 'node-d' is published by a running sidecar at"):
        async with sidecar("c.sqlite3"):
            pass
    assert first.cluster.connected
    port = int(first.url.rsplit(":", 1)[1])
    await first.shutdown(drain_s=1)
    async with sidecar("a.sqlite3", port) as again:  # the same node at its address: no conflict
        assert again.cluster.node == "node-d"


async def test_of_two_sidecars_starting_at_once_under_one_node_name_one_refuses(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """The last outside run: started at the same instant, both read the name free and both ran (2 starts in 6). The
    name is taken in one etcd transaction: one of them takes it, the other finds it taken."""
    name = unique_cluster("race")
    sims = await start_sims(stack, 1)

    def sidecar(usage: str) -> GatewayServer:
        config = sidecar_config(etcd.url, name, sims, str(tmp_path / usage), node="node-r")
        return GatewayServer(parse_config(config), role="sidecar")

    async def start(server: GatewayServer) -> GatewayServer:
        return await stack.enter_async_context(server)

    outcomes = await asyncio.gather(start(sidecar("a.sqlite3")), start(sidecar("b.sqlite3")), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, StartupError)]
    running = [o for o in outcomes if isinstance(o, GatewayServer)]
    assert len(refused) == 1 and len(running) == 1, outcomes
    assert "node 'node-r' is published by a running sidecar" in str(refused[0])


async def test_a_sidecar_started_while_etcd_is_down_checks_its_node_name_once_etcd_answers(
    stack: contextlib.AsyncExitStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside run: a second sidecar under a running one's `cluster.node`, started while etcd was down, skipped the
    check for good; once etcd was back both published in turn, and centrals swapped the node between them at every
    publication. It now checks before its first publication and stops (exit 1 from `serve`). It also said nothing
    about etcd out of reach from its start (a wrong endpoint logged nothing, ever): now once, and once reached."""
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    stack.callback(etcd.stop)
    name = unique_cluster("late")
    sims = await start_sims(stack, 1)

    def sidecar(usage: str) -> GatewayServer:
        config = sidecar_config(etcd.url, name, sims, str(tmp_path / usage), node="node-l")
        return GatewayServer(parse_config(config), role="sidecar")

    first = await stack.enter_async_context(sidecar("a.sqlite3"))
    etcd.stop()
    second = await stack.enter_async_context(sidecar("b.sqlite3"))  # starts: etcd cannot say the name is taken
    assert second.failure is None
    await eventually(lambda: "not reached" in caplog.text, what="the second sidecar to say etcd is out of reach")
    said = [r for r in caplog.records if r.name == "lockgate.cluster.lease" and "not reached" in r.message]
    assert len(said) == 1 and said[0].levelname == "WARNING", said  # once, not every retry
    etcd.start()
    async with asyncio.timeout(30):  # bounds a hang only: the check waits up to a lease TTL for the other's record
        await second.failed.wait()
    assert second.failure is not None and "node 'node-l' is published by a running sidecar at " + first.url in (
        second.failure
    )
    assert second.cluster.registration.writes == 0 and not second.cluster.connected
    await eventually(lambda: first.cluster.connected, what="the first sidecar to publish again")
    assert "etcd reached: " in caplog.text  # the first one, whose loss was said, says it is back
    _, kvs = await first.cluster.etcd.get_prefix(first.cluster.registration.key)
    from lockgate.cluster.keys import decode_node

    assert [decode_node(kv.value).url for kv in kvs] == [first.url]


async def test_a_central_that_finds_no_sidecar_says_so_and_answers_503(
    etcd: EtcdServer,
    stack: contextlib.AsyncExitStack,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outside run: a central whose `cluster.name` differed from its sidecars' logged nothing and answered 404
    `model_not_found` (as did every central of a cluster started all at once, until the sidecars published), which
    SDKs do not retry: 503 `cluster_not_synced`, and a warning naming the prefix it reads, once none has come a
    while after its first read (not at every cold start: sidecars publish moments after)."""
    from lockgate.cluster import discovery

    monkeypatch.setattr(discovery, "_LONELY_S", 0.2)
    name = unique_cluster("empty")
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    await eventually(lambda: central.cluster.synced_at is not None, what="the central to read etcd")
    assert "no sidecar publishes" not in caplog.text
    await eventually(lambda: f"no sidecar publishes under /lockgate/{name}/" in caplog.text, what="the warning")
    # (Not "requests get 503": an outside run's operator read it while the models its configuration lists answered.)
    assert "requests for models only sidecars serve get 503 until one does" in caplog.text
    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.post(central.url + "/v1/chat/completions", json=chat("hi")) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "cluster_not_synced"
    sims = await start_sims(stack, 1)
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, sims, str(tmp_path / "s.sqlite3"), node="n")), role="sidecar"
        )
    )
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: routable(f) == 1)
    async with session.post(central.url + "/v1/chat/completions", json={**chat("hi"), "model": "other"}) as resp:
        assert resp.status == 404  # a model no sidecar serves, once some do


async def test_an_engine_its_sidecar_renames_is_renamed_at_the_centrals(tmp_path: Path) -> None:
    """An outside run: a sidecar's reload renamed one of its engines (its record then said so); the centrals kept the
    old name in `/admin/fleet` and every series for good, while answers named the new one. The engine keeps its key
    (the same engine): its name, series and routing counter follow."""
    config = parse_config(central_config("http://127.0.0.1:1", unique_cluster("rename"), str(tmp_path / "c.sqlite3")))
    assert config.cluster is not None
    metrics = GatewayMetrics()
    fleet = Fleet(config, metrics)
    discovery = Discovery(config.cluster, fleet)
    key = node_key(config.cluster.name, "node-r")
    record = NodeRecord("node-r", "http://127.0.0.1:9", (EngineRecord("e0", "engine-0", ("m",)),), seq=1)
    try:
        discovery.apply([WatchEvent("put", key, encode_node(record), 0)], 0.0)
        (engine,) = fleet.pools["m"].instances
        gauges = ("lockgate_permits_in_use", "lockgate_instance_healthy", "lockgate_upstream_calls_in_flight")

        def shown(name: str) -> list[str]:
            text = metrics.render().decode()
            return [gauge for gauge in gauges if f'{gauge}{{instance="{name}"}}' in text]

        assert shown("node-r/engine-0") == list(gauges)
        renamed = dataclasses.replace(record, engines=(EngineRecord("e0", "engine-x", ("m",)),), seq=2)
        discovery.apply([WatchEvent("put", key, encode_node(renamed), 0)], 0.0)
        assert fleet.pools["m"].instances == [engine] and engine.name == "node-r/engine-x"
        assert shown("node-r/engine-x") == list(gauges) and shown("node-r/engine-0") == []
        assert [i["name"] for i in describe_fleet(fleet)["instances"]] == ["node-r/engine-x"]
    finally:
        await discovery.aclose()
        await fleet.aclose()


async def test_the_engines_sharing_an_unreachable_sidecar_say_why_they_are_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer's run: after a sidecar was killed, the log said its other engine "is now unhealthy: no reason
    known"; it names the sidecar's address now."""
    config = parse_config(central_config("http://127.0.0.1:1", unique_cluster("why"), str(tmp_path / "c.sqlite3")))
    assert config.cluster is not None
    fleet = Fleet(config, GatewayMetrics())
    discovery = Discovery(config.cluster, fleet)
    engines = (EngineRecord("e0", "engine-0", ("m",)), EngineRecord("e1", "engine-1", ("m",)))
    record = NodeRecord("node-w", "http://127.0.0.1:9", engines, seq=1)
    try:
        discovery.apply([WatchEvent("put", node_key(config.cluster.name, "node-w"), encode_node(record), 0)], 0.0)
        first, second = sorted(fleet.pools["m"].instances, key=lambda i: i.name)
        fleet.report_failure(first, "connect", "cannot connect to 127.0.0.1:9")
        assert (
            not second.healthy and second.last_error == "its sidecar cannot be reached (cannot connect to 127.0.0.1:9)"
        )
        assert "no reason known" not in caplog.text
    finally:
        await discovery.aclose()
        await fleet.aclose()
