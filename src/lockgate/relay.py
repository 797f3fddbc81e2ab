"""The request path: route, call the engine (retrying elsewhere before the first byte), relay back.

An attempt may be retried on another instance as long as nothing has reached the client: a failed
connect, a retryable status (502/503), and for streams also a stream that breaks or ends before its
first event — the response is only prepared once that event is in hand. Retries are bounded by the
model's `retries` and by the request's deadline.

Runs inside `Exchange.run()`, which owns every resource this code acquires and decides how the
request ends; nothing here needs to clean up after itself on cancellation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from . import sse
from .assemble import Assembler
from .errors import UpstreamError, UpstreamProtocolError
from .exchange import ClientGone, Exchange, Phase
from .routing import RouteRequest
from .upstream import UpstreamCall

if TYPE_CHECKING:
    from .fleet import Instance, Lease


@dataclass(slots=True)
class _Opened:
    call: UpstreamCall
    lease: Lease
    #: Stream events already read (up to the first with choices), and the rest of the stream.
    head: list[dict[str, Any]]
    events: AsyncGenerator[dict[str, Any], None] | None


async def relay(ex: Exchange, http_request: web.Request) -> web.StreamResponse:
    route = ex.pool.route_request(ex.api, http_request.headers)
    opened = await _open_with_retries(ex, route)
    if ex.api.stream:
        return await _relay_stream(ex, http_request, opened)
    return await _relay_whole(ex, opened)


def _retryable(error: UpstreamError) -> bool:
    # Called only before the first byte reached the client: a stream that broke (or ended) before its
    # first event produced nothing the client saw, so another instance may answer instead.
    return error.retryable or isinstance(error, UpstreamProtocolError)


def _time_left(ex: Exchange) -> bool:
    return ex.deadline_s is None or time.perf_counter() - ex.started < ex.deadline_s


async def _open_with_retries(ex: Exchange, route: RouteRequest) -> _Opened:
    gateway = ex.gateway
    pool = ex.pool
    api = ex.api
    tried: set[str] = set()
    attempts = pool.config.retries + 1
    last_error: UpstreamError | None = None
    for attempt in range(attempts):
        try:
            instance, view = pool.choose_view(replace(route, exclude=frozenset(tried)))
        except Exception:
            if last_error is not None:
                raise last_error from None
            raise
        stream = api.stream or instance.dialect.stream_upstream_always
        body = instance.dialect.upstream_body(
            api,
            served_model=pool.served[instance.key],
            request_id=ex.id,
            stream=stream,
            priority=ex.engine_priority,
        )
        call = UpstreamCall(
            gateway.fleet,
            gateway.metrics,
            instance,
            api.endpoint.path,
            orjson.dumps(body),
            ex.id,
            stream=stream,
        )
        lease = gateway.fleet.lease(instance, max(0, route.prompt_tokens - view.cached_tokens))
        ex.attach(lease, call)
        ex.phase = Phase.CONNECTING
        try:
            await call.open()
            if not call.streaming:
                return _Opened(call, lease, [], None)
            events = call.events()
            head = await _first_events(events, call, lease)
            return _Opened(call, lease, head, events)
        except UpstreamError as exc:
            ex.detach()
            if not _retryable(exc) or attempt + 1 == attempts or not _time_left(ex):
                raise
            last_error = exc
            tried.add(instance.key)
            gateway.metrics.retries.labels(api.model).inc()
    raise AssertionError("unreachable")  # pragma: no cover


async def _first_events(
    events: AsyncGenerator[dict[str, Any], None], call: UpstreamCall, lease: Lease
) -> list[dict[str, Any]]:
    """Read the stream up to its first event with choices; nothing has been sent to the client yet."""
    head: list[dict[str, Any]] = []
    try:
        async for event in events:
            head.append(event)
            if event.get("choices"):
                lease.first_token()
                return head
    except BaseException:
        await events.aclose()
        raise
    raise UpstreamProtocolError(f"Instance {call.instance.name} sent an empty stream.")


async def _chain(
    head: list[dict[str, Any]], rest: AsyncGenerator[dict[str, Any], None]
) -> AsyncGenerator[dict[str, Any], None]:
    for event in head:
        yield event
    async for event in rest:
        yield event


def _headers(ex: Exchange, instance: Instance) -> dict[str, str]:
    return {
        "x-request-id": ex.record.client_request_id or ex.id,
        "x-lockgate-instance": instance.name,
        **ex.response_headers,
    }


async def _relay_whole(ex: Exchange, opened: _Opened) -> web.StreamResponse:
    call = opened.call
    if opened.events is not None:
        assembler = Assembler(ex.api.endpoint)
        events = _chain(opened.head, opened.events)
        try:
            async for event in events:
                assembler.feed(event)
        finally:
            await events.aclose()
            await opened.events.aclose()
        payload = assembler.result()
    else:
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


async def _relay_stream(ex: Exchange, http_request: web.Request, opened: _Opened) -> web.StreamResponse:
    """Relay the engine's stream, normalised: usage (which the gateway always asks for) goes out as
    one final `choices: []` chunk if, and only if, the client asked for it."""
    api = ex.api
    call, lease = opened.call, opened.lease
    assert opened.events is not None
    upstream = opened.events
    events = _chain(opened.head, upstream)
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
        last: dict[str, Any] | None = None
        usage: dict[str, Any] | None = None
        delivered = 0
        async for event in events:
            chunk_usage = event.pop("usage", None)
            if isinstance(chunk_usage, dict):
                usage = chunk_usage
                ex.record.prompt_tokens = _int(usage.get("prompt_tokens"))
                ex.record.completion_tokens = max(delivered, _int(usage.get("completion_tokens")))
                lease.completion_tokens = ex.record.completion_tokens
            choices = event.get("choices")
            if not choices:
                continue
            if api.include_usage:
                event["usage"] = None
            event["model"] = api.model
            if last is None:
                # The first byte goes out only now: until here a failure could still be retried.
                ex.record.http_status = 200
                ex.response = response
                await _write(response.prepare(http_request))
                ex.phase = Phase.STREAMING
            last = event
            if _has_content(choices):
                delivered += 1
                lease.completion_tokens = delivered
                if ex.record.completion_tokens < delivered:
                    ex.record.completion_tokens = delivered
                ex.first_token()
            await _write(response.write(sse.encode(event)))
        if last is None:
            raise UpstreamProtocolError(f"Instance {call.instance.name} sent an empty stream.")
        ex.phase = Phase.FINISHING
        if api.include_usage and usage is not None:
            tail = {k: last[k] for k in ("id", "object", "created", "model", "system_fingerprint") if k in last}
            await _write(response.write(sse.encode({**tail, "choices": [], "usage": usage})))
        await _write(response.write(sse.DONE_EVENT))
        await _write(response.write_eof())
        return response
    finally:
        await events.aclose()
        await upstream.aclose()


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
