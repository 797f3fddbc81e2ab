"""A gateway's place in a cluster: `join()` starts the sidecar or the central role for it.

    async with join("central", config.cluster, gateway, url):   # or "sidecar"
        ...

Either role exports `lockgate_cluster_connected` (etcd reachable and this process's keys and view
current) and `lockgate_cluster_state_age_seconds` (how long ago etcd last confirmed them), and adds a
`cluster` section to `GET /admin/fleet`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

from prometheus_client import Gauge

from .config import ClusterConfig
from .discovery import Discovery, new_replica_id
from .limits import ClusterLimits
from .publisher import Publisher

if TYPE_CHECKING:
    from ..gateway import Gateway

Role = Literal["central", "sidecar"]


@contextlib.asynccontextmanager
async def join(role: Role, config: ClusterConfig, gateway: Gateway, url: str) -> AsyncIterator[Discovery | Publisher]:
    member: Discovery | Publisher
    if role == "sidecar":
        member = Publisher(config, gateway.fleet, url, lambda: gateway.draining)
    else:
        admission = gateway.admission
        limits = ClusterLimits(new_replica_id(), admission.limiter, lambda: admission.book.tenants)
        member = Discovery(config, gateway.fleet, limits)
    registry = gateway.metrics.registry
    connected = Gauge(
        "lockgate_cluster_connected",
        "1 while etcd answers and this gateway's cluster state is current.",
        registry=registry,
    )
    connected.set_function(lambda: 1.0 if member.connected else 0.0)
    age = Gauge(
        "lockgate_cluster_state_age_seconds",
        "Seconds since etcd last confirmed this gateway's cluster state (grows while etcd is unreachable).",
        registry=registry,
    )

    def state_age() -> float:
        confirmed = member.confirmed_at
        return -1.0 if confirmed is None else time.monotonic() - confirmed

    age.set_function(state_age)
    if isinstance(member, Discovery):
        discovery = member
        nodes = Gauge("lockgate_cluster_nodes", "Sidecars this gateway currently knows.", registry=registry)
        nodes.set_function(lambda: float(len(discovery.nodes)))
    gateway.fleet.reports["cluster"] = member.describe
    async with member:
        yield member
