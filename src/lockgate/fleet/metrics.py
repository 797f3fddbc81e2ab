"""Per-instance load state as Prometheus gauges, read from the fleet at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .state import EngineLoad

if TYPE_CHECKING:
    from .instance import Instance
    from .pool import Pool

_GAUGES = (
    ("in_flight", "Requests the gateway has in flight on the instance."),
    ("queued_prompt_tokens", "Prompt tokens sent to the instance whose first token has not come back."),
    ("ttft_seconds", "Observed time to first token (EWMA)."),
    ("tpot_seconds", "Observed time per output token (EWMA)."),
    ("prefill_tokens_per_second", "Measured prefill rate (EWMA)."),
    ("engine_waiting", "Requests waiting, as last scraped from the engine (-1: unknown)."),
    ("engine_running", "Requests running, as last scraped from the engine (-1: unknown)."),
    ("engine_kv_usage", "KV-cache use 0..1, as last scraped from the engine (-1: unknown)."),
    ("engine_metrics_age_seconds", "Age of the last good scrape of the engine's metrics (-1: never)."),
    ("ejected", "1 while the instance is ejected as an outlier."),
    ("errors", "Failed attempts on the instance seen by the gateway."),
)


class FleetView(Protocol):
    """What the collector reads of a fleet at each scrape (the fleet replaces its pools on a reload)."""

    @property
    def instances(self) -> Mapping[str, Instance]: ...

    @property
    def pools(self) -> Mapping[str, Pool]: ...

    @property
    def retiring(self) -> Iterable[Instance]: ...

    def in_flight_shown(self, instance: Instance) -> int: ...


class FleetCollector(Collector):
    def __init__(self, fleet: FleetView) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = time.monotonic()
        families = {
            name: GaugeMetricFamily(f"lockgate_instance_{name}", doc, labels=["instance"]) for name, doc in _GAUGES
        }
        current = self._fleet.instances.values()
        names = {instance.name for instance in current}
        # An instance a reload removed is shown until its last request ends (as its calls and permits are), unless
        # one of the same name replaced it, or one at its URL did (its requests count there: `Instance.hand_over`).
        # One that left under the name of one serving now (at another URL) shows under it (`Fleet.in_flight_shown`).
        leaving = [i for i in self._fleet.retiring if i.name not in names and i.successor is None]
        shown = self._fleet.in_flight_shown
        for instance in (*current, *leaving):
            own, load = instance.own, instance.engine_load
            values = {
                "in_flight": instance.in_flight if instance.retired else shown(instance),
                "queued_prompt_tokens": own.queued_prompt_tokens,
                "ttft_seconds": own.ttft.value,
                "tpot_seconds": own.tpot.value,
                "prefill_tokens_per_second": own.prefill_tps.value,
                "engine_waiting": _known(load.waiting if load else None),
                "engine_running": _known(load.running if load else None),
                "engine_kv_usage": _known(load.kv_usage if load else None),
                "engine_metrics_age_seconds": load.age(now) if load else -1.0,
                "ejected": 1 if instance.ejection.ejected else 0,
                "errors": own.errors,
            }
            for name, value in values.items():
                families[name].add_metric([instance.name], float(value))
        index = GaugeMetricFamily("lockgate_prefix_index_blocks", "Blocks in a model's prefix index.", labels=["model"])
        hit_rate = GaugeMetricFamily(
            "lockgate_kv_cache_hit_rate",
            "Engine prefix-cache hit rate 0..1 per model: prefix-cache hit tokens / queried tokens summed over the "
            "model's instances since they started (vLLM counters), else the mean of the engines' own hit-rate "
            "gauges (SGLang). Absent while no instance of the model exports either.",
            labels=["model"],
        )
        # The engines' own counters, for windowed hit rates in PromQL (a restarted engine is a counter reset).
        prefix_hits = CounterMetricFamily(
            "lockgate_instance_engine_prefix_cache_hits",
            "Prefix-cache hit tokens, as last scraped from the engine (engines that export the counter).",
            labels=["instance"],
        )
        prefix_queries = CounterMetricFamily(
            "lockgate_instance_engine_prefix_cache_queries",
            "Prefix-cache queried tokens, as last scraped from the engine (engines that export the counter).",
            labels=["instance"],
        )
        for instance in self._fleet.instances.values():
            load = instance.engine_load
            if load is not None and load.prefix_hits is not None and load.prefix_queries is not None:
                prefix_hits.add_metric([instance.name], load.prefix_hits)
                prefix_queries.add_metric([instance.name], load.prefix_queries)
        for pool in self._fleet.pools.values():
            index.add_metric([pool.model], float(len(pool.index)))
            rate = kv_cache_hit_rate(i.engine_load for i in pool.instances)
            if rate is not None:
                hit_rate.add_metric([pool.model], rate)
        yield from families.values()
        yield index
        yield hit_rate
        yield prefix_hits
        yield prefix_queries


def kv_cache_hit_rate(loads: Iterable[EngineLoad | None]) -> float | None:
    """A model's prefix-cache hit rate from its instances' last scrapes (None: no instance exports one).
    Counters (hits and queries, in tokens) win over the engines' own rate gauges: they weigh each
    instance by its traffic."""
    hits = queries = 0.0
    rates: list[float] = []
    for load in loads:
        if load is None:
            continue
        if load.prefix_hits is not None and load.prefix_queries is not None:
            # An engine counting more hits than queries (a bug of its own) counts as all hits, not more: one such
            # engine's 1e14 hits over 1 query read 1.0 for a model whose other engine hit 0 of 66.
            hits += min(load.prefix_hits, load.prefix_queries)
            queries += load.prefix_queries
        elif load.prefix_hit_rate is not None:
            rates.append(load.prefix_hit_rate)
    if queries > 0:
        return hits / queries
    if rates:
        return sum(rates) / len(rates)
    return None


def _known(value: float | None) -> float:
    return -1.0 if value is None else value
