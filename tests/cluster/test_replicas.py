"""Two central replicas behave as one: the same prefix goes to the same engine whichever replica a
request reaches (shared rendezvous placement), the load one replica sends is visible to the other
through the sidecar's published accounting, and a duplicate that reaches the other replica shares the
first one's engine call at the sidecar."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp

from lockgate.config import parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.routing.placement import rendezvous_spread
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import central_config, eventually, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer

SYSTEM = "You are a careful assistant for the accounts team; follow the written policy exactly. " * 24


def chat(content: str, question: str = "go on", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": content + ": " + SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 3,
        "temperature": 0,
        **extra,
    }


def top(anchor: int, keys: list[str]) -> str | None:
    picked = rendezvous_spread(anchor, [(k, k) for k in keys], 1)
    return picked[0] if picked else None


def test_rendezvous_is_stable_and_moves_only_the_leavers_share() -> None:
    keys = [f"http://node-{n}:8080#engine" for n in range(5)]
    anchors = range(2000)
    before = {a: top(a, keys) for a in anchors}
    assert before == {a: top(a, list(reversed(keys))) for a in anchors}  # order does not matter
    assert min(list(before.values()).count(k) for k in keys) > 300  # spread (2000 / 5 = 400 each)
    after = {a: top(a, keys[1:]) for a in anchors}
    moved = [a for a in anchors if before[a] != after[a]]
    assert all(before[a] == keys[0] for a in moved)
    assert top(1, []) is None


def test_rendezvous_spreads_a_prefix_over_distinct_nodes() -> None:
    engines = [(f"n{n}/e{e}", f"n{n}") for n in range(3) for e in range(2)]
    for anchor in range(500):
        two = rendezvous_spread(anchor, engines, 2)
        assert len({key.split("/")[0] for key in two}) == 2  # never both engines of one node
        assert two == rendezvous_spread(anchor, list(reversed(engines)), 2)
        assert two[0] == top(anchor, [k for k, _ in engines])  # the first choice is the plain winner
    # Fewer nodes than choices: the rest from the nodes there are; never more than the keys.
    one_node = [("n0/e0", "n0"), ("n0/e1", "n0")]
    assert sorted(rendezvous_spread(7, one_node, 2)) == ["n0/e0", "n0/e1"]
    assert len(rendezvous_spread(7, one_node, 3)) == 2
    # Balance: 8 hot prompts over 2 nodes put 6 or more on one node in ~29% of draws with one choice;
    # with two every prompt may go to either node.
    nodes = [("a/e", "a"), ("b/e", "b")]
    assert all(len(rendezvous_spread(anchor, nodes, 2)) == 2 for anchor in range(100))


async def test_replicas_agree_share_load_and_coalesce_at_the_sidecar(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("replicas")
    sims = [await stack.enter_async_context(SimServer(SimConfig(models=("m",), seed=n))) for n in range(2)]
    sidecars = []
    for n, sim in enumerate(sims):
        sidecars.append(
            await stack.enter_async_context(
                GatewayServer(
                    parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / f"s{n}.sqlite3"), f"node-{n}")),
                    role="sidecar",
                )
            )
        )
    centrals = [
        await stack.enter_async_context(
            GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / f"c{n}.sqlite3"))))
        )
        for n in range(2)
    ]
    fleets: list[Fleet] = []
    for central in centrals:
        assert central.gateway is not None
        fleets.append(central.gateway.fleet)
        await central.gateway.fleet.wait_until(
            lambda f: "m" in f.pools and sum(i.routable for i in f.pools["m"].instances) == 2
        )
    session = await stack.enter_async_context(aiohttp.ClientSession())

    async def ask(central: GatewayServer, body: dict[str, Any]) -> str:
        async with session.post(central.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-lockgate-instance"]

    def idle() -> bool:
        """Both replicas see every engine idle. (Right after a request, a publication made while it ran
        shows it queued there for up to one publishing interval: load, rightly, and the same for both
        replicas only once both have received the same publication.)"""
        return all(
            i.engine_load is not None and not (i.engine_load.waiting or i.engine_load.running)
            for f in fleets
            for i in f.pools["m"].instances
        )

    # Agreement: a conversation's turns alternate between the replicas and stay on one engine.
    # The default placement hashes each conversation over the engines (whose keys carry random ports): keep
    # going until both were chosen (all of 16 on one engine would happen with odds of 2**-15).
    chosen = set()
    asked = 0
    for n in range(16):
        await eventually(idle, what="idle engines")
        first = await ask(centrals[0], chat(f"conversation {n}"))
        await eventually(idle, what="idle engines")
        second = await ask(centrals[1], chat(f"conversation {n}", "and then?"))
        assert first == second
        chosen.add(first)
        asked += 2
        if n >= 3 and len(chosen) == 2:
            break
    assert len(chosen) == 2  # different conversations spread over both engines

    # A duplicate through the other replica: held at the engine, the second joins at the sidecar.
    body = chat("a duplicate question")
    for sim in sims:
        sim.control.hold_next = 1
    leader = asyncio.create_task(ask(centrals[0], body))
    waits = [asyncio.create_task(s.wait_held(1)) for s in sims]
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    held = waits.index(done.pop())
    for sim in sims:
        sim.control.hold_next = 0
    engine = sidecars[held].gateway
    assert engine is not None
    # The other replica sees the load the first one sent, through the sidecar's publication.
    other = next(i for i in fleets[1].pools["m"].instances if i.name.startswith(f"node-{held}/"))
    await eventually(lambda: other.published is not None and other.published.in_flight == 1, what="shared load")

    # ... and routes by it: the slot that request takes there is taken for this replica too (while the
    # publication is fresh: polled, a loaded machine may let one age past `scrape.stale_after_ms`).
    def seen_taken() -> bool:
        view = next(v for v in fleets[1].pools["m"].snapshot().instances if v.key == other.key)
        return view.in_flight == 1

    await eventually(seen_taken, what="the other replica's request counted in this one's view")
    assert other.in_flight == 0
    follower = asyncio.create_task(ask(centrals[1], body))
    await eventually(
        lambda: [f.subscribers for f in engine.dedup.flights.all()] == [2], what="the duplicate to join at the sidecar"
    )
    sims[held].release()
    assert await leader == await follower
    assert sum(s.statistics()["requests_started"] for s in sims) == asked + 1


async def test_a_central_that_has_not_read_etcd_yet_answers_503_not_404(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """An outside run: a central restarted in a rolling update answered its first requests (and, started while etcd
    was down, every request) 404 `model_not_found`, which SDKs do not retry, for a model its sidecars serve. Until
    its first read of etcd that finds a sidecar, a model it does not know is 503 `cluster_not_synced`; after it, 404."""
    unreachable = central_config("http://127.0.0.1:1", unique_cluster("unsynced"), str(tmp_path / "u.sqlite3"))
    blind = await stack.enter_async_context(GatewayServer(parse_config(unreachable)))
    cluster = unique_cluster("synced")
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("other",))))
    sidecar = sidecar_config(etcd.url, cluster, [sim], str(tmp_path / "side.sqlite3"), node="n", model="other")
    await stack.enter_async_context(GatewayServer(parse_config(sidecar), role="sidecar"))
    synced_cfg = central_config(etcd.url, cluster, str(tmp_path / "s.sqlite3"))
    synced = await stack.enter_async_context(GatewayServer(parse_config(synced_cfg)))
    assert synced.gateway is not None
    await synced.gateway.fleet.wait_until(lambda f: not f.discovering)
    session = await stack.enter_async_context(aiohttp.ClientSession())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with session.post(blind.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "cluster_not_synced"
    # (A stored response's route too: it was 404 `response_not_found`, final to an SDK, for an id the cluster holds.)
    async with session.get(blind.url + "/v1/responses/resp_made_before_the_restart") as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "cluster_not_synced"
    async with session.post(synced.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


async def test_a_central_that_knows_no_engine_is_not_ready(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """A central started before any sidecar published (or before etcd could be reached) serves nothing: `/ready`
    said 200 (every model it knew of, none, had an instance) and a load balancer sent it traffic to answer 404."""
    name = unique_cluster("ready")
    central = await stack.enter_async_context(
        GatewayServer(parse_config(central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    session = await stack.enter_async_context(aiohttp.ClientSession())
    async with session.get(central.url + "/ready") as resp:
        assert resp.status == 503 and (await resp.json()) == {"status": "not_ready", "models": []}
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("m",))))
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / "s.sqlite3"), "node-0")), role="sidecar"
        )
    )
    assert central.gateway is not None
    await central.gateway.fleet.wait_until(lambda f: "m" in f.pools and any(i.routable for i in f.pools["m"].instances))
    async with session.get(central.url + "/ready") as resp:
        assert resp.status == 200
