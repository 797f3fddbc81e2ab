"""The gateway's Prometheus metrics, on a registry of its own (never the process-global one).

One `GatewayMetrics` per gateway; tests start several gateways in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from .fleet import Fleet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "lockgate_requests", "Client requests by model and final status.", ["model", "status"], registry=r
        )
        self.request_duration = Histogram(
            "lockgate_request_duration_seconds",
            "Time from request arrival to the end of the response.",
            ["model", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "lockgate_time_to_first_token_seconds",
            "Time from request arrival to the first byte of content sent to the client.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.client_requests_in_flight = Gauge(
            "lockgate_client_requests_in_flight", "Client requests being served.", registry=r
        )
        self.upstream_calls_in_flight = Gauge(
            "lockgate_upstream_calls_in_flight", "Engine calls open.", ["instance"], registry=r
        )
        self.permits_in_use = Gauge(
            "lockgate_permits_in_use", "Instance leases (routing slots) held.", ["instance"], registry=r
        )
        self.cancellations = Counter(
            "lockgate_cancellations", "Requests ended early, by reason.", ["reason"], registry=r
        )
        self.abort_latency = Histogram(
            "lockgate_upstream_abort_seconds",
            "Time from detecting the end of a request (disconnect, deadline, cancel) to its upstream "
            "connection being closed.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.leaks = Counter(
            "lockgate_invariant_violations",
            "Resource invariant violations (double release, leaked lease). Must stay 0.",
            ["what"],
            registry=r,
        )
        self.retries = Counter(
            "lockgate_upstream_retries",
            "Attempts moved to another instance before the first byte.",
            ["model"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "lockgate_upstream_errors",
            "Engine call failures by instance and kind.",
            ["instance", "kind"],
            registry=r,
        )
        self.instance_healthy = Gauge(
            "lockgate_instance_healthy",
            "1 when the instance passes health checks.",
            ["instance"],
            registry=r,
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

        self.routing_decisions = Counter(
            "lockgate_routing_decisions",
            "Instances chosen, by model and routing policy.",
            ["model", "policy", "instance"],
            registry=r,
        )
        self.ejections = Counter("lockgate_instance_ejections", "Passive outlier ejections.", ["instance"], registry=r)
        self.scrapes = Counter(
            "lockgate_engine_scrapes", "Engine metric scrapes by result.", ["instance", "result"], registry=r
        )

    def watch_fleet(self, fleet: Fleet) -> None:
        """Per-instance load state, read from the fleet when /metrics is scraped (nothing on the hot path)."""
        from .fleet_metrics import FleetCollector

        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)
