"""A stored response's routes (the Responses API), forwarded to the engine that made the response:
`GET /v1/responses/{id}` (the SDK's `responses.retrieve`), `DELETE /v1/responses/{id}`, `POST
/v1/responses/{id}/cancel` (a background response) and `GET /v1/responses/{id}/input_items`.

An engine with a response store (OpenAI; vLLM with `VLLM_ENABLE_RESPONSES_API_STORE`) answers these for the
responses it made, and only for those: the gateway remembers which instance made each recent response, and for which
tenant (`Pool.remember_response`, the same record that pins a `previous_response_id` follow-up), and sends the
request there with the instance's own credentials. The id a client names is the one it was shown (`response_ids.py`:
with tenants, bound to its tenant; each names the instance that made it), turned back into the engine's. An id it
does not remember, or one another tenant made, is 404: a tenant learns nothing of another's responses. The engine's
answer comes back as it is, but for the model name inside a response object (the client's, not the engine's), the
response's id as the client was shown it, and errors in the OpenAI envelope (`UpstreamStatusError`). A `stream`
asked for in the query (replaying a background response's events) is not relayed: 400. Each request is one of its
tenant's (rate limits, `max_concurrent`), and at most `MAX_IN_FLIGHT` are forwarded at once; one forwarded to its
engine gets a usage record (`responses.retrieve`, ...: who read or deleted what, and how it ended).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from .cluster.identity import TENANT_HEADER
from .edge.server import Request, Response
from .errors import (
    DeadlineExceeded,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Unavailable,
    UpstreamConnectError,
    UpstreamStatusError,
    shown,
)
from .fleet.instance import upstream_headers
from .http import ConnectError, DisconnectedError, ProtocolError, ResponseTooLarge
from .response_ids import tagged_member
from .responses import show_ids
from .upstream import call_failed, too_large

if TYPE_CHECKING:
    from .admission.tenants import Tenant
    from .fleet.fleet import Fleet
    from .fleet.instance import Instance
    from .fleet.pool import Pool
    from .records import UsageRecord
    from .response_ids import ResponseIds

PREFIX = "/v1/responses/"

#: The routes below `PREFIX` (method, what follows the id), and the `endpoint` their usage records name.
_ACTIONS = {
    ("GET", ""): "responses.retrieve",
    ("DELETE", ""): "responses.delete",
    ("POST", "/cancel"): "responses.cancel",
    ("GET", "/input_items"): "responses.input_items",
}

#: At most this many stored-route requests at once, gateway-wide (each may hold an answer of up to
#: `upstream.max_response_bytes`): beyond, 503.
MAX_IN_FLIGHT = 32

#: How long the engine may take to answer when the model sets no `timeout_ms`.
DEFAULT_TIMEOUT_S = 60.0


def endpoint_of(request: Request) -> str | None:
    """What a stored response's route is (`responses.retrieve`, ...; None: no such route)."""
    return _route(request)[2]


def _route(request: Request) -> tuple[str, str, str | None]:
    """The response id a stored response's route names, the rest of its path (`/cancel`, ...) and what the route is
    (None: no such route)."""
    response_id, slash, action = request.path[len(PREFIX) :].partition("/")
    tail = slash + action
    return response_id, tail, _ACTIONS.get((request.method, tail)) if response_id else None


async def forward(
    request: Request,
    tenant: Tenant,
    fleet: Fleet,
    record: UsageRecord,
    ids: ResponseIds,
    *,
    deadline_s: float | None = None,
    relay: bool = False,
    deleted: Callable[[str], None] | None = None,
) -> Response:
    """Answer a stored response's route (see the module docstring) for `tenant` (its allowance already taken);
    raises `GatewayError` for the client's error. `record`: the request's usage record (its id is the one the engine
    is told), filled in once the request is forwarded (its `instance` set: an accepted request, to be submitted;
    the caller records how it ended). `ids`: the ids clients are shown (`response_ids.py`). `deadline_s`: the
    client's (`x-lockgate-timeout-ms`), within the model's `timeout_ms`. `relay`: a central replica, which tells a
    sidecar whose request it is (the sidecar checks the tenant again). `deleted`: told the engine's id of a response
    the engine deleted (the result cache forgets it)."""
    response_id, tail, endpoint = _route(request)
    if endpoint is None:
        methods = [method for method, rest in _ACTIONS if rest == tail]
        if response_id and methods:  # (an outside run: PUT on a response was 404 `unknown_route`, not 405)
            raise MethodNotAllowed(request.method, request.path, ", ".join(sorted(methods)))
        raise NotFound(f"There is no route {request.method} {request.path}.", code="unknown_route")
    if _asks_stream(request.query_string):
        raise InvalidRequest(
            "Replaying a stored response's events (`stream=true`) is not relayed by the gateway: retrieve it whole.",
            param="stream",
            code="unsupported_value",
        )
    taken = ids.take(response_id, tenant.name)
    found = None
    if taken is not None:
        engine_id, tag = taken
        found = home_of(fleet, engine_id)
        if found is None and tag is not None:
            found = _home_by_tag(fleet, tag, tenant)
    if taken is not None and found is None and fleet.discovering:
        # (A central that has not read the cluster's engines yet: a plain request is told the same.)
        raise Unavailable(
            "This gateway has not read the cluster's engines from etcd yet; retry shortly.",
            code="cluster_not_synced",
            retry_after=1,
        )
    if taken is None or found is None or found[2] != tenant.name or not tenant.may_use(found[0].model):
        raise NotFound(f"No response '{shown(response_id)}' is known for you.", code="response_not_found")
    pool, key, _ = found
    instance = pool.member(key)
    if instance is None and pool.left_lately(key):  # (a sidecar restarting: its engines come back with it)
        raise _unavailable(response_id)
    if instance is None:
        raise NotFound(
            f"The engine that made response '{shown(response_id)}' has left the fleet.", code="response_not_found"
        )
    path = PREFIX + urllib.parse.quote(engine_id, safe="") + tail
    if request.query_string:
        path += "?" + request.query_string
    record.endpoint, record.model, record.instance, record.attempts = endpoint, pool.model, instance.name, 1
    relayed = ((TENANT_HEADER, tenant.name),) if relay and instance.published is not None else ()
    timeout = pool.config.timeout_ms / 1000 if pool.config.timeout_ms else DEFAULT_TIMEOUT_S
    if deadline_s is not None:
        timeout = min(timeout, deadline_s)
    try:
        async with asyncio.timeout(timeout):
            status, body, content_type = await _call(instance, request, path, record.request_id, fleet, relayed)
    except TimeoutError:
        raise DeadlineExceeded(f"Instance {instance.name} did not answer within {timeout:g} s.") from None
    except UpstreamConnectError as exc:
        # (The engine that holds it is down or restarting: no other has it, and a 502 read as final to a client
        # the README tells to retry.)
        record.error = exc.message[:500]
        raise _unavailable(response_id) from None
    headers = {"x-lockgate-instance": instance.name}
    if status == 404:  # (deleted, or not stored: the same answer as for an id never made)
        raise NotFound(f"No response '{shown(response_id)}' is known for you.", code="response_not_found")
    if status >= 400:
        error = UpstreamStatusError(status, body, content_type)
        error.message = error.message.replace(engine_id, response_id)  # the id the client knows
        record.error = error.message[:500]
        return Response(
            status=error.http_status, body=error.body_bytes(), content_type="application/json", headers=headers
        )

    if request.method == "DELETE" and status < 300 and deleted is not None:
        deleted(engine_id)

    def show(engine: str) -> str:
        return response_id if engine == engine_id else ids.show(engine, tenant.name, instance.key)

    return Response(status=status, body=_as_shown(body, pool.model, show), content_type=content_type, headers=headers)


