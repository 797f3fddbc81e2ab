"""The key layout in etcd and the records stored there (docs/cluster.md has the same table).

    /lockgate/<cluster>/nodes/<node>       a sidecar: its URL and each engine's state (JSON, `NodeRecord`),
                                           rewritten every `publish_interval_ms` under the sidecar's lease
    /lockgate/<cluster>/replicas/<id>      a central gateway (`ReplicaRecord`): its id, start time and
                                           per-tenant demand, rewritten every `publish_interval_ms` under
                                           its lease (the live replicas split each tenant's limits by
                                           demand; the lease's keepalive is also how a replica notices
                                           that etcd is gone)

Every key is written under its writer's lease, so a writer that dies takes its keys with it within
the lease TTL. Values are JSON objects; readers ignore fields they do not know and skip records they
cannot read (a newer writer, a foreign key), so the layout can grow.

`decode_node` is pure and total: whatever bytes a key holds, it returns a record or None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

ROOT = "/lockgate/"

#: The request header a central gateway sends to a sidecar to name the engine it chose (its key there).
ENGINE_HEADER = "x-lockgate-engine"


def cluster_prefix(cluster: str) -> str:
    return f"{ROOT}{cluster}/"


def nodes_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}nodes/"


def node_key(cluster: str, node: str) -> str:
    return f"{nodes_prefix(cluster)}{node}"


def replicas_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}replicas/"


def replica_key(cluster: str, replica: str) -> str:
    return f"{replicas_prefix(cluster)}{replica}"


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One engine behind a sidecar, as that sidecar sees it. Load numbers are the sidecar's merged view
    (its own accounting raised by the engine's scraped metrics), so they include every central
    replica's traffic."""

    #: The engine's key at its sidecar (its URL there): what `ENGINE_HEADER` carries.
    id: str
    #: Display name at the sidecar.
    name: str
    #: Model names (as clients send them) this engine serves.
    models: tuple[str, ...]
    engine: str = "vllm"
    routable: bool = True
    max_concurrency: int = 64
    in_flight: int = 0
    waiting: int = 0
    running: int = 0
    queued_prompt_tokens: int = 0
    kv_usage: float = 0.0
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prefill_tps: float = 0.0
    #: Prefix anchors (`routing/residency.py`) of the prompts routed to this engine since the sidecar's
    #: previous publication, at most `MAX_RESIDENT`.
    resident: tuple[int, ...] = ()


#: Anchors one engine entry may carry (a sidecar keeps the newest).
MAX_RESIDENT = 4096


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A sidecar and its engines, one etcd value."""

    node: str
    url: str
    engines: tuple[EngineRecord, ...]
    #: Publications so far by this sidecar process (readers can see a restart: it starts again at 1).
    seq: int = 0
    #: The sidecar's wall clock when it published (informational: ages are measured on receipt).
    published_at: float = 0.0
    draining: bool = False


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A central replica and the demand it sees per rate-limited tenant (requests offered per second,
    admitted or not: what it would use if it could), and the fraction of each one's allowance it still holds
    (`fill`: where a replica that joins starts)."""

    id: str
    started_at: float = 0.0
    demand: tuple[tuple[str, float], ...] = ()
    fill: tuple[tuple[str, float], ...] = ()


def encode_replica(record: ReplicaRecord) -> bytes:
    return orjson.dumps(
        {"id": record.id, "started_at": record.started_at, "demand": dict(record.demand), "fill": dict(record.fill)}
    )


def decode_replica(raw: bytes) -> ReplicaRecord | None:
    try:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            return None
        demand = data.get("demand", {})
        fill = data.get("fill", {})  # (absent from an older replica's record)
        if not isinstance(demand, dict) or not isinstance(fill, dict):
            return None
        return ReplicaRecord(
            id=_str(data["id"]),
            started_at=float(data.get("started_at", 0.0)),
            demand=tuple(sorted((_str(k), max(0.0, float(v))) for k, v in demand.items())),
            fill=tuple(sorted((_str(k), min(1.0, max(0.0, float(v)))) for k, v in fill.items())),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def encode_node(record: NodeRecord) -> bytes:
    return orjson.dumps(asdict(record))


def decode_node(raw: bytes) -> NodeRecord | None:
    """The record in `raw`, or None if it is not one (bad JSON, missing or mistyped fields)."""
    try:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            return None
        engines = tuple(_engine(e) for e in data["engines"])
        return NodeRecord(
            node=_str(data["node"]),
            url=_str(data["url"]),
            engines=engines,
            seq=int(data.get("seq", 0)),
            published_at=float(data.get("published_at", 0.0)),
            draining=bool(data.get("draining", False)),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _engine(data: Any) -> EngineRecord:
    if not isinstance(data, dict):
        raise TypeError("engine entry is not an object")
    models = data["models"]
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise TypeError("models must be a list of names")

    def opt(name: str) -> float | None:
        value = data.get(name)
        return None if value is None else float(value)

    return EngineRecord(
        id=_str(data["id"]),
        name=_str(data["name"]),
        models=tuple(models),
        engine=_str(data.get("engine", "vllm")),
        routable=bool(data.get("routable", True)),
        max_concurrency=max(1, int(data.get("max_concurrency", 64))),
        in_flight=int(data.get("in_flight", 0)),
        waiting=int(data.get("waiting", 0)),
        running=int(data.get("running", 0)),
        queued_prompt_tokens=int(data.get("queued_prompt_tokens", 0)),
        kv_usage=float(data.get("kv_usage", 0.0)),
        prefix_hits=opt("prefix_hits"),
        prefix_queries=opt("prefix_queries"),
        ttft_s=float(data.get("ttft_s", 0.0)),
        tpot_s=float(data.get("tpot_s", 0.0)),
        prefill_tps=float(data.get("prefill_tps", 0.0)),
        resident=_hashes(data.get("resident", [])),
    )


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RESIDENT:
        raise TypeError("resident must be a list of at most MAX_RESIDENT hashes")
    if not all(type(h) is int and 0 <= h < 2**64 for h in value):
        raise TypeError("resident hashes are 64-bit unsigned integers")
    return tuple(value)


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise TypeError("expected a non-empty printable string")
    return value
