"""The gateway's Prometheus metrics, on a registry of its own (never the process-global one).

One `GatewayMetrics` per gateway; tests start several gateways in one process.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

M = TypeVar("M", bound=MetricWrapperBase)

#: 2.0 is a bound because the design's P0 TTFT objective is "p99 < 2 s": its burn rate reads that bucket exactly.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: A stream's total wait on its client: mostly 0 (observed too), then anything up to the write timeout.
_BACKPRESSURE_BUCKETS = (0.0, 0.001, 0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0)
#: Tenants beyond `metrics.max_tenant_labels` share this label value.
OTHER_TENANTS = "other"


class Family(Generic[M]):
    """A labelled metric whose children are memoised: `labels()` on the hot path is one dict lookup.

    prometheus-client validates and locks on every `labels()` call (~3 us); label values here come
    from configuration (models, instances) and fixed vocabularies (statuses, reasons), so the cache
    stays small.
    """

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def collect(self) -> Any:
        return self.metric.collect()

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """Drop a child (an instance a reload removed); nothing if there is none."""
        if self._children.pop(values, None) is not None:
            self.metric.remove(*values)


class LoopCounter:
    """A counter child updated only from the event loop's thread: no lock (prometheus-client takes one
    per update)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopHistogram:
    """A histogram child updated only from the event loop's thread: one bisect, no lock."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1  # `le`: a value on a bound counts in it
        self.sum += amount


class ReadCounter(Collector):
    """A counter kept elsewhere (the edge server's refused connections), read when the registry is rendered."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        #: Where the count comes from (0 until one is given).
        self.read: Callable[[], float] = lambda: 0.0
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self.read())


