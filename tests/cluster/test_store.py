"""The etcd client against a real etcd: put and read, prefix watches, leases kept and lost."""

from __future__ import annotations

import asyncio
import os

import pytest

from lockgate.cluster.lease import Registration
from lockgate.cluster.store import Etcd, LeaseLost, StoreUnavailable, prefix_end
from tests.cluster.support import eventually
from tests.etcd_support import EtcdServer, free_port


def unique(name: str) -> str:
    return f"/lockgate-test/{name}-{os.urandom(4).hex()}/"


def test_prefix_end() -> None:
    assert prefix_end("/a/") == b"/a0"
    assert prefix_end("/b/") == b"/b0"


async def test_put_read_watch(etcd: EtcdServer) -> None:
    prefix = unique("watch")
    async with Etcd([etcd.url]) as client:
        await client.put(prefix + "one", b"1")
        revision, kvs = await client.get_prefix(prefix)
        assert [(kv.key, kv.value) for kv in kvs] == [(prefix + "one", b"1")]
        await client.put(prefix.rstrip("/") + "x", b"outside")  # not under the prefix

        async def changes() -> list[tuple[str, str, bytes]]:
            seen: list[tuple[str, str, bytes]] = []
            async for batch in client.watch_prefix(prefix, revision + 1):
                seen += [(e.kind, e.key, e.value) for e in batch]
                if len(seen) == 2:
                    return seen
            raise AssertionError("unreachable")

        watcher = asyncio.create_task(changes())
        await client.put(prefix + "two", b"2")
        await client.delete(prefix + "one")
        assert await asyncio.wait_for(watcher, 10) == [("put", prefix + "two", b"2"), ("delete", prefix + "one", b"")]


async def test_lease_expiry_deletes_and_keepalive_reports_loss(etcd: EtcdServer) -> None:
    prefix = unique("lease")
    async with Etcd([etcd.url]) as client:
        revision, _ = await client.get_prefix(prefix)
        lease, ttl = await client.grant(1)
        assert ttl >= 1
        await client.put(prefix + "k", b"v", lease=lease)
        assert await client.keepalive(lease) >= 1
        events = []
        async for batch in client.watch_prefix(prefix, revision + 1):  # the put, then the expiry's delete
            events += [e.kind for e in batch]
            if "delete" in events:
                break
        assert events == ["put", "delete"]
        with pytest.raises(LeaseLost):
            await client.keepalive(lease)
        with pytest.raises(LeaseLost):
            await client.put(prefix + "k", b"v", lease=lease)


async def test_unreachable_endpoint_is_skipped_and_reported(etcd: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with Etcd([dead, etcd.url], timeout_s=2) as client:
        await client.put(unique("failover") + "k", b"v")
        assert client.endpoint == etcd.url
    async with Etcd([dead], timeout_s=2) as client:
        with pytest.raises(StoreUnavailable) as info:
            await client.get_prefix("/x/")
    # Readable where it is shown (/admin/fleet's last_error, the log): not aiohttp's repr of its connection key.
    assert str(info.value).startswith(f"{dead}/v3/kv/range: ClientConnectorError: Cannot connect to host")
    assert "ConnectionKey(" not in str(info.value)


async def test_registration_regrants_a_lost_lease(etcd: EtcdServer) -> None:
    """A key whose lease was revoked behind its owner's back (as when etcd was away past the TTL)
    is written again under a new lease."""
    key = unique("reg") + "me"
    async with Etcd([etcd.url]) as client:
        reg = Registration(client, key, lambda: b"here", ttl_s=1, republish_s=0.05)
        task = asyncio.create_task(reg.run())
        try:
            async for batch in client.watch_prefix(key, 1):
                if any(e.kind == "put" for e in batch):
                    break
            await eventually(lambda: reg.connected, what="the registration to confirm its write")
            first = reg.lease
            assert first is not None
            await client.revoke(first)
            revision, _ = await client.get_prefix(key)  # read after the revoke: later puts use a new lease
            async for batch in client.watch_prefix(key, revision + 1):
                if any(e.kind == "put" for e in batch):
                    break
            assert reg.lease not in (None, first)
            _, kvs = await client.get_prefix(key)
            assert [kv.value for kv in kvs] == [b"here"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await reg.aclose()
        _, kvs = await client.get_prefix(key)
        assert kvs == []  # revoked on close


async def test_registration_writes_an_unchanged_value_once(etcd: EtcdServer) -> None:
    """Rewriting every `republish_s` is for values that change (a sidecar's state): an unchanged one
    stays under the kept-alive lease, with no raft entry and no watch event per period."""
    key = unique("same") + "me"
    value = [b"one"]
    async with Etcd([etcd.url]) as client:
        reg = Registration(client, key, lambda: value[0], ttl_s=1, republish_s=0.01)
        # Confirmed means etcd answered: a period that asks etcd nothing does not refresh `confirmed_at`
        # (the state-age gauge would read fresh while etcd is away).
        confirmations: list[float | None] = []
        confirm = reg._confirmed

        def counted() -> None:
            confirm()
            confirmations.append(reg.confirmed_at)

        reg._confirmed = counted  # type: ignore[method-assign]
        task = asyncio.create_task(reg.run())
        try:
            # Two lease refreshes (a third of the TTL apart) span dozens of republish periods.
            await eventually(lambda: reg.refreshes >= 2, what="two lease refreshes")
            assert reg.writes == 1
            assert len(confirmations) == 1 + reg.refreshes  # the grant and the one write, then each refresh
            revision, kvs = await client.get_prefix(key)
            assert [kv.value for kv in kvs] == [b"one"]
            value[0] = b"two"
            async for batch in client.watch_prefix(key, revision + 1):
                if any(e.kind == "put" for e in batch):
                    assert [e.value for e in batch] == [b"two"]
                    break
            # The watch may deliver the put before its answer reaches the registration.
            await eventually(lambda: reg.writes >= 2, what="the registration to count its write")
            assert reg.writes == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await reg.aclose()


async def test_a_watch_line_beyond_the_bound_ends_the_watch(etcd: EtcdServer) -> None:
    """The bound on one watch answer: past it the watch fails (the caller re-reads), nothing grows."""
    prefix = unique("bound")
    async with Etcd([etcd.url], max_line=4096) as client:
        revision, _ = await client.get_prefix(prefix)
        await client.put(prefix + "big", b"x" * 20_000)
        with pytest.raises(StoreUnavailable):
            async for _ in client.watch_prefix(prefix, revision + 1):
                raise AssertionError("a 27 KB line passed a 4 KB bound")
