"""The sidecar role: publish this node's engines to etcd, every `publish_interval_ms`, under a lease.

A sidecar is a full lockgate in front of its node's engines (de-duplication, cancellation, admission,
usage records); `Publisher` adds one thing: the node's record (`keys.NodeRecord`: its URL and each
engine's health and load as this sidecar sees them) rewritten under the sidecar's lease. A sidecar that
dies stops refreshing the lease and its record disappears within the TTL; one that drains publishes
`draining` so central gateways stop sending at once.

`node_record()` is pure over the fleet's current state; `Publisher` is the async shell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..fleet.fleet import Fleet
from ..routing.residency import anchors
from ..tasks import cancel_and_wait
from .config import ClusterConfig
from .keys import MAX_RESIDENT, EngineRecord, NodeRecord, decode_node, encode_node, node_key
from .lease import Registration
from .store import Etcd, StoreUnavailable

log = logging.getLogger(__name__)


class NodeNameTaken(Exception):
    """Another running sidecar publishes under this sidecar's node name."""


def node_record(
    fleet: Fleet,
    *,
    node: str,
    url: str,
    seq: int,
    draining: bool,
    now: float,
    resident: Mapping[str, tuple[int, ...]] | None = None,
) -> NodeRecord:
    """This node's engines as published: every instance the sidecar routes to (not those it discovered),
    with the prefix anchors routed to each since the last publication (`resident`)."""
    models: dict[str, list[str]] = {}
    stale_after = 1.0
    for pool in fleet.pools.values():
        stale_after = pool.stale_after
        for instance in pool.instances:
            models.setdefault(instance.key, []).append(pool.model)
    engines = []
    for instance in fleet.instances.values():
        if instance.published is not None or instance.key not in models:
            continue
        view = instance.view(now, stale_after)
        load = instance.engine_load
        fresh = load is not None and load.age(now) <= stale_after
        own = instance.own
        engines.append(
            EngineRecord(
                id=instance.key,
                name=instance.name,
                models=tuple(models[instance.key]),
                engine=instance.dialect.name,
                routable=instance.routable and not draining,
                max_concurrency=instance.max_concurrency,
                in_flight=instance.in_flight,
                waiting=view.waiting,
                running=view.running,
                queued_prompt_tokens=view.queued_prompt_tokens,
                kv_usage=view.kv_usage,
                prefix_hits=load.prefix_hits if fresh and load is not None else None,
                prefix_queries=load.prefix_queries if fresh and load is not None else None,
                ttft_s=own.ttft.value,
                tpot_s=own.tpot.value,
                prefill_tps=own.prefill_tps.value,
                resident=(resident or {}).get(instance.key, ()),
            )
        )
    return NodeRecord(node=node, url=url, engines=tuple(engines), seq=seq, published_at=time.time(), draining=draining)


