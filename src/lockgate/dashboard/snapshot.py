"""The dashboard's snapshot: a pure function from the gateway's state (`sources.GatewayState`) and the
per-second history to the JSON object one SSE event carries.

The page renders only what is here; the shape (all keys always present):

    {"type": "snapshot", "at", "uptime_s", "draining",
     "instances": [{"name", "url", "engine", "models", "status", "healthy", "routable", "ejected",
                    "returns_in_s", "in_flight", "max_concurrency", "waiting", "running", "kv_usage",
                    "prefix_hits", "prefix_queries", "prefix_hit_rate", "metric_age_s", "stale",
                    "probe_age_s", "last_error"}],
     "pools": [{"model", "policy", "capacity", "running", "queued",
                "classes": [{"name", "queued", "running", "granted", "rejected"}]}],
     "requests": {"total", "shown": [Exchange.describe(), ... oldest first, bounded]},
     "dedup": {"outcomes": {...}, "hit_ratio", "flights_in_flight", "subscribers", "cache": {...},
               "tokens_saved": {...}},
     "cancellations": {reason: count}, "finished": {status: count},
     "history": {"fields": [...], "rows": [[...], ...], "full": bool},
     "slo": {"objectives": [...]} | null, "slo_error": str | null}

`history.full` is true when `rows` is the whole ring (a client's first event); later events carry only the
newest rows and the page appends those newer than what it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .history import SAMPLE_FIELDS, Sample
from .sources import GatewayState

#: Outcomes of `lockgate_dedup` that spared an engine call.
_SAVED = ("coalesced", "hit", "semantic")
#: Outcomes that describe a served request (`semantic_shadow` is a shadow-mode note, not a request).
_SERVED = ("miss", "coalesced", "hit", "semantic", "bypass")


def build_snapshot(state: GatewayState, samples: Sequence[Sample], *, full_history: bool) -> dict[str, Any]:
    """The snapshot for `state`; `samples` are the history rows to include (all of them when
    `full_history`, else the newest few)."""
    models_of: dict[str, list[str]] = {}
    for pool in state.fleet.get("pools", ()):
        for name in pool["instances"]:
            models_of.setdefault(name, []).append(pool["model"])
    return {
        "type": "snapshot",
        "at": round(state.at, 3),
        "uptime_s": round(max(0.0, state.at - state.started_at), 1),
        "draining": state.draining,
        "instances": [_instance(i, models_of.get(i["name"], [])) for i in state.fleet.get("instances", ())],
        "pools": _pools(state),
        "requests": {"total": state.requests_total, "shown": list(state.requests)},
        "dedup": _dedup(state),
        "cancellations": dict(state.counters.get("cancellations", {})),
        "finished": dict(state.counters.get("requests", {})),
        "history": {"fields": list(SAMPLE_FIELDS), "rows": [s.row() for s in samples], "full": full_history},
        "slo": None if state.slo is None else dict(state.slo),
        "slo_error": state.slo_error,
    }


def instance_status(healthy: bool, ejected: bool, stale: bool | None) -> str:
    """One word for an instance: `ejected` (outlier ejection), `down` (failing health checks), `stale`
    (healthy, but its engine metrics are too old to be used), else `healthy`."""
    if ejected:
        return "ejected"
    if not healthy:
        return "down"
    if stale:
        return "stale"
    return "healthy"


def _instance(raw: Mapping[str, Any], models: list[str]) -> dict[str, Any]:
    engine = raw["sources"]["engine"]
    ejection = raw["ejection"]
    hits = None if engine is None else engine.get("prefix_cache_hits")
    queries = None if engine is None else engine.get("prefix_cache_queries")
    stale = None if engine is None else bool(engine.get("stale"))
    return {
        "name": raw["name"],
        "url": raw["url"],
        "engine": raw["engine"],
        "models": models,
        "status": instance_status(bool(raw["healthy"]), bool(ejection["ejected"]), stale),
        "healthy": raw["healthy"],
        "routable": raw["routable"],
        "ejected": ejection["ejected"],
        "returns_in_s": ejection["returns_in_s"],
        "in_flight": raw["in_flight"],
        "max_concurrency": raw["max_concurrency"],
        "waiting": None if engine is None else engine.get("waiting"),
        "running": None if engine is None else engine.get("running"),
        "kv_usage": None if engine is None else engine.get("kv_usage"),
        "prefix_hits": hits,
        "prefix_queries": queries,
        "prefix_hit_rate": round(hits / queries, 4) if hits is not None and queries else None,
        "metric_age_s": None if engine is None else engine.get("age_s"),
        "stale": stale,
        "probe_age_s": raw["last_probe_age_s"],
        "last_error": raw["last_error"],
    }


def _pools(state: GatewayState) -> list[dict[str, Any]]:
    policies = {p["model"]: p["policy"] for p in state.fleet.get("pools", ())}
    out = []
    for model, stats in state.admission.get("pools", {}).items():
        classes = [
            {
                "name": name,
                "queued": c["queued"],
                "running": c["running"],
                "granted": c["granted"],
                "rejected": c["rejected"],
            }
            for name, c in stats["classes"].items()
        ]
        out.append(
            {
                "model": model,
                "policy": policies.get(model),
                "capacity": stats["capacity"],
                "running": stats["running"],
                "queued": sum(c["queued"] for c in classes),
                "classes": classes,
            }
        )
    return out


def _dedup(state: GatewayState) -> dict[str, Any]:
    outcomes = dict(state.counters.get("dedup", {}))
    served = sum(outcomes.get(o, 0.0) for o in _SERVED)
    saved = sum(outcomes.get(o, 0.0) for o in _SAVED)
    flights = state.dedup.get("flights", {})
    return {
        "outcomes": outcomes,
        "hit_ratio": round(saved / served, 4) if served else None,
        "flights_in_flight": flights.get("in_flight", 0),
        "subscribers": flights.get("subscribers", 0),
        "cache": dict(state.dedup.get("cache", {})),
        "tokens_saved": dict(state.counters.get("tokens_saved", {})),
    }
