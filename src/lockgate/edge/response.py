"""What a handler returns: a whole `Response` (one write) or a `StreamResponse` (chunked, written as it goes).

A `Response` is plain data; the connection renders it (status line, headers, `Content-Length`, body) into one
`transport.write` after the handler returns, so its headers may still be changed until then. Its optional
`on_sent(delivered)` is called exactly once: True when the client has taken the body (the write left the
transport below its high-water mark, or it drained below its low-water mark later — the same test a stream's
`write` passes), False when the client went first or the response was never written.

A `StreamResponse` writes through the connection of the request it was prepared for: `prepare` sends the
status line and headers, each `write` one chunk (`Transfer-Encoding: chunked`; for an HTTP/1.0 client the raw
bytes, and the connection closes at the end), `write_eof` the terminating chunk. `write` waits while the
transport is paused (backpressure; the waits add up in `backpressure_s`) and raises `ConnectionResetError` once
the client is gone; `write_nowait` sends nothing (and returns False) while it is paused. Each has a synchronous
twin for writers that run in a callback (`start`, `send` — which sends and says whether the transport is now
paused, `drained()` then waits — and `end`).

Framing headers (`Content-Length`, `Transfer-Encoding`, `Connection`) belong to the server: those given by a
handler are dropped. A header name or value containing CR or LF raises `ValueError` (no response splitting).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

import orjson

from .. import awaitpoints, header_lines

if TYPE_CHECKING:
    from .protocol import Connection
    from .request import Request

__all__ = ["Reply", "Response", "StreamResponse", "json_response"]

_STATUS_LINES: dict[int, bytes] = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode() for s in HTTPStatus}
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
#: Statuses whose responses never have a body (and carry no Content-Length/Transfer-Encoding here).
_NO_BODY = frozenset({204, 304})
#: The size lines of chunks up to 1 KiB (a streamed token's usual write), made once: formatting one (`b"%x" % n`)
#: cost the compiled build more than the rest of a `send`.
_SIZE_LINES: Final = [b"%x\r\n" % size for size in range(1024)]


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"Invalid HTTP status {status}")
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


class _Clock:
    """The `Date` header line (RFC 9110 asks every origin server with a clock for one), formatted once a second."""

    __slots__ = ("line", "second")

    def __init__(self) -> None:
        self.second = 0
        self.line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"Date: " + formatdate(now, usegmt=True).encode("ascii") + b"\r\n"
        return self.line


_clock = _Clock()


def _chunk(data: bytes) -> bytes:
    """`data` framed as one chunk of a chunked body."""
    size = len(data)
    line = _SIZE_LINES[size] if size < len(_SIZE_LINES) else b"%x\r\n" % size
    return line + data + b"\r\n"


def render_head(status: int, content_type: str | None, headers: Mapping[str, str] | None) -> bytes:
    """Status line, `Date` and the handler's headers, each line ending in CRLF (the blank line is not included)."""
    head = status_line(status) + _clock.date_line()
    if content_type is not None:
        if header_lines.has_crlf(content_type):
            raise ValueError("CR or LF in Content-Type")
        head += b"Content-Type: " + content_type.encode("latin-1") + b"\r\n"
    if headers:
        block = header_lines.render(headers.items())  # every header is checked, framing ones included
        if not _FRAMING.isdisjoint(map(str.lower, headers)):
            block = header_lines.render([(n, v) for n, v in headers.items() if n.lower() not in _FRAMING])
        head += block.encode("latin-1")
    return head


class Response:
    """A whole response. `body` is sent as is, with its `Content-Length`."""

    __slots__ = ("body", "content_type", "headers", "on_sent", "status")

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        on_sent: Callable[[bool], None] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers: Mapping[str, str] = headers if headers is not None else {}
        #: Told whether the client took the body (see the module docstring); called once, then cleared.
        self.on_sent = on_sent

    def __repr__(self) -> str:
        return f"<Response {self.status} {len(self.body)} bytes>"