class Publisher:
    """Owns the etcd client and the publishing task; `async with` starts and stops both."""

    def __init__(self, config: ClusterConfig, fleet: Fleet, url: str, draining: Callable[[], bool]) -> None:
        self.config = config
        self.url = config.advertise_url or url
        self.node = config.node or self.url.split("://", 1)[-1].replace("/", "_")
        self._fleet = fleet
        self._draining = draining
        self.etcd = Etcd(config.endpoints, timeout_s=config.timeout_ms / 1000)
        self.seq = 0
        self._stopping = False
        self.registration = Registration(
            self.etcd,
            node_key(config.name, self.node),
            self._value,
            ttl_s=config.lease_ttl_ms / 1000,
            republish_s=config.publish_interval_ms / 1000,
        )
        self._task: asyncio.Task[None] | None = None
        #: Told why, when this sidecar cannot publish after all (its node's name proved taken once etcd answered).
        self.failed: Callable[[str], None] | None = None
        #: Per engine: anchors of the prompts routed to it since the last publication (newest kept).
        self._resident: dict[str, deque[int]] = {}

    def _routed(self, key: str, blocks: tuple[int, ...]) -> None:
        pending = self._resident.get(key)
        if pending is None:
            pending = self._resident[key] = deque(maxlen=MAX_RESIDENT)
        pending.extend(anchors(blocks))

    def _value(self) -> bytes:
        self.seq += 1
        resident = {key: tuple(pending) for key, pending in self._resident.items() if pending}
        for pending in self._resident.values():
            pending.clear()
        record = node_record(
            self._fleet,
            node=self.node,
            url=self.url,
            seq=self.seq,
            draining=self._stopping or self._draining(),
            now=time.monotonic(),
            resident=resident,
        )
        return encode_node(record)

    async def __aenter__(self) -> Publisher:
        self._fleet.report_routed = self._routed  # pools a reload creates get it too
        for pool in self._fleet.pools.values():
            pool.report_routed = self._routed
        await self.etcd.__aenter__()
        # Made again before each lease the registration grants (after one was lost), and before the first publication
        # when etcd is out of reach now: two sidecars started under one name while etcd was down published in turn
        # for good, and centrals swapped the node between them at every publication.
        self.registration.claim = self._claim
        try:
            await self._claim()
            self.registration.claimed = True
        except StoreUnavailable:
            pass
        except BaseException:
            await self.etcd.aclose()
            raise
        self._task = asyncio.create_task(self.registration.run(), name="lockgate-cluster-publish")
        self._task.add_done_callback(self._ended)
        return self

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The publishing task ends only when cancelled, or when the node's name proved taken once etcd answered:
        then this sidecar publishes nothing, and says so (`failed`, which stops the process: exit 1, as at the
        start)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        self.registration.last_error = str(error)
        if isinstance(error, NodeNameTaken):
            log.error("lockgate sidecar: %s", error)
        else:  # (a bug: the process goes on serving its direct clients, publishing nothing)
            log.error("cluster publishing stopped", exc_info=error)
        if self.failed is not None:
            self.failed(str(error))

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _claim(self) -> None:
        """Refuse to take a node name another live sidecar publishes under: two sidecars sharing one key made every
        central swap the node between their URLs at every publication (rebuilding its engines each time), and the
        one that stopped took the key of the other with it. A record of this URL (this sidecar's earlier run) is
        taken over; one of another URL is another sidecar's: alive if its record changes, or if its key outlives a
        lease TTL (a killed sidecar's key goes within its TTL, and is then taken over); draining, it is refused too
        (it still publishes until it stops). Raises `StoreUnavailable` while etcd is out of reach (made again before
        the first publication)."""
        key = self.registration.key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.config.lease_ttl_ms / 1000, 2.0) + 1.0  # etcd's TTLs are 2 s at least
        seen: int | None = None
        while True:
            _, kvs = await self.etcd.get_prefix(key)
            record = next((decode_node(kv.value) for kv in kvs if kv.key == key), None)
            if record is None:
                # Free: take it in one transaction, so that of two sidecars starting at the same instant one does.
                lease, _ = await self.etcd.grant(self.registration.ttl_s)
                value = self._value()
                if await self.etcd.create(key, value, lease=lease):
                    self.registration.adopt(lease, value)
                    return
                await self.etcd.revoke(lease)
                continue  # another sidecar took it meanwhile: is it alive?
            if record.url == self.url:
                return
            if record.draining:
                raise NodeNameTaken(
                    f"cluster {self.config.name!r}: node {self.node!r} is draining at {record.url}; start this one "
                    "once it has stopped, or give it another `cluster.node`"
                )
            if (seen is not None and record.seq != seen) or loop.time() >= deadline:
                raise NodeNameTaken(
                    f"cluster {self.config.name!r}: node {self.node!r} is published by a running sidecar at "
                    f"{record.url}; give this one another `cluster.node`"
                )
            seen = record.seq
            await asyncio.sleep(0.1)

    async def aclose(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            if not task.done():  # (one that ended by itself was reported: `_ended`)
                await cancel_and_wait(task)
            # The last record says it stopped, whatever the drain published: centrals then let the node go at
            # once when its key goes, instead of keeping its engines as they do for a node whose lease expired.
            self._stopping = True
            await self.registration.aclose(last=self._value())
        await self.etcd.aclose()

    @property
    def connected(self) -> bool:
        return self.registration.connected

    @property
    def confirmed_at(self) -> float | None:
        return self.registration.confirmed_at

    def describe(self) -> dict[str, Any]:
        confirmed = self.registration.confirmed_at
        return {
            "role": "sidecar",
            "cluster": self.config.name,
            "node": self.node,
            "url": self.url,
            "connected": self.connected,
            "etcd_endpoint": self.etcd.endpoint,
            "last_confirmed_age_s": None if confirmed is None else round(time.monotonic() - confirmed, 3),
            "publications": self.seq,
            "last_error": self.registration.last_error,
        }
