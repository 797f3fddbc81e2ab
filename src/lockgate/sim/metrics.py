"""Prometheus metrics with vLLM's names, in a registry owned by one sim (never the global one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class LiveGauges:
    running: int
    waiting: int
    kv_usage: float


class _GaugeCollector(Collector):
    def __init__(self, model_name: str, read: Callable[[], LiveGauges]) -> None:
        self._model_name = model_name
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = self._read()
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", g.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (pre-v0.10 name).", g.kv_usage),
        ):
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self._model_name], value)
            yield fam


class SimMetrics:
    def __init__(
        self,
        model_name: str,
        read_gauges: Callable[[], LiveGauges],
        *,
        num_gpu_blocks: int | None = None,
        block_size: int = 16,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        labels = ["model_name"]
        self._model_name = model_name
        reg.register(_GaugeCollector(model_name, read_gauges))
        if num_gpu_blocks is not None:
            # As vLLM exports its CacheConfig: an info gauge whose labels carry the values.
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["block_size", "enable_prefix_caching", "num_gpu_blocks"],
                registry=reg,
            )
            info.labels(str(block_size), "True", str(num_gpu_blocks)).set(1)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels, registry=reg
        ).labels(model_name)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels, registry=reg
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._success_by_reason = {r: self._success.labels(model_name, r) for r in ("stop", "length", "abort")}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (per-request mean).",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)

    def success(self, finished_reason: str) -> None:
        c = self._success_by_reason.get(finished_reason)
        if c is None:
            c = self._success_by_reason[finished_reason] = self._success.labels(self._model_name, finished_reason)
        c.inc()

    def finished(
        self,
        *,
        completion_tokens: int,
        ttft: float,
        e2e: float,
        finish_reason: str,
        observe_ttft: bool = True,
    ) -> None:
        """Record a completed request (one call, so the hot path stays short). Its tokens are not counted here: as
        vLLM's, `prompt_tokens` and `generation_tokens` count the work as it is done (an aborted request's too).

        The step loop observes TTFT when the first token appears (``observe_ttft=False`` here).
        """
        if observe_ttft:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if completion_tokens > 1:
            self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        self.success(finish_reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
