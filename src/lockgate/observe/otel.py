"""Optional OpenTelemetry export: one span per request (`tracing: {otel: true}`, extra `otel`).

Theory of operation: `Tracer.start()` opens the request's span when its exchange is created, as a child
of the client's `traceparent` if it sent one (else a new trace), and returns the trace-context headers
that name this span as the parent: those are forwarded to the engine, so the engine's own spans nest
under the gateway's. `Tracer.end()` sets the span's attributes from the finished usage record and ends it
when the exchange releases its resources. The SDK's batch span processor queues the span (a lock and a
deque) and exports from its own thread, so the event loop never waits on the collector.

The SDK is imported only when tracing is on: the default install does not have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..extras import install_hint
from .config import TracingConfig

if TYPE_CHECKING:
    from ..records import UsageRecord


class Tracer:
    """Spans for requests. `exporter` (tests: the SDK's in-memory exporter) replaces the OTLP/HTTP one and
    is exported synchronously; raises `RuntimeError` naming the extra if the SDK is not installed."""

    def __init__(self, config: TracingConfig, *, exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation import set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(f"tracing.otel needs the OpenTelemetry SDK: {install_hint('otel')}") from exc
        self._provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # endpoint None: the exporter's default (`OTEL_EXPORTER_OTLP_*` environment variables).
            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        else:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("lockgate")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._set_span_in_context = set_span_in_context
        self._error = Status(StatusCode.ERROR)

    def start(self, name: str, incoming: tuple[tuple[str, str], ...]) -> tuple[Any, tuple[tuple[str, str], ...]]:
        """Open a request's span under the client's trace context (`incoming`, validated headers); returns
        the span and the trace-context headers to send to the engine."""
        parent = self._propagator.extract(dict(incoming)) if incoming else None
        span = self._tracer.start_span(name, context=parent, kind=self._kind)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._set_span_in_context(span))
        return span, tuple(carrier.items())

    def end(self, span: Any, record: UsageRecord) -> None:
        """Describe the finished request on its span and end it."""
        attributes: dict[str, Any] = {
            "lockgate.request_id": record.request_id,
            "lockgate.tenant": record.tenant,
            "lockgate.priority": record.priority or "",
            "lockgate.status": record.status,
            "lockgate.cache": record.served_by,
            "lockgate.attempts": record.attempts,
            "gen_ai.request.model": record.model,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }
        if record.instance is not None:
            attributes["lockgate.instance"] = record.instance
        if record.cancel_reason is not None:
            attributes["lockgate.cancel_reason"] = record.cancel_reason
        if record.http_status is not None:
            attributes["http.response.status_code"] = record.http_status
        if record.first_token_at is not None:
            attributes["lockgate.ttft_ms"] = round((record.first_token_at - record.started_at) * 1000, 3)
        span.set_attributes(attributes)
        if record.status == "error":
            span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: call it off the event loop)."""
        self._provider.shutdown()
