"""De-duplication metrics, registered on the gateway's own Prometheus registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from ..metrics import Family, LoopFamily

OUTCOMES = ("miss", "coalesced", "hit", "semantic", "bypass", "semantic_shadow")


class DedupMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # Updated on every request, from the event loop only: lock-free families.
        self.outcomes = LoopFamily(
            "lockgate_dedup",
            "Requests that ended (not rejected) by how de-duplication served them (miss: eligible, served by an "
            "upstream call of its own or none; coalesced: joined one in flight; hit/semantic: served from a cache; "
            "bypass: not eligible or opted out; semantic_shadow: a semantic hit recorded but not served, when seen).",
            ["outcome"],
            registry,
        )
        self._by_outcome = {o: self.outcomes.labels(o) for o in OUTCOMES}
        self.hit_ratio = Gauge(
            "lockgate_dedup_hit_ratio",
            "Share of requests served without an engine call of their own since start: (coalesced + hit + "
            "semantic) / (miss + coalesced + hit + semantic + bypass); 0 before any request. For a window, use "
            "rate() of lockgate_dedup_total.",
            registry=registry,
        )
        self.hit_ratio.set_function(self._hit_ratio)
        self.tokens_saved = LoopFamily(
            "lockgate_dedup_upstream_tokens_saved",
            "Engine tokens not spent because a request was coalesced or served from a cache.",
            ["kind"],
            registry,
        )
        self._prompt_saved = self.tokens_saved.labels("prompt")
        self._completion_saved = self.tokens_saved.labels("completion")
        self.flights_in_flight = Gauge(
            "lockgate_dedup_flights_in_flight", "Upstream generations shared through flights.", registry=registry
        )
        self.cache_entries = Gauge(
            "lockgate_dedup_cache_entries", "Completed results held in the cache.", registry=registry
        )
        self.cache_bytes = Gauge("lockgate_dedup_cache_bytes", "Bytes held by the result cache.", registry=registry)
        # Per model (`Family`: a model a reload removed takes its series with it).
        self.semantic_entries = Family(
            Gauge(
                "lockgate_semantic_cache_entries",
                "Completed answers held by a model's semantic cache (bounded by its max_entries).",
                ["model"],
                registry=registry,
            )
        )
        self.semantic_bytes = Family(
            Gauge(
                "lockgate_semantic_cache_bytes",
                "Bytes of answers held by a model's semantic cache (bounded by its max_bytes).",
                ["model"],
                registry=registry,
            )
        )

    def bind(self, flights: Callable[[], float], entries: Callable[[], float], nbytes: Callable[[], float]) -> None:
        self.flights_in_flight.set_function(flights)
        self.cache_entries.set_function(entries)
        self.cache_bytes.set_function(nbytes)

    def bind_semantic(self, model: str, entries: Callable[[], float], nbytes: Callable[[], float]) -> None:
        self.semantic_entries.labels(model).set_function(entries)
        self.semantic_bytes.labels(model).set_function(nbytes)

    def unbind_semantic(self, model: str) -> None:
        self.semantic_entries.remove(model)
        self.semantic_bytes.remove(model)

    def _hit_ratio(self) -> float:
        count = {outcome: child.value for outcome, child in self._by_outcome.items()}
        saved = count["coalesced"] + count["hit"] + count["semantic"]
        total = saved + count["miss"] + count["bypass"]
        return saved / total if total else 0.0

    def outcome(self, outcome: str) -> None:
        self._by_outcome[outcome].inc()

    def saved(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._prompt_saved.inc(prompt_tokens)
        self._completion_saved.inc(completion_tokens)
