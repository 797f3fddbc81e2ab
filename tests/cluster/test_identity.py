"""Priority class and tenant through the hop: a central replica passes its client's tenant and class to
the sidecar, which schedules and records by them; only a caller with a central's key may set them, so a
client that reaches the sidecar directly cannot forge either."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.admission.tenants import group_salt, hash_key
from lockgate.cluster import identity
from lockgate.cluster.identity import TENANT_HEADER, Relayed
from lockgate.config import parse_config
from lockgate.records import read_records
from lockgate.response_ids import SECRET_ENV
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import cluster_section, unique_cluster
from tests.etcd_support import EtcdServer

CENTRAL_KEY = "central-secret"
DIRECT_KEY = "direct-client"
ACME_KEY = "acme-key"
BETA_KEY = "beta-key"


def test_only_a_central_key_relays_a_tenant_and_names_are_bounded() -> None:
    relayed = Relayed([hash_key(CENTRAL_KEY)], default_priority=1)
    acme = relayed.tenant(f"Bearer {CENTRAL_KEY}", "acme")
    assert acme is not None and acme.name == "acme" and acme.max_priority == 0
    assert acme.requests_per_minute is None and acme.tokens_per_minute is None and acme.may_use("any-model")
    assert relayed.tenant(f"Bearer {CENTRAL_KEY}", "acme") is acme
    assert relayed.tenant(f"Bearer {CENTRAL_KEY}", None) is not None  # a central naming nobody: `default`
    for forged in (f"Bearer {DIRECT_KEY}", "Bearer", f"Basic {CENTRAL_KEY}", None):
        assert relayed.tenant(forged, "acme") is None
    assert Relayed([], default_priority=1).tenant(f"Bearer {CENTRAL_KEY}", "acme") is None
    # "acme" and "default" are kept already: MAX_TENANTS - 2 new names, then the rest are `other`.
    tenants = [relayed.tenant(f"Bearer {CENTRAL_KEY}", f"t{n}") for n in range(identity.MAX_TENANTS + 10)]
    names = {t.name for t in tenants if t is not None}
    assert len(names) == identity.MAX_TENANTS - 1 and identity.OVERFLOW_TENANT in names
    # Counted under one name, each keeps its own results; so does a name not taken as it is (here too long).
    scopes = {t.cache_scope for t in tenants if t is not None}
    assert len(scopes) == len(tenants) and acme.cache_scope not in scopes
    long_a, long_b = (relayed.tenant(f"Bearer {CENTRAL_KEY}", c * 200) for c in "ab")
    assert long_a is not None and long_b is not None and long_a.name == long_b.name == "default"
    assert long_a.cache_scope != long_b.cache_scope
    # Apart from every local tenant, whatever its name.
    assert all(not scope.isprintable() for scope in scopes)


async def test_relayed_tenants_counted_as_one_share_no_results(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path, monkeypatch: Any
) -> None:
    """Past the sidecar's bound of relayed names, new ones are counted as `other`: they must not get each other's
    cached answers (nor those of a local tenant named `other`)."""
    monkeypatch.setattr(identity, "MAX_TENANTS", 1)
    name = unique_cluster("scope")
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("m",))))
    config = sidecar(etcd.url, name, sim, str(tmp_path / "s.sqlite3"))
    config["tenants"][0]["name"] = "other"
    side = await stack.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
    http = await stack.enter_async_context(aiohttp.ClientSession())
    body = {"model": "m", "messages": [{"role": "user", "content": "a secret"}], "max_tokens": 3, "temperature": 0}

    async def ask(key: str, **headers: str) -> str:
        hdrs = {"Authorization": f"Bearer {key}", **headers}
        async with http.post(side.url + "/v1/chat/completions", json=body, headers=hdrs) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-lockgate-cache"]

    assert await ask(CENTRAL_KEY, **{TENANT_HEADER: "first"}) == "miss"  # the one name kept
    assert await ask(CENTRAL_KEY, **{TENANT_HEADER: "victim"}) == "miss"
    assert await ask(CENTRAL_KEY, **{TENANT_HEADER: "victim"}) == "hit"
    assert await ask(CENTRAL_KEY, **{TENANT_HEADER: "attacker"}) == "miss"
    assert await ask(DIRECT_KEY) == "miss"
    assert sim.stats.requests_started == 4


async def knowing(*centrals: GatewayServer, instances: int) -> None:
    """Wait until each central knows `instances` instances of model `m` (15 s at most)."""
    for cent in centrals:
        assert cent.gateway is not None
        async with asyncio.timeout(15):
            await cent.gateway.fleet.wait_until(lambda f: "m" in f.pools and len(f.pools["m"].instances) == instances)


def sidecar(etcd_url: str, cluster: str, sim: SimServer, usage: str) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_ms": 60000},
        "usage": {"path": usage},
        "models": [{"name": "m", "instances": [{"url": sim.url, "engine": "vllm", "max_concurrency": 1}]}],
        "tenants": [{"name": "direct", "keys": [hash_key(DIRECT_KEY)], "max_priority": "P2"}],
        "cluster": cluster_section(etcd_url, cluster, node="node-0", central_keys=[hash_key(CENTRAL_KEY)]),
    }


def central(etcd_url: str, cluster: str, usage: str) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_ms": 60000},
        "usage": {"path": usage},
        "tenants": [
            {"name": "acme", "keys": [hash_key(ACME_KEY)], "max_priority": "P0"},
            {"name": "beta", "keys": [hash_key(BETA_KEY)], "max_priority": "P2"},
        ],
        "cluster": cluster_section(etcd_url, cluster, api_key=CENTRAL_KEY),
    }


async def central_and_sidecar(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path, name: str
) -> tuple[SimServer, GatewayServer, GatewayServer, aiohttp.ClientSession]:
    """A simulator behind a sidecar, a central replica that has learnt of it, and a client session."""
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("m",))))
    side = await stack.enter_async_context(
        GatewayServer(parse_config(sidecar(etcd.url, name, sim, str(tmp_path / "s.sqlite3"))), role="sidecar")
    )
    cent = await stack.enter_async_context(
        GatewayServer(parse_config(central(etcd.url, name, str(tmp_path / "c.sqlite3"))))
    )
    assert cent.gateway is not None and side.gateway is not None
    async with asyncio.timeout(15):
        await cent.gateway.fleet.wait_until(lambda f: "m" in f.pools and f.pools["m"].ready())
    return sim, side, cent, await stack.enter_async_context(aiohttp.ClientSession())


def chat(text: str, *, stream: bool = False, max_tokens: int = 3) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    return orjson.dumps(body)


async def test_the_sidecar_schedules_and_records_by_the_clients_tenant_and_class(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("identity")
    sim, side, cent, http = await central_and_sidecar(etcd, stack, tmp_path, name)
    assert side.gateway is not None

    async def ask(url: str, key: str, text: str, **headers: str) -> int:
        hdrs = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers}
        async with http.post(url + "/v1/chat/completions", data=chat(text), headers=hdrs) as resp:
            await resp.read()
            return resp.status

    # Through the central: the sidecar records the client's tenant and the class the central admitted
    # (beta asked for P0, its cap is P2).
    assert await ask(cent.url, ACME_KEY, "acme asks", **{"x-priority": "P0"}) == 200
    assert await ask(cent.url, BETA_KEY, "beta asks", **{"x-priority": "P0"}) == 200
    # Straight to the sidecar with a client's key: the forged tenant and class are not believed.
    forged = {TENANT_HEADER: "acme", "x-priority": "P0"}
    assert await ask(side.url, DIRECT_KEY, "direct asks", **forged) == 200

    # The sidecar schedules by the relayed class: a P0 relayed while its one slot holds a relayed P2
    # preempts it (the P2 resumes afterwards).
    sim.control.hold_next = 1
    p2 = asyncio.create_task(ask(side.url, CENTRAL_KEY, "batch work", **{TENANT_HEADER: "beta", "x-priority": "P2"}))
    async with asyncio.timeout(10):
        await sim.wait_held(1)
    assert await ask(side.url, CENTRAL_KEY, "urgent", **{TENANT_HEADER: "acme", "x-priority": "P0"}) == 200
    sim.release()
    assert await p2 == 200
    metrics = side.gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 1.0' in metrics

    await side.gateway.records.wait_flushed()
    rows = {r["tenant"] + ":" + r["priority"] for r in read_records(str(tmp_path / "s.sqlite3"))}
    assert rows == {"acme:P0", "beta:P2", "direct:P2"}


async def test_responses_through_a_central_and_its_sidecar(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """The Responses API across the hop: a response made through the central, streamed and whole; its stored copy
    retrieved through the central (the sidecar checks the relayed tenant: another tenant's request is 404 there
    too), and a follow-up continuing it on the engine that holds it."""
    name = unique_cluster("responses")
    _, side, cent, http = await central_and_sidecar(etcd, stack, tmp_path, name)
    assert side.gateway is not None
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"model": "m", "input": "hello", "max_output_tokens": 4}
    async with http.post(cent.url + "/v1/responses", json={**body, "stream": True}, headers=acme) as resp:
        assert resp.status == 200
        last = [b for b in (await resp.read()).split(b"\n\n") if b][-1]
    assert last.startswith(b"event: response.incomplete\n")
    async with http.post(cent.url + "/v1/responses", json=body, headers=acme) as resp:
        made = await resp.json()
    async with http.get(cent.url + f"/v1/responses/{made['id']}", headers=acme) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["output"] == made["output"]
    beta = {"Authorization": f"Bearer {BETA_KEY}"}
    async with http.get(cent.url + f"/v1/responses/{made['id']}", headers=beta) as resp:
        assert resp.status == 404
    follow = {**body, "input": "and then?", "previous_response_id": made["id"]}
    async with http.post(cent.url + "/v1/responses", json=follow, headers=acme) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["input_tokens"] > made["usage"]["input_tokens"]
    await side.gateway.records.wait_flushed()
    rows = [(r["tenant"], r["endpoint"]) for r in read_records(str(tmp_path / "s.sqlite3"))]
    assert rows == [("acme", "responses")] * 2 + [("acme", "responses.retrieve"), ("acme", "responses")]


async def test_tenants_stay_apart_in_the_engines_cache_through_the_hop(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """The central chooses each tenant's prefix-cache salt and sends it with the relayed request
    (`x-lockgate-cache-salt`): behind the sidecar one tenant still hits only its own cached prompts. A client that
    reaches the sidecar directly is salted by its own tenant there, whatever header it sends."""
    name = unique_cluster("salt")
    _, side, cent, http = await central_and_sidecar(etcd, stack, tmp_path, name)
    secret = "acme's private plan " + " ".join(f"w{i}" for i in range(300))

    async def cached(url: str, key: str, **headers: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": secret}], "max_tokens": 2, "temperature": 1}
        hdrs = {"Authorization": f"Bearer {key}", **headers}
        async with http.post(url + "/v1/chat/completions", json=body, headers=hdrs) as resp:
            assert resp.status == 200, await resp.text()
            tokens: int = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
            return tokens

    assert await cached(cent.url, ACME_KEY) == 0
    assert await cached(cent.url, ACME_KEY) > 200
    assert await cached(cent.url, BETA_KEY) == 0
    forged = {identity.CACHE_SALT_HEADER: group_salt("acme"), TENANT_HEADER: "acme"}  # acme's own salt
    assert await cached(side.url, DIRECT_KEY, **forged) == 0


async def test_a_sidecar_that_forgot_where_responses_were_made_follows_the_centrals_id(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """An outside run: after a sidecar restarted (its memory of where each response was made empty), follow-ups and
    retrievals of responses made before went to whichever of its engines routing chose, and got a final 404 from the
    others (the SDKs do not retry it). A central's request names the engine by the id's tag, which the sidecar now
    believes (the central took the id back for its tenant); a direct caller's tag is still not believed."""
    name = unique_cluster("forgot")
    sims = [await stack.enter_async_context(SimServer(SimConfig(models=("m",)))) for _ in range(2)]
    config = sidecar(etcd.url, name, sims[0], str(tmp_path / "s.sqlite3"))
    del config["tenants"]  # (an open sidecar: its ids are tagged, not bound; with tenants its ids are bound)
    config["models"][0]["routing"] = "round_robin"
    config["models"][0]["instances"] = [
        {"url": s.url, "engine": "vllm", "name": f"e{i}", "max_concurrency": 1} for i, s in enumerate(sims)
    ]
    side = await stack.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
    cent = await stack.enter_async_context(GatewayServer(parse_config(central(etcd.url, name, str(tmp_path / "c")))))
    assert side.gateway is not None
    await knowing(cent, instances=2)
    http = await stack.enter_async_context(aiohttp.ClientSession())
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"model": "m", "input": "hello", "max_output_tokens": 4}
    async with http.post(cent.url + "/v1/responses", json=body, headers=acme) as resp:
        made = await resp.json()
    side_pool = side.gateway.fleet.pools["m"]
    for _ in range(3):  # (round robin at the sidecar: a guess reaches the other engine within two)
        side_pool._response_homes.clear()  # what a restart leaves it
        follow = {**body, "input": "and then?", "previous_response_id": made["id"]}
        async with http.post(cent.url + "/v1/responses", json=follow, headers=acme) as resp:
            assert resp.status == 200, await resp.text()
        side_pool._response_homes.clear()
        async with http.get(cent.url + f"/v1/responses/{made['id']}", headers=acme) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_central_that_never_saw_a_response_tells_its_follow_up_to_retry_while_its_node_is_away(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside run: a response made through central A, its sidecar restarting, was 503 (retry) through A but a final
    404 through B, which had not seen it made: B looked for the id's engine among the members of now only. A member that
    left lately counts as the response's home at every central (`tagged_member`), for follow-ups and stored routes
    alike, and the 503 names the engine as clients see it (`node/engine`), not its addresses."""
    monkeypatch.setenv(SECRET_ENV, "one secret for both centrals")
    name = unique_cluster("away")
    sims = [await stack.enter_async_context(SimServer(SimConfig(models=("m",)))) for _ in range(2)]
    nodes: list[contextlib.AsyncExitStack] = []
    for i, sim in enumerate(sims):
        node = await stack.enter_async_context(contextlib.AsyncExitStack())
        config = sidecar(etcd.url, name, sim, str(tmp_path / f"s{i}.sqlite3"))
        config["cluster"]["node"] = f"node-{i}"
        await node.enter_async_context(GatewayServer(parse_config(config), role="sidecar"))
        nodes.append(node)
    made_by, other = [
        await stack.enter_async_context(GatewayServer(parse_config(central(etcd.url, name, str(tmp_path / f"c{i}")))))
        for i in range(2)
    ]
    await knowing(made_by, other, instances=2)
    http = await stack.enter_async_context(aiohttp.ClientSession())
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"model": "m", "input": "hello", "max_output_tokens": 4}
    async with http.post(made_by.url + "/v1/responses", json=body, headers=acme) as resp:
        assert resp.status == 200, await resp.text()
        home, made = resp.headers["x-lockgate-instance"], await resp.json()
    await nodes[int(home.split("/")[0][-1])].aclose()  # its sidecar stops (and leaves etcd)
    assert other.gateway is not None
    async with asyncio.timeout(15):
        await other.gateway.fleet.wait_until(lambda f: len(f.pools["m"].instances) == 1)
    follow = {**body, "input": "and then?", "previous_response_id": made["id"]}
    for cent in (made_by, other):
        async with http.post(cent.url + "/v1/responses", json=follow, headers=acme) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, resp.headers["Retry-After"]) == (503, "2")
            assert error["code"] == "previous_response_unavailable"
            assert f"({home})" in error["message"]
        async with http.get(cent.url + f"/v1/responses/{made['id']}", headers=acme) as resp:
            assert (resp.status, (await resp.json())["error"]["code"]) == (503, "response_unavailable")


async def test_a_central_does_not_reuse_a_stored_response_another_central_may_delete(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside run: a response deleted through central B came back from central A's result cache (`hit`, the deleted
    id, then 404 for it) for the cache's TTL: only the process that relays a deletion forgets it. A central keeps no
    finished stored response for reuse; one made with `store: false` (no object to delete) is still reused."""
    monkeypatch.setenv(SECRET_ENV, "one secret for both centrals")
    name = unique_cluster("deleted")
    _, _, made_by, http = await central_and_sidecar(etcd, stack, tmp_path, name)
    other = await stack.enter_async_context(
        GatewayServer(parse_config(central(etcd.url, name, str(tmp_path / "c2.sqlite3"))))
    )
    assert other.gateway is not None
    async with asyncio.timeout(15):
        await other.gateway.fleet.wait_until(lambda f: "m" in f.pools and f.pools["m"].ready())
    acme = {"Authorization": f"Bearer {ACME_KEY}"}

    async def create(**extra: Any) -> tuple[str, str]:
        body = {"model": "m", "input": "the same question", "max_output_tokens": 4, "temperature": 0, **extra}
        async with http.post(made_by.url + "/v1/responses", json=body, headers=acme) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-lockgate-cache"], (await resp.json())["id"]

    outcome, first = await create()
    async with http.delete(other.url + f"/v1/responses/{first}", headers=acme) as resp:
        assert resp.status == 200 and (await resp.json())["deleted"] is True
    outcome, again = await create()
    assert outcome == "miss" and again != first
    async with http.get(made_by.url + f"/v1/responses/{again}", headers=acme) as resp:
        assert resp.status == 200
    assert [(await create(store=False))[0] for _ in range(2)] == ["miss", "hit"]
