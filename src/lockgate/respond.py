"""Writing a generation back to one client: an SSE stream or one JSON body.

Shared by the direct path (`relay.py`, one engine call per request) and de-duplication (flights and
cached results): both hand over the generation's events and the response headers. Runs inside
`Exchange.run()`; a failed write means the client has gone (`ClientGone`).

Theory of operation: `SSEWriter` is the synchronous core — one client's view of the events, the status
line on the first event with choices, batching, delivered-token accounting, the closing usage chunk and
`[DONE]` — and two shells drive it:
- `stream_events` iterates any async source of events (a flight's subscription, a resumable generation,
  a cached result), one task step per event it waits for;
- `pump` is the direct path's: it writes what the engine has already sent, then hands the writer to the
  engine connection's data callback (`Opened.follow`), which writes each network read's events as it
  arrives, so no task wakes up per chunk. The request's task waits only for what a callback cannot do —
  the client's transport to drain (backpressure), the end of the stream — and stays the one place where the
  request ends: a disconnect, deadline or cancel lands at that await, which stops following.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson

from . import sse
from .assemble import ClientView, has_content
from .edge.server import Reply, Request, Response, StreamResponse
from .errors import GatewayError, UpstreamProtocolError
from .exchange import ClientGone, Exchange, Phase

if TYPE_CHECKING:
    from .attempt import Opened

#: The most a stream gathers into one write (events already here are written together).
MAX_BATCH_BYTES = 64 * 1024

#: What a step of the pump leaves: nothing to do until more arrives, the client's transport is full, the end.
_WAIT, _PAUSED, _END = 0, 1, 2


class SSEWriter:
    """One client's SSE response, fed an event at a time (synchronous: see the module docstring).

    `add()` takes an event; `flush()` writes what was added since the last flush as one send and says whether
    the client's transport is paused now (then `drain()` before sending more); `finish()` ends the stream.
    Tokens count as delivered once the write carrying them went out without pausing the transport, or once the
    transport drained after it. Write failures raise `ClientGone`."""

    __slots__ = (
        "_batch",
        "_batch_bytes",
        "_batch_tokens",
        "_ex",
        "_headers",
        "_request",
        "_unconfirmed",
        "delivered",
        "response",
        "view",
    )

    def __init__(self, ex: Exchange, http_request: Request, headers: dict[str, str], response_id: str | None) -> None:
        api = ex.api
        self._ex = ex
        self._request = http_request
        self._headers = headers
        self.view = ClientView(model=api.model, include_usage=api.include_usage, response_id=response_id)
        self.response: StreamResponse | None = None
        #: Completion tokens written to the client.
        self.delivered = 0
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._batch_tokens = 0
        #: Tokens sent in a write that paused the transport: delivered once it drains.
        self._unconfirmed = 0

    @property
    def full(self) -> bool:
        """The batch has reached `MAX_BATCH_BYTES`: flush before adding more."""
        return self._batch_bytes >= MAX_BATCH_BYTES

    @property
    def pending(self) -> bool:
        """Something was added since the last flush."""
        return bool(self._batch)

    def add(self, event: dict[str, Any], raw: bytes | None = None) -> None:
        """Take one event of the generation. `raw`: the source's own bytes for it, when it knows them: an event
        the client's view leaves unchanged is then written as those bytes (pass-through)."""
        view, record = self.view, self._ex.record
        out = view.event(event)
        if view.usage is not None:
            record.prompt_tokens = _int(view.usage.get("prompt_tokens"))
            record.completion_tokens = max(self.delivered, _int(view.usage.get("completion_tokens")))
        if out is None:
            return
        if self.response is None:
            self._start()
        payload = raw if out is event else None
        # Pass-through, unless the payload spans several `data:` lines (then re-encoded on one).
        data = b"data: " + payload + b"\n\n" if payload and payload.find(b"\n") < 0 else sse.encode(out)
        self._batch.append(data)
        self._batch_bytes += len(data)
        self._batch_tokens += has_content(out)

    def _start(self) -> None:
        """The status line goes out with the first event that has choices: until then, a failure can still be
        answered with an error status (or retried elsewhere)."""
        ex = self._ex
        response = StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **self._headers,
            },
        )
        ex.record.http_status = 200
        ex.response = self.response = response
        try:
            response.start(self._request)
        except ConnectionError as exc:
            raise ClientGone() from exc
        ex.phase = Phase.STREAMING

    def flush(self) -> bool:
        """Write the batch (one send); True when the client's transport is paused now."""
        batch = self._batch
        if not batch:
            return False
        response = self.response
        assert response is not None
        data = b"".join(batch) if len(batch) > 1 else batch[0]
        batch.clear()
        self._batch_bytes = 0
        tokens, self._batch_tokens = self._batch_tokens, 0
        try:
            paused = response.send(data)
        except ConnectionError as exc:
            raise ClientGone() from exc
        if paused:
            self._unconfirmed += tokens
        elif tokens:
            self._confirm(tokens)
        return paused

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was sent; the tokens of those writes are delivered."""
        response = self.response
        assert response is not None
        try:
            await response.drained()
        except ConnectionError as exc:
            raise ClientGone() from exc
        tokens, self._unconfirmed = self._unconfirmed, 0
        if tokens:
            self._confirm(tokens)

    def _confirm(self, tokens: int) -> None:
        """`tokens` more are delivered (written to the client's connection)."""
        self.delivered += tokens
        record = self._ex.record
        if record.completion_tokens < self.delivered:
            record.completion_tokens = self.delivered
        self._ex.first_token()

    async def finish(self) -> Reply:
        """The end of the generation: what is batched, the closing usage chunk (if the client asked for
        usage), `[DONE]` (the request is answered once that is written) and the end of the response."""
        response = self.response
        if response is None:
            raise UpstreamProtocolError("The engine sent an empty stream.")
        ex = self._ex
        ex.phase = Phase.FINISHING
        final = self.view.final()
        if final is not None:
            self._batch.append(sse.encode(final))
        self._batch.append(sse.DONE_EVENT)
        if self.flush() or self._unconfirmed:
            await self.drain()
        ex.answered = True
        try:
            response.end()
        except ConnectionError as exc:
            raise ClientGone() from exc
        return response


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
    """Relay a generation as SSE (see `SSEWriter`).

    Events that are already here (`ready()`: the source's next step will not wait — another event,
    or its end) are written together, one write (one send) for all of them: an engine or flight that
    is ahead of this client costs one syscall per batch, not per token. A batch stops at `MAX_BATCH_BYTES`,
    and a write that leaves the transport paused waits for it to drain, so a slow client holds its source
    back (backpressure) and what waits for it is at most the transport's high-water mark plus one batch."""
    writer = SSEWriter(ex, http_request, headers, response_id)
    try:
        async for event in events:
            writer.add(event, raw() if raw is not None else None)
            if writer.pending and (ready is None or writer.full or not ready()) and writer.flush():
                await writer.drain()
    except GatewayError:
        # The source broke: the events before the break (batched, since the next was already here) are the
        # client's, written before the error that ends its stream.
        writer.flush()
        raise
    return await writer.finish()


async def pump(ex: Exchange, http_request: Request, opened: Opened, headers: dict[str, str]) -> Reply:
    """Relay an engine's stream as SSE from the engine connection's callbacks (see the module docstring).

    The same writer and batching as `stream_events`: each step writes every event already received in
    one send, so a read that brought several chunks costs one write. Backpressure: a step that leaves the
    client's transport paused stops reading events (the engine's bytes wait in its connection, which stops
    reading past its high-water mark) until the task has seen the transport drain."""
    writer = SSEWriter(ex, http_request, headers, None)
    state = _WAIT
    while state != _END:
        if state == _PAUSED:
            await writer.drain()
        # Steps at once (for what is here already), then at each read the engine connection makes.
        state = await opened.follow(lambda: _step(writer, opened) or None)
    return await writer.finish()


def _step(writer: SSEWriter, opened: Opened) -> int:
    """Write every event of `opened` that can be had without waiting: `_WAIT` for more, `_PAUSED` when the
    client's transport is full, `_END` once the stream has ended (what is batched then goes with `[DONE]`)."""
    paused = False
    for event, raw in opened.take():  # decoded already: all of them are written, whatever the client's pace
        writer.add(event, raw)
        if writer.full:
            paused = writer.flush() or paused
    if opened.ended:
        return _END
    paused = writer.flush() or paused
    if opened.broken:
        opened.take()  # raises what broke the stream, now that the events before it are written
    return _PAUSED if paused else _WAIT


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


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
