"""The `cluster:` section: where etcd is, which cluster this process belongs to, how it keeps its lease.

The same section serves both roles; the command picks the role (`lockgate sidecar` publishes its
engines, `lockgate serve` discovers the sidecars' engines). Kept apart from `config.py` so that the
cluster's keys live next to the code that reads them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..admission.config import check_key_digests
from ..routing.config import RoutingConfig
from ..urlcheck import http_url_problem


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: etcd client URLs (`http://host:port`), tried in order; the first that answers is used.
    endpoints: Annotated[list[str], Field(min_length=1)] = ["http://127.0.0.1:2379"]
    #: Every key lives under `/lockgate/<name>/`: several clusters can share one etcd.
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")] = "default"
    #: Lease TTL: a process that stops refreshing its lease (killed, cut off) drops out after this long.
    #: etcd rounds TTLs up to its own minimum (1.5 election timeouts: 2 s with etcd's defaults).
    lease_ttl_ms: Annotated[int, Field(ge=1000, le=60_000)] = 3000
    #: How often a sidecar publishes its engines' state.
    publish_interval_ms: Annotated[int, Field(ge=10, le=10_000)] = 100
    #: Each etcd call's deadline; a watch that stays silent is checked by the lease's keepalive instead.
    timeout_ms: Annotated[int, Field(ge=50, le=60_000)] = 1000
    #: Sidecar: this node's name in etcd (unique in the cluster); defaults to its advertised URL's host:port.
    node: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    #: Sidecar: the URL central gateways use to reach it; defaults to its listen address.
    advertise_url: str | None = None
    #: Central: the bearer token it sends to sidecars (a key of a sidecar tenant; none for open sidecars);
    #: kept out of `repr`.
    api_key: str | None = Field(default=None, repr=False)
    #: Central: the routing of a model that only etcd knows about (a model also configured under
    #: `models:` keeps its own settings and gets the discovered instances added).
    routing: RoutingConfig = RoutingConfig()
    #: Central: prompts whose first this-many blocks (`prefix_index.block_chars` each) agree get the same
    #: default instance on every replica (rendezvous hashing over the live instances; load still
    #: decides). 0 turns the shared placement off.
    placement_blocks: Annotated[int, Field(ge=0, le=4096)] = 8
    #: Central: on how many nodes (their best-weighted engines) that placement counts a new prefix as
    #: cached; load picks among them.
    placement_choices: Annotated[int, Field(ge=1, le=8)] = 2
    #: Sidecar: who picks the engine among this node's. `sidecar`: the central's pick (`x-lockgate-engine`)
    #: chooses the node, and the sidecar routes among its own engines by its own policy: it sees every request
    #: they get, from every replica (exact in-flight, queues, cache residency), where a central sees the
    #: others' traffic a publication late. `central`: the sidecar sends each request to the engine the central
    #: named (a central-side policy that must decide per engine, e.g. `consistent_hash` over the whole fleet).
    engine_choice: Literal["sidecar", "central"] = "sidecar"
    #: Sidecar: sha256 digests of the keys central replicas present (their `api_key`); a request with
    #: one of them is scheduled and recorded by the client's tenant and class the central passes on
    #: (`cluster/identity.py`). Without them, central traffic is one tenant here.
    central_keys: list[str] = []

    @field_validator("central_keys")
    @classmethod
    def _check_central_keys(cls, value: list[str]) -> list[str]:
        return check_key_digests(value)

    @field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"etcd endpoint must start with http:// or https:// (got {url!r})")
        return [url.rstrip("/") for url in value]

    @field_validator("advertise_url")
    @classmethod
    def _check_advertise(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        problem = http_url_problem(value)  # what every central will check it against (an instance's URL)
        if problem is not None:
            raise ValueError(problem)
        return value.rstrip("/")
