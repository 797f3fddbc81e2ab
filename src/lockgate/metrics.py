"""The gateway's Prometheus metrics, on a registry of its own (never the process-global one).

One `GatewayMetrics` per gateway; tests start several gateways in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

if TYPE_CHECKING:
    from .fleet.pool import Fleet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


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


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Family(
            Counter("lockgate_requests", "Client requests by model and final status.", ["model", "status"], registry=r)
        )
        self.request_duration = Family(
            Histogram(
                "lockgate_request_duration_seconds",
                "Time from request arrival to the end of the response.",
                ["model", "status"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.ttft = Family(
            Histogram(
                "lockgate_time_to_first_token_seconds",
                "Time from request arrival to the first byte of content sent to the client.",
                ["model"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.client_requests_in_flight = Gauge(
            "lockgate_client_requests_in_flight", "Client requests being served.", registry=r
        )
        self.upstream_calls_in_flight = Family(
            Gauge("lockgate_upstream_calls_in_flight", "Engine calls open.", ["instance"], registry=r)
        )
        self.permits_in_use = Family(
            Gauge("lockgate_permits_in_use", "Instance leases (routing slots) held.", ["instance"], registry=r)
        )
        self.cancellations = Family(
            Counter("lockgate_cancellations", "Requests ended early, by reason.", ["reason"], registry=r)
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
            "lockgate_usage_records_pending", "Usage records waiting for the writer.", registry=r
        )
        self.usage_records_written = Counter("lockgate_usage_records_written", "Usage records stored.", registry=r)
        self.usage_records_spilled = Counter(
            "lockgate_usage_records_spilled",
            "Usage records written to the spill file because the writer queue was full.",
            registry=r,
        )
        self.scheduling = SchedulingMetrics(r)

        self.routing_decisions = Family(
            Counter(
                "lockgate_routing_decisions",
                "Instances chosen, by model and routing policy.",
                ["model", "policy", "instance"],
                registry=r,
            )
        )
        self.ejections = Counter("lockgate_instance_ejections", "Passive outlier ejections.", ["instance"], registry=r)
        self.scrapes = Counter(
            "lockgate_engine_scrapes", "Engine metric scrapes by result.", ["instance", "result"], registry=r
        )

    def watch_fleet(self, fleet: Fleet) -> None:
        """Per-instance load state, read from the fleet when /metrics is scraped (nothing on the hot path)."""
        from .fleet.metrics import FleetCollector

        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulingMetrics:
    """Admission, priority queues and tenant rate limits (see `admission/gate.py`)."""

    def __init__(self, r: CollectorRegistry) -> None:
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
        self.queue_wait = Family(
            Histogram(
                "lockgate_queue_wait_seconds",
                "Time from arrival to getting a slot (admitted requests).",
                ["model", "priority"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.admissions = Family(
            Counter(
                "lockgate_admissions",
                "Requests given a slot, by model and priority class.",
                ["model", "priority"],
                registry=r,
            )
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
        self.ratelimit_remaining_requests = Gauge(
            "lockgate_ratelimit_remaining_requests",
            "Requests left in the tenant's per-minute allowance (as of its last admission or settlement).",
            ["tenant"],
            registry=r,
        )
        self.ratelimit_remaining_tokens = Gauge(
            "lockgate_ratelimit_remaining_tokens",
            "Tokens left in the tenant's per-minute allowance (as of its last admission or settlement).",
            ["tenant"],
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "lockgate_tenant_requests_in_flight", "Admitted requests in flight, by tenant.", ["tenant"], registry=r
        )
        self.tokens_reserved = Gauge(
            "lockgate_tokens_reserved",
            "Tokens reserved by requests in flight, by tenant (returns to 0).",
            ["tenant"],
            registry=r,
        )
