"""One client connection: the parser callbacks, the handler task, deadlines, and errors the server answers itself.

Internal to `lockgate.edge`; the theory of operation (states, who cancels and closes what) is in `server.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httptools
import orjson

from .request import Headers, Request, split_target
from .response import Response, StreamResponse, render_head

if TYPE_CHECKING:
    from .server import HttpServer

log = logging.getLogger("lockgate.edge.server")

#: How long a connection that got an error from the server itself keeps reading (and discarding) before it closes.
LINGER_S = 2.0

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"Connection: close\r\n"
_KEEP_ALIVE = b"Connection: keep-alive\r\n"
#: `SO_LINGER` on, 0 s: closing the socket resets the connection and drops what its send buffer holds.
_RESET = struct.pack("ii", 1, 0)
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}


#: The parser of every connection once lost (nothing feeds it).
_LOST = httptools.HttpRequestParser(object())


@dataclass(frozen=True, slots=True)
class Limits:
    """What each connection enforces (`limits:` in the configuration; see `HttpServer`)."""

    max_body_bytes: int
    max_header_bytes: int = 16384
    keepalive_timeout_s: float = 75.0
    header_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    max_connections: int = 8192
    #: Bytes of request bodies all connections may hold at once (being received, or not yet answered).
    max_held_body_bytes: int = 512 * 1024 * 1024
    #: The kernel's send buffer of each client connection (`SO_SNDBUF`; 0: the kernel's own, which grows to
    #: megabytes: a client that stopped reading was noticed only once that much was queued toward it).
    send_buffer_bytes: int = 0


def default_error_body(status: int, message: str, code: str | None = None) -> bytes:
    """An OpenAI-style error envelope."""
    kind = "invalid_request_error" if status < 500 or status == 505 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


class _Reject(Exception):
    """Raised in a parser callback to stop parsing and answer with this status (and `code`, where the status alone
    does not say which limit refused: the connections' or the held bodies' 503)."""

    def __init__(self, status: int, message: str, code: str | None = None, response: Response | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        #: The whole answer, when the server's `precheck` gave it (else an error body is rendered).
        self.response = response
        #: The answer to a HEAD request: its head only (RFC 9110 9.3.2).
        self.head_only = False


#: A request's head beyond its target and header lines: `GET `, ` HTTP/1.1` and its line end, the blank line.
_REQUEST_LINE_REST = len(b"GET  HTTP/1.1\r\n\r\n")

#: Bytes a parsed JSON value takes beyond its text, about (a Python list, dict, string or number object and the
#: reference to it: 50-230 bytes; an empty list `[]` is 2 bytes of text and 64 parsed).
_PARSED_VALUE_BYTES = 64


def parsed_weight(body: bytes) -> int:
    """What a request body will take once the handler parses it, beyond its bytes: `_PARSED_VALUE_BYTES` for each
    value a JSON text can open or separate (`{`, `[`, `,`; also counted inside strings: an upper bound for text). A
    body of millions of tiny values (`[[],[],...]`) took ~20x its bytes, all of it outside the held bodies' bound."""
    return _PARSED_VALUE_BYTES * (body.count(b"{") + body.count(b"[") + body.count(b","))


