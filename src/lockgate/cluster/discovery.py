"""The central role: discover sidecars and their engines by watching etcd, and keep the fleet in step.

Theory of operation. `Discovery.run()` reads every node record under `/lockgate/<cluster>/nodes/` once,
makes the fleet match it (engines attached, gone ones detached), then watches the prefix from the next
revision: each put updates that node's engines (load, health; membership when it changed), each
delete (the sidecar's lease expired, or it stopped cleanly) detaches them. Nothing polls: between
events the loop waits on the watch stream. When the watch breaks (etcd stopped, cut off, history
compacted) the fleet keeps the last-known state and the loop starts over with a fresh read as soon as
etcd answers, which also drops the sidecars that left meanwhile.

A central gateway also registers itself (`/lockgate/<cluster>/replicas/<id>`, under its own lease,
with its per-tenant demand) and watches the other replicas' records in the same watch (the whole
cluster prefix): `limits.py` splits each tenant's limits among the live replicas. The lease's keepalive
also notices an etcd that went silent without closing the watch. `connected` needs both the watch and
the keepalive; `confirmed_at` is when etcd last confirmed this view.

A remote engine is an `Instance` whose URL is its sidecar's and whose key is `<sidecar URL>#<engine id>`;
its generation requests carry `x-lockgate-engine: <engine id>` so the sidecar uses that exact engine.
Published load becomes the instance's `EngineLoad` (received time as its age: stale numbers are ignored
by routing like stale scrapes), published health its health.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

import orjson
from pydantic import ValidationError

from ..config import InstanceConfig
from ..fleet.fleet import Fleet
from ..fleet.state import EngineLoad, Published
from ..tasks import cancel_and_wait
from .config import ClusterConfig
from .keys import (
    ENGINE_HEADER,
    NodeRecord,
    ReplicaRecord,
    cluster_prefix,
    decode_node,
    decode_replica,
    nodes_prefix,
    replica_key,
    replicas_prefix,
)
from .lease import Registration
from .limits import ClusterLimits
from .store import Etcd, KeyValue, StoreUnavailable, WatchEvent

log = logging.getLogger(__name__)

#: How long after a first read of etcd that found no sidecar a central says so (a cluster started at once has its
#: sidecars published moments after its centrals read etcd).
_LONELY_S = 10.0


def new_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def remote_key(record: NodeRecord, engine_id: str) -> str:
    return f"{record.url}#{engine_id}"


class Discovery:
    def __init__(self, config: ClusterConfig, fleet: Fleet, limits: ClusterLimits | None = None) -> None:
        self.config = config
        self._fleet = fleet
        self.etcd = Etcd(config.endpoints, timeout_s=config.timeout_ms / 1000)
        self.replica = limits.replica if limits is not None else new_replica_id()
        self.limits = limits
        started = time.time()
        self.registration = Registration(
            self.etcd,
            replica_key(config.name, self.replica),
            limits.record if limits is not None else lambda: orjson.dumps({"id": self.replica, "started_at": started}),
            ttl_s=config.lease_ttl_ms / 1000,
            republish_s=config.publish_interval_ms / 1000 if limits is not None else None,
        )
        self.prefix = cluster_prefix(config.name)
        self._nodes_prefix = nodes_prefix(config.name)
        self._replicas_prefix = replicas_prefix(config.name)
        #: etcd key -> a live central replica's record (this one's included once it is written).
        self.replicas: dict[str, ReplicaRecord] = {}
        #: etcd key -> (record, monotonic time it was received).
        self.nodes: dict[str, tuple[NodeRecord, float]] = {}
        #: etcd key -> the instance keys that node's engines have here; instance key -> its models.
        self._owned: dict[str, set[str]] = {}
        self._models: dict[str, tuple[str, ...]] = {}
        self.watching = False
        self.synced_at: float | None = None
        self.resyncs = 0
        self.events = 0
        self.last_error: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: etcd key -> the timer that detaches the engines of a node whose key went without it stopping (`_delete`).
        self._leaving: dict[str, asyncio.TimerHandle] = {}
        #: The timer that says no sidecar was found (`_still_lonely`), after the first read of etcd found none.
        self._lonely: asyncio.TimerHandle | None = None
        fleet.discovering = True  # until a read of etcd finds a sidecar (`_found`)

    async def __aenter__(self) -> Discovery:
        await self.etcd.__aenter__()
        self._tasks = [
            asyncio.create_task(self.registration.run(), name="lockgate-cluster-replica"),
            asyncio.create_task(self.run(), name="lockgate-cluster-watch"),
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._lonely is not None:
            self._lonely.cancel()
        for timer in self._leaving.values():
            timer.cancel()
        self._leaving.clear()
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)
        if tasks:
            await self.registration.aclose()
        await self.etcd.aclose()

    # --- state -----------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.watching and self.registration.connected

    @property
    def confirmed_at(self) -> float | None:
        times = [t for t in (self.synced_at, self.registration.confirmed_at) if t is not None]
        return max(times) if times else None

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        retry = min(0.25, self.config.lease_ttl_ms / 4000)
        while True:
            try:
                first = self.synced_at is None
                revision, kvs = await self.etcd.get_prefix(self.prefix)
                self.resync(kvs, time.monotonic())
                if self.last_error is not None:
                    log.warning("etcd watch resumed: %d sidecar(s) in the fleet", len(self.nodes))
                    self.last_error = None
                if first and not self.nodes:
                    # (A central whose `cluster.name` differs from its sidecars' said nothing, and served nothing.)
                    # Said if none has come a while after: a cluster started at once has its sidecars moments later.
                    loop = asyncio.get_running_loop()
                    self._lonely = loop.call_later(_LONELY_S, self._still_lonely)
                self.watching = True
                async for events in self.etcd.watch_prefix(self.prefix, revision + 1):
                    self.apply(events, time.monotonic())
            except StoreUnavailable as exc:
                if self.watching or self.last_error is None:
                    if self.synced_at is None:
                        # (Models the configuration lists are served meanwhile: "requests get 503" misled an operator.)
                        log.warning(
                            "etcd not reached (%s): no sidecar known yet, requests for models only sidecars serve get "
                            "503 until it is",
                            exc,
                        )
                    else:
                        log.warning("etcd watch lost (%s): serving on the last-known fleet", exc)
                self.last_error = str(exc)
            self.watching = False
            await asyncio.sleep(retry)

    def _still_lonely(self) -> None:
        self._lonely = None
        if not self.nodes:
            log.warning(
                "etcd at %s: no sidecar publishes under %s (is `cluster.name` the sidecars' own?); requests for models "
                "only sidecars serve get 503 until one does",
                self.etcd.endpoint,
                self.prefix,
            )

    def resync(self, kvs: list[KeyValue], now: float) -> None:
        """Make the fleet match a full read of the prefix."""
        self.resyncs += 1
        self.synced_at = now
        seen = set()
        for kv in kvs:
            seen.add(kv.key)
            self._put(kv.key, kv.value, now)
        for key in [k for k in [*self.nodes, *self.replicas] if k not in seen]:
            self._delete(key)
        self._replicas_changed()
        self._found()

    def _found(self) -> None:
        """Once etcd was read and a sidecar found, the models not known here are not served (404). Before, the fleet
        is still being discovered (503 `cluster_not_synced`): a cluster starting all at once has centrals that read
        etcd before any sidecar published."""
        if self._fleet.discovering and self.nodes:
            self._fleet.discovered()

    def apply(self, events: list[WatchEvent], now: float) -> None:
        self.synced_at = now
        replicas = False
        for event in events:
            self.events += 1
            if event.key.startswith(self._replicas_prefix):
                replicas = True
            if event.kind == "put":
                self._put(event.key, event.value, now)
            else:
                self._delete(event.key)
        if replicas:
            self._replicas_changed()
        self._found()

    def _replicas_changed(self) -> None:
        if self.limits is not None:
            self.limits.apply(self.replicas)

    def _put(self, key: str, raw: bytes, now: float) -> None:
        if key.startswith(self._replicas_prefix):
            replica = decode_replica(raw)
            if replica is not None:
                self.replicas[key] = replica
            return
        if not key.startswith(self._nodes_prefix):
            return  # a key of a later layout
        record = decode_node(raw)
        if record is None:
            log.warning("etcd key %s does not hold a node record; ignored", key)
            return
        fleet = self._fleet
        leaving = self._leaving.pop(key, None)
        if leaving is not None:
            leaving.cancel()
            log.info("sidecar %s (%s) is back: its engines stay", record.node, record.url)
        elif key not in self.nodes:
            log.info("sidecar %s (%s) joined with %d engine(s)", record.node, record.url, len(record.engines))
        self.nodes[key] = (record, now)
        owned = self._owned.setdefault(key, set())
        current = set()
        for engine in record.engines:
            ikey = remote_key(record, engine.id)
            instance = fleet.instances.get(ikey)
            if instance is None or self._models.get(ikey) != engine.models:
                try:
                    spec = InstanceConfig(
                        url=record.url,
                        engine="openai",
                        name=f"{record.node}/{engine.name}",
                        max_concurrency=engine.max_concurrency,
                        api_key=self.config.api_key,
                    )
                except ValidationError:
                    log.warning("sidecar %s publishes an unusable URL %r; ignored", record.node, record.url)
                    return
                instance = fleet.attach(
                    spec, engine.models, key=ikey, headers=[(ENGINE_HEADER, engine.id)], routing=self.config.routing
                )
                self._models[ikey] = engine.models
            fleet.rename(instance, f"{record.node}/{engine.name}")  # (a sidecar's reload may rename its engine)
            current.add(ikey)
            fleet.set_concurrency(instance, engine.max_concurrency)
            instance.published = Published(
                node=record.node,
                engine_id=engine.id,
                seq=record.seq,
                received_at=now,
                in_flight=engine.in_flight,
                queued_prompt_tokens=engine.queued_prompt_tokens,
                ttft_s=engine.ttft_s,
                tpot_s=engine.tpot_s,
                prefill_tps=engine.prefill_tps,
                engine=engine.engine,
            )
            # The sidecar counts every replica's requests; this replica's own are counted live here, so
            # the rest (as of now) is the other replicas'. Their slots count here; their queued prefill
            # does not (docs/cluster.md, "Load": a duplicate of a request in flight there would be sent
            # elsewhere and miss it at the sidecar).
            instance.engine_load = EngineLoad(
                scraped_at=now,
                waiting=engine.waiting,
                running=engine.running,
                kv_usage=engine.kv_usage,
                prefix_hits=engine.prefix_hits,
                prefix_queries=engine.prefix_queries,
                foreign_in_flight=max(0, engine.in_flight - instance.in_flight),
                own_left=instance.own.left_unanswered,
            )
            if record.draining or not engine.routable:
                instance.last_error = "its sidecar is stopping" if record.draining else "its sidecar reports it down"
            fleet.set_health(instance, engine.routable and not record.draining)
            if engine.resident:
                for model in engine.models:
                    pool = fleet.pools.get(model)
                    if pool is not None and pool.residency is not None:
                        pool.residency.add(ikey, engine.resident)
        for gone in owned - current:
            self._forget(gone)
        self._owned[key] = current

    def _delete(self, key: str) -> None:
        """A node's key is gone. A sidecar that stopped (its record said it was draining) leaves at once. Otherwise
        its lease expired (killed, cut off, or etcd itself stalled past the lease's TTL or lost its data: then every
        sidecar re-registers within moments): its engines take no new requests now and leave after one lease TTL
        unless the node is back by then, so a model served by live sidecars never answers 404 for that moment,
        and engines that come back keep their state."""
        if self.replicas.pop(key, None) is not None:
            return
        entry = self.nodes.pop(key, None)
        if entry is None or key in self._leaving:
            return
        record = entry[0]
        if record.draining:
            log.info("sidecar %s left (it stopped)", record.node)
            self._detach(key)
            return
        log.info("sidecar %s lost its key: its engines take no requests, and leave unless it is back", record.node)
        for ikey in self._owned.get(key, ()):
            instance = self._fleet.instances.get(ikey)
            if instance is not None:
                instance.last_error = "its sidecar's key in etcd expired"
                self._fleet.set_health(instance, False, cache_lost=False)  # its engine may well run on
        grace = self.config.lease_ttl_ms / 1000
        self._leaving[key] = asyncio.get_running_loop().call_later(grace, self._left, key, record.node)

    def _left(self, key: str, node: str) -> None:
        """A node whose key went without it stopping did not come back within a lease TTL."""
        if self._leaving.pop(key, None) is not None:
            log.info("sidecar %s left (its key is gone)", node)
            self._detach(key)

    def _detach(self, key: str) -> None:
        for ikey in self._owned.pop(key, set()):
            self._forget(ikey)

    def _forget(self, ikey: str) -> None:
        self._models.pop(ikey, None)
        self._fleet.detach(ikey)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        confirmed = self.confirmed_at
        return {
            "role": "central",
            "cluster": self.config.name,
            "replica": self.replica,
            "connected": self.connected,
            "watching": self.watching,
            "etcd_endpoint": self.etcd.endpoint,
            "last_confirmed_age_s": None if confirmed is None else round(now - confirmed, 3),
            "replicas": sorted(r.id for r in self.replicas.values()),
            "tenant_shares": self.limits.shares() if self.limits is not None else {},
            "resyncs": self.resyncs,
            "events": self.events,
            # (The watch may stay open to an etcd that stopped answering the replica's lease.)
            "last_error": (self.last_error or self.registration.last_error) if not self.connected else None,
            "nodes": [
                {
                    "node": record.node,
                    "url": record.url,
                    "age_s": round(now - received, 3),
                    "seq": record.seq,
                    "draining": record.draining,
                    "engines": [e.name for e in record.engines],
                }
                for record, received in self.nodes.values()
            ],
        }