def json_response(data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


class StreamResponse:
    """A response written piece by piece (SSE). See the module docstring for the contract."""

    __slots__ = (
        "_body_allowed",
        "_chunked",
        "_conn",
        "_eof",
        "_held",
        "backpressure_s",
        "headers",
        "prepared",
        "status",
    )

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        #: Total time `write` waited for the client to take data (the transport was paused).
        self.backpressure_s = 0.0
        self.headers: Mapping[str, str] = headers if headers is not None else {}
        self.prepared = False
        self._eof = False
        #: The status line and headers, while `start(hold_head=True)` keeps them for the first write.
        self._held: bytes | None = None
        self._chunked = True
        self._body_allowed = True
        self._conn: Connection | None = None  # set by prepare()

    @property
    def ended(self) -> bool:
        """`write_eof` has been called."""
        return self._eof

    def abandon(self) -> None:
        """The connection gave up on this response (its handler ended without finishing it): later writes to it
        raise instead of landing in the connection's next response."""
        self._eof = True

    async def prepare(self, request: Request) -> None:
        """Send the status line and headers (`start`, for callers that await)."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("StreamResponse.prepare", None)
        self.start(request)

    def start(self, request: Request, *, hold_head: bool = False) -> None:
        """Send the status line and headers. A second call does nothing. `hold_head`: the response is committed
        now (status and headers fixed) but its head goes out with the first chunk, or with `end()`, in the same
        write (one send fewer; for a writer whose first chunk follows at once, before any await).

        Raises ConnectionResetError if the client has gone."""
        if self.prepared:
            return
        conn = request.connection
        if conn.lost:
            raise ConnectionResetError("The client has gone.")
        no_body = self.status in _NO_BODY or self.status < 200
        head = render_head(self.status, None, self.headers)
        http10 = request.version == "1.0"
        if no_body:
            self._chunked = False
        elif http10:
            # No chunked encoding in HTTP/1.0: the body ends when the connection closes.
            self._chunked = False
            conn.close_after = True
        else:
            head += b"Transfer-Encoding: chunked\r\n"
        self._body_allowed = not no_body and request.method != "HEAD"
        self._conn = conn
        head += conn.connection_header(request) + b"\r\n"
        if hold_head:
            self._held = head
            head = b""
        conn.begin_stream(self, head)
        self.prepared = True

    async def write(self, data: bytes) -> None:
        """Send one chunk (nothing for empty data); waits while the transport is paused."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("StreamResponse.write", data)
        if self.send(data):
            await self.drained()

    def send(self, data: bytes, *, last: bool = False) -> bool:
        """Send one chunk (nothing for empty data) without waiting; returns True when the transport is paused
        now (the client has not taken what was sent: `drained()` before sending more). `last`: the response
        ends with it (`end()` in the same write). Raises ConnectionResetError once the client is gone."""
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("send() before prepare() or after write_eof()")
        if conn.lost:
            raise ConnectionResetError("The client has gone.")
        out = b""
        if data and self._body_allowed:
            out = _chunk(data) if self._chunked else data
        if last:
            self._eof = True
            if self._chunked and self._body_allowed:
                out += b"0\r\n\r\n"
        held = self._held
        if held is not None:
            self._held = None
            out = held + out
        if out:
            conn.transport.write(out)
        return conn.write_paused

    async def drained(self) -> None:
        """Wait while the transport is paused (the wait counts in `backpressure_s`); ConnectionResetError if the
        client goes meanwhile."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("StreamResponse.drained", None)
        conn = self._conn
        if conn is None:
            raise RuntimeError("drained() before prepare()")
        if conn.write_paused:
            started = time.perf_counter()
            try:
                await conn.drain()
            finally:
                self.backpressure_s += time.perf_counter() - started

    def write_nowait(self, data: bytes) -> bool:
        """Send one chunk unless the transport is paused (the client has not taken what was sent before):
        then send nothing and return False. Never waits, so a sender that would rather skip data than queue
        it (a live view: the next update supersedes this one) holds at most what the transport buffers.
        Raises ConnectionResetError once the client is gone."""
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("write_nowait() before prepare() or after write_eof()")
        if conn.lost:
            raise ConnectionResetError("The client has gone.")
        if conn.write_paused:
            return False
        self.send(data)
        return True

    async def write_eof(self) -> None:
        """End the response (`end`, for callers that await)."""
        if awaitpoints.hook is not None:
            await awaitpoints.hook("StreamResponse.write_eof", None)
        self.end()

    def end(self) -> None:
        """End the response (the terminating chunk). A second call does nothing."""
        if not self._eof:
            self.send(b"", last=True)

    def __repr__(self) -> str:
        state = "ended" if self._eof else "prepared" if self.prepared else "new"
        return f"<StreamResponse {self.status} {state}>"


#: What a handler returns.
Reply = Response | StreamResponse