class Connection(asyncio.Protocol):
    """One client connection; its states are described in `lockgate.edge.server`."""

    __slots__ = (
        "_began_in_read",
        "_body",
        "_body_deadline",
        "_body_size",
        "_chunk_body",
        "_chunk_open",
        "_deadline",
        "_discarding",
        "_drain_waiter",
        "_expect_pending",
        "_header_bytes_raw",
        "_held",
        "_in_headers",
        "_in_message",
        "_lingering",
        "_loop",
        "_parser",
        "_pipeline",
        "_raw_headers",
        "_read_size",
        "_reading_paused",
        "_reject",
        "_request",
        "_server",
        "_started",
        "_stream",
        "_task",
        "_task_running",
        "_timer",
        "_trailer_bytes",
        "_unsent",
        "_url",
        "close_after",
        "lost",
        "remote",
        "transport",
        "write_paused",
    )

    transport: asyncio.Transport

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        self.lost = False
        self.write_paused = False
        self.close_after = False  # the response in progress said (or must end with) Connection: close
        self._drain_waiter: asyncio.Future[None] | None = None
        # The message being read.
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        #: Bytes of this connection's request bodies counted in the server's held bodies (`max_held_body_bytes`).
        self._held = 0
        self._header_bytes_raw = 0  # bytes received while in the header phase, in earlier reads
        #: A chunk's header was read and its chunk has not ended (`on_chunk_header`), and whether body bytes of it came:
        #: a chunk open without any is the last one (size 0), whose trailers follow. Reads that bring nothing but those
        #: are counted (`_trailer_bytes`) against `max_header_bytes`; the trailers themselves are not kept.
        self._chunk_open = False
        self._chunk_body = False
        self._trailer_bytes = 0
        #: Messages begun during the read being parsed (`data_received`).
        self._began_in_read = 0
        self._read_size = 0  # of the read being parsed
        self._in_headers = False
        self._in_message = False
        self._expect_pending = False
        self._request: Request | None = None
        self._reject: _Reject | None = None
        # The request in progress and those queued behind it.
        self._task: asyncio.Task[None] | None = None
        self._task_running = False  # its coroutine has started (so its `finally` will run)
        self._pipeline: deque[Request | _Reject] = deque()
        self._stream: StreamResponse | None = None
        self._started = False  # bytes of the current response have been written
        self._reading_paused = False
        self._discarding = False
        self._lingering = False
        self._deadline = 0.0
        #: When the body of the request being read must be complete (`body_timeout_s` after its headers).
        self._body_deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        #: `on_sent` callbacks of whole responses written while the transport was paused (not yet taken).
        self._unsent: list[Callable[[bool], None]] = []

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they implement its interface.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.remote = str(peer[0])
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._server.limits.send_buffer_bytes:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._server.limits.send_buffer_bytes)
        server = self._server
        server.live.add(self)
        if server.closing:  # accepted in the same loop iteration as the shutdown began
            self.transport.close()
            return
        if len(server.live) > server.limits.max_connections:
            server.refused_connections += 1
            self._fail(_Reject(503, "Too many connections to the gateway; try again later.", "too_many_connections"))
            return
        self._arm(self._loop.time() + server.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        # The parser holds this protocol's bound methods (a reference cycle) and what it was gathering: let both go
        # now, not at the collector's next full pass.
        self._parser = _LOST
        self._raw_headers = []
        self.lost = True
        self._server.connection_gone(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None:
            task.cancel()
            if not self._task_running:
                # Cancelled before its first step, the coroutine never runs, nor its `finally`: account for it here.
                self._task = None
                self._server.request_ended()
        self._pipeline.clear()
        if self._held:
            self._server.release_body(self._held)
            self._held = 0
        if self._unsent:
            self._tell_sent(False)
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("The client has gone."))

    def eof_received(self) -> bool:
        # The client half-closed: it is treated as gone. Returning False closes the transport, which calls
        # connection_lost (and so cancels the handler).
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._task is not None and not self._lingering:
            # A client that leaves writing paused for this long is gone (`_on_timer`).
            self._arm(self._loop.time() + self._server.limits.write_timeout_s)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._unsent:
            self._tell_sent(True)
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._read_size = len(data)
        continuing = self._in_message
        self._began_in_read = 0
        trailing = self._chunk_open and not self._chunk_body
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(_Reject(400, "Protocol upgrades are not supported."))
            return
        except httptools.HttpParserError as exc:
            self._fail(self._reject or _Reject(400, f"Malformed HTTP request: {exc}."))
            return
        except Exception:  # a bug in a callback: never let it take the server down
            log.exception("HTTP request parsing failed")
            self._fail(_Reject(400, "Malformed HTTP request."))
            return
        if self._in_headers:
            # The headers are still incomplete: what llhttp holds of them is bounded by counting every byte read
            # since the message began. When this read also held the end of the previous (pipelined) message, its
            # bytes are not this one's: count what this message's callbacks saw (a header still partial at the end of
            # this read is then counted from the next read on: within one read's size).
            began = self._began_in_read
            if began > 1 or (began and continuing):
                self._header_bytes_raw = self._header_size()
            else:
                self._header_bytes_raw += len(data)
            if self._header_bytes_raw > self._server.limits.max_header_bytes:
                self._fail(_Reject(431, "Request headers are too large."))
        elif trailing and self._chunk_open and not self._chunk_body:
            # A read of the last chunk's trailers alone (the read that began them is not counted: it may hold body
            # bytes; one read at most). Unbounded, a client held 16 MB of trailer lines (~230 MB of the gateway's
            # memory), or one endless trailer value, for the whole body timeout.
            self._trailer_bytes += len(data)
            if self._trailer_bytes > self._server.limits.max_header_bytes:
                self._fail(_Reject(431, "Request trailers are too large."))

    # -- parser callbacks ------------------------------------------------------------------------------------------

    def _header_size(self) -> int:
        """The request line and the complete header lines received so far, in bytes (the method counted as the
        shortest, `GET`: it is not known before the headers end)."""
        return (
            _REQUEST_LINE_REST + len(self._url) + sum(len(name) + len(value) + 4 for name, value in self._raw_headers)
        )

    def on_message_begin(self) -> None:
        self._began_in_read += 1
        self._in_message = True
        self._in_headers = True
        self._chunk_open = self._chunk_body = False
        self._trailer_bytes = 0
        self._url = b""
        self._raw_headers = []
        self._header_bytes_raw = 0
        if self._task is None:
            self._arm(self._loop.time() + self._server.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_headers:  # (a trailer is not kept: nothing reads it)
            self._raw_headers.append((name, value))

    def on_chunk_header(self) -> None:
        self._chunk_open = True
        self._chunk_body = False

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    def on_headers_complete(self) -> None:
        self._in_headers = False
        server = self._server
        url = self._url
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            # llhttp also reads HTTP/0.9 and HTTP/2.0 request lines; neither may be answered as HTTP/1.1.
            raise self._rejecting(505, f"HTTP/{version} is not supported; use HTTP/1.1.")
        items: dict[str, str] = {}
        for name, value in self._raw_headers:
            key = name.lower().decode()  # llhttp admits only token characters in names
            if key in items:
                if key == "host":  # RFC 9112 section 3.2: which one would name the target?
                    raise self._rejecting(400, "A request must not carry more than one Host header.")
                items[key] += ", " + value.decode("latin-1")
            else:
                items[key] = value.decode("latin-1")
        if "host" not in items and version == "1.1":
            raise self._rejecting(400, "An HTTP/1.1 request must carry a Host header.")
        # The headers may be over the limit only when the reads since the message began are (then they are counted).
        limit = server.limits.max_header_bytes
        if self._header_bytes_raw + self._read_size > limit and self._header_size() > limit:
            raise self._rejecting(431, "Request headers are too large.")
        if parser.should_upgrade():
            raise self._rejecting(400, "Protocol upgrades are not supported.")
        coding = items.get("transfer-encoding")
        if coding is not None and coding.replace(" ", "").replace("\t", "").lower() != "chunked":
            # llhttp frames `gzip, chunked` by its final coding and would pass the body on still compressed.
            raise self._rejecting(501, f"Transfer-Encoding {coding!r} is not supported; only chunked.")
        # RFC 9112 section 6.1: framing an HTTP/1.0 message by Transfer-Encoding is faulty (a proxy in front that reads
        # it as HTTP/1.0 sees no body, and the chunks as the next request): answered, then the connection closed.
        keep_alive = parser.should_keep_alive() and not (coding is not None and version == "1.0")
        coding = items.get("content-encoding")
        if coding is not None and coding.strip().lower() not in ("", "identity"):
            raise self._rejecting(415, f"Content-Encoding {coding!r} is not supported; send the body uncompressed.")
        content_length: int | None = None
        length = items.get("content-length")
        if length is not None:
            try:
                content_length = int(length)
            except ValueError:
                raise self._rejecting(400, "Invalid Content-Length.") from None
            if content_length > server.limits.max_body_bytes:
                raise self._rejecting(413, f"The request body is larger than {server.limits.max_body_bytes} bytes.")
            if not server.body_fits(content_length):
                raise self._refusing_body()
        try:
            raw_path, path, query = split_target(url)
        except httptools.HttpParserError:
            raise self._rejecting(400, "Invalid request target.") from None
        method_bytes = parser.get_method()
        method = _METHODS.get(method_bytes) or method_bytes.decode("ascii", "replace")
        self._request = Request(
            self, method, raw_path, path, query, Headers(items), version, keep_alive, content_length
        )
        self._body = []
        self._body_size = 0
        self._body_deadline = self._loop.time() + server.limits.body_timeout_s
        if self._task is None and self._body_deadline < self._deadline:
            self._arm(self._body_deadline)
        precheck = server.precheck
        if precheck is not None and (content_length or "transfer-encoding" in items):
            refusal = self._precheck(precheck)
            if refusal is not None:
                self._request = None
                raise self._rejecting(refusal.status, "", None, refusal)
        expect = items.get("expect")
        if expect is not None and expect.lower() == "100-continue" and version != "1.0":
            if self._task is None:
                self.transport.write(_CONTINUE)
            else:
                self._expect_pending = True  # answered when the request in progress is done

    def on_body(self, chunk: bytes) -> None:
        self._chunk_body = True
        size = len(chunk)
        self._body_size += size
        server = self._server
        if self._body_size > server.limits.max_body_bytes:
            raise self._rejecting(413, f"The request body is larger than {server.limits.max_body_bytes} bytes.")
        if not server.body_fits(size):
            raise self._refusing_body()
        server.hold_body(size)
        self._held += size
        self._body.append(chunk)
        if self._task is None:
            # Usually later than the deadline armed: stored only (the timer re-arms itself); earlier once the body
            # deadline is near (`_arm` moves the timer).
            deadline = min(self._loop.time() + self._server.limits.header_timeout_s, self._body_deadline)
            if deadline < self._deadline:
                self._arm(deadline)
            else:
                self._deadline = deadline

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None
        self._request = None
        self._in_message = False
        self._expect_pending = False
        body = self._body
        if body:
            raw = request.body = body[0] if len(body) == 1 else b"".join(body)
            self._body = []
            weight = parsed_weight(raw)
            server = self._server
            if not server.body_fits(weight):
                raise self._refusing_body()
            server.hold_body(weight)
            self._held += weight
            request.held = len(raw) + weight
        if self._task is None:
            self._start(request)
        else:
            self._pipeline.append(request)
            if not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    def _refusing_body(self) -> _Reject:
        """503 for a body that would take the server's held bodies past `max_held_body_bytes`."""
        self._server.body_refused()
        return self._rejecting(
            503,
            "The gateway holds as many request bodies as it may; try again shortly (limits.max_held_body_bytes).",
            "too_many_request_bodies",
        )

    def _rejecting(
        self, status: int, message: str, code: str | None = None, response: Response | None = None
    ) -> _Reject:
        """A refusal of the request whose head or body is being parsed (raised in a parser callback)."""
        self._reject = _Reject(status, message, code, response)
        self._reject.head_only = self._parser.get_method() == b"HEAD"
        return self._reject

    # -- requests --------------------------------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._server.request_started()
        self._task_running = False
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        self._task_running = True
        response: Response | StreamResponse | None = None
        try:
            try:
                response = await self._server.handler(request)
                if not self.lost:
                    if response.__class__ is Response and not self._started:
                        self._write_whole(response, request)
                    else:
                        await self._finish_other(response, request)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.lost:
                    return  # a disconnect (or shutdown's hard stop) cancelled us: nobody to answer
                if task is not None and task.cancelling():
                    # Cancelled by someone else while the client waits: it gets no answer, so it must not
                    # wait for one on this connection (the way a disconnect would have ended it).
                    self.abort()
                    return
                self._handler_failed(request)  # a CancelledError that escaped from something the handler awaited
            except Exception:
                self._handler_failed(request)
            if self.write_paused and self._pipeline and not self.lost:
                # Do not start the next pipelined request while the client is not reading this answer.
                with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                    await self.drain()
        finally:
            if isinstance(response, Response) and response.on_sent is not None:
                # Never written (the client left first, or writing it failed): the client has none of it.
                on_sent, response.on_sent = response.on_sent, None
                self._call_on_sent(on_sent, False)
            size = request.held
            if size and not self.lost:  # (a lost connection gave back everything it held)
                self._held -= size
                self._server.release_body(size)
            self._request_done()

    async def _finish_other(self, response: Response | StreamResponse, request: Request) -> None:
        if isinstance(response, StreamResponse) and (self._stream is None or response is self._stream):
            if not response.prepared:
                await response.prepare(request)
            await response.write_eof()
        elif self._stream is not None:
            log.error("Handler for %s %s streamed a response but returned %r", request.method, request.path, response)
            self._stream.abandon()
            self.close_after = True
        elif isinstance(response, Response):
            self._write_whole(response, request)  # a Response subclass
        else:
            raise TypeError(f"Handler returned {response!r}, not a Response or StreamResponse")

    def _write_whole(self, response: Response, request: Request) -> None:
        status = response.status
        head = render_head(status, response.content_type, response.headers)
        connection = self.connection_header(request)
        if status in (204, 304) or status < 200:
            self.transport.write(head + connection + b"\r\n")
        elif request.method == "HEAD":
            self.transport.write(b"%sContent-Length: %d\r\n%s\r\n" % (head, len(response.body), connection))
        else:
            body = response.body
            self.transport.write(b"%sContent-Length: %d\r\n%s\r\n%s" % (head, len(body), connection, body))
        self._started = True
        on_sent = response.on_sent
        if on_sent is not None:
            response.on_sent = None
            if self.write_paused:  # the client has not taken it yet: told on resume_writing or connection_lost
                self._unsent.append(on_sent)
            else:
                self._call_on_sent(on_sent, True)

    def _tell_sent(self, delivered: bool) -> None:
        callbacks, self._unsent = self._unsent, []
        for on_sent in callbacks:
            self._call_on_sent(on_sent, delivered)

    @staticmethod
    def _call_on_sent(on_sent: Callable[[bool], None], delivered: bool) -> None:
        try:
            on_sent(delivered)
        except Exception:
            log.exception("a response's on_sent callback failed")

    def _handler_failed(self, request: Request) -> None:
        if self.lost:
            log.debug("Handler for %s %s failed after the client left", request.method, request.path, exc_info=True)
            return
        log.exception("Handler for %s %s failed", request.method, request.path)
        if self._started:
            self.close_after = True  # mid-stream: the client sees the chunked body end early
        else:
            self._write_error(
                500, "Internal server error.", self.connection_header(request), head_only=request.method == "HEAD"
            )

    def _request_done(self) -> None:
        self._task = None
        self._stream = None
        self._started = False
        server = self._server
        server.request_ended()
        if self.lost:
            return
        if self.close_after or server.closing:
            self.transport.close()
            return
        if self._pipeline:
            item = self._pipeline.popleft()
            if not self._pipeline and self._reading_paused and not self._discarding:
                self._reading_paused = False
                self.transport.resume_reading()
            if isinstance(item, Request):
                self._start(item)
            else:
                self._send_error(item)
            return
        if self._reading_paused and not self._discarding:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._expect_pending:
            self._expect_pending = False
            self.transport.write(_CONTINUE)
        timeout = self._server.limits.header_timeout_s if self._in_message else self._server.limits.keepalive_timeout_s
        if self.write_paused:  # the client has not taken the whole response yet
            timeout = min(timeout, self._server.limits.write_timeout_s)
        self._arm(self._loop.time() + timeout)

    # -- used by StreamResponse ------------------------------------------------------------------------------------

    def connection_header(self, request: Request) -> bytes:
        """The Connection header line for the response to `request`; decides whether the connection stays."""
        if not request.keep_alive or self._server.draining or self.close_after:
            self.close_after = True
            return _CLOSE
        return _KEEP_ALIVE if request.version == "1.0" else b""

    def begin_stream(self, stream: StreamResponse, head: bytes) -> None:
        """`stream` answers the current request; `head` is written now (empty: the stream holds it)."""
        self._stream = stream
        self._started = True
        if head:
            self.transport.write(head)

    async def drain(self) -> None:
        """Wait until the transport accepts writes again; ConnectionResetError if the client goes."""
        if self.lost:
            raise ConnectionResetError("The client has gone.")
        waiter = self._drain_waiter
        if waiter is None:
            waiter = self._drain_waiter = self._loop.create_future()
        await waiter

    # -- errors the server answers itself --------------------------------------------------------------------------

    def _fail(self, reject: _Reject) -> None:
        """Stop parsing; answer `reject` now, or after the requests already in progress or queued."""
        self._discarding = True
        self._in_headers = self._in_message = False
        if self._task is not None:
            self._pipeline.append(reject)
        else:
            self._send_error(reject)

    def _precheck(self, precheck: Callable[[Request], Response | None]) -> Response | None:
        request = self._request
        assert request is not None
        try:
            return precheck(request)
        except Exception:  # a bug in it: the handler decides, as it would have without one
            log.exception("precheck failed")
            return None

    def _send_error(self, reject: _Reject) -> None:
        response = reject.response
        if response is None:
            self._write_error(reject.status, reject.message, _CLOSE, reject.code, reject.head_only)
        else:
            head = render_head(response.status, response.content_type, response.headers)
            body = response.body
            self.transport.write(
                b"%sContent-Length: %d\r\n%s\r\n%s" % (head, len(body), _CLOSE, b"" if reject.head_only else body)
            )
        self._linger()

    def _write_error(
        self, status: int, message: str, connection: bytes, code: str | None = None, head_only: bool = False
    ) -> None:
        try:
            body = self._server.error_body(status, message, code)
        except Exception:
            log.exception("error_body failed")
            body = default_error_body(status, message, code)
        extra = self._server.error_headers
        self.transport.write(
            b"%sContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (
                render_head(status, None, extra() if extra is not None else None),
                len(body),
                connection,
                b"" if head_only else body,
            )
        )

    def _linger(self) -> None:
        self._discarding = self._lingering = True
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._arm(self._loop.time() + LINGER_S)

    # -- deadlines and shutdown ------------------------------------------------------------------------------------

    def _arm(self, deadline: float) -> None:
        """Set the deadline. One timer per connection, moved only when the deadline gets earlier: most requests
        only store a float here."""
        self._deadline = deadline
        timer = self._timer
        if timer is None:
            self._timer = self._loop.call_at(deadline, self._on_timer)
        elif deadline < timer.when():
            timer.cancel()
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.lost or (self._task is not None and not self._lingering and not self.write_paused):
            return  # busy: finishing the request sets the next deadline
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        if self._in_message and self._task is None and not self._lingering:
            # Headers or body too slow: answered (the client may be alive, only slow), then lingering.
            self._fail(_Reject(408, "The request was not received in time."))
            return
        # Idle, a client that stopped reading its response, or the lingering period is over. abort(), not
        # close(): close() would wait for a client that does not read to take what is still buffered. A handler
        # in progress is cancelled by the connection_lost that follows.
        if self.write_paused:
            # And with a reset: closed, the socket would hand the kernel what its send buffer holds (~0.4 MB at
            # the default size), kept for minutes in FIN-WAIT-1 while a client that reads nothing keeps
            # acknowledging the kernel's probes (an outside run: 380 KB still queued at 195 s).
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self.transport.abort()

    def close_if_idle(self) -> None:
        """Shutdown: close unless a request is in progress or its body is being read."""
        if self.lost or self._task is not None or (self._in_message and not self._in_headers):
            return
        self.transport.close()

    def abort(self) -> None:
        if not self.lost:
            self.transport.abort()