class LoopFamily(Collector):
    """A labelled counter or histogram for the per-request hot path, exported by the registry like
    prometheus-client's own (same names, types and samples, without `_created`).

    Every request updates about six of these; prometheus-client's children lock on every update and
    cost ~3 us per request together. These are plain attributes: correct as long as only the event
    loop's thread updates and renders them, which holds for everything on the request path."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float] | None = None,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = list(labelnames)
        self._bounds = None if buckets is None else tuple(sorted(buckets))
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            child = LoopCounter() if self._bounds is None else LoopHistogram(self._bounds)
            self._children[values] = child
        return child

    @property
    def labelnames(self) -> tuple[str, ...]:
        return tuple(self._labelnames)

    @property
    def bounds(self) -> tuple[float, ...] | None:
        """A histogram's finite bucket bounds (its children's `counts` have one more: +Inf); None for a counter."""
        return self._bounds

    def children(self) -> list[tuple[tuple[str, ...], Any]]:
        """(label values, child) for each label set so far: `LoopCounter`s or `LoopHistogram`s, to read only.
        Cheaper than `collect()` for a reader that wants the numbers, not the exposition format."""
        return list(self._children.items())

    def describe(self) -> Iterator[Metric]:
        yield from self._families({})

    def collect(self) -> Iterator[Metric]:
        yield from self._families(dict(self._children))

    def _families(self, children: dict[tuple[str, ...], Any]) -> Iterator[Metric]:
        if self._bounds is None:
            counters = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
            for values, child in children.items():
                counters.add_metric(list(values), child.value)
            yield counters
            return
        histograms = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        bounds = [*map(_bound, self._bounds), "+Inf"]
        for values, child in children.items():
            cumulative, running = [], 0
            for bound, count in zip(bounds, child.counts, strict=True):
                running += count
                cumulative.append((bound, running))
            histograms.add_metric(list(values), cumulative, child.sum)
        yield histograms


def _bound(value: float) -> str:
    """A bucket bound as prometheus-client writes it (`0.005`, `1.0`)."""
    return repr(float(value))


class TokenCount:
    """Prompt and completion tokens of one (model, tenant label), updated from the event loop only."""

    __slots__ = ("completion", "prompt")

    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0


class TokenCounters(Collector):
    """`lockgate_prompt_tokens_total` and `lockgate_completion_tokens_total` by model and tenant.

    Tenant label values are bounded: the first `max_tenant_labels` tenants in `tenant_order` (the
    configuration's order) keep their name, then tenants the configuration does not name (a sidecar's, relayed by
    its centrals: `cluster/identity.py`, itself bounded) as they first come while places are left; every other
    tenant is counted under `other`. `child()` is one dict lookup on the request path (the cache of (model, tenant)
    pairs is bounded by the tenants' names, configured or relayed)."""

    def __init__(self, registry: CollectorRegistry, tenant_order: Sequence[str], max_tenant_labels: int) -> None:
        self._max = max_tenant_labels
        self._labels: dict[str, str] = {}
        #: Every tenant name given a label of its own in this process (its series stay exported).
        self._given: set[str] = set()
        #: The configured tenants' names (those past the bound are `other`, whatever comes after them).
        self._configured: frozenset[str] = frozenset()
        self._by_label: dict[tuple[str, str], TokenCount] = {}
        #: (model, tenant) -> its counts; the request path reads it directly (no call when present).
        self.children: dict[tuple[str, str], TokenCount] = {}
        self.set_tenants(tenant_order)
        registry.register(self)

    def set_tenants(self, tenant_order: Sequence[str]) -> None:
        """The configured tenants changed (a reload): label them anew. Counts already made stay where they are, so
        a name once given keeps its label, and a new one takes a place no name ever had: the process never exports
        more than `max_tenant_labels` tenant names (reloads that renamed tenants added series past the bound)."""
        order = list(dict.fromkeys(tenant_order))
        labels = {name: name for name in order if name in self._given}
        for name in order:
            if name not in labels and len(self._given) < self._max:
                self._given.add(name)
                labels[name] = name
        self._labels = labels
        self._configured = frozenset(order)
        self.children = {}

    def tenant_label(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:
            # A name the configuration does not hold (a sidecar's relayed tenants: an outside run found all of them
            # under `other`, though their records named them): its own label while places are left.
            if tenant in self._given or (tenant not in self._configured and len(self._given) < self._max):
                self._given.add(tenant)
                label = self._labels[tenant] = tenant
            else:
                label = OTHER_TENANTS
        return label

    def child(self, model: str, tenant: str) -> TokenCount:
        child = self.children.get((model, tenant))
        if child is None:
            key = (model, self.tenant_label(tenant))
            child = self._by_label.get(key)
            if child is None:
                child = self._by_label[key] = TokenCount()
            self.children[model, tenant] = child
        return child

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> Iterator[Metric]:
        labels = ["model", "tenant"]
        prompt = CounterMetricFamily("lockgate_prompt_tokens", "Prompt tokens of finished requests.", labels=labels)
        completion = CounterMetricFamily(
            "lockgate_completion_tokens", "Completion tokens delivered to clients.", labels=labels
        )
        for (model, tenant), child in list(self._by_label.items()):
            prompt.add_metric([model, tenant], float(child.prompt))
            completion.add_metric([model, tenant], float(child.completion))
        yield prompt
        yield completion


class GatewayMetrics:
    """Every metric of one gateway. `tenants` (configuration order) and `max_tenant_labels` bound the
    tenant label of the token counters."""

    def __init__(
        self, *, tenants: Sequence[str] = (), max_tenant_labels: int = 100, ttft_bounds: Sequence[float] = ()
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # With the SLO's threshold among the bounds (TTFT and `unanswered` alike): its rules count what is within it.
        first_token_buckets = tuple(sorted({*_LATENCY_BUCKETS, *ttft_bounds}))
        self.endpoint_requests = LoopFamily(
            "lockgate_endpoint_requests",
            "Client requests by endpoint (chat, completions, embeddings, responses) and final status.",
            ["endpoint", "status"],
            r,
        )
        #: Labels: model, priority class, status (completed, error, rejected, or the cancel reason).
        self.request_duration = LoopFamily(
            "lockgate_request_duration_seconds",
            "Time from request arrival to the end of the response, by model, priority and final status "
            "(completed, error, rejected, or the cancel reason).",
            ["model", "priority", "status"],
            r,
            buckets=_LATENCY_BUCKETS,
        )
        self.requests = LoopFamily(
            "lockgate_requests",
            "Client requests by model, priority and final status.",
            ["model", "priority", "status"],
            r,
        )
        self.ttft = LoopFamily(
            "lockgate_time_to_first_token_seconds",
            "Time from request arrival to the first content sent to the client, by model, priority and "
            "stream (false: a whole response, whose first token is its last).",
            ["model", "priority", "stream"],
            r,
            buckets=first_token_buckets,
        )
        self.unanswered = LoopFamily(
            "lockgate_unanswered_wait_seconds",
            "Requests that ended without a first token (their client left or timed out, the request failed; "
            "rejections are not counted), by how long they had waited, by model, priority and stream.",
            ["model", "priority", "stream"],
            r,
            buckets=first_token_buckets,
        )
        self.backpressure = LoopFamily(
            "lockgate_stream_backpressure_seconds",
            "Per stream, the total time its writes waited for the client to take data (0: never waited).",
            ["model"],
            r,
            buckets=_BACKPRESSURE_BUCKETS,
        )
        self.tokens = TokenCounters(r, tenants, max_tenant_labels)
        self.client_requests_in_flight = Gauge(
            "lockgate_client_requests_in_flight", "Client requests being served.", registry=r
        )
        self.client_connections = Gauge("lockgate_client_connections", "Client connections open.", registry=r)
        self.client_connections_refused = ReadCounter(
            "lockgate_client_connections_refused",
            "Client connections answered 503 and closed because limits.max_connections were open.",
            r,
        )
        self.request_body_bytes_held = Gauge(
            "lockgate_request_body_bytes_held",
            "Bytes of request bodies being received or held by requests not yet answered (limits.max_held_body_bytes).",
            registry=r,
        )
        self.request_bodies_refused = ReadCounter(
            "lockgate_request_bodies_refused",
            "Requests answered 503: their body would have taken the held bodies past limits.max_held_body_bytes.",
            r,
        )
        self.upstream_calls_in_flight = Family(
            Gauge("lockgate_upstream_calls_in_flight", "Engine calls open.", ["instance"], registry=r)
        )
        self.permits_in_use = Family(
            Gauge("lockgate_permits_in_use", "Instance leases (routing slots) held.", ["instance"], registry=r)
        )
        self.concurrency_limit = Family(
            Gauge(
                "lockgate_instance_concurrency_limit",
                "Requests an instance is sent at once: discovered from its engine's queue, below the ceiling.",
                ["instance"],
                registry=r,
            )
        )
        self.prefix_hit_rate_gap = Family(
            Gauge(
                "lockgate_prefix_hit_rate_gap",
                "Predicted (prefix index) minus engine-reported prefix-cache hit rate, per instance (EWMA over "
                "scrape intervals; positive: the index believes more is cached than the engine has).",
                ["instance"],
                registry=r,
            )
        )
        self.cancellations = Family(
            Counter(
                "lockgate_cancellations",
                "Requests that ended before their answer was complete, by model, priority and reason: "
                "client_disconnect, timeout, admin, shutdown (with or without an engine call of their own); "
                "preempted: an engine generation stopped for a more urgent request, then resumed or restarted "
                "(details in lockgate_preemptions_total). Engine calls aborted: lockgate_upstream_abort_seconds_count.",
                ["model", "priority", "reason"],
                registry=r,
            )
        )
        self.abort_latency = Histogram(
            "lockgate_upstream_abort_seconds",
            "Time from detecting the end of a request (disconnect, deadline, cancel) to its upstream "
            "connection being closed.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.leaks = Family(
            Counter(
                "lockgate_invariant_violations",
                "Resource invariant violations (double release, leaked lease). Must stay 0.",
                ["what"],
                registry=r,
            )
        )
        self.long_prefill_waits = Family(
            Counter(
                "lockgate_long_prefill_waits",
                "Requests with a long prompt that waited in the gateway for an instance with no long prefill "
                "outstanding (routing.long_prefill_ms).",
                ["model"],
                registry=r,
            )
        )
        self.strict_first_token_waits = Family(
            Counter(
                "lockgate_strict_first_token_waits",
                "Requests of a preemptible class that waited in the gateway, before they were sent, for a strict "
                "request's first token at the instance chosen for them.",
                ["model"],
                registry=r,
            )
        )
        self.retries = Family(
            Counter(
                "lockgate_upstream_retries",
                "Attempts moved to another instance before the first byte.",
                ["model"],
                registry=r,
            )
        )
        self.upstream_errors = Family(
            Counter(
                "lockgate_upstream_errors",
                "Engine call failures by instance and kind.",
                ["instance", "kind"],
                registry=r,
            )
        )
        self.instance_healthy = Family(
            Gauge(
                "lockgate_instance_healthy",
                "1 when the instance passes health checks.",
                ["instance"],
                registry=r,
            )
        )
        self.usage_records_pending = Gauge(
            "lockgate_usage_records_pending",
            "Usage records waiting for the writer (queued, or held in memory while neither the database nor the spill "
            "file takes them).",
            registry=r,
        )
        self.usage_records_written = Counter("lockgate_usage_records_written", "Usage records stored.", registry=r)
        self.usage_records_spilled = Counter(
            "lockgate_usage_records_spilled",
            "Usage records written to the spill file (the writer's queue full, or the database failing), imported "
            "later.",
            registry=r,
        )
        self.usage_records_logged = Counter(
            "lockgate_usage_records_logged",
            "Usage records neither the database nor the spill file took, past the memory bound or at shutdown: "
            "written to the log as JSON lines.",
            registry=r,
        )
        self.scheduling = SchedulingMetrics(r, self.cancellations)

        self.routing_decisions = LoopFamily(
            "lockgate_routing_decisions",
            "Instances chosen, by model and routing policy.",
            ["model", "policy", "instance"],
            r,
        )
        self.ejections = Counter("lockgate_instance_ejections", "Passive outlier ejections.", ["instance"], registry=r)
        self.ejections_held_back = Counter(
            "lockgate_instance_ejections_held_back",
            "Passive ejections refused because the pool needed the instance (health.ejection.max_ejection_percent).",
            ["instance"],
            registry=r,
        )
        self.routing_panics = Counter(
            "lockgate_routing_panics",
            "Requests routed over passively ejected instances because no instance of the pool was routable.",
            ["model"],
            registry=r,
        )
        self.scrapes = Counter(
            "lockgate_engine_scrapes", "Engine metric scrapes by result.", ["instance", "result"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulingMetrics:
    """Admission, priority queues and tenant rate limits (see `admission/gate.py`)."""

    def __init__(self, r: CollectorRegistry, cancellations: Family[Counter]) -> None:
        #: The gateway's cancellations counter (a preemption counts as one, reason `preempted`).
        self.cancellations = cancellations
        self.queue_depth = Gauge(
            "lockgate_queue_depth",
            "Requests waiting for a slot, by model and priority class.",
            ["model", "priority"],
            registry=r,
        )
        self.slots_in_use = Gauge(
            "lockgate_queue_slots_in_use",
            "Scheduler slots held (running requests), by model and priority class.",
            ["model", "priority"],
            registry=r,
        )
        self.queue_wait = LoopFamily(
            "lockgate_queue_wait_seconds",
            "Time from arrival (or from a preemption) to getting a slot: one observation per grant, so a preempted "
            "request that gets its slot back is observed again.",
            ["model", "priority"],
            r,
            buckets=_LATENCY_BUCKETS,
        )
        self.admissions = LoopFamily(
            "lockgate_admissions",
            "Slots granted, by model and priority class (a preempted request counts again when it gets a slot back).",
            ["model", "priority"],
            r,
        )
        self.rejections = Family(
            Counter(
                "lockgate_rejections",
                "Requests refused by admission, by reason (queue_full, queue_timeout, rate_limit_requests, "
                "rate_limit_tokens, rate_limit_concurrency) and priority class.",
                ["reason", "priority"],
                registry=r,
            )
        )
        self.preemptions = Family(
            Counter(
                "lockgate_preemptions",
                "Running requests stopped for a strict-class arrival, by model, the stopped request's "
                "priority class and outcome (resumed: continued from its output so far; restarted).",
                ["model", "priority", "outcome"],
                registry=r,
            )
        )
        self.reprefill_tokens = Family(
            Counter(
                "lockgate_preemption_reprefill_tokens",
                "Tokens engines prefill again because a request was preempted (its prompt, plus for a "
                "resumption the output so far): the work preemption costs, by model.",
                ["model"],
                registry=r,
            )
        )
        # Per tenant (`Family`: a reload drops the series of the tenants and limits it removed).
        self.ratelimit_remaining_requests = Family(
            Gauge(
                "lockgate_ratelimit_remaining_requests",
                "Requests left in the tenant's per-minute allowance (as of its last admission or settlement).",
                ["tenant"],
                registry=r,
            )
        )
        self.ratelimit_remaining_tokens = Family(
            Gauge(
                "lockgate_ratelimit_remaining_tokens",
                "Tokens left in the tenant's per-minute allowance (as of its last admission or settlement).",
                ["tenant"],
                registry=r,
            )
        )
        self.tenant_in_flight = Family(
            Gauge(
                "lockgate_tenant_requests_in_flight", "Admitted requests in flight, by tenant.", ["tenant"], registry=r
            )
        )
        self.tokens_reserved = Family(
            Gauge(
                "lockgate_tokens_reserved",
                "Tokens reserved by requests in flight, by tenant (returns to 0).",
                ["tenant"],
                registry=r,
            )
        )
