"""The gateway: its parts, and the handler that turns HTTP requests into exchanges.

`Gateway` is an async context manager owning the fleet, the usage-record writer and the registry of
requests in flight. `Gateway.handle` answers one request of the edge server (`edge/`); `server.py`
runs that server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import orjson

from . import resume, stored
from .admin_api import CANCEL_PREFIX, AdminApi
from .admission.admin import METRICS_PATH, AdminGate
from .admission.gate import Admission
from .admission.tenants import DEFAULT_TENANT, PRIORITY_HEADER, Tenant, cache_salt_for
from .cluster.identity import CACHE_SALT_HEADER, TENANT_HEADER, Relayed, relayed_cache_salt
from .config import Config
from .dashboard import Dashboard, SloProvider
from .dashboard.assets import STATIC_PREFIX
from .dedup.coalescer import Coalescer
from .dedup.stoppable import StoppableFlight
from .edge.server import Reply, Request, Response, json_response
from .errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    ShuttingDown,
    Unauthorized,
    Unavailable,
    shown,
)
from .exchange import Exchange, Registry
from .fleet.fleet import Fleet
from .metrics import GatewayMetrics
from .observe.access_log import AccessLog
from .observe.otel import Tracer
from .observe.trace import TRACEPARENT, TRACESTATE, trace_headers
from .records import RecordWriter, UsageRecord
from .relay import relay
from .request_ids import client_request_id, echoed_request_id, new_request_id
from .response_ids import SECRET_ENV, ResponseIds, take_references
from .slo import SloService
from .wire import Endpoint, parse_request
from .workerset import WorkerSet

if TYPE_CHECKING:
    from .config_diff import ConfigDiff
    from .reload import Reloader

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-lockgate-timeout-ms"
#: `GET /v1/models/{id}`: routed by prefix, the rest of the path is the id (ids may contain `/`).
_MODEL_PREFIX = "/v1/models/"


#: The API's endpoints, by path (POST).
_ENDPOINTS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    "/v1/responses": Endpoint.RESPONSES,
}


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
        #: The warnings standing when they were last said (`unsaid_warnings`).
        self._said: frozenset[str] = frozenset()
        self._open_ids = ResponseIds(bound=False)
        #: At a sidecar (its callers' tenants relayed by central replicas): tags are not believed (`response_ids.py`).
        self._sidecar_ids = ResponseIds(bound=False, trusts_tags=False)
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
        #: The operator's routes, behind the admin gate (who may use `/admin/*`, `/dashboard` and, if configured,
        #: `/metrics`).
        self.admin = AdminApi(self, AdminGate(config.admin, lambda: self.admission.book))
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
            self.admin.gate = AdminGate(config.admin, lambda: self.admission.book)
            # The routes the gate guards may have changed with it (`metrics_require_key` guards `/metrics`).
            self._route_table = self._routes()
        if diff.tenants_changed or diff.admin_changed:
            for warning in self.unsaid_warnings():  # (a reload that adds the first tenants says it here)
                log.warning("%s", warning)
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
            "/metrics": self.admin.metrics,
            "/admin/requests": self.admin.requests,
            "/admin/fleet": self.admin.fleet,
            "/admin/flights": self.admin.flights,
            "/admin/slo": self.admin.slo,
        }
        routes: dict[tuple[str, str], Callable[[Request], Awaitable[Reply]]] = {
            ("POST", path): functools.partial(self._serve, endpoint=endpoint) for path, endpoint in _ENDPOINTS.items()
        }
        if self.dashboard is not None:
            get["/dashboard"] = get["/dashboard/"] = self.dashboard.page
            routes["GET", "/dashboard/events"] = self._dashboard_events
        for path, handler in get.items():
            routes["GET", path] = routes["HEAD", path] = _with_request_id(handler)
        routes["POST", "/admin/reload"] = _with_request_id(self.admin.reload)
        # Operator routes are gated by path prefix, so routes added later are covered too. Always: a reload
        # may add tenant keys to an open gateway (the gate is then checked per request, off the hot path).
        for key, inner in list(routes.items()):
            if self.admin.gate.protects(key[1]):
                routes[key] = self.admin.guarded(inner)
        return routes

    def handle(self, request: Request) -> Awaitable[Reply]:
        """The edge server's handler: one dictionary lookup to the endpoint, whose coroutine the server
        awaits directly (no coroutine of its own in between)."""
        handler = self._route_table.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        return self._other(request)

    async def _other(self, request: Request) -> Reply:
        denied = self.admin.denied(request) if self.admin.gate.protects(request.path) else None
        if denied is not None:
            reply: Reply = denied
        elif request.path.startswith(CANCEL_PREFIX) and request.method == "DELETE":
            reply = await self.admin.cancel_anywhere(request)
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
                return self._refused(endpoint, exc, echoed_request_id(request))
            return None
        if self.admin.gate.protects(request.path):
            return self.admin.denied(request)
        return None

    def _refused(self, endpoint: Endpoint, error: GatewayError, request_id: str) -> Response:
        """A request refused before it became an exchange (no record: counted here)."""
        self.metrics.requests.labels("", "", "rejected").inc()
        self.metrics.endpoint_requests.labels(endpoint.value, "rejected").inc()
        return self.error_response(error, request_id)

    async def _serve(self, request: Request, endpoint: Endpoint) -> Reply:
        client_id = client_request_id(request)
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
            if endpoint.generates:
                api.cache_salt = (
                    relayed_cache_salt(request.headers.get(CACHE_SALT_HEADER))
                    if tenant.relayed
                    else cache_salt_for(tenant, api.body.get("cache_salt"))
                )
            pool = self.fleet.pool(api.model)
            if pool is None:
                if self.fleet.gone_recently(api.model):
                    raise Unavailable(
                        f"The model '{api.model}' has no engine right now: the last one serving it left the cluster "
                        "moments ago (a sidecar restarting?); retry shortly.",
                        retry_after=1,
                    )
                if self.fleet.discovering:
                    # (An outside run: a central restarted in a rolling update, or started while etcd was down, or
                    # before any sidecar published, told clients 404, which SDKs do not retry, for models its sidecars
                    # serve.)
                    raise Unavailable(
                        f"The model '{shown(api.model)}' is not known here yet: this gateway has not read the "
                        "cluster's engines from etcd (or no sidecar has published any); retry shortly.",
                        code="cluster_not_synced",
                        retry_after=1,
                    )
                raise ModelNotFound(
                    f"The model '{shown(api.model)}' does not exist or you do not have access to it.",
                    param="model",
                )
            traceparent = request.headers.get(TRACEPARENT)
            if traceparent is not None:
                api.trace_headers = trace_headers(traceparent, request.headers.get(TRACESTATE))
            deadline_s = self._deadline(request, pool.config.timeout_ms)
            ids = self._shown_ids(tenant) if api.endpoint is Endpoint.RESPONSES else None
            previous = take_references(api.body, tenant.name, ids, pool) if ids is not None else None
            klass = self.admission.book.priority(tenant, request.headers.get(PRIORITY_HEADER))
            if self.relays_identity:
                api.relay_headers = ((TENANT_HEADER, tenant.name), (PRIORITY_HEADER, self.admission.class_name(klass)))
                if api.cache_salt is not None:
                    api.relay_headers += ((CACHE_SALT_HEADER, api.cache_salt),)
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
        ex.urgent = admission.classes[klass].strict
        ex.yields = not ex.urgent
        room = admission.room_for(ex.api.model, klass)
        key = self.dedup.plan(ex, request.headers.get("Cache-Control"))
        if key is not None:
            # A flight of a preemptible class may be stopped while nobody joined it (sent again or continued later,
            # `dedup.stoppable`); one that another client joined never is.
            stoppable = None
            if klass in admission.preemptible:
                stoppable = StoppableFlight(admission.max_preemptions, ex.record)
            slot = admission.slot(ex, klass, tag=stoppable)
            return await self.dedup.serve(ex, request, key, slot, room, stoppable)
        if klass in admission.preemptible and ex.api.endpoint.generates:
            return await resume.relay_resumable(ex, request, klass, admission, self.fleet)
        await admission.slot(ex, klass).take()
        # (A preemptible class's request that cannot be resumed here, an embedding: nothing there a P0 can stop.)
        return await relay(ex, request, self.fleet, None if klass in admission.preemptible else room)

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
                raise ModelNotFound(f"The model '{shown(model_id)}' does not exist or you do not have access to it.")
        except GatewayError as exc:
            return self.error_response(exc, "")  # `_set_request_id` adds the id
        return json_response(card)

    def unsaid_warnings(self) -> list[str]:
        """The `warnings()` not standing when they were last asked for (at start, at a reload changing tenants or
        admin keys): each is said when it comes about, not again at every reload (an outside run's log held 181
        copies of one after as many reloads)."""
        now = self.warnings()
        unsaid = [warning for warning in now if warning not in self._said]
        self._said = frozenset(now)
        return unsaid

    def warnings(self) -> list[str]:
        """What the operator of a gateway with tenants is told once it listens (and after a reload that changes its
        tenants or admin keys): response ids that hold in this process only (no `LOCKGATE_RESPONSE_ID_SECRET`: after a
        restart, or at another replica, they are 404); engines whose prefix caches every tenant shares (they take no
        `cache_salt`); a `/metrics` anyone who reaches the port reads, which names the tenants, their usage and their
        remaining quotas. Under `--workers` (the first worker says it): engines every worker reaches on its own."""
        said = self._shared_engines()
        if self.admission.book.open:
            return said
        if self.response_ids.drawn:
            said.append(
                f"{SECRET_ENV} is not set: the response ids this process shows its tenants are valid here only (after "
                "a restart, or at another replica, a follow-up or a retrieval naming one is 404); set it alike on "
                "every replica"
            )
        unsalted = sorted(
            {i.name for i in self.fleet.instances.values() if not i.dialect.cache_salt and not i.published}
        )
        if unsalted:
            said.append(
                f"instances {_some(unsalted)} take no cache_salt (not vLLM): every tenant shares their prefix caches, "
                "so one tenant can learn another's prompts through cached_tokens or time to first token there; give "
                "tenants that must not share instances of their own"
            )
        if not self.admin.gate.protects(METRICS_PATH):
            said.append(
                "GET /metrics needs no key: anyone who reaches this port reads the tenants' names, usage and remaining "
                "quotas there; set admin.metrics_require_key: true (a Prometheus scrape then sends an admin key) or "
                "keep the port private"
            )
        return said

    def _shared_engines(self) -> list[str]:
        """Under `--workers`, the instances each worker sends to directly (not behind a sidecar): each worker takes its
        part of such an engine's limit (`Instance.share`), and what it counts of tenants and duplicates is its own."""
        workers = self.workers
        if workers is None or workers.index != 0:
            return []
        fleet = self.fleet
        direct = sorted({i.name for i in fleet.instances.values() if not i.published and i.key not in fleet.private})
        if not direct:
            return []
        return [
            f"instances {_some(direct)} are reached by each of the {workers.count} workers on its own: each worker "
            "takes its part of an engine's limit (a client's requests all on one connection use one worker's part), "
            "and tenants' max_concurrent and de-duplication hold within a worker, not across them; put such engines "
            "behind a `lockgate sidecar` for one scheduler per engine"
        ]

    def _shown_ids(self, tenant: Tenant) -> ResponseIds:
        """The response ids clients are shown (`response_ids.py`): bound to their tenant once tenants are configured,
        else tagged with their home only (one party). At a sidecar the tags of a direct caller's ids are not believed
        (only its memory, which keeps each response's tenant, finds a response); a central's are: it took the id back
        for its tenant (the HMAC), and after a restart the memory is empty (an outside run: every follow-up of a
        response made before the sidecar restarted went to whichever engine routing chose, and got a final 404)."""
        if not self.admission.book.open:
            return self.response_ids
        return self._sidecar_ids if self.relayed is not None and not tenant.relayed else self._open_ids

    async def _stored(self, request: Request) -> Response:
        """A stored response's routes (`stored.py`), for the caller's tenant, within its rate limits and concurrency
        (a request, no tokens). One forwarded to an engine gets its usage record (who read or deleted what, and how
        it ended); one refused before (no such route, an id not the tenant's) gets none, as for the endpoints."""
        request_id = new_request_id()  # (the engine is told it; the client gets its own back, if it sent one)
        client_id = client_request_id(request)
        echo = client_id or request_id
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
            self._count_stored(request, "", "rejected", 0.0)
            return self.error_response(exc, echo)
        self._stored_in_flight += 1
        record = UsageRecord(
            request_id=request_id,
            tenant=tenant.name,
            model="",
            endpoint="",
            stream=False,
            client_request_id=client_id,
            started_at=time.time(),
        )
        reply: Response | None = None
        try:
            reply = await stored.forward(
                request,
                tenant,
                self.fleet,
                record,
                self._shown_ids(tenant),
                deadline_s=deadline_s,
                relay=self.relays_identity,
                deleted=self.dedup.forget_response,
            )
        except GatewayError as exc:
            reply = self.error_response(exc, echo)
            record.error = exc.message[:500]
        except Exception:  # (a bug: still answered, and recorded as the gateway's failure)
            log.exception("stored-response request %s failed inside the gateway", record.request_id)
            reply = self.error_response(GatewayError("The gateway failed to serve the request."), echo)
            record.error = "The gateway failed to serve the request."
        finally:
            self._stored_in_flight -= 1
            self.admission.settle_plain(reservation)
            if record.instance is not None:  # forwarded: an accepted request, recorded as it ended
                record.finished_at = time.time()
                if reply is None:  # (cancelled: the client left)
                    record.status, record.cancel_reason = "cancelled", "client_disconnect"
                else:
                    record.http_status = reply.status
                    record.status = "completed" if reply.status < 400 else "rejected" if reply.status < 500 else "error"
                self.records.submit(record)
            if record.instance is not None:
                status = record.cancel_reason or record.status
            else:  # refused before it was forwarded (no record), or the client left meanwhile, or a gateway failure
                status = "client_disconnect" if reply is None else "error" if reply.status == 500 else "rejected"
            self._count_stored(request, record.model, status, time.time() - record.started_at)
        reply.headers = {**reply.headers, "x-request-id": echo}
        return reply

    def _count_stored(self, request: Request, model: str, status: str, elapsed: float) -> None:
        """A stored response's route, counted as the endpoints' requests are (`Exchange._finish_record`), by its
        action (`responses.retrieve`, ...; `responses.unknown` for a route there is not)."""
        metrics = self.metrics
        metrics.requests.labels(model, "", status).inc()
        metrics.request_duration.labels(model, "", status).observe(elapsed)
        metrics.endpoint_requests.labels(stored.endpoint_of(request) or "responses.unknown", status).inc()

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

    def _dashboard_events(self, request: Request) -> Awaitable[Reply]:
        """The dashboard's SSE feed; its id header is given before the stream starts (`_with_request_id`
        sets it after the handler returns, too late for a stream). The admin gate in force is asked again before
        each event: a reload that revokes the key ends the stream."""
        assert self.dashboard is not None
        return self.dashboard.events(
            request,
            headers={"x-request-id": echoed_request_id(request)},
            allowed=lambda r: self.admin.denied(r) is None,
        )

    def _unknown(self, request: Request) -> Response:
        allowed = self._allowed.get(request.path)
        error: GatewayError = (
            NotFound(f"Unknown path: {request.method} {request.path}")
            if allowed is None
            else MethodNotAllowed(request.method, request.path, allowed)
        )
        return Response(
            status=error.status, body=error.body_bytes(), content_type="application/json", headers=error.headers()
        )


def _set_request_id(reply: Reply, request: Request) -> None:
    """Echo the client's `x-request-id`, or give the response a new one, unless its handler gave it the id it used
    (the generation endpoints and the stored routes: the id the engine was told)."""
    if "x-request-id" not in reply.headers:
        reply.headers = {**reply.headers, "x-request-id": echoed_request_id(request)}


def _with_request_id(
    handler: Callable[[Request], Awaitable[Reply]],
) -> Callable[[Request], Awaitable[Reply]]:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Reply:
        reply = await handler(request)
        _set_request_id(reply, request)
        return reply

    return wrapped


def _some(names: list[str]) -> str:
    """Names as a warning lists them: the first five, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _tenant_order(config: Config) -> list[str]:
    """Tenants in the order they get their own metric label: configured tenants first (with keys
    configured, "default" is never a request's tenant)."""
    return [*(t.name for t in config.tenants), DEFAULT_TENANT]
