"""The gateway: its parts, and the HTTP edge (aiohttp) that turns requests into exchanges.

`Gateway` is an async context manager owning the fleet, the usage-record writer and the registry of
requests in flight. `Gateway.app()` builds the aiohttp application; `server.py` runs it.
"""

from __future__ import annotations

import itertools
import os
import time

import orjson
from aiohttp import web

from .admission import resume
from .admission.gate import Admission
from .admission.tenants import PRIORITY_HEADER, Tenant
from .config import Config
from .dedup import Coalescer
from .errors import GatewayError, InvalidRequest, ModelNotFound, NotFound, PayloadTooLarge, ShuttingDown
from .exchange import Exchange, Registry
from .fleet.pool import Fleet, Instance
from .fleet.report import describe_fleet
from .metrics import GatewayMetrics
from .records import RecordWriter
from .relay import relay
from .wire import Endpoint, parse_request

TIMEOUT_HEADER = "x-lockgate-timeout-ms"


_ID_PREFIX = "lg-" + os.urandom(6).hex() + "-"
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """Unique per process run (a random prefix and a counter): no syscall on the hot path. The counter
    is zero-padded so that ids sort in creation order: the usage table's key index then grows at its
    end instead of splitting pages at random places."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):010x}"


class Gateway:
    def __init__(self, config: Config, *, usage_path: str | None = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.fleet = Fleet(config, self.metrics)
        self.records = RecordWriter(
            usage_path or config.usage.path,
            self.metrics,
            batch_size=config.usage.batch_size,
            queue_size=config.usage.queue_size,
        )
        self.registry = Registry()
        self.admission = Admission(config, self.metrics.scheduling)
        self.fleet.listeners.append(lambda: self.admission.resize(self.fleet.pools))
        #: De-duplication: flights (shared upstream calls) and the completed-result cache.
        self.dedup = Coalescer(config, self.metrics, self.fleet)
        self.metrics.client_requests_in_flight.set_function(lambda: len(self.registry))
        self.draining = False
        self.started_at = time.time()
        self._max_body = config.limits.max_body_bytes
        self._model_list = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": m.name, "object": "model", "created": int(self.started_at), "owned_by": "lockgate"}
                    for m in config.models
                ],
            }
        )

    async def __aenter__(self) -> Gateway:
        await self.records.__aenter__()
        try:
            await self.fleet.__aenter__()
        except BaseException:
            await self.records.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for exchange in self.registry.all():
            exchange.cancel("shutdown")
        await self.registry.wait_empty()
        await self.dedup.aclose()
        await self.fleet.aclose()
        await self.records.aclose()

    # --- the HTTP edge -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/requests", self._admin_list)
        app.router.add_delete("/admin/requests/{id}", self._admin_cancel)
        app.router.add_get("/admin/fleet", self._admin_fleet)
        app.router.add_get("/admin/flights", self._admin_flights)
        self._known_paths = {r.get_info().get("path") for r in app.router.resources()}
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    def error_response(self, error: GatewayError, request_id: str, instance: Instance | None = None) -> web.Response:
        headers = {"x-request-id": request_id, **error.headers()}
        if instance is not None:
            headers["x-lockgate-instance"] = instance.name
        return web.Response(
            status=error.http_status,
            body=error.body_bytes(),
            content_type="application/json",
            headers=headers,
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.COMPLETIONS)

    async def _serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        client_id = request.headers.get("x-request-id")
        if client_id is not None and (len(client_id) > 200 or not client_id.isprintable()):
            client_id = None
        request_id = new_request_id()
        echo_id = client_id or request_id
        try:
            tenant = self.admission.book.authenticate(request.headers.get("Authorization"))
            raw = await self._read_body(request)
            # Checked after the last await before the request registers: a drain that started while
            # the body was being read must not miss it.
            if self.draining:
                raise ShuttingDown("The gateway is shutting down.", retry_after=1)
            api = parse_request(endpoint, raw)
            self.admission.book.check_model(tenant, api.model)
            pool = self.fleet.pool(api.model)
            if pool is None:
                raise ModelNotFound(
                    f"The model '{api.model}' does not exist or you do not have access to it.",
                    param="model",
                )
            deadline_s = self._deadline(request, pool.config.timeout_ms)
            klass = self.admission.book.priority(tenant, request.headers.get(PRIORITY_HEADER))
        except GatewayError as exc:
            self.metrics.requests.labels("", "rejected").inc()
            return self.error_response(exc, echo_id)
        exchange = Exchange(
            self,
            request_id,
            api,
            pool,
            deadline_s=deadline_s,
            tenant=tenant.name,
            priority=self.admission.class_name(klass),
        )
        exchange.record.client_request_id = client_id
        return await exchange.run(lambda ex: self._admit_and_relay(ex, request, tenant, klass))

    async def _admit_and_relay(
        self, ex: Exchange, request: web.Request, tenant: Tenant, klass: int
    ) -> web.StreamResponse:
        if klass in self.admission.preemptible:
            return await resume.admit_and_relay(ex, request, tenant, klass)
        await self.admission.admit(ex, tenant, klass)
        return await relay(ex, request)

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self._max_body:
            raise PayloadTooLarge(f"The request body is {request.content_length} bytes; the limit is {self._max_body}.")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"The request body is larger than the limit of {self._max_body} bytes.") from None

    @staticmethod
    def _deadline(request: web.Request, default_ms: int | None) -> float | None:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return default_ms / 1000 if default_ms else None
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise InvalidRequest(
                f"Header {TIMEOUT_HEADER} must be a positive integer (milliseconds).", param=TIMEOUT_HEADER
            )
        if default_ms:
            value = min(value, default_ms)
        return value / 1000

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(body=self._model_list, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        not_ready = [name for name, pool in self.fleet.pools.items() if not pool.ready()]
        if not_ready:
            return web.json_response({"status": "not_ready", "models_without_instance": not_ready}, status=503)
        return web.json_response({"status": "ready"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _admin_list(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": [e.describe() for e in self.registry.all()]})

    async def _admin_cancel(self, request: web.Request) -> web.Response:
        request_id = request.match_info["id"]
        exchange = self.registry.get(request_id)
        if exchange is None:
            return self.error_response(NotFound(f"No request '{request_id}' is in flight."), request_id)
        exchange.cancel("admin")
        return web.json_response({"id": request_id, "cancelled": True})

    async def _admin_flights(self, request: web.Request) -> web.Response:
        """De-duplication: the shared engine calls in flight and the completed-result cache."""
        return web.json_response(
            {"flights": [f.describe() for f in self.dedup.flights.all()], "statistics": self.dedup.statistics()}
        )

    async def _admin_fleet(self, request: web.Request) -> web.Response:
        return web.json_response(describe_fleet(self.fleet))

    async def _unknown(self, request: web.Request) -> web.Response:
        if request.path in self._known_paths:
            error = NotFound(f"Method {request.method} is not allowed on {request.path}.", code="method_not_allowed")
            return web.Response(status=405, body=error.body_bytes(), content_type="application/json")
        error = NotFound(f"Unknown path: {request.method} {request.path}")
        return web.Response(status=404, body=error.body_bytes(), content_type="application/json")
