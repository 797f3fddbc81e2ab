"""`GET /admin/fleet`: each instance's state, its sources and their ages, ejection, prefix-index size."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fleet import Fleet
    from .instance import Instance
    from .state import Ewma


def describe_fleet(fleet: Fleet) -> dict[str, Any]:
    now = time.monotonic()
    index_blocks: dict[str, int] = {}
    for pool in fleet.pools.values():
        for instance in pool.instances:
            index_blocks[instance.key] = index_blocks.get(instance.key, 0) + pool.index.blocks_of(instance.key)
    return {
        **{name: report() for name, report in fleet.reports.items()},
        "instances": [_instance(i, now, index_blocks.get(i.key, 0), fleet) for i in fleet.instances.values()],
        # Instances a reload removed whose requests still run (those replaced at their URL count on their replacement).
        "retiring": [
            {"name": i.name, "url": i.url, "in_flight": i.in_flight, "calls_open": i.open_calls}
            for i in fleet.retiring
            if i.successor is None
        ],
        "pools": [
            {
                "model": pool.model,
                "policy": pool.policy.name,
                "instances": [i.name for i in pool.instances],
                "prefix_index": {
                    "blocks": len(pool.index),
                    "max_blocks": pool.index.max_entries,
                    "approx_bytes": pool.index.approx_bytes,
                    "block_chars": pool.index.block_chars,
                    "evictions": pool.index.evictions,
                },
            }
            for pool in fleet.pools.values()
        ],
    }


def _instance(instance: Instance, now: float, index_blocks: int, fleet: Fleet) -> dict[str, Any]:
    own, load, ejection, published = instance.own, instance.engine_load, instance.ejection, instance.published
    stale_after = min((p.stale_after for p in fleet.pools.values() if instance in p.instances), default=1.0)
    return {
        "name": instance.name,
        "url": instance.url,
        "engine": instance.dialect.name,
        "healthy": instance.healthy,
        "routable": instance.routable,
        "in_flight": instance.in_flight,
        "max_concurrency": instance.max_concurrency,
        # What the engine said it runs at once (None: it does not say; the limit is discovered).
        "engine_parallelism": instance.concurrency.declared,
        "last_error": instance.last_error,
        "last_probe_age_s": None if instance.last_probe_at is None else round(time.time() - instance.last_probe_at, 3),
        "ejection": {
            "ejected": ejection.ejected,
            "returns_in_s": None
            if ejection.ejected_until is None
            else round(max(0.0, ejection.ejected_until - now), 3),
            "ejections_in_a_row": ejection.ejections,
            "consecutive_failures": ejection.consecutive_failures,
            "held_back": ejection.held_back,
            # Ejected after its engine went silent in a call: it returns by answering a one-token request (probed
            # when `returns_in_s` runs out), not by its health check.
            "awaits_answer": ejection.silent,
        },
        "sources": {
            "gateway": {
                "age_s": _age(own.updated_at, now),
                "queued_prompt_tokens": own.queued_prompt_tokens,
                "pending_first_token": own.pending,
                "ttft_s": _ewma(own.ttft),
                "tpot_s": _ewma(own.tpot),
                "decode_s": _ewma(own.decode),
                "prefill_tps": _ewma(own.prefill_tps),
                "errors": own.errors,
            },
            "engine": None
            if load is None
            else {
                "age_s": round(load.age(now), 3),
                "stale": load.age(now) > stale_after,
                "waiting": load.waiting,
                "running": load.running,
                "kv_usage": load.kv_usage,
                "prefix_cache_hits": load.prefix_hits,
                "prefix_cache_queries": load.prefix_queries,
                "tpot_s": load.tpot_s,
                "scrape_error": instance.scrape_error,
            },
            "sidecar": None
            if published is None
            else {
                "node": published.node,
                "engine": published.engine_id,
                "age_s": round(published.age(now), 3),
                "seq": published.seq,
                "in_flight": published.in_flight,
                "queued_prompt_tokens": published.queued_prompt_tokens,
                "ttft_s": published.ttft_s,
                "tpot_s": published.tpot_s,
                "prefill_tps": published.prefill_tps,
            },
        },
        "prefix_index_blocks": index_blocks,
        "prefix_cache": {
            "tokens": instance.cache_tokens or (load.cache_tokens if load is not None else None),
            "predicted_hit_rate": round(instance.predicted_hits / instance.predicted_queries, 4)
            if instance.predicted_queries
            else None,
            "hit_rate_gap": round(instance.hit_gap.value, 4) if instance.hit_gap.ewma.samples else None,
        },
        "routing_view": _view(instance, now, stale_after),
    }


def _view(instance: Instance, now: float, stale_after: float) -> dict[str, Any]:
    view = instance.view(now, stale_after)
    return {
        "waiting": view.waiting,
        "running": view.running,
        "kv_usage": view.kv_usage,
        "queued_prompt_tokens": view.queued_prompt_tokens,
    }


def _age(at: float | None, now: float) -> float | None:
    return None if at is None else round(now - at, 3)


def _ewma(e: Ewma) -> float | None:
    return None if not e.samples else round(e.value, 6)
