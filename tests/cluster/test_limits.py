"""Tenant limits hold cluster-wide: two central replicas split a tenant's requests/minute by the demand
they publish, and the survivor takes the whole limit back when the other leaves."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import pytest

from lockgate.admission.tenants import hash_key
from lockgate.cluster.limits import EQUAL_PART, share_of
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

    # One replica leaves (its lease is revoked): the other takes the whole limit back.
    await centrals[1].shutdown(drain_s=0)
    await eventually(lambda: members[0].limits.shares() == {"acme": 1.0}, what="the survivor's share to return")
