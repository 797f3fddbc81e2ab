"""Tenant limits hold cluster-wide: two central replicas split a tenant's requests/minute by the demand
they publish, and the survivor takes the whole limit back when the other leaves."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import pytest

from lockgate.admission.ratelimit import RateLimiter
from lockgate.admission.tenants import hash_key
from lockgate.cluster.keys import ReplicaRecord, decode_replica, encode_replica
from lockgate.cluster.limits import EQUAL_PART, ClusterLimits, share_of
from lockgate.config import parse_config
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from tests.cluster.support import central_config, eventually, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer

KEY = "sk-acme-test"
LIMIT = 60


def test_shares_add_up_and_follow_demand() -> None:
    assert share_of("a", {}) == 1.0
    assert share_of("a", {"a": 0.0, "b": 0.0}) == 0.5
    assert share_of("c", {"a": 0.0, "b": 0.0}) == pytest.approx(1 / 3)  # not yet in etcd: counted anyway
    demand = {"a": 3.0, "b": 1.0}
    shares = [share_of(r, demand) for r in demand]
    assert sum(shares) == pytest.approx(1.0)
    assert shares[0] > shares[1]
    heavy = {"a": 300.0, "b": 100.0}  # enough evidence: the ratio gets its full weight
    assert share_of("a", heavy) == pytest.approx(EQUAL_PART / 2 + (1 - EQUAL_PART) * 0.75)


def test_a_replica_starts_where_the_others_stand_or_full_alone() -> None:
    """`start_fill`: the mean of what the other replicas' records say they hold of the tenant's allowance; full when
    alone or for a tenant they do not report. A record from before `fill` existed still decodes."""
    limiter = RateLimiter()
    limits = ClusterLimits("me", limiter, dict)
    assert limiter.start_fill is not None and limiter.start_fill("acme") == 1.0
    records = {
        rid: ReplicaRecord(rid, 0.0, (), fill) for rid, fill in {"a": (("acme", 0.1),), "b": (("acme", 0.3),)}.items()
    }
    records["me"] = ReplicaRecord("me", 0.0, (), (("acme", 1.0),))  # its own (older) record is not counted
    limits.apply(records)
    assert limits.start_fill("acme") == pytest.approx(0.2) and limits.start_fill("other") == 1.0
    old = decode_replica(b'{"id": "x", "started_at": 1.0, "demand": {"acme": 2.0}}')
    assert old is not None and old.fill == () and old.demand == (("acme", 2.0),)
    assert decode_replica(encode_replica(records["a"])) == records["a"]


async def test_two_replicas_hold_a_tenant_limit_cluster_wide(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    name = unique_cluster("limits")
    sim = await stack.enter_async_context(SimServer(SimConfig(models=("m",), fast=True)))
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / "s.sqlite3"), "node")), role="sidecar"
        )
    )
    tenants = [{"name": "acme", "keys": [hash_key(KEY)], "requests_per_minute": LIMIT}]
    centrals = []
    for n in range(2):
        config = {**central_config(etcd.url, name, str(tmp_path / f"c{n}.sqlite3")), "tenants": tenants}
        centrals.append(await stack.enter_async_context(GatewayServer(parse_config(config))))
    members = [c.cluster for c in centrals]
    await eventually(
        lambda: all(len(m.replicas) == 2 and m.limits.shares() == {"acme": 0.5} for m in members),
        what="both replicas to take half the limit",
    )
    for central in centrals:
        assert central.gateway is not None
        await central.gateway.fleet.wait_until(lambda f: "m" in f.pools and f.pools["m"].ready())

    session = await stack.enter_async_context(aiohttp.ClientSession())
    headers = {"Authorization": f"Bearer {KEY}"}
    admitted = refused = 0
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for n in range(2 * LIMIT):
        async with session.post(centrals[n % 2].url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            if resp.status == 200:
                admitted += 1
            else:
                assert resp.status == 429
                refused += 1
    # The limit holds across both replicas (plus what refilled during the run: one a second).
    assert LIMIT * 0.9 <= admitted <= LIMIT * 1.1, admitted
    assert refused >= LIMIT * 0.8

    # A replica that joins now (a restart, a worker started again) starts where the others stand: the tenant spent
    # its limit, so the newcomer's share starts (nearly) empty instead of minting a fresh third of it.
    config = {**central_config(etcd.url, name, str(tmp_path / "c2.sqlite3")), "tenants": tenants}
    joiner = await stack.enter_async_context(GatewayServer(parse_config(config)))
    assert joiner.gateway is not None and joiner.cluster is not None
    limits = joiner.cluster.limits
    await eventually(
        lambda: len(limits.replicas) == 3 and limits.start_fill("acme") < 0.2, what="the newcomer to see the others"
    )
    await joiner.gateway.fleet.wait_until(lambda f: "m" in f.pools and f.pools["m"].ready())
    late = []
    for _ in range(10):
        async with session.post(joiner.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            late.append(resp.status)
    assert late.count(200) <= 3, late  # was 10: a full share of 20
    await joiner.shutdown(drain_s=0)

    # One replica leaves (its lease is revoked): the other takes the whole limit back.
    await centrals[1].shutdown(drain_s=0)
    await eventually(lambda: members[0].limits.shares() == {"acme": 1.0}, what="the survivor's share to return")
