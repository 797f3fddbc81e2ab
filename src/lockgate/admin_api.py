"""The operator's routes of one gateway process: `/metrics`, `/admin/requests` (and cancelling one), `/admin/flights`,
`/admin/fleet`, `/admin/slo`, `/admin/reload`, behind the admin gate (`admission/admin.py`: an admin key once keys
are configured, and no cross-site changes). Under `--workers` a listing or a cancel also asks the other workers
(`workerset.py`) and gathers their answers; `/admin/reload` tells the others to reload the same file.

The gateway owns one `AdminApi`, routes the paths to its handlers and replaces its gate when a reload changes the
tenants or the admin keys.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from .admission.admin import AdminGate, cross_site
from .admission.admin import challenge as admin_challenge
from .config import ConfigError
from .edge.server import Reply, Request, Response, json_response
from .errors import Forbidden, GatewayError, InvalidConfig, InvalidRequest, NotFound, Unavailable
from .fleet.report import describe_fleet
from .request_ids import echoed_request_id
from .workers import reload_all_workers
from .workerset import LOCAL_HEADER, WorkerSet

if TYPE_CHECKING:
    from .dedup.coalescer import Coalescer
    from .exchange import Registry
    from .fleet.fleet import Fleet
    from .metrics import GatewayMetrics
    from .reload import Reloader
    from .slo import SloService


class Operated(Protocol):
    """What the operator's routes read and drive (`gateway.Gateway`)."""

    @property
    def workers(self) -> WorkerSet | None: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def dedup(self) -> Coalescer: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def slo(self) -> SloService: ...

    @property
    def reloader(self) -> Reloader | None: ...

    def error_response(self, error: GatewayError, request_id: str) -> Response: ...


#: `DELETE /admin/requests/{id}` cancels a request in flight (or a flight, by its id).
CANCEL_PREFIX = "/admin/requests/"

Handler = Callable[[Request], Awaitable[Reply]]


class AdminApi:
    def __init__(self, gateway: Operated, gate: AdminGate) -> None:
        self._gateway = gateway
        #: Who may use these routes (replaced by a reload that changes tenants or admin keys).
        self.gate = gate

    # --- the gate ------------------------------------------------------------------------------------
    def guarded(self, handler: Handler) -> Handler:
        """`handler` behind the admin gate (401/403 in the OpenAI envelope without an admin key)."""

        async def guarded(request: Request) -> Reply:
            denied = self.denied(request)
            return denied if denied is not None else await handler(request)

        return guarded

    def denied(self, request: Request) -> Response | None:
        """The answer refusing `request` an operator route, or None if it may use it."""
        asked = request.headers
        try:
            self.gate.check(asked.get("authorization"))
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
            headers["x-request-id"] = echoed_request_id(request)
            body = exc.body_bytes()
            return Response(status=exc.http_status, body=body, content_type="application/json", headers=headers)
        return None

    # --- the routes ----------------------------------------------------------------------------------
    def _gathering(self, request: Request) -> WorkerSet | None:
        """The other workers to ask too (`--workers`), unless one of them asks for this worker's own answer."""
        workers = self._gateway.workers
        return None if workers is None or LOCAL_HEADER in request.headers else workers

    async def metrics(self, request: Request) -> Response:
        body = self._gateway.metrics.render()
        workers = self._gathering(request)
        if workers is not None:
            body = await workers.scrape(body, request.headers.get("authorization"))
        return Response(body=body, content_type="text/plain; charset=utf-8")

    async def requests(self, request: Request) -> Response:
        """`GET /admin/requests`: the requests in flight."""
        entries = self._own([e.describe() for e in self._gateway.registry.all()])
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
        workers = self._gateway.workers
        if workers is not None:
            for entry in entries:
                entry["worker"] = workers.index
        return entries

    async def cancel_anywhere(self, request: Request) -> Response:
        """`DELETE /admin/requests/{id}`: here, else (`--workers`) at the worker that holds it."""
        request_id = request.path[len(CANCEL_PREFIX) :]
        here = self.cancel(request_id)
        workers = self._gathering(request)
        if here.status != 404 or workers is None:
            return here
        path = CANCEL_PREFIX + urllib.parse.quote(request_id, safe="")  # the path is decoded: encoded again
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
            return self._gateway.error_response(error, "")
        return here

    def cancel(self, request_id: str) -> Response:
        """Cancel the request `request_id` in this process (or the flight of that id)."""
        gateway = self._gateway
        exchange = gateway.registry.get(request_id)
        if exchange is None:
            # A flight's id (`GET /admin/flights`): one that runs on after its clients left is stopped the same way.
            stopped = gateway.dedup.flights.cancel(request_id)
            if stopped is not None:
                return json_response({"id": request_id, "cancelled": stopped})
            return gateway.error_response(NotFound(f"No request '{request_id}' is in flight."), "")
        # False: it was already ending (its own end, or an earlier cancel, decides how).
        return json_response({"id": request_id, "cancelled": exchange.cancel("admin")})

    async def flights(self, request: Request) -> Response:
        """De-duplication: the shared engine calls in flight and the completed-result cache."""
        dedup = self._gateway.dedup
        flights = self._own([f.describe() for f in dedup.flights.all()])
        answer: dict[str, Any] = {"flights": flights, "statistics": dedup.statistics()}
        workers = self._gathering(request)
        if workers is not None:
            others, answer["workers_unreachable"] = await workers.others_json(
                request.path, request.headers.get("authorization")
            )
            flights += [flight for _, other in others for flight in other.get("flights", ())]
            # Each worker's own caches and counts, and their sum (an outside run read this worker's alone, then
            # named `statistics`, as the gateway's).
            by_worker = {str(workers.index): answer["statistics"]} | {
                str(n): other.get("statistics") for n, other in others
            }
            answer["statistics_by_worker"] = by_worker
            answer["statistics"] = summed([part for part in by_worker.values() if isinstance(part, dict)])
        return json_response(answer)

    async def reload(self, request: Request) -> Response:
        """Re-read the configuration file and apply it (what SIGHUP does); an invalid file changes
        nothing and is answered 422 with the reason."""
        gateway = self._gateway
        if gateway.reloader is None:
            error = InvalidRequest(
                "The gateway runs the embedded default configuration (started without --config): "
                "there is no file to reload.",
                code="nothing_to_reload",
            )
            return gateway.error_response(error, "")
        try:
            diff = await gateway.reloader.reload()
        except ConfigError as exc:
            return gateway.error_response(InvalidConfig(str(exc)), "")
        # Under `--workers`, this is one worker of several: the others reload the same file (SIGHUP via the
        # supervisor), or a revoked key would go on working on all but one.
        return json_response({"reloaded": True, "changes": diff.describe(), "all_workers": reload_all_workers()})

    async def slo(self, request: Request) -> Response:
        """Each objective's status, error budget, windows and burn-rate alerts (`slo/objectives.py`),
        at most `slo.cache_ms` old."""
        return json_response(await self._gateway.slo.evaluate())

    async def fleet(self, request: Request) -> Response:
        return json_response(describe_fleet(self._gateway.fleet))


def summed(parts: list[Any]) -> Any:
    """Workers' statistics added up key by key: counts (integers) summed; anything else (a threshold, a flag, a
    list of examples) as the first part has it."""
    first = parts[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(key for part in parts if isinstance(part, dict) for key in part)
        return {key: summed([part[key] for part in parts if isinstance(part, dict) and key in part]) for key in keys}
    if isinstance(first, int) and not isinstance(first, bool):
        return sum(part for part in parts if isinstance(part, int) and not isinstance(part, bool))
    return first
