"""The gateway: its parts, and the handler that turns HTTP requests into exchanges.

`Gateway` is an async context manager owning the fleet, the usage-record writer and the registry of
requests in flight. `Gateway.handle` answers one request of the edge server (`edge/`); `server.py`
runs that server.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from . import resume, stored
from .admission.admin import AdminGate, cross_site
from .admission.admin import challenge as admin_challenge
from .admission.gate import Admission
from .admission.tenants import DEFAULT_TENANT, PRIORITY_HEADER, Tenant
from .cluster.identity import TENANT_HEADER, Relayed
from .config import Config, ConfigError
from .dashboard import Dashboard, SloProvider
from .dashboard.assets import STATIC_PREFIX
from .dedup.coalescer import Coalescer
from .edge.server import Reply, Request, Response, json_response
from .errors import (
    Forbidden,
    GatewayError,
    InvalidConfig,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    ShuttingDown,
    Unauthorized,
    Unavailable,
)
from .exchange import Exchange, Registry
from .fleet.fleet import Fleet
from .fleet.report import describe_fleet
from .metrics import GatewayMetrics
from .observe.access_log import AccessLog
from .observe.otel import Tracer
from .observe.trace import TRACEPARENT, TRACESTATE, trace_headers
from .records import RecordWriter
from .relay import relay
from .response_ids import ResponseIds
from .slo import SloService
from .wire import Endpoint, parse_request
from .workers import reload_all_workers
from .workerset import LOCAL_HEADER, WorkerSet

if TYPE_CHECKING:
    from .config_diff import ConfigDiff
    from .reload import Reloader

TIMEOUT_HEADER = "x-lockgate-timeout-ms"
_CANCEL_PREFIX = "/admin/requests/"
#: `GET /v1/models/{id}`: routed by prefix, the rest of the path is the id (ids may contain `/`).
_MODEL_PREFIX = "/v1/models/"


_ID_PREFIX = "lg-" + os.urandom(6).hex() + "-"
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """Unique per process run (a random prefix and a counter): no syscall on the hot path. The counter
    is zero-padded so that ids sort in creation order: the usage table's key index then grows at its
    end instead of splitting pages at random places."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):010x}"


#: The API's endpoints, by path (POST).
_ENDPOINTS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    "/v1/responses": Endpoint.RESPONSES,
}


def _client_request_id(request: Request) -> str | None:
    """The client's own `x-request-id`, if it sent a usable one (echoed back, kept in the record)."""
    client_id = request.headers.get("x-request-id")
    if client_id is not None and (len(client_id) > 200 or not client_id.isprintable()):
        return None
    return client_id