async def _call(
    instance: Instance,
    request: Request,
    path: str,
    request_id: str,
    fleet: Fleet,
    relayed: tuple[tuple[str, str], ...],
) -> tuple[int, bytes, str]:
    """The engine's status, body and content type for the forwarded request. A failed call, or a 5xx, counts against
    the instance's health as a generation's does (`upstream.call_failed`)."""
    limit = fleet.upstream.max_response_bytes
    headers = upstream_headers(instance, request_id, stream=False, extra=relayed)  # (its Content-Type included)
    try:
        response = await instance.http.request(request.method, path, request.body, headers)
        try:
            body = await response.read(limit)
        except BaseException:
            response.close()  # (cancelled, timed out: the connection is not reused)
            raise
    except ResponseTooLarge:
        raise too_large(instance.name, limit) from None
    except (ConnectError, DisconnectedError, ProtocolError) as exc:
        raise call_failed(fleet, instance, exc) from None
    if response.status >= 400:  # (as a generation's answer is: a 5xx or refused credentials count against it)
        body = instance.credentials.scrub(body)
        fleet.report_failure(instance, f"http_{response.status}", body[:200].decode("utf-8", "replace"))
    else:
        fleet.report_success(instance)
    return response.status, body, response.content_type or "application/json"


def _unavailable(response_id: str) -> Unavailable:
    """The 503 for a stored response whose engine cannot take requests right now (down, restarting, its sidecar gone
    a moment ago): only that engine holds it."""
    return Unavailable(
        f"The engine that holds response '{shown(response_id)}' cannot take requests right now; retry shortly.",
        code="response_unavailable",
        retry_after=2,
    )


def home_of(fleet: Fleet, response_id: str) -> tuple[Pool, str, str] | None:
    """The pool, instance key and tenant of a response made through this gateway (`Pool.remember_response`)."""
    for pool in _pools(fleet):
        home = pool.response_home(response_id)
        if home is not None:
            return pool, home[0], home[1]
    return None


def _pools(fleet: Fleet) -> list[Pool]:
    """The pools a stored response may have been made in: the fleet's, and those whose last instance left moments ago
    (a lone sidecar restarting: its responses come back with it, and until then they are 503, not 404)."""
    return [*fleet.pools.values(), *fleet.gone_pools()]


def _home_by_tag(fleet: Fleet, tag: str, tenant: Tenant) -> tuple[Pool, str, str] | None:
    """The pool and key of the instance a shown id's tag names (a process that never saw the response)."""
    for pool in _pools(fleet):
        key = tagged_member(pool, tag) if tenant.may_use(pool.model) else None
        if key is not None:
            return pool, key, tenant.name
    return None


def _as_shown(body: bytes, model: str, show: Callable[[str], str]) -> bytes:
    """The engine's answer as the client sees it: a response object naming the client's model (the engine's name for
    it may differ), its response ids (its own, the one it follows up, a deleted one's) as `show` gives them."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(parsed, dict):
        return body
    if parsed.get("object") != "response":  # (a list of input items: no response id, no model)
        return body
    before = dict(parsed)
    if "model" in parsed:  # (not in a deletion's answer)
        parsed["model"] = model
    show_ids(parsed, show)
    return body if parsed == before else orjson.dumps(parsed)


def _asks_stream(query: str) -> bool:
    """Whether the query asks for a stream, however it is written (`stream=tru%65`, `STREAM=yes`): only an absent,
    empty, `false` or `0` one does not."""
    return any(
        name.strip().lower() == "stream" and value.strip().lower() not in ("", "false", "0")
        for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True)
    )
