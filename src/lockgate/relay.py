"""The request path: route, call the engine (retrying elsewhere before the first byte), relay back.

Runs inside `Exchange.run()`, which owns every resource this code acquires and decides how the
request ends; nothing here needs to clean up after itself on cancellation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from .assemble import assemble
from .errors import UpstreamError
from .exchange import Exchange, Phase
from .respond import stream_events, whole_body
from .routing import RouteRequest
from .upstream import UpstreamCall

if TYPE_CHECKING:
    from .fleet import Instance
    from .wire import ApiRequest


async def relay(ex: Exchange, http_request: web.Request) -> web.StreamResponse:
    dedup = ex.gateway.dedup
    key = dedup.plan(ex, http_request.headers.get("Cache-Control"))
    if key is not None:
        return await dedup.serve(ex, http_request, key)
    call = await _open_with_retries(ex)
    if ex.api.stream:
        return await _relay_stream(ex, http_request, call)
    return await _relay_whole(ex, call)


async def _open_with_retries(
    ex: Exchange, *, api: ApiRequest | None = None, upstream_id: str | None = None
) -> UpstreamCall:
    """Open the engine call for `ex` (or for `api` on its behalf: a resumed generation, under
    `upstream_id`, so that the engine never sees two requests with one id)."""
    gateway = ex.gateway
    pool = ex.pool
    api = api or ex.api
    upstream_id = upstream_id or ex.id
    tried: set[str] = set()
    attempts = pool.config.retries + 1
    last_error: UpstreamError | None = None
    for attempt in range(attempts):
        try:
            instance = pool.choose(RouteRequest(api.model, exclude=frozenset(tried)))
        except Exception:
            if last_error is not None:
                raise last_error from None
            raise
        stream = api.stream or instance.dialect.stream_upstream_always
        body = instance.dialect.upstream_body(
            api,
            served_model=pool.served[instance.key],
            request_id=upstream_id,
            stream=stream,
            priority=ex.engine_priority,
        )
        call = UpstreamCall(
            gateway.fleet,
            gateway.metrics,
            instance,
            api.endpoint.path,
            orjson.dumps(body),
            upstream_id,
            stream=stream,
        )
        ex.attach(gateway.fleet.lease(instance), call)
        ex.phase = Phase.CONNECTING
        try:
            await call.open()
            return call
        except UpstreamError as exc:
            ex.detach()
            if not exc.retryable or attempt + 1 == attempts:
                raise
            last_error = exc
            tried.add(instance.key)
            gateway.metrics.retries.labels(api.model).inc()
    raise AssertionError("unreachable")  # pragma: no cover


def _headers(ex: Exchange, instance: Instance) -> dict[str, str]:
    return {
        "x-request-id": ex.record.client_request_id or ex.id,
        "x-lockgate-instance": instance.name,
        **ex.response_headers,
        "x-lockgate-cache": "bypass",
    }


async def _relay_whole(ex: Exchange, call: UpstreamCall) -> web.StreamResponse:
    if call.streaming:
        body = assemble(ex.api.endpoint, [event async for event in call.events()], model=ex.api.model)
    else:
        body = await call.read_json()
    return whole_body(ex, body, _headers(ex, call.instance))


async def _relay_stream(ex: Exchange, http_request: web.Request, call: UpstreamCall) -> web.StreamResponse:
    events = call.events()
    try:
        return await stream_events(ex, http_request, events, _headers(ex, call.instance))
    finally:
        await events.aclose()