class Gateway:
    def __init__(self, config: Config, *, usage_path: str | None = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics(
            tenants=_tenant_order(config),
            max_tenant_labels=config.metrics.max_tenant_labels,
            ttft_bounds=(config.slo.ttft_threshold_ms / 1000,),
        )
        self.fleet = Fleet(config, self.metrics)
        self.records = RecordWriter(
            usage_path or config.usage.path,
            self.metrics,
            batch_size=config.usage.batch_size,
            queue_size=config.usage.queue_size,
            access_log=AccessLog(config.access_log) if config.access_log.enabled else None,
        )
        #: One OpenTelemetry span per request (`tracing.otel`), else None.
        self.tracer: Tracer | None = Tracer(config.tracing) if config.tracing.otel else None
        #: Records keep the prompt for the access log only when it asks for prompts.
        self.log_prompts = config.access_log.enabled and config.access_log.include_prompts
        self.registry = Registry()
        self.admission = Admission(config, self.metrics.scheduling)
        #: A response's id as each tenant's clients see it (`response_ids.py`; with tenants configured), and as an
        #: open gateway's clients see it.
        self.response_ids = ResponseIds()
        self._open_ids = ResponseIds(bound=False)
        self.fleet.listeners.append(lambda: self.admission.resize(self.fleet.pools))
        #: De-duplication: flights (shared upstream calls) and the completed-result cache.
        self.dedup = Coalescer(config, self.metrics, self.fleet)
        self.metrics.client_requests_in_flight.set_function(lambda: len(self.registry))
        self.draining = False
        self.started_at = time.time()
        #: Re-reads the configuration file and applies it (`reload.py`); None: nothing to reload.
        self.reloader: Reloader | None = None
        #: Fills the dashboard's SLO panel: returns what `GET /admin/slo` answers, or None (nothing evaluated).
        #: Called once per dashboard tick while a dashboard is open (so it should return a cached evaluation).
        self.slo_provider: SloProvider | None = None
        #: The SLOs (`GET /admin/slo`): cached evaluations over the usage records and the engines' busy signals.
        self.slo = SloService(
            config.slo,
            usage_path or config.usage.path,
            self.fleet,
            stale_after_s=config.scrape.stale_after_ms / 1000,
            queued=self._queued,
        )
        self.slo_provider = self.slo.cached
        self.dashboard = Dashboard(self, config.dashboard) if config.dashboard.enabled else None
        #: Who may use `/admin/*`, `/dashboard` and (if configured) `/metrics`.
        self.admin_gate = AdminGate(config.admin, lambda: self.admission.book)
        self._route_table = self._routes()
        #: Each path's methods, for a 405's `Allow` (RFC 9110 15.5.6).
        self._allowed: dict[str, str] = {}
        for method, path in sorted(self._route_table):
            self._allowed[path] = f"{self._allowed[path]}, {method}" if path in self._allowed else method
        #: Sidecars with `cluster.central_keys`: the tenant a central relays a request for.
        self.relayed: Relayed | None = None
        #: Central replicas: pass each request's tenant and class on to the sidecars.
        self.relays_identity = False
        #: Stored-response requests being forwarded (`stored.MAX_IN_FLIGHT` at most).
        self._stored_in_flight = 0
        #: Under `--workers`: the other workers, whom operator requests ask too (`workerset.py`).
        self.workers: WorkerSet | None = None
        self._set_models(config)

    def _set_models(self, config: Config) -> None:
        #: The fleet generation the lists were made at: a cluster's central gateway also serves the models
        #: its sidecars publish, which come and go (`Fleet.generation`).
        self._models_generation = self.fleet.generation
        names = dict.fromkeys([*(m.name for m in config.models), *self.fleet.pools])
        #: Each configured (or discovered) model in the OpenAI shape, by name (`/v1/models`, `/v1/models/{id}`).
        self._model_cards = {
            name: {"id": name, "object": "model", "created": int(self.started_at), "owned_by": "lockgate"}
            for name in names
        }
        #: The whole list, rendered once: what an open gateway (no tenant keys) answers to everyone.
        self._model_list = orjson.dumps({"object": "list", "data": list(self._model_cards.values())})

    def reconfigure(self, config: Config, diff: ConfigDiff) -> None:
        """Serve `config` from now on (a reload; `config_diff.py` computed `diff`). Synchronous, so
        every request sees either the old or the new configuration; requests in flight keep the
        pool, instance, tenant and scheduler ticket they hold."""
        self.admission.reconfigure(config)
        if diff.admin_changed:
            self.admin_gate = AdminGate(config.admin, lambda: self.admission.book)
        self.metrics.tokens.set_tenants(_tenant_order(config))
        self.fleet.apply(config, diff)  # its listeners resize the schedulers of the new pools
        self.admission.withdraw([model for model in diff.removed_models if model not in self.fleet.pools])
        self.dedup.forget_models(diff.removed_models)
        self.config = config
        self._set_models(config)

    async def __aenter__(self) -> Gateway:
        #: Kept for the hot path: on Python 3.11 each `asyncio.get_running_loop()` is a getpid() call.
        self.loop = asyncio.get_running_loop()
        await self.records.__aenter__()
        try:
            await self.fleet.__aenter__()
        except BaseException:
            await self.records.aclose()
            raise
        await self.slo.__aenter__()  # starts one task; nothing in it can fail before that
        if self.dashboard is not None:
            await self.dashboard.__aenter__()  # starts one task; nothing in it can fail before that
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.dashboard is not None:
            await self.dashboard.aclose()
        for exchange in self.registry.all():
            exchange.cancel("shutdown")
        await self.registry.wait_empty()
        await self.dedup.aclose()
        await self.slo.aclose()
        await self.fleet.aclose()
        await self.records.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)

    # --- the HTTP edge -------------------------------------------------------------------------
    def _queued(self, model: str) -> int:
        """Requests waiting at admission for `model` (0 for a model without a scheduler)."""
        scheduler = self.admission.schedulers.get(model)
        return 0 if scheduler is None else scheduler.core.queued_total

    def _routes(self) -> dict[tuple[str, str], Callable[[Request], Awaitable[Reply]]]:
        get = {
            "/v1/models": self._models,
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
            "/admin/requests": self._admin_list,
            "/admin/fleet": self._admin_fleet,
            "/admin/flights": self._admin_flights,
            "/admin/slo": self._admin_slo,
        }
        routes: dict[tuple[str, str], Callable[[Request], Awaitable[Reply]]] = {
            ("POST", path): functools.partial(self._serve, endpoint=endpoint) for path, endpoint in _ENDPOINTS.items()
        }
        if self.dashboard is not None:
            get["/dashboard"] = get["/dashboard/"] = self.dashboard.page
            routes["GET", "/dashboard/events"] = self._dashboard_events
        for path, handler in get.items():
            routes["GET", path] = routes["HEAD", path] = _with_request_id(handler)
        routes["POST", "/admin/reload"] = _with_request_id(self._admin_reload)
        # Operator routes are gated by path prefix, so routes added later are covered too. Always: a reload
        # may add tenant keys to an open gateway (the gate is then checked per request, off the hot path).
        for key, inner in list(routes.items()):
            if self.admin_gate.protects(key[1]):
                routes[key] = self._guarded(inner)
        return routes

    def _guarded(self, handler: Callable[[Request], Awaitable[Reply]]) -> Callable[[Request], Awaitable[Reply]]:
        """`handler` behind the admin gate (401/403 in the OpenAI envelope without an admin key)."""

        async def guarded(request: Request) -> Reply:
            denied = self._denied(request)
            return denied if denied is not None else await handler(request)

        return guarded

    def _denied(self, request: Request) -> Response | None:
        asked = request.headers
        try:
            self.admin_gate.check(asked.get("authorization"))
            forwarded = asked.get("x-forwarded-host")
            hosts = (asked.get("host"), forwarded.split(",")[0] if forwarded else None)
            if cross_site(request.method, asked.get("origin"), asked.get("sec-fetch-site"), hosts):
                raise Forbidden(
                    "A cross-site request may not change anything here: send it from the dashboard's own page, or "
                    "without an Origin header (curl, an SDK).",
                    code="cross_site_request",
                )
        except GatewayError as exc:
            headers = exc.headers()
            if exc.http_status == 401:
                headers["WWW-Authenticate"] = admin_challenge(request.path)
            body = exc.body_bytes()
            denied = Response(status=exc.http_status, body=body, content_type="application/json", headers=headers)
            _set_request_id(denied, request)
            return denied
        return None

    def handle(self, request: Request) -> Awaitable[Reply]:
        """The edge server's handler: one dictionary lookup to the endpoint, whose coroutine the server
        awaits directly (no coroutine of its own in between)."""
        handler = self._route_table.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        return self._other(request)

    async def _other(self, request: Request) -> Reply:
        denied = self._denied(request) if self.admin_gate.protects(request.path) else None
        if denied is not None:
            reply: Reply = denied
        elif request.path.startswith(_CANCEL_PREFIX) and request.method == "DELETE":
            reply = await self._admin_cancel_anywhere(request)
        elif request.path.startswith(_MODEL_PREFIX) and request.method in ("GET", "HEAD"):
            reply = self._model(request, request.path[len(_MODEL_PREFIX) :])
        elif request.path.startswith(stored.PREFIX):
            reply = await self._stored(request)
        elif (
            self.dashboard is not None and request.path.startswith(STATIC_PREFIX) and request.method in ("GET", "HEAD")
        ):
            reply = self.dashboard.static(request)
        else:
            reply = self._unknown(request)
        _set_request_id(reply, request)
        return reply

    @staticmethod
    def edge_error_body(status: int, message: str, code: str | None = None) -> bytes:
        """Errors the edge server answers itself (malformed HTTP, limits), in the OpenAI envelope."""
        if status == 413:
            return PayloadTooLarge(message).body_bytes()
        if status == 503:
            return Unavailable(message, code=code or "service_unavailable").body_bytes()
        if status < 500 or status in (501, 505):
            codes = {
                408: "request_timeout",
                415: "unsupported_content_encoding",
                431: "headers_too_large",
                501: "unsupported_transfer_encoding",
                505: "http_version_not_supported",
            }
            return InvalidRequest(message, code=codes.get(status, "bad_http_request")).body_bytes()
        return GatewayError(message).body_bytes()

    def count_dedup(self, outcome: str) -> None:
        """An ended request's de-duplication outcome (`Exchange.dedup_outcome`)."""
        self.dedup.metrics.outcome(outcome)

    def error_response(
        self,
        error: GatewayError,
        request_id: str,
        instance: str | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> Response:
        """The error in the OpenAI envelope; `instance`: the name of the instance that answered or was
        tried last (none if the request reached no instance); `extra`: headers it carries too (the error's own win)."""
        headers = {"x-request-id": request_id, **error.headers()} if request_id else error.headers()
        if extra:
            headers = {**extra, **headers}
        if instance:
            headers["x-lockgate-instance"] = instance
        return Response(
            status=error.http_status,
            body=error.body_bytes(),
            content_type="application/json",
            headers=headers,
        )

    def _tenant(self, request: Request) -> Tenant:
        """The request's tenant, from its key (a central's relayed one at a sidecar); `Unauthorized` without one."""
        authorization = request.headers.get("authorization")
        relayed = self.relayed
        return (
            relayed.tenant(authorization, request.headers.get(TENANT_HEADER)) if relayed is not None else None
        ) or self.admission.book.authenticate(authorization)

    def precheck(self, request: Request) -> Response | None:
        """The edge server's look at a request's headers before its body is read (see `HttpServer`): a request to
        an endpoint without a valid key (tenants configured), or to an operator route without the operator's, is
        refused there, with the answer the handler would give."""
        endpoint = _ENDPOINTS.get(request.path) if request.method == "POST" else None
        if endpoint is not None:
            if self.admission.book.open:
                return None  # (every request has a tenant: `default`, or a central's relayed one)
            try:
                self._tenant(request)
            except Unauthorized as exc:
                return self._refused(endpoint, exc, _client_request_id(request) or new_request_id())
            return None
        if self.admin_gate.protects(request.path):
            return self._denied(request)
        return None

    def _refused(self, endpoint: Endpoint, error: GatewayError, request_id: str) -> Response:
        """A request refused before it became an exchange (no record: counted here)."""
        self.metrics.requests.labels("", "", "rejected").inc()
        self.metrics.endpoint_requests.labels(endpoint.value, "rejected").inc()
        return self.error_response(error, request_id)

    async def _serve(self, request: Request, endpoint: Endpoint) -> Reply:
        client_id = _client_request_id(request)
        request_id = new_request_id()
        echo_id = client_id or request_id
        try:
            tenant = self._tenant(request)
            # The edge server has read the whole body (within `limits.max_body_bytes`).
            raw = request.body
            if self.draining:
                raise ShuttingDown("The gateway is shutting down.", retry_after=1)
            api = parse_request(endpoint, raw)
            self.admission.book.check_model(tenant, api.model)
            pool = self.fleet.pool(api.model)
            if pool is None:
                if self.fleet.gone_recently(api.model):
                    raise Unavailable(
                        f"The model '{api.model}' has no engine right now: the last one serving it left the cluster "
                        "moments ago (a sidecar restarting?); retry shortly.",
                        retry_after=1,
                    )
                raise ModelNotFound(
                    f"The model '{api.model}' does not exist or you do not have access to it.",
                    param="model",
                )
            traceparent = request.headers.get(TRACEPARENT)
            if traceparent is not None:
                api.trace_headers = trace_headers(traceparent, request.headers.get(TRACESTATE))
            deadline_s = self._deadline(request, pool.config.timeout_ms)
            ids = self._shown_ids() if api.endpoint is Endpoint.RESPONSES else None
            previous = stored.take_references(api.body, tenant.name, ids, pool) if ids is not None else None
            klass = self.admission.book.priority(tenant, request.headers.get(PRIORITY_HEADER))
            if self.relays_identity:
                api.relay_headers = ((TENANT_HEADER, tenant.name), (PRIORITY_HEADER, self.admission.class_name(klass)))
        except GatewayError as exc:
            return self._refused(endpoint, exc, echo_id)
        exchange = Exchange(
            self,
            request_id,
            api,
            pool,
            deadline_s=deadline_s,
            tenant=tenant.name,
            priority=self.admission.class_name(klass),
            scope=tenant.cache_scope,
            response_ids=ids,
            previous_response=previous,
        )
        exchange.record.client_request_id = client_id
        if api.trace_headers:
            exchange.record.traceparent = api.trace_headers[0][1]
        if self.tracer is not None:
            # The engine is told the gateway's span as its parent.
            exchange.span, api.trace_headers = self.tracer.start(f"{api.endpoint.value} {api.model}", api.trace_headers)
        return await exchange.run(lambda ex: self._admit_then_serve(ex, request, tenant, klass))

    async def _admit_then_serve(self, ex: Exchange, request: Request, tenant: Tenant, klass: int) -> Reply:
        """The request's path, chosen here: the tenant's allowance, then de-duplication (a cached result or a flight to
        join needs no slot: only a flight's leader takes one, `Coalescer.serve`), else a slot and an engine call —
        resumed elsewhere after a preemption for the preemptible classes (an embedding has nothing to resume; a
        response is restarted, while its client has been sent nothing)."""
        admission = self.admission
        admission.allow(ex, tenant, klass)
        room = admission.room_for(ex.api.model, klass)
        key = self.dedup.plan(ex, request.headers.get("Cache-Control"))
        if key is not None:
            # A flight (possibly shared by several clients) is never preempted.
            return await self.dedup.serve(ex, request, key, admission.slot(ex, klass), room)
        if klass in admission.preemptible and ex.api.endpoint.generates:
            return await resume.relay_resumable(ex, request, klass, admission, self.fleet)
        await admission.slot(ex, klass).take()
        return await relay(ex, request, self.fleet, room)

    @staticmethod
    def _deadline(request: Request, default_ms: int | None) -> float | None:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return default_ms / 1000 if default_ms else None
        # Digits only: `int()` would also take signs, spaces and underscores ("1_000").
        value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else 0
        if value <= 0:
            raise InvalidRequest(
                f"Header {TIMEOUT_HEADER} must be a positive integer (milliseconds).",
                param=TIMEOUT_HEADER,
                code="invalid_timeout",
            )
        if default_ms:
            value = min(value, default_ms)
        return value / 1000

    async def _models(self, request: Request) -> Response:
        """The models the caller may use: every configured model on an open gateway, the tenant's
        allowed ones otherwise (401 without a valid key, as on the chat endpoint)."""
        if self.fleet.generation != self._models_generation:
            self._set_models(self.config)
        if self.admission.book.open:
            return Response(body=self._model_list, content_type="application/json")
        try:
            tenant = self.admission.book.authenticate(request.headers.get("authorization"))
        except GatewayError as exc:
            return self.error_response(exc, "")  # `_set_request_id` adds the id
        data = [card for name, card in self._model_cards.items() if tenant.may_use(name)]
        return json_response({"object": "list", "data": data})

    def _model(self, request: Request, model_id: str) -> Response:
        """One model in the OpenAI shape; 404 for an unknown model or one the caller's tenant may not use
        (the same answer: a tenant learns nothing about models it cannot use)."""
        if self.fleet.generation != self._models_generation:
            self._set_models(self.config)
        try:
            tenant = self.admission.book.authenticate(request.headers.get("authorization"))
            card = self._model_cards.get(model_id)
            if card is None or not tenant.may_use(model_id):
                raise ModelNotFound(f"The model '{model_id}' does not exist or you do not have access to it.")
        except GatewayError as exc:
            return self.error_response(exc, "")  # `_set_request_id` adds the id
        return json_response(card)

    def _shown_ids(self) -> ResponseIds:
        """The response ids clients are shown (`response_ids.py`): bound to their tenant once tenants are configured,
        else tagged with their home only (one party)."""
        return self._open_ids if self.admission.book.open else self.response_ids

    async def _stored(self, request: Request) -> Response:
        """A stored response's routes (`stored.py`), for the caller's tenant, within its rate limits and concurrency
        (a request, no tokens)."""
        request_id = _client_request_id(request) or new_request_id()
        try:
            tenant = self._tenant(request)
            deadline_s = self._deadline(request, None)  # (the model's `timeout_ms` bounds it too: `stored.forward`)
            if self._stored_in_flight >= stored.MAX_IN_FLIGHT:
                raise Unavailable(
                    f"Too many stored-response requests at once (at most {stored.MAX_IN_FLIGHT}); retry shortly.",
                    code="too_many_stored_requests",
                    retry_after=1,
                )
            reservation = self.admission.allow_plain(tenant)
        except GatewayError as exc:
            return self.error_response(exc, request_id)
        self._stored_in_flight += 1
        try:
            ids = self._shown_ids()
            reply = await stored.forward(
                request, tenant, self.fleet, request_id, ids, deadline_s=deadline_s, relay=self.relays_identity
            )
            reply.headers = {**reply.headers, "x-request-id": request_id}  # (the id the engine was told)
            return reply
        except GatewayError as exc:
            return self.error_response(exc, request_id)
        finally:
            self._stored_in_flight -= 1
            self.admission.settle_plain(reservation)

    async def _health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def _ready(self, request: Request) -> Response:
        if self.draining:
            return json_response({"status": "draining"}, status=503)
        if not self.fleet.pools:
            # A central replica that has not learned of any engine yet (etcd not reached, no sidecar published): it
            # can serve nothing, and a load balancer must not send it traffic.
            return json_response({"status": "not_ready", "models": []}, status=503)
        not_ready = [name for name, pool in self.fleet.pools.items() if not pool.ready()]
        if not_ready:
            return json_response({"status": "not_ready", "models_without_instance": not_ready}, status=503)
        return json_response({"status": "ready"})

    def _gathering(self, request: Request) -> WorkerSet | None:
        """The other workers to ask too (`--workers`), unless one of them asks for this worker's own answer."""
        workers = self.workers
        return None if workers is None or LOCAL_HEADER in request.headers else workers

    async def _metrics(self, request: Request) -> Response:
        body = self.metrics.render()
        workers = self._gathering(request)
        if workers is not None:
            body = await workers.scrape(body, request.headers.get("authorization"))
        return Response(body=body, content_type="text/plain; charset=utf-8")

    async def _admin_list(self, request: Request) -> Response:
        entries = self._own([e.describe() for e in self.registry.all()])
        answer: dict[str, Any] = {"requests": entries}
        workers = self._gathering(request)
        if workers is not None:
            others, answer["workers_unreachable"] = await workers.others_json(
                request.path, request.headers.get("authorization")
            )
            entries += [entry for _, other in others for entry in other.get("requests", ())]
        return json_response(answer)

    def _own(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`entries` of this worker's state marked with its index (under `--workers`)."""
        if self.workers is not None:
            for entry in entries:
                entry["worker"] = self.workers.index
        return entries

    async def _admin_cancel_anywhere(self, request: Request) -> Response:
        """`DELETE /admin/requests/{id}`: here, else (`--workers`) at the worker that holds it."""
        request_id = request.path[len(_CANCEL_PREFIX) :]
        here = self._admin_cancel(request_id)
        workers = self._gathering(request)
        if here.status != 404 or workers is None:
            return here
        path = _CANCEL_PREFIX + urllib.parse.quote(request_id, safe="")  # the path is decoded: encoded again
        answers, missing = await workers.ask("DELETE", path, request.headers.get("authorization"))
        found = next((a for a in answers if a.status == 200), None)
        if found is not None:
            return Response(body=found.body, content_type="application/json")
        missing += [a.worker for a in answers if a.status != 404]
        if missing:
            # Not "no such request": it may be held by a worker that did not answer.
            silent = ", ".join(map(str, sorted(missing)))
            error = Unavailable(
                f"No worker that answered holds request '{request_id}'; worker(s) {silent} did not answer: try again.",
                code="worker_unreachable",
                retry_after=1,
            )
            return self.error_response(error, "")
        return here

    def _admin_cancel(self, request_id: str) -> Response:
        exchange = self.registry.get(request_id)
        if exchange is None:
            # A flight's id (`GET /admin/flights`): one that runs on after its clients left is stopped the same way.
            stopped = self.dedup.flights.cancel(request_id)
            if stopped is not None:
                return json_response({"id": request_id, "cancelled": stopped})
            return self.error_response(NotFound(f"No request '{request_id}' is in flight."), request_id)
        # False: it was already ending (its own end, or an earlier cancel, decides how).
        return json_response({"id": request_id, "cancelled": exchange.cancel("admin")})

    async def _admin_flights(self, request: Request) -> Response:
        """De-duplication: the shared engine calls in flight and the completed-result cache."""
        flights = self._own([f.describe() for f in self.dedup.flights.all()])
        answer: dict[str, Any] = {"flights": flights, "statistics": self.dedup.statistics()}
        workers = self._gathering(request)
        if workers is not None:
            others, answer["workers_unreachable"] = await workers.others_json(
                request.path, request.headers.get("authorization")
            )
            flights += [flight for _, other in others for flight in other.get("flights", ())]
            # Each worker's own caches and counts (`statistics` is this worker's).
            answer["statistics_by_worker"] = {str(workers.index): answer["statistics"]} | {
                str(n): other.get("statistics") for n, other in others
            }
        return json_response(answer)

    async def _admin_reload(self, request: Request) -> Response:
        """Re-read the configuration file and apply it (what SIGHUP does); an invalid file changes
        nothing and is answered 422 with the reason."""
        if self.reloader is None:
            error = InvalidRequest(
                "The gateway runs the embedded default configuration (started without --config): "
                "there is no file to reload.",
                code="nothing_to_reload",
            )
            return self.error_response(error, "")
        try:
            diff = await self.reloader.reload()
        except ConfigError as exc:
            return self.error_response(InvalidConfig(str(exc)), "")
        # Under `--workers`, this is one worker of several: the others reload the same file (SIGHUP via the
        # supervisor), or a revoked key would go on working on all but one.
        return json_response({"reloaded": True, "changes": diff.describe(), "all_workers": reload_all_workers()})

    def _dashboard_events(self, request: Request) -> Awaitable[Reply]:
        """The dashboard's SSE feed; its id header is given before the stream starts (`_with_request_id`
        sets it after the handler returns, too late for a stream)."""
        assert self.dashboard is not None
        return self.dashboard.events(request, headers={"x-request-id": _client_request_id(request) or new_request_id()})

    async def _admin_slo(self, request: Request) -> Response:
        """Each objective's status, error budget, windows and burn-rate alerts (`slo/objectives.py`),
        at most `slo.cache_ms` old."""
        return json_response(await self.slo.evaluate())

    async def _admin_fleet(self, request: Request) -> Response:
        return json_response(describe_fleet(self.fleet))

    def _unknown(self, request: Request) -> Response:
        allowed = self._allowed.get(request.path)
        if allowed is not None:
            error = NotFound(f"Method {request.method} is not allowed on {request.path}.", code="method_not_allowed")
            headers = {"Allow": allowed}
            return Response(status=405, body=error.body_bytes(), content_type="application/json", headers=headers)
        error = NotFound(f"Unknown path: {request.method} {request.path}")
        return Response(status=404, body=error.body_bytes(), content_type="application/json")


def _set_request_id(reply: Reply, request: Request) -> None:
    """Echo the client's `x-request-id`, or give the response a new one, unless its handler gave it the id it used
    (the generation endpoints and the stored routes: the id the engine was told)."""
    if "x-request-id" not in reply.headers:
        reply.headers = {**reply.headers, "x-request-id": _client_request_id(request) or new_request_id()}


def _with_request_id(
    handler: Callable[[Request], Awaitable[Reply]],
) -> Callable[[Request], Awaitable[Reply]]:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Reply:
        reply = await handler(request)
        _set_request_id(reply, request)
        return reply

    return wrapped


def _tenant_order(config: Config) -> list[str]:
    """Tenants in the order they get their own metric label: configured tenants first (with keys
    configured, "default" is never a request's tenant)."""
    return [*(t.name for t in config.tenants), DEFAULT_TENANT]
