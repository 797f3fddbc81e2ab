"""The request path: route, call the engine (retrying elsewhere before the first byte), relay back.

Runs inside `Exchange.run()`, which owns every resource this code acquires and decides how the
request ends; nothing here needs to clean up after itself on cancellation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from . import sse
from .errors import UpstreamError, UpstreamProtocolError
from .exchange import ClientGone, Exchange, Phase
from .routing import RouteRequest
from .upstream import UpstreamCall

if TYPE_CHECKING:
    from .fleet import Instance


async def relay(ex: Exchange, http_request: web.Request) -> web.StreamResponse:
    call = await _open_with_retries(ex)
    if ex.api.stream:
        return await _relay_stream(ex, http_request, call)
    return await _relay_whole(ex, call)


async def _open_with_retries(ex: Exchange) -> UpstreamCall:
    gateway = ex.gateway
    pool = ex.pool
    api = ex.api
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
        body = instance.dialect.upstream_body(api, served_model=pool.served[instance.key], request_id=ex.id)
        call = UpstreamCall(
            gateway.fleet,
            gateway.metrics,
            instance,
            api.endpoint.path,
            orjson.dumps(body),
            ex.id,
            stream=api.stream,
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
    }


async def _relay_whole(ex: Exchange, call: UpstreamCall) -> web.StreamResponse:
    payload = await call.read_json()
    ex.phase = Phase.FINISHING
    ex.first_token()
    payload["model"] = ex.api.model
    usage = payload.get("usage")
    if isinstance(usage, dict):
        ex.record.prompt_tokens = _int(usage.get("prompt_tokens"))
        ex.record.completion_tokens = _int(usage.get("completion_tokens"))
    ex.record.http_status = 200
    return web.Response(
        body=orjson.dumps(payload),
        content_type="application/json",
        headers=_headers(ex, call.instance),
    )


async def _relay_stream(ex: Exchange, http_request: web.Request, call: UpstreamCall) -> web.StreamResponse:
    api = ex.api
    events = call.events()
    try:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **_headers(ex, call.instance),
            },
        )
        prepared = False
        delivered = 0
        async for event in events:
            usage = event.pop("usage", None)
            if isinstance(usage, dict):
                ex.record.prompt_tokens = _int(usage.get("prompt_tokens"))
                ex.record.completion_tokens = max(delivered, _int(usage.get("completion_tokens")))
            choices = event.get("choices")
            if not choices:
                if usage is None or not api.include_usage:
                    continue
                event["usage"] = usage
            elif api.include_usage:
                event["usage"] = None
            event["model"] = api.model
            if not prepared:
                # The first byte goes out only now: until here a failure could still be retried.
                ex.record.http_status = 200
                ex.response = response
                await _write(response.prepare(http_request))
                prepared = True
                ex.phase = Phase.STREAMING
            if choices and _has_content(choices):
                delivered += 1
                if ex.record.completion_tokens < delivered:
                    ex.record.completion_tokens = delivered
                ex.first_token()
            await _write(response.write(sse.encode(event)))
        if not prepared:
            raise UpstreamProtocolError(f"Instance {call.instance.name} sent an empty stream.")
        ex.phase = Phase.FINISHING
        await _write(response.write(sse.DONE_EVENT))
        ex.answered = True
        await _write(response.write_eof())
        return response
    finally:
        await events.aclose()


async def _write(awaitable: Any) -> Any:
    try:
        return await awaitable
    except ConnectionError as exc:
        raise ClientGone() from exc


def _has_content(choices: list[Any]) -> bool:
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
