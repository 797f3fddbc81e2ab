"""One HTTP call to an engine, with an explicit, immediate abort.

Resource handling: the call owns one upstream connection from `open()` until `abort()` (or until the
body has been read to its end, when the connection goes back to the keep-alive pool). `abort()` is
synchronous and idempotent: it closes the connection at once — the engine sees the disconnect
immediately — and never leaves the response to the garbage collector.

The call goes through the instance's lean keep-alive pool (`lockgate.http`, llhttp parsing): this is the
hot path, and aiohttp's client cost ~90 us of CPU per request where this one costs ~40 (see
docs/decisions.md). aiohttp stays for the rare side calls (health probes, abort calls); metrics scrapes have a
lean pool of their own (`fleet/scrape.py`).

Error handling: the client's errors are translated here into `UpstreamConnectError` (before any
response: the request may be retried elsewhere), `UpstreamStatusError` (the engine said no) and
`UpstreamProtocolError` (the stream broke after it started or carried the engine's error event, or the
engine sent more than the gateway holds: a body over `upstream.max_response_bytes`, an SSE event over
`upstream.max_event_bytes`), and its `UpstreamStalled` (a streamed call waited `upstream.stall_timeout_ms` for the
engine's next byte, its head or an event, or a whole answer `upstream.answer_timeout_ms` for its head: a hung
engine; the pool closed the connection, see `lockgate.http`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson

from .assemble import ChoiceUsages, has_content
from .chunkshape import ChunkShape
from .errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStalled,
    UpstreamStatusError,
    UpstreamTooLarge,
    shown,
    stream_error,
)
from .fleet.fleet import Fleet
from .fleet.instance import Instance, Lease, upstream_headers
from .http import ConnectError, DisconnectedError, ProtocolError, Response, ResponseTooLarge, StalledError
from .metrics import GatewayMetrics
from .responses import is_terminal
from .sse import DONE, EventTooLarge, SSEDecoder
from .wire import Endpoint

T = TypeVar("T")

RESPONSES_PATH = Endpoint.RESPONSES.path

#: The response header naming the engine that served a request (a sidecar's answer names one of its own).
SERVED_BY_HEADER = "x-lockgate-instance"
#: A longer engine name from a sidecar is ignored (the instance's own name stands).
MAX_ENGINE_NAME = 256


class UpstreamCall:
    __slots__ = (
        "_body",
        "_choices_per_prompt",
        "_extra_headers",
        "_finished",
        "_fleet",
        "_metrics",
        "_path",
        "_request_id",
        "_response",
        "aborted",
        "instance",
        "received",
        "served_by",
        "stream",
    )

    def __init__(
        self,
        fleet: Fleet,
        metrics: GatewayMetrics,
        instance: Instance,
        path: str,
        body: bytes,
        request_id: str,
        *,
        stream: bool,
        headers: tuple[tuple[str, str], ...] = (),
        choices_per_prompt: int = 1,
    ) -> None:
        self._fleet = fleet
        #: The request's `n`: how a usage reported per choice is counted (`assemble.ChoiceUsages`).
        self._choices_per_prompt = choices_per_prompt
        #: Request headers beyond the instance's own (trace context).
        self._extra_headers = headers
        self._metrics = metrics
        self.instance = instance
        self._path = path
        self._body = body
        self._request_id = request_id
        #: Whether the engine is asked for a stream (SSE) rather than one JSON body.
        self.stream = stream
        self._response: Response | None = None
        self._finished = False
        self.aborted = False
        #: Bytes of event payloads yielded by `events()` so far, or of the body `read_json_bytes()` read (bounds what a
        #: caller assembles; a flight sizes its buffer and its result by it).
        self.received = 0
        #: The name of the engine that serves the call: the instance's, or, behind a sidecar that chose another
        #: of its engines (`cluster.engine_choice: sidecar`), that one's as `node/engine` (set by `open()`).
        self.served_by = instance.name
        # Counted from creation, not from `open()`: an attempt may be aborted before it is opened (its
        # owner is cancelled in between), and `abort()` must then leave the gauge balanced.
        instance.open_calls += 1

    async def open(self) -> None:
        """Send the request and wait for the response status; raises on error statuses."""
        instance = self.instance
        try:
            response = await instance.http.request(
                "POST",
                self._path,
                self._body,
                upstream_headers(instance, self._request_id, stream=self.stream, extra=self._extra_headers),
                watch=self._fleet.watch_s(instance, self.stream),
            )
        except StalledError as exc:
            self._finish()
            self._fleet.report_failure(instance, "stall", str(exc))
            raise stalled(instance.name, exc, stream=self.stream) from None
        except (ConnectError, DisconnectedError, ProtocolError) as exc:
            self._finish()
            raise call_failed(self._fleet, instance, exc) from None
        except BaseException:
            # Cancelled while connecting or waiting for headers: the pool closes the connection, but the
            # engine may already be working on the request (prefill), so abort it explicitly too (SGLang's
            # `/abort_request`): an engine that notices closed connections late must not keep going.
            self.abort()
            raise
        self._response = response
        if response.status >= 400:
            try:
                body = instance.credentials.scrub(await response.read(self._fleet.upstream.max_response_bytes))
            except ProtocolError:
                body = b""
            finally:
                self.abort()
            status, content_type = response.status, response.content_type
            blamed = instance.dialect.request_error(status, body)
            if blamed is not None:
                status, body, content_type = 400, blamed, "application/json"
            self._fleet.report_failure(instance, f"http_{status}", body[:200].decode("utf-8", "replace"))
            raise UpstreamStatusError(status, body, content_type, response.headers.get("retry-after"))
        if response.status >= 300:
            # A redirect (an `http://` URL an engine's proxy sends to `https://`): not followed, and not an answer
            # (its body was read as one: "not JSON", "ended without [DONE]", which named nothing to fix).
            self.abort()
            where = shown(response.headers.get("location") or "nowhere")
            message = f"answered {response.status}, a redirect to {where}, which the gateway does not follow"
            self._fleet.report_failure(instance, f"http_{response.status}", message)
            raise UpstreamProtocolError(f"Instance {instance.name} {message}: set its url to where it points.")
        if instance.published is not None:
            self.served_by = served_by(instance.name, instance.published.node, response.headers)

    async def read_json_bytes(self) -> tuple[dict[str, Any], bytes]:
        """The whole non-streaming body, parsed, and the engine's bytes of it (a flight keeps those as its result:
        no encoding again)."""
        response = self._require()
        limit = self._fleet.upstream.max_response_bytes
        try:
            raw = await response.read(limit)
        except ResponseTooLarge:
            self.abort()
            raise too_large(self.served_by, limit) from None
        except StalledError as exc:
            self.broken(str(exc), "stall")
            raise stalled(self.served_by, exc, stream=False) from None
        except ProtocolError as exc:
            self.abort()
            raise UpstreamProtocolError(f"Instance {self.served_by} broke the response: {exc}") from None
        self.release()
        self.received = len(raw)
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamProtocolError(f"Instance {self.served_by} sent a body that is not JSON.") from None
        if not isinstance(payload, dict):
            raise UpstreamProtocolError(f"Instance {self.served_by} sent a JSON body that is not an object.")
        return payload, raw

    def events(self, lease: Lease) -> UpstreamEvents:
        """The parsed `data:` payloads of the stream, until `[DONE]` or the end of the body; their tokens
        count on `lease` (the instance's TPOT). A response's events (the Responses API) are bounded as a whole answer
        is (`upstream.max_response_bytes`): its last events each carry the whole output."""
        limits = self._fleet.upstream
        stall_s = limits.stall_timeout_ms / 1000
        if self._path == RESPONSES_PATH:
            return UpstreamEvents(self, self._require(), limits.max_response_bytes, lease, stall_s, responses=True)
        usages = ChoiceUsages(self._choices_per_prompt) if self.instance.dialect.usage_per_choice else None
        return UpstreamEvents(self, self._require(), limits.max_event_bytes, lease, stall_s, usages=usages)

    def _require(self) -> Response:
        if self._response is None:
            raise RuntimeError("UpstreamCall.open() was not called or failed")
        return self._response

    def broken(self, reason: str, kind: str = "stream") -> None:
        """The stream broke: abort the call, and report the engine's failure (`kind`) unless the gateway had
        closed it itself."""
        if self.abort():
            self._fleet.report_failure(self.instance, kind, reason)

    def release(self) -> None:
        """The body is complete: the connection goes back to the pool, and the engine served the call, a success for
        its ejection count (not at its headers: an engine that broke every stream midway had each one's failure
        undone by its own start, and was never ejected)."""
        if self._finished:
            return
        if self._response is not None:
            self._response.release()
        self._finish()
        self._fleet.report_success(self.instance)

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.instance.open_calls -= 1
            self.instance.wake_if_idle()  # its connection is back, or closed

    @property
    def finished(self) -> bool:
        return self._finished

    def abort(self) -> bool:
        """Close the connection now. Returns True if this call was still open."""
        if self._finished:
            return False
        self.aborted = True
        if self._response is not None:
            self._response.close()
        self._finish()
        call = self.instance.dialect.abort_call(self._request_id)
        if call is not None:
            self._fleet.send_abort(self.instance, call)
        return True


class UpstreamEvents:
    """The parsed `data:` payloads of a call's stream, until `[DONE]` or the end of the body: taken a network
    read's worth at a time without waiting (`take()`, what a reader following the connection calls from its
    callback: `follow`), or one at a time as an async iterator (a class rather than an async generator, so
    that mypyc can compile it). `read_first()` reads ahead to the first event with choices while the call is
    being opened (nothing has reached a client: a failure may still be retried elsewhere); those events come
    first. The tokens of every event read count on the call's lease (the instance's TPOT).

    Error handling: a broken stream, an event over `upstream.max_event_bytes` or a body that ends without
    `[DONE]` aborts the call (reported as the engine's failure unless the gateway closed it) and raises
    `UpstreamProtocolError`; so do an event that is not a JSON object and an error the engine reports as an event
    (`errors.stream_error`: vLLM and SGLang send one, then `[DONE]`), which counts against the engine's health
    unless it names a 4xx status. After an error or the end, iteration stops. `close()` (synchronous, idempotent)
    ends the iteration; it does not abort the call, which belongs to its owner."""

    __slots__ = (
        "_call",
        "_decoder",
        "_done",
        "_error",
        "_given",
        "_head",
        "_index",
        "_lease",
        "_payloads",
        "_quiet_since",
        "_response",
        "_responses",
        "_shape",
        "_stall_s",
        "_tail",
        "_taken",
        "_usages",
        "backlog",
        "broken",
        "ended",
    )

    def __init__(
        self,
        call: UpstreamCall,
        response: Response,
        max_event_bytes: int,
        lease: Lease,
        stall_s: float = 0.0,
        *,
        responses: bool = False,
        usages: ChoiceUsages | None = None,
    ) -> None:
        self._call = call
        #: An engine's usage reported per choice, merged into each event that carries one (None: it is the answer's).
        self._usages = usages
        #: `upstream.stall_timeout_ms` (0: off) for a stream that brings bytes but no token (keep-alive comments, an
        #: event a byte at a time, events without output: the connection's own watch sees bytes), and since when its
        #: reads brought none.
        self._stall_s = stall_s
        self._quiet_since: float | None = None
        #: A response's stream (the Responses API): its end is a terminal event, its events bounded as a whole answer.
        self._responses = responses
        self._response = response
        self._lease = lease
        self._decoder = SSEDecoder(max_event_bytes)
        #: The stream's usual token chunk, made from its bytes without parsing once learned.
        self._shape = ChunkShape()
        #: The payloads decoded from the last chunk, and the next one to parse.
        self._payloads: list[bytes] = []
        self._index = 0
        #: The body has ended: `_payloads` is what the decoder held at its end (an incomplete stream).
        self._tail = False
        #: Nothing more is read (the end, an error, or `close()`).
        self._done = False
        #: An error met by `take()` after events it returned first: raised by the next step.
        self._error: UpstreamProtocolError | None = None
        #: The events `read_first()` read ahead, given first.
        self._head: list[tuple[dict[str, Any], bytes, bool]] = []
        #: After `take()` (plain attributes, not properties: a reader following the stream asks after every
        #: read): the stream is over, nothing more to take; it broke after the events `take()` returned, and the
        #: next `take()` raises why; events are here that `take()` did not return (never: it returns them all).
        self.ended = False
        self.broken = False
        self.backlog = False
        #: The iterator's events taken and not given yet (`__anext__`), from `_given` on.
        self._taken: list[tuple[dict[str, Any], bytes, bool]] = []
        self._given = 0

    def __aiter__(self) -> UpstreamEvents:
        return self

    async def read_first(self) -> None:
        """Read the stream, a network read at a time, up to the read that brought its first event with choices (a
        response's: its first output, or its end) (the events after it in that read come along): they are the first
        `take()` returns. Raises what broke the stream before, and `UpstreamProtocolError` for a stream without any
        such event."""
        head: list[tuple[dict[str, Any], bytes, bool]] = []
        try:
            while not self.ended:
                taken = self.take()
                head += taken
                if any(content or event.get("choices") or is_terminal(event) for event, _, content in taken):
                    self._lease.first_token()
                    self._head = head
                    self.ended = False  # not before the events read ahead are taken
                    return
                if not taken:
                    await self._response.wait()
        except BaseException:
            self.close()  # no `await` in a handler (see `relay.py`)
            raise
        raise UpstreamProtocolError(f"Instance {self._call.served_by} sent an empty stream.")

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
        """Every event that can be had without waiting — the events read ahead, then those decoded from what the
        engine has sent so far — with the engine's bytes of each and whether it carries a token (`has_content`:
        computed once, here, for every count made of it), in order (one call for the events a network read
        brought). Once `[DONE]` is among them the call is released and `ended` is true. An error raises; one
        met after events returns those first (`broken` is then true) and raises at the next call, so that a
        caller writes them before it handles the error. Not to be mixed with iterating (whose events taken and
        not given yet it skips)."""
        out = self._head
        if out:
            self._head = []
            if self._done:  # the events read ahead are all there is (for now: an error is raised next)
                self.ended, self.broken = self._error is None, self._error is not None
                return out
        else:
            out = []  # (not the empty `_head` itself)
            error = self._error
            if error is not None:
                self._error = None
                self.broken = False
                self.ended = True
                raise error
            if self._done:
                return out
        call = self._call
        tokens = 0
        try:
            # One pass per piece of body: its events, then the next piece. Everything received so far is decoded
            # by one `next_nowait()`; another is needed only to see the body's end (`complete`).
            more = True
            while True:
                payloads, index, tail = self._payloads, self._index, self._tail
                first, before = index, tokens
                while index < len(payloads):
                    payload = payloads[index]
                    index += 1
                    if payload == DONE:
                        self._index = index
                        self._done = self.ended = True
                        call.release()
                        return out
                    call.received += len(payload)
                    made = self._shape.event(payload)
                    if made is not None:  # the stream's usual chunk, with its token (see `ChunkShape`)
                        tokens += 1
                        out.append((made, payload, True))
                        continue
                    try:
                        event = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        self._index, self._done = index, True
                        raise UpstreamProtocolError(
                            f"Instance {call.served_by} sent an event that is not JSON."
                        ) from None
                    if not isinstance(event, dict):
                        if event is None:
                            continue  # llama.cpp opens a batched prompt's stream with `data: null`: nothing in it
                        self._index, self._done = index, True
                        raise UpstreamProtocolError(
                            f"Instance {call.served_by} sent an event that is not a JSON object."
                        )
                    content = has_content(event)
                    if content:
                        self._shape.learn(event, payload)
                    else:
                        if self._usages is not None:
                            self._usages.merge(event)
                        if "error" in event or event.get("object") == "error" or event.get("type") == "error":
                            failure = stream_error(event)
                            if failure is not None:
                                self._index, self._done = index, True
                                raise self._engine_error(*failure, event)
                        elif is_terminal(event):
                            # A response's last event (`responses.py`): its stream ends there, `[DONE]` or not.
                            out.append((event, payload, content))
                            self._index = index
                            self._done = self.ended = True
                            call.release()
                            return out
                    tokens += content
                    out.append((event, payload, content))
                self._index = index
                if self._stall_s:
                    # The stall clock runs until a token comes: events that carry none (an empty delta, forever) keep
                    # the stream open as keep-alives would.
                    if tokens > before:
                        self._quiet_since = None
                    elif index > first:  # (events read now, not those of an earlier call)
                        self._quiet_read()
                if tail:
                    # The engine ended the body without `[DONE]`: an incomplete stream.
                    self._done = True
                    call.broken("stream ended without [DONE]")
                    end = "its terminal event (response.completed)" if self._responses else "[DONE]"
                    raise UpstreamProtocolError(f"Instance {call.served_by} ended the stream without {end}.")
                if not more:
                    return out
                # What the body has brought since the last read, or at its end what the decoder still holds.
                try:
                    chunk = self._response.next_nowait()
                    if chunk is None:
                        return out
                    if chunk:
                        payloads = self._payloads = self._decoder.feed(chunk)
                        more = self._response.complete
                        if self._stall_s and not payloads:
                            self._quiet_read()
                    else:
                        # (A last event without its blank line counts, `[DONE]` too: an outside run's engine ended
                        # its body right after `data: [DONE]\n`, and every complete stream was an error.)
                        self._payloads = self._decoder.close()
                        self._tail = True
                    self._index = 0
                except StalledError as exc:
                    self._done = True
                    call.broken(str(exc), "stall")
                    raise stalled(call.served_by, exc, stream=True) from None
                except ProtocolError as exc:
                    self._done = True
                    call.broken(repr(exc))
                    # (What broke it, as the gateway's own client says: "connection lost during the response",
                    # "malformed response: ..."; the class name alone told a newcomer nothing.)
                    raise UpstreamProtocolError(
                        f"Instance {call.served_by} broke the stream: {str(exc)[:200] or exc.__class__.__name__}."
                    ) from None
                except EventTooLarge:
                    self._done = True
                    call.broken("event too large")
                    raise UpstreamTooLarge(
                        f"Instance {call.served_by} sent an SSE event larger than "
                        f"{'upstream.max_response_bytes' if self._responses else 'upstream.max_event_bytes'} "
                        f"({self._decoder.max_event_bytes} bytes)."
                    ) from None
        except UpstreamProtocolError as exc:
            if not out:
                self.ended = True
                raise
            self._error = exc
            self.broken = True
            return out
        finally:
            if tokens:
                self._lease.produced_tokens(tokens)

    def _quiet_read(self) -> None:
        """A read that brought no event, or only events without a token (`null`, `{}`, an empty delta): past
        `upstream.stall_timeout_ms` of such reads (counted from the first), the stream is stalled as if the engine had
        sent nothing (an engine's keep-alive comments, a proxy's in front of a hung engine, or a broken engine's empty
        events every few milliseconds kept it open for good)."""
        now = time.monotonic()
        if self._quiet_since is None:
            self._quiet_since = now
        elif now - self._quiet_since >= self._stall_s:
            self._done = True
            call = self._call
            call.broken("no token", "stall")
            raise UpstreamStalled(
                f"Instance {call.served_by} sent no token for {self._stall_s:g}s, only keep-alives, pieces of an event "
                "or events without output (upstream.stall_timeout_ms): the engine looks hung; the call was closed."
            )

    def _engine_error(self, message: str, status: int | None, event: dict[str, Any]) -> UpstreamProtocolError:
        """The error an engine reported as an event of its stream (then usually `[DONE]`, which must not end the
        client's stream as if it had succeeded): the call is aborted, and counted as the engine's failure unless
        the error names a client error status (4xx: the request's fault, not the engine's health). A sidecar's
        error (a gateway's own envelope) keeps its code: `upstream_stalled` from behind a sidecar is one too."""
        call = self._call
        if status is not None and status < 500:
            call.abort()
        else:
            call.broken("error event in the stream")
        message = call.instance.credentials.scrub_text(message)
        code = "upstream_stream_error"
        if call.instance.published is not None:
            error = event.get("error")
            told = error.get("code") if isinstance(error, dict) else None
            if isinstance(told, str) and told.isidentifier() and len(told) <= 64:
                code = told
        error = UpstreamProtocolError(
            f"Instance {call.served_by} reported an error in the stream: {message}", code=code
        )
        # A client error status: the request's fault, as an engine's 4xx answer is (recorded `rejected`, not tried on
        # another instance).
        error.rejected = status is not None and status < 500
        return error

    def follow(self, step: Callable[[], T | None]) -> Awaitable[T]:
        """Call `step` (which takes what is here with `take()`) at once and then from the engine connection's
        callback at each read, until it returns something (`Response.follow`)."""
        return self._response.follow(step)

    async def __anext__(self) -> dict[str, Any]:
        """The next event (taken a read's worth at a time)."""
        while True:
            taken, given = self._taken, self._given
            if given < len(taken):
                self._given = given + 1
                return taken[given][0]
            if self.ended:
                raise StopAsyncIteration
            self._taken, self._given = self.take(), 0
            if not self._taken and not self.ended:
                await self._response.wait()

    def close(self) -> None:
        """End the iteration (synchronous, idempotent)."""
        self._done = self.ended = True
        self.broken = False
        self._taken, self._given, self._error, self._head = [], 0, None, []


def served_by(instance: str, node: str, headers: Mapping[str, str]) -> str:
    """The engine that served a call to a sidecar on `node`: the one its answer names (`node/engine`), else
    the instance the call was for (no name, or one over `MAX_ENGINE_NAME` characters)."""
    engine = headers.get(SERVED_BY_HEADER)
    if engine and len(engine) <= MAX_ENGINE_NAME and engine.isprintable():
        return f"{node}/{engine}"
    return instance


def call_failed(
    fleet: Fleet, instance: Instance, exc: ConnectError | DisconnectedError | ProtocolError
) -> UpstreamError:
    """The gateway's error for an engine call that failed before its answer's status, reported to the fleet (its
    health and ejection). A connection the engine closed before answering (a dying engine; a stale keep-alive
    connection is retried once by the pool) produced nothing: another instance may be tried, as when it refused.
    A failed connection's detail names the engine's address: the fleet's (`/admin/fleet`, the log), not the
    client's (behind a central, a sidecar's answer showed its clients an engine's internal host and port)."""
    if isinstance(exc, ConnectError):
        fleet.report_failure(instance, "connect", str(exc))
        return UpstreamConnectError(f"Cannot connect to instance {instance.name}: {exc.reason}.")
    if isinstance(exc, DisconnectedError):
        fleet.report_failure(instance, "disconnect", repr(exc))
        return UpstreamConnectError(f"Instance {instance.name} closed the connection: {exc}")
    fleet.report_failure(instance, "protocol", repr(exc))
    return UpstreamProtocolError(f"Instance {instance.name} failed: {exc}")


def too_large(instance: str, limit: int) -> UpstreamTooLarge:
    """The error for an engine answer larger than `upstream.max_response_bytes` (502)."""
    return UpstreamTooLarge(
        f"Instance {instance} sent an answer larger than upstream.max_response_bytes ({limit} bytes)."
    )


def stalled(instance: str, exc: StalledError, *, stream: bool) -> UpstreamStalled:
    """The error for an engine call that waited its watch for the engine's next byte (504): a stream's
    `upstream.stall_timeout_ms`, a whole answer's `upstream.answer_timeout_ms`."""
    setting = "upstream.stall_timeout_ms" if stream else "upstream.answer_timeout_ms"
    return UpstreamStalled(
        f"Instance {instance} {exc.what} {exc.timeout_s:g}s ({setting}): the engine looks hung; the call was closed."
    )
