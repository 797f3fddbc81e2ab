"""One HTTP/1.1 connection (an asyncio Protocol over llhttp) and the `Response` read from it.

Theory of operation
-------------------
A `Connection` carries one exchange at a time (no pipelining). Its life, as seen by its owner (the pool):

    connecting ──connection_made──> in use ──response complete, keep-alive, released──> idle ──checkout──> in use
        │                             │                                                  │
        └──────── any failure ────────┴─────────── abort() / connection_lost() ──────────┴──> closed (final)

* `send()` writes the request (one `transport.write` for bodies up to 256 KiB; larger ones in pieces through
  `send_rest()`, which honours `pause_writing`) and returns a future for the response head.
* `data_received` feeds llhttp; its callbacks resolve that future with a `Response` in `on_headers_complete`
  and append body pieces to the response's buffer, waking a reader if one waits. No task runs per request.
  A reader may instead follow the body (`Response.follow(step)`): `step` is then called once per read that
  carried body (after llhttp is done with the read), at the body's end and on an error, and takes what
  arrived with `next_nowait()` in that callback: no task wakes up per piece of a stream.
* When the message completes the connection is reusable only if llhttp says keep-alive, the whole request
  body was written, and the request was not HEAD (llhttp cannot be told a response answers a HEAD, so its
  body framing would be misread; the gateway never sends HEAD). A connection that is not reusable is closed
  at once, even if the response body is still unread in its buffer.
* Backpressure: while a response holds more than `HIGH_WATER` unconsumed bytes the transport stops reading;
  consuming the buffer resumes it. `read()` consumes as it goes, so it never stalls itself.
* Bounds: a response head (status line and headers) over `MAX_HEAD_BYTES` is a `ProtocolError`; `read()`
  takes a `max_bytes` beyond which the body is refused (`ResponseTooLarge`) and the connection closed.
* Stalls: a request sent with a `watch` (seconds) may wait that long for the server's next byte. Reads are only
  counted (`reads`: no clock on the hot path); the pool asks `stalled(now)` now and then, which notes when the count
  last moved (the request's sending and a resumed read count too) and fails an exchange still waiting whose count has
  not moved for its `watch` with `StalledError`, closing the connection. While reading is paused the gateway is the
  one not taking bytes: that never counts. A stall is seen between `watch` and `watch` plus two checks.

Who closes what: the connection closes itself on a parse error, on bytes it did not ask for, and when its
response is complete but not reusable. Otherwise the `Response`'s owner decides: `release()` returns a
completely received connection to the pool and closes any other; `close()` aborts it unconditionally.
Every path to "closed" goes through `abort()` or `connection_lost()`, which tell the owner exactly once
(`on_closed`); a reusable connection is handed back through `on_reusable`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import TypeVar, cast

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from .. import awaitpoints
from .errors import DisconnectedError, ProtocolError, ResponseTooLarge, StalledError

T = TypeVar("T")

#: Unconsumed response bytes above which the transport stops reading.
HIGH_WATER = 256 * 1024
#: Request bodies are written in pieces of this size when larger (waiting for the transport to drain).
WRITE_PIECE = 256 * 1024
#: A response's status line and headers may not be larger than this.
MAX_HEAD_BYTES = 64 * 1024
#: The parser of every connection once lost (nothing feeds it).
_LOST = HttpResponseParser(object())


class Response:
    """Status and headers of a response, and its body as it arrives.

    Resource handling: the response holds its connection until `release()` or `close()`; `read()` and a
    `chunks()` iteration that reaches the end release it themselves. Both are idempotent. A response that
    is never released keeps its connection (and pool slot) forever; a read cancelled while it waits leaves
    the response as it was, for its owner to close.
    """

    __slots__ = (
        "_body",
        "_buffered",
        "_conn",
        "_error",
        "_listener",
        "_loop",
        "_waiter",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        # The connection's loop, kept: a stream waits once per network read, and on Python 3.11 every
        # `asyncio.get_running_loop()` is a getpid() system call.
        self._loop = conn.loop
        self._conn: Connection | None = conn
        self.status = status
        #: Header names are lower-cased; repeated headers are joined with ", ".
        self.headers = headers
        self._body: list[bytes] = []
        self._buffered = 0
        #: The whole body has been received (it may not have been consumed yet).
        self.complete = False
        self._error: ProtocolError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[], None] | None = None

    @property
    def content_type(self) -> str:
        """The media type only, lower-cased (`application/json`), or "" when absent."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet consumed (0: the next read waits, unless the body has ended)."""
        return self._buffered

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (Content-Length, chunked or until close); releases the connection. A body larger
        than `max_bytes` raises `ResponseTooLarge` (once more than that has arrived: at most one read beyond
        it is held) and closes the connection."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("Response.read", None)
        parts: list[bytes] = []
        size = 0
        while True:
            piece = self.next_nowait()
            if piece is None:
                await self._wait()
                continue
            if not piece:  # the end (the connection is released)
                return parts[0] if len(parts) == 1 else b"".join(parts)
            size += len(piece)
            if max_bytes is not None and size > max_bytes:
                self.close()
                raise ResponseTooLarge(f"the response body is larger than {max_bytes} bytes")
            parts.append(piece)

    def chunks(self) -> Response:
        """Iterate over the body in de-chunked pieces as they arrive (all that is buffered at each step)."""
        return self

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while (piece := self.next_nowait()) is None:
            await self._wait()
        if not piece:  # the end of the body
            raise StopAsyncIteration
        return piece

    def next_nowait(self) -> bytes | None:
        """The body received and not consumed yet, without waiting: None when nothing new has arrived (the
        next piece would be waited for), `b""` at the end of the body (the connection is released then).
        Raises the response's error (a broken or closed response)."""
        parts = self._body
        if parts:
            self._body = []
            self._buffered = 0
            conn = self._conn
            if conn is not None and conn.reading_paused:
                conn.resume_reading()
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if self.complete:
            self.release()
            return b""
        if self._error is not None:
            raise self._error
        return None

    async def wait(self) -> None:
        """Wait until `next_nowait()` has something to say (a piece, the end, or an error)."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("Response.wait", None)
        if not self._body and not self.complete and self._error is None:
            await self._wait()

    async def follow(self, step: Callable[[], T | None]) -> T:
        """Call `step()` from the connection's callbacks each time `next_nowait()` may have something new (once
        per network read that carried body, at the end of the body, on an error) until it returns something
        other than None; return that (or raise what `step` raised). A reader that handles each piece in the
        callback that received it needs no task to wake up per piece: the task waits here once. `step` is
        called at once first (for what has arrived already). `close()` stops following."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("Response.follow", None)
        result = step()
        if result is not None:
            return result
        done: asyncio.Future[T] = self._loop.create_future()
        listener = self._listener = listener_of(step, done)
        try:
            return await done
        finally:
            if self._listener is listener:
                self._listener = None
            # An exception `done` holds has this frame in its traceback: the frame must not hold `done` (a reference
            # cycle, until the collector's next full pass).
            del done, listener

    def release(self) -> None:
        """Give the connection back: to the pool if the body was completely received, else closed."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self.complete and self._error is None:
            conn.finish()
        else:
            conn.abort()

    def close(self) -> None:
        """Abort now, whatever the state: the transport is aborted (uvloop closes the socket in this call,
        asyncio at its next loop iteration; unsent data is dropped), and later reads raise ProtocolError."""
        self._listener = None
        self._body = []
        self._buffered = 0
        self.complete = False
        if self._error is None:
            self._error = ProtocolError("response closed")
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.abort()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _tell(self) -> None:
        """Wake a waiting reader, and call the listener (outside llhttp's callbacks: see `data_received`)."""
        self._wake()
        listener = self._listener
        if listener is not None:
            listener()


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; see the module docstring for its lifecycle."""

    __slots__ = (
        "_drain",
        "_head",
        "_head_began",
        "_head_bytes",
        "_head_only",
        "_headers",
        "_on_closed",
        "_on_reusable",
        "_parser",
        "_quiet_since",
        "_received",
        "_response",
        "_seen_reads",
        "_until_close",
        "closed",
        "idle_since",
        "loop",
        "reading_paused",
        "reads",
        "reused",
        "transport",
        "unsent",
        "watch",
        "writing_paused",
    )

    def __init__(self, on_reusable: Callable[[Connection], None], on_closed: Callable[[Connection], None]) -> None:
        self._on_reusable = on_reusable
        self._on_closed = on_closed
        self._parser = HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        # Kept: on Python 3.11, every `asyncio.get_running_loop()` is a getpid() system call.
        self.loop = asyncio.get_running_loop()
        self.closed = False
        #: Served a request before the current one (a failure before any response byte may be a stale socket).
        self.reused = False
        self.idle_since = 0.0
        #: The current request's stall timeout (0.0: not watched, `stalled`); network reads so far; the count as the
        #: last check saw it, and since when it has not moved.
        self.watch = 0.0
        self.reads = 0
        self._seen_reads = 0
        self._quiet_since = 0.0
        self.reading_paused = False
        self.writing_paused = False
        self._drain: asyncio.Future[None] | None = None
        #: The part of the request body not yet written (bodies larger than WRITE_PIECE).
        self.unsent: memoryview | None = None
        # The current exchange: the head future until the head arrives, then the response until it completes.
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._head_only = False
        self._head_bytes = 0
        #: When a stall check first saw the current head begun and not complete (0.0: not seen so).
        self._head_began = 0.0
        self._received = False
        self._until_close = False
        self._headers: dict[str, str] = {}

    # -- requests ---------------------------------------------------------------------------------------

    def send(
        self, head: bytes, body: bytes, *, head_only: bool = False, watch: float = 0.0
    ) -> asyncio.Future[Response]:
        """Write a request; the future resolves with the response once its head has arrived. With a `watch`, the
        request fails as stalled once it waits that long for the server's next byte (`stalled`)."""
        future: asyncio.Future[Response] = self.loop.create_future()
        transport = self.transport
        if self.closed or transport is None:
            future.set_exception(DisconnectedError("connection closed before the request was sent"))
            return future
        self.watch = watch
        if watch:
            self._seen_reads, self._quiet_since = self.reads, self.loop.time()
        self._head = future
        self._head_only = head_only
        self._head_bytes = 0
        self._head_began = 0.0
        self._received = False
        self._headers = {}
        if len(body) <= WRITE_PIECE:
            self.unsent = None
            transport.write(head + body)
        else:
            view = memoryview(body)
            transport.write(head + view[:WRITE_PIECE])
            self.unsent = view[WRITE_PIECE:]
        return future

    async def send_rest(self) -> None:
        """Write the rest of a large body, waiting while the transport is paused; stops early (and the
        connection will not be reused) if the connection closes or the response head arrives first."""
        while (view := self.unsent) is not None and self._head is not None and not self.closed:
            if self.writing_paused:
                self._drain = asyncio.get_running_loop().create_future()
                try:
                    await self._drain
                finally:
                    self._drain = None
                continue
            assert self.transport is not None
            self.transport.write(view[:WRITE_PIECE])
            self.unsent = view[WRITE_PIECE:] if len(view) > WRITE_PIECE else None

    def finish(self) -> None:
        """The response was completely received and released: hand the connection back for reuse."""
        if self.closed:
            return
        if self.reading_paused:
            self.resume_reading()
        self.reused = True
        self._on_reusable(self)

    def abort(self) -> None:
        """Close now (write buffer discarded); any reader of the current exchange sees a ProtocolError."""
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._fail(ProtocolError("connection closed"), DisconnectedError("connection closed"))
        self._wake_drain()
        self._on_closed(self)

    def resume_reading(self) -> None:
        self.reading_paused = False
        self.reads += 1  # (the time it was paused was the reader's, not the server's: the clock starts again)
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def stalled(self, now: float) -> bool:
        """If this connection's watched exchange has waited its `watch` or more for the server's next byte (reading not
        paused; counted from the check that last saw the reads move), fail it with `StalledError`, close the connection
        and return True."""
        if not self.watch or self.closed or (self._head is None and self._response is None):
            return False
        if self._head is not None and self._received:
            # The head has begun and is not complete: a server sends it at once, and one trickled a byte at a time
            # would keep the reads moving for as long as it liked (64 KiB at a byte a second: 18 hours).
            if not self._head_began:
                self._head_began = now
            elif now - self._head_began >= self.watch:
                error = StalledError(self.watch, trickled=True)
                self._fail(error, error)
                self.abort()
                return True
        if self.reads != self._seen_reads or self.reading_paused:
            self._seen_reads, self._quiet_since = self.reads, now
            return False
        if now - self._quiet_since < self.watch:
            return False
        error = StalledError(self.watch)
        self._fail(error, error)
        self.abort()
        return True

    # -- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        # The parser holds this protocol's bound methods (a reference cycle) and what it was gathering, the headers
        # dict a head or trailers in progress: let both go now, not at the collector's next full pass.
        self._parser = _LOST
        self._headers = {}
        response = self._response
        if response is not None and self._until_close and exc is None:
            # A body without length or chunking ends when the server closes: that is its end, not an error.
            self._response = None
            response.complete = True
            response._tell()
        self._wake_drain()
        if self.closed:
            return
        self.closed = True
        detail = f": {exc}" if exc is not None else ""
        self._fail(
            ProtocolError(f"connection lost during the response{detail}"),
            DisconnectedError(f"server closed the connection before responding{detail}"),
        )
        self._on_closed(self)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self._head is None and self._response is None:
            self.abort()  # bytes nobody asked for: the connection's state is unknown
            return
        self._received = True
        self.reads += 1
        # An upper bound of the head received so far; once it is complete, of what came since the last piece of body
        # (`on_body` sets it back to 0): a chunked body's trailers, which the parser would otherwise take without end.
        self._head_bytes += len(data)
        # The response whose body this read may carry: its listener hears of the whole read once, after the
        # parser is done with it (not from inside llhttp's callbacks, and one call for several chunks).
        response = self._response
        try:
            self._parser.feed_data(data)
        except (HttpParserError, HttpParserUpgrade) as exc:
            message = f"malformed response: {exc}" if isinstance(exc, HttpParserError) else "unexpected upgrade"
            self._fail(ProtocolError(message), ProtocolError(message))
            self.abort()
            return
        if response is not None and response._listener is not None:
            response._listener()
        if self._head_bytes > MAX_HEAD_BYTES:
            # Still no complete head after this much: the status line and headers are too large; or after the body's
            # last piece, its trailers are.
            what = "the response head is" if self._head is not None else "the response's trailers are"
            message = f"{what} larger than {MAX_HEAD_BYTES} bytes"
            self._fail(ProtocolError(message), ProtocolError(message))
            self.abort()

    # -- llhttp callbacks (called from inside feed_data) --------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head is None:
            return  # a trailer, after a chunked body: not kept (bounded with the head's bytes in `data_received`)
        key = name.decode("latin-1").lower()
        headers = self._headers
        text = value.decode("latin-1")
        headers[key] = headers[key] + ", " + text if key in headers else text

    def on_headers_complete(self) -> None:
        head = self._head
        status = self._parser.get_status_code()
        headers = self._headers
        self._headers = {}
        if head is None:  # a response nobody asked for (after a HEAD's, or unsolicited)
            self.abort()
            return
        if 100 <= status < 200:  # informational: llhttp completes it as a message of its own; skip it
            return
        if self._head_bytes > MAX_HEAD_BYTES and _head_size(headers) > MAX_HEAD_BYTES:
            # Complete within the read that took the bytes received past the bound (counted only then).
            message = f"the response head is larger than {MAX_HEAD_BYTES} bytes"
            self._fail(ProtocolError(message), ProtocolError(message))
            self.abort()
            return
        self._head = None
        response = self._response = Response(self, status, headers)
        if self._head_only:
            self._complete(response, reusable=False)
        elif "content-length" not in headers:
            coding = headers.get("transfer-encoding")
            self._until_close = coding is None or coding.rpartition(",")[2].strip().lower() != "chunked"
            if self._until_close and status in (204, 304):
                self._until_close = False
        self._wake_drain()
        if head.done():  # the requester was cancelled; it aborts the connection when it resumes
            self.abort()
        else:
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is None:
            return
        self._head_bytes = 0
        response._body.append(body)
        response._buffered += len(body)
        waiter = response._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if response._buffered > HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response = self._response
        if response is not None:
            self._complete(response, reusable=self.unsent is None and self._parser.should_keep_alive())

    # -- internals ----------------------------------------------------------------------------------------

    def _complete(self, response: Response, *, reusable: bool) -> None:
        self._response = None
        self._until_close = False
        response.complete = True
        response._wake()
        if not reusable:
            self.abort()

    def _fail(self, broken: ProtocolError, silent: DisconnectedError | ProtocolError) -> None:
        """End the current exchange (if any) with an error: `silent` if no response byte has arrived yet (for
        the requester awaiting the head), else `broken` (for it, or for the reader of the body)."""
        head = self._head
        if head is not None:
            self._head = None
            if not head.done():
                head.set_exception(broken if self._received else silent)
        response = self._response
        if response is not None:
            self._response = None
            if response._error is None:
                response._error = broken
            response._tell()

    def _wake_drain(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)


def listener_of(step: Callable[[], T | None], done: asyncio.Future[T]) -> Callable[[], None]:
    """The callback of a `follow`: call `step()`, and end `done` with what it returns (when not None) or with
    what it raises; once `done` is done, nothing more."""

    def listener() -> None:
        if done.done():
            return
        try:
            result = step()
        except Exception as exc:
            if not done.done():
                done.set_exception(exc)
            return
        # `step` may have ended the wait itself: what it wrote to a client that had gone closed that client's
        # connection, and so cancelled the task awaiting `done` (and `done` with it).
        if result is not None and not done.done():
            done.set_result(result)

    return listener


def _head_size(headers: dict[str, str]) -> int:
    """The bytes of a response head's header lines (a lower bound of the head: without its status line)."""
    return sum(len(name) + len(value) + 4 for name, value in headers.items())
