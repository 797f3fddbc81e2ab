"""Tenant limits hold cluster-wide: two central replicas split a tenant's requests/minute by the demand
they publish, and the survivor takes the whole limit back when the other leaves."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import pytest

from lockgate.admission.ratelimit import RateLimiter, RateLimitExceeded
from lockgate.admission.tenants import Tenant, hash_key
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
    heavy = {"a": 300.0, "b": 100.0}  # many requests: the ratio counts in full
    assert share_of("a", heavy) == pytest.approx(EQUAL_PART / 2 + (1 - EQUAL_PART) * 0.75, abs=1e-3)


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


def acme(requests_per_minute: int | None = None, tokens_per_minute: int | None = None) -> Tenant:
    return Tenant("acme", None, 1, 0, requests_per_minute, tokens_per_minute)


def test_a_share_that_grows_takes_the_added_part_at_the_fill_of_the_replica_it_came_from() -> None:
    """An outside run: a central killed after spending its share left the survivor's idle, full half to grow into
    the whole limit, full: the tenant was admitted 1,007 in 5.8 s on a limit of 600 a minute. The part a share
    gains comes at the fill the replica that held it last said it had (here the departed one's, nearly spent)."""
    limiter = RateLimiter()
    limits = ClusterLimits("me", limiter, lambda: {"acme": acme(requests_per_minute=600)})
    records = {
        "me": ReplicaRecord("me", 0.0, (), (("acme", 1.0),)),
        "gone": ReplicaRecord("gone", 0.0, (), (("acme", 0.05),)),
    }
    limits.apply(records)
    assert limiter.share("acme") == 0.5
    limiter.state(acme(requests_per_minute=600), 0.0)  # its buckets, full: 300 requests
    del records["gone"]
    limits.apply(records)
    assert limiter.share("acme") == 1.0
    bucket = limiter.tenants()["acme"].requests
    assert bucket is not None and bucket.capacity == 600
    assert bucket.level == pytest.approx(300 + 300 * 0.05, abs=1)  # was 600: a fresh half minted
    # A share that shrinks keeps the fraction it holds (what it gives up goes with it).
    limiter.set_share(acme(requests_per_minute=600), 0.25, bucket.stamp)
    assert bucket.capacity == 150 and bucket.level == pytest.approx(150 * 315 / 600, abs=1)


def test_a_tenant_with_a_low_limit_gets_its_share_where_its_traffic_is() -> None:
    """An outside run: a tenant of 60 a minute offering 2 a second, all through one replica of two, got about 32 a
    minute: demand took its full weight only at 200 requests in the window (20 a second for this tenant), so the idle
    replica kept half. The ratio now counts a few more requests for every replica instead."""
    assert share_of("busy", {"busy": 2.0, "idle": 0.0}) > 0.75  # 20 requests in the window to none
    assert share_of("busy", {"busy": 0.3, "idle": 0.0}) < 0.65  # 3 to none: noise, mostly
    assert share_of("a", {"a": 1.0, "b": 1.0}) == 0.5


def test_a_reservation_over_this_replicas_share_but_under_the_limit_waits_for_a_full_bucket() -> None:
    """An outside run: at 3,000 tokens a minute over two replicas (1,500 each), a request reserving 2,000 was refused
    again at every Retry-After (21 s), for good: only one over the tenant's whole limit may never pass. It now waits
    for this replica's full bucket and leaves a debt that refills."""
    tenant = acme(tokens_per_minute=3000)
    limiter = RateLimiter()
    limiter.set_share(tenant, 0.5, 0.0)
    limiter.admit(tenant, 2000, 0.0).settle(2000, 0.0)  # a full bucket: it passes, 500 in debt
    with pytest.raises(RateLimitExceeded) as refused:
        limiter.admit(tenant, 2000, 0.0)
    assert refused.value.code == "rate_limit_exceeded"
    wait = refused.value.retry_after
    assert wait is not None and wait == pytest.approx((1500 + 500) / (1500 / 60))  # until full again
    limiter.admit(tenant, 2000, wait)  # and it passes then


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
