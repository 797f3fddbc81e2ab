"""Writing a generation back to one client: an SSE stream or one JSON body.

Shared by the direct path (`relay.py`, one engine call per request) and de-duplication (flights and
cached results): both hand over the generation's events and the response headers. Runs inside
`Exchange.run()`; a failed write means the client has gone (`ClientGone`).

Theory of operation: `SSEWriter` is the synchronous core — one client's view of the events, the status
line on the first event with choices, batching, delivered-token accounting, the closing usage chunk and
`[DONE]` — and two shells drive it:
- `stream_events` iterates any async source of events (a resumable generation, a cached result), one task
  step per event it waits for;
- `pump` follows a source from its producer's callbacks: the direct path's engine call (`UpstreamEvents.follow`:
  each network read's events are written in the engine connection's data callback, as they arrive) and a
  streaming flight's subscription (`Subscription.follow`: each event the flight keeps is written in the
  callback that brought it to the flight, for every subscriber caught up with it). No task wakes up per
  chunk. The request's task waits only for what a callback cannot do — the client's transport to drain
  (backpressure), the end of the stream — and stays the one place where the request ends: a disconnect,
  deadline or cancel lands at that await, which stops following.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson

from . import sse
from .assemble import ClientView, count_of, estimated_output_tokens, has_content, usage_tokens
from .edge.server import Reply, Request, Response, StreamResponse
from .errors import GatewayError, UpstreamProtocolError
from .exchange import ClientGone, Exchange, Phase
from .responses import ResponseView, failure_of, show_ids
from .wire import Endpoint

if TYPE_CHECKING:
    from .dedup.flight import Subscription
    from .upstream import UpstreamEvents

#: The most a stream gathers into one write (events already here are written together).
MAX_BATCH_BYTES = 64 * 1024

#: What a step of the pump leaves (None: nothing to do until more arrives): the client's transport is full, the end.
_PAUSED, _END = 1, 2


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
        "_first_sent",
        "_headers",
        "_instance",
        "_record",
        "_request",
        "_unconfirmed",
        "delivered",
        "response",
        "view",
    )

    def __init__(
        self,
        ex: Exchange,
        http_request: Request,
        headers: dict[str, str],
        response_id: str | None,
        instance: Callable[[], str | None] | None = None,
    ) -> None:
        api = ex.api
        self._ex = ex
        #: The exchange's record and whether its first token went out, kept here: `_confirm` runs per write, and
        #: the compiled build reads an interpreted class's attributes through generic lookups (~250 instructions a
        #: write, of ~1.2k).
        self._record = ex.record
        self._first_sent = False
        self._request = http_request
        self._headers = headers
        #: The engine serving the generation, asked when the head goes out (a flight's leader starts following
        #: before its engine call has opened): named in `x-lockgate-instance`.
        self._instance = instance
        self.view = (
            ClientView(
                model=api.model,
                include_usage=api.include_usage,
                response_id=response_id,
                prompt_tokens=api.estimated_prompt_tokens() if api.include_usage else 0,
            )
            if api.endpoint.chunked
            else ResponseView(
                model=api.model,
                made=ex.naming.made if ex.naming is not None else None,
                shown=ex.naming.show if ex.naming is not None and ex.naming.shows else None,
            )
        )
        self.response: StreamResponse | None = None
        #: Completion tokens written to the client.
        self.delivered = 0
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._batch_tokens = 0
        #: Tokens sent in a write that paused the transport: delivered once it drains.
        self._unconfirmed = 0

    @property
    def pending(self) -> bool:
        """Something was added since the last flush."""
        return bool(self._batch)

    def add(self, event: dict[str, Any], raw: bytes | None = None, content: bool | None = None) -> bool:
        """Take one event of the generation; True when the batch is now `full` (flush before adding more).
        `raw`: the source's own bytes for it, when it knows them: an event the client's view leaves unchanged is
        then written as those bytes (pass-through). `content`: whether it carries a token, when the source knows
        (a client's view never changes the choices; None: see here)."""
        view = self.view
        payload: bytes | None = None
        # The engine's bytes when they are one line (a payload of several `data:` lines is re-encoded on one).
        line = raw if raw is not None and sse.LF not in raw else None
        if line is not None:
            if view.plain and "usage" not in event and event.get("model") == view.model and event.get("choices"):
                # An engine's usual chunk for a client that takes it as it is (`ClientView.plain`: the view would
                # return it unchanged and stay as it was): its bytes, without asking the view (this runs per token).
                payload = line
            else:
                payload = view.spliced(event, line)  # only the trailing usage key differs: the bytes, spliced
        if payload is None:
            out = view.event(event)
            if view.usage is not None:
                record = self._record
                record.prompt_tokens = count_of(view.usage.get("prompt_tokens"))
                record.completion_tokens = max(self.delivered, count_of(view.usage.get("completion_tokens")))
            if out is None:
                return self._batch_bytes >= MAX_BATCH_BYTES
            payload = line if out is event and line is not None else orjson.dumps(out)
        if self.response is None:
            self._start()
        if view.named:  # a response's event, with its type's line (`responses.py`)
            data = b"event: " + str(event.get("type")).encode() + b"\ndata: " + payload + b"\n\n"
            sequence = event.get("sequence_number")
            naming = self._ex.naming
            if type(sequence) is int and naming is not None:
                naming.sequence_sent = sequence
        else:
            data = b"data: " + payload + b"\n\n"
        self._batch.append(data)
        self._batch_bytes += len(data)
        self._batch_tokens += has_content(event) if content is None else content
        return self._batch_bytes >= MAX_BATCH_BYTES

    def _start(self) -> None:
        """The status line goes out with the first event that has choices: until then, a failure can still be
        answered with an error status (or retried elsewhere)."""
        ex = self._ex
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        headers.update(self._headers)
        if self._instance is not None:
            instance = self._instance()
            if instance is not None:
                headers["x-lockgate-instance"] = instance
        response = StreamResponse(status=200, headers=headers)
        ex.record.http_status = 200
        ex.response = self.response = response
        try:
            response.start(self._request, hold_head=True)  # the head goes with the first batch, one send
        except ConnectionError as exc:
            raise ClientGone() from exc
        ex.phase = Phase.STREAMING

    def flush(self, *, last: bool = False) -> bool:
        """Write the batch (one send; `last`: the response ends with it); True when the client's transport is
        paused now."""
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
            paused = response.send(data, last=last)
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
        delivered = self.delivered = self.delivered + tokens
        record = self._record
        if record.completion_tokens < delivered:
            record.completion_tokens = delivered
        if not self._first_sent:
            self._first_sent = True
            self._ex.first_token()  # (idempotent: the record's time of it is set once)

    async def finish(self) -> Reply:
        """The end of the generation: what is batched, the closing usage chunk (if the client asked for
        usage), `[DONE]` (the request is answered once that is written) and the end of the response."""
        response = self.response
        if response is None:
            raise UpstreamProtocolError("The engine sent an empty stream.")
        ex = self._ex
        ex.phase = Phase.FINISHING
        final = self.view.final(self.delivered + self._unconfirmed + self._batch_tokens)
        if final is not None:
            self._batch.append(sse.encode(final))
        view = self.view
        if not view.named:  # (a response's stream ends with its terminal event)
            self._batch.append(sse.DONE_EVENT)
        elif isinstance(view, ResponseView):
            if view.failure is not None:
                ex.engine_failed(view.failure)
            usage = view.usage
            if ex.record.first_token_at is None and usage is not None and count_of(usage.get("completion_tokens")) > 0:
                ex.first_token()  # output in no `*.delta` event (an item sent whole): its first token came with it
        if self.flush(last=True) or self._unconfirmed:  # the end of the response in the same send
            await self.drain()
        ex.answered = True
        return response


async def stream_events(
    ex: Exchange,
    http_request: Request,
    events: AsyncIterator[dict[str, Any]],
    headers: dict[str, str],
    *,
    response_id: str | None = None,
    ready: Callable[[], bool] | None = None,
) -> Reply:
    """Relay a generation as SSE (see `SSEWriter`).

    Events that are already here (`ready()`: the source's next step will not wait — another event,
    or its end) are written together, one write (one send) for all of them: a source that is ahead of
    this client costs one syscall per batch, not per token. A batch stops at `MAX_BATCH_BYTES`,
    and a write that leaves the transport paused waits for it to drain, so a slow client holds its source
    back (backpressure) and what waits for it is at most the transport's high-water mark plus one batch."""
    writer = SSEWriter(ex, http_request, headers, response_id)
    try:
        async for event in events:
            full = writer.add(event)
            if writer.pending and (ready is None or full or not ready()) and writer.flush():
                await writer.drain()
    except GatewayError:
        # The source broke: the events before the break (batched, since the next was already here) are the
        # client's, written before the error that ends its stream.
        writer.flush()
        raise
    return await writer.finish()


async def pump(
    ex: Exchange,
    http_request: Request,
    source: UpstreamEvents | Subscription,
    headers: dict[str, str],
    *,
    response_id: str | None = None,
    instance: Callable[[], str | None] | None = None,
) -> Reply:
    """Relay a generation as SSE from its producer's callbacks (see the module docstring).

    The same writer and batching as `stream_events`: each step writes every event already here in one
    send, so a read that brought several chunks costs one write. Backpressure: a step that leaves the
    client's transport paused stops taking events (an engine's bytes wait in its connection, which stops
    reading past its high-water mark; a flight's wait in its buffer, within its lag bound) until the task has
    seen the transport drain. `response_id`: the client's own (None keeps the source's); `instance`: see `SSEWriter`.

    `source`: the direct path's engine call (`UpstreamEvents`) or a streaming flight's subscription (`Subscription`):
    `take()` gives each event with the source's bytes of it when it passes them through (else None) and whether it
    carries a token, and `ended`, `broken` and `backlog` say what follows. The two classes by name, not a protocol:
    the compiled build reaches a protocol's methods and attributes through the interpreter's generic lookups, four
    of them a chunk (~1k instructions)."""
    writer = SSEWriter(ex, http_request, headers, response_id, instance)
    step = functools.partial(_step, writer, source)  # called per arrival: no Python frame of its own
    # Steps at once (for what is here already), then at each arrival, until the end or a full transport.
    while await source.follow(step) == _PAUSED:
        await writer.drain()
    return await writer.finish()


def _step(writer: SSEWriter, source: UpstreamEvents | Subscription) -> int | None:
    """Write every event of `source` that can be had without waiting: None to wait for more, `_PAUSED` when the
    client's transport is full, `_END` once the generation has ended (what is batched then goes with `[DONE]`).
    A source that takes in bounded batches (`backlog`: a late joiner's replay) is written batch after batch
    until the transport pauses."""
    paused = False
    while True:
        for event, raw, content in source.take():  # all of a batch are written, whatever the client's pace
            if writer.add(event, raw, content):
                paused = writer.flush() or paused
        if source.ended:
            return _END
        paused = writer.flush() or paused
        if source.broken:
            source.take()  # raises what broke the stream, now that the events before it are written
        if paused:
            return _PAUSED
        if not source.backlog:
            return None


def whole_body(ex: Exchange, body: dict[str, Any], headers: dict[str, str], raw: bytes | None = None) -> Response:
    """Answer a non-streaming client with a complete body (from the engine or assembled). `raw`: the engine's bytes of
    `body`, sent as they are when the body already names the model the client asked for (nothing to rewrite)."""
    ex.phase = Phase.FINISHING
    ex.first_token()
    model = ex.api.model
    naming = ex.naming
    if naming is not None:  # a response: where its follow-ups go, its id as the client sees it, its failure
        engine_id = body.get("id")
        if isinstance(engine_id, str):
            naming.made(engine_id)
        if naming.shows:
            show_ids(body, naming.show)
            raw = None
        failure = failure_of(body)
        if failure is not None:
            ex.engine_failed(failure)
    usage = body.get("usage")
    record = ex.record
    if isinstance(usage, dict):
        counts = usage_tokens(usage)
        record.prompt_tokens = count_of(counts.get("prompt_tokens"))
        record.completion_tokens = count_of(counts.get("completion_tokens"))
    if not record.completion_tokens:
        # No count (or none that is one) from an engine that generated output: estimated, as a stream's are (the
        # record said 0 and 0, and the tenant was charged nothing for the output). The prompt's follows when the
        # record ends (`Exchange._finish_record`); an embedding's is estimated here.
        record.completion_tokens = estimated_output_tokens(body)
    if not record.prompt_tokens and ex.api.endpoint is Endpoint.EMBEDDINGS:
        record.prompt_tokens = ex.api.estimated_prompt_tokens()
    if isinstance(usage, dict) and not _counts_only(usage):
        # Counts that are none (strings, negatives, 1e20) reach no client: the record's (an outside run's SDK got
        # `prompt_tokens='12'` and `total_tokens='x'`).
        prompt = record.prompt_tokens or ex.api.estimated_prompt_tokens()
        body["usage"] = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": record.completion_tokens,
            "total_tokens": prompt + record.completion_tokens,
        }
        raw = None
    if raw is None or body.get("model") != model:
        body["model"] = model
        raw = orjson.dumps(body)
    record.http_status = 200
    return ex.whole_response(raw, headers)


def _counts_only(usage: dict[str, Any]) -> bool:
    """Whether a chat, completion or embedding usage's counts that are there are counts (a response's usage, in
    other names, is taken as it is)."""
    return all(
        key not in usage or count_of(usage[key]) == usage[key]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    )
