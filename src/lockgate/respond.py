"""Writing a generation back to one client: an SSE stream or one JSON body.

Shared by the direct path (`relay.py`, one engine call per request) and de-duplication (flights and
cached results): both hand over the generation's events and the response headers. Runs inside
`Exchange.run()`; a failed write means the client has gone (`ClientGone`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from . import sse
from .assemble import ClientView, has_content
from .edge.server import Reply, Request, Response, StreamResponse
from .errors import UpstreamProtocolError
from .exchange import ClientGone, Exchange, Phase

#: The most a stream gathers into one write (events already here are written together).
MAX_BATCH_BYTES = 64 * 1024


async def stream_events(
    ex: Exchange,
    http_request: Request,
    events: AsyncIterator[dict[str, Any]],
    headers: dict[str, str],
    *,
    response_id: str | None = None,
    ready: Callable[[], bool] | None = None,
    raw: Callable[[], bytes | None] | None = None,
) -> Reply:
    """Relay a generation as SSE. The status line goes out with the first event that has choices:
    until then, a failure can still be answered with an error status (or retried elsewhere).

    Events that are already here (`ready()`: the source's next step will not wait — another event,
    or its end) are written together, one write (one send) for all of them: an engine or flight that
    is ahead of this client costs one syscall per batch, not per token. A batch stops at `MAX_BATCH_BYTES`,
    and a write still awaits the transport's drain, so a slow client holds its source back (backpressure)
    and what waits for it is at most the transport's high-water mark plus one batch.

    `raw()` gives the source's own bytes for the event just received, when it knows them: an event the
    client's view leaves unchanged is then written as those bytes, not serialised again (pass-through)."""
    api, record = ex.api, ex.record
    view = ClientView(model=api.model, include_usage=api.include_usage, response_id=response_id)
    response: StreamResponse | None = None
    delivered = 0
    batch: list[bytes] = []
    batch_bytes = 0
    batch_tokens = 0
    async for event in events:
        out = view.event(event)
        if view.usage is not None:
            record.prompt_tokens = _int(view.usage.get("prompt_tokens"))
            record.completion_tokens = max(delivered, _int(view.usage.get("completion_tokens")))
        if out is not None:
            if response is None:
                response = StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                        **headers,
                    },
                )
                record.http_status = 200
                ex.response = response
                await _write(response.prepare(http_request))
                ex.phase = Phase.STREAMING
            payload = raw() if raw is not None and out is event else None
            # Pass-through, unless the payload spans several `data:` lines (then re-encoded on one).
            data = b"data: " + payload + b"\n\n" if payload and payload.find(b"\n") < 0 else sse.encode(out)
            batch.append(data)
            batch_bytes += len(data)
            batch_tokens += has_content(out)
        if not batch or (ready is not None and batch_bytes < MAX_BATCH_BYTES and ready()):
            continue
        assert response is not None
        await _write(response.write(b"".join(batch) if len(batch) > 1 else batch[0]))
        batch.clear()
        batch_bytes = 0
        if batch_tokens:
            # Delivered = written to the client's connection.
            delivered += batch_tokens
            batch_tokens = 0
            if record.completion_tokens < delivered:
                record.completion_tokens = delivered
            ex.first_token()
    if response is None:
        raise UpstreamProtocolError("The engine sent an empty stream.")
    ex.phase = Phase.FINISHING
    final = view.final()
    if final is not None:
        batch.append(sse.encode(final))
    batch.append(sse.DONE_EVENT)
    await _write(response.write(b"".join(batch)))
    if batch_tokens:
        record.completion_tokens = max(record.completion_tokens, delivered + batch_tokens)
        ex.first_token()
    ex.answered = True
    await _write(response.write_eof())
    return response


def whole_body(ex: Exchange, body: dict[str, Any], headers: dict[str, str]) -> Response:
    """Answer a non-streaming client with a complete body (from the engine or assembled)."""
    ex.phase = Phase.FINISHING
    ex.first_token()
    body["model"] = ex.api.model
    usage = body.get("usage")
    if isinstance(usage, dict):
        ex.record.prompt_tokens = _int(usage.get("prompt_tokens"))
        ex.record.completion_tokens = _int(usage.get("completion_tokens"))
    ex.record.http_status = 200
    return ex.whole_response(orjson.dumps(body), headers)


async def _write(awaitable: Any) -> Any:
    try:
        return await awaitable
    except ConnectionError as exc:
        raise ClientGone() from exc


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
