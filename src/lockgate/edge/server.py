"""A lean HTTP/1.1 server: an asyncio Protocol over llhttp (`httptools.HttpRequestParser`).

Theory of operation
-------------------
One `Connection` (`protocol.py`) per accepted socket. Bytes go straight into the parser, whose callbacks collect a
request (URL, a list of raw header pairs, body chunks). A connection is always in one of these states:

- **refused**: accepted while `max_connections` were open already: answered 503 at once and closed (lingering).
- **idle**: no request in progress, no bytes of the next one. Deadline: `keepalive_timeout_s` (for a new
  connection: `header_timeout_s`). When it passes, the connection is closed.
- **reading**: a request has begun and is incomplete. Deadline: `header_timeout_s` until the headers are
  complete, then `header_timeout_s` from each body chunk (a stalled body), and the whole body within
  `body_timeout_s` of its headers (a body trickled a byte at a time). A deadline passed while reading is answered
  408 (lingering). Limits are checked here: headers
  over `max_header_bytes` -> 431, a `Content-Length` or a chunked body over `max_body_bytes` -> 413, a body
  that would take the bytes of bodies held by the whole server (being read, or read and not yet answered) past
  `max_held_body_bytes` -> 503 (the server's bound on what clients can make it hold: see below),
  malformed input or an Upgrade -> 400. `Expect: 100-continue` is answered when the headers are complete.
- **busy**: the message is complete and one `asyncio.Task` runs the handler on it. No deadline, except while a
  response waits for the client to take what was written (the transport paused writing): if writing stays
  paused for `write_timeout_s` (the client has not taken enough for the buffer to drain below its low-water
  mark), it counts as gone (the connection is aborted, the handler cancelled). Bytes that keep
  arriving are parsed; a request completed meanwhile (pipelining) is queued and reading is paused until the
  queue is empty again, so a pipelining client cannot make us buffer more than one read.
- **lingering**: the server answered an error itself (400/413/431) and will not parse more: it shuts down its
  write side, discards what still arrives for up to `_LINGER_S`, then closes. (Closing at once with unread
  input makes the kernel send RST, which can destroy the error response before the client reads it.)

Who cancels what: `connection_lost` (and `eof_received`: a half-close counts as the client leaving) cancels the
handler task at once; this is how a disconnect aborts the work behind a request. Nothing else cancels it except
the hard stop of `HttpServer.shutdown`, which aborts transports and so goes the same way. The task swallows that
`CancelledError`; a handler that returns after the client has gone writes nothing.

Who writes what: the task writes the handler's `Response` in one `transport.write`; a `StreamResponse` writes
itself (the task ends one that the handler left open). A handler exception becomes a 500 if nothing was sent
yet, otherwise the connection is closed (the client sees a truncated chunked body) — logged either way.

Who closes what: the connection closes itself after a response that said `Connection: close` (client asked,
HTTP/1.0 without keep-alive, shutdown in progress, a streamed body to an HTTP/1.0 client), after an error it
produced itself (lingering), and on a deadline. `HttpServer.shutdown` stops listening, closes idle connections,
lets busy ones finish (their responses say `Connection: close`) and aborts what is left at its timeout.

What a connection holds: the body being read and the bodies of its requests not yet answered (the one in progress,
one pipelined). Their bytes count on the server from the first body byte until the request's handler has ended (or
the connection is lost), so the bodies held at once are bounded by `max_held_body_bytes` however many clients send.

Headers: names are lower-cased; a repeated header's values are joined with ", " (RFC 9110 list semantics).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping

from .protocol import Connection, Limits, default_error_body
from .request import Headers, Request
from .response import Reply, Response, StreamResponse, json_response

__all__ = [
    "Handler",
    "Headers",
    "HttpServer",
    "Reply",
    "Request",
    "Response",
    "StreamResponse",
    "default_error_body",
    "json_response",
]

log = logging.getLogger(__name__)

#: After shutdown's timeout, how long cancelled handlers get to unwind before shutdown returns anyway.
_CANCEL_GRACE_S = 1.0

Handler = Callable[[Request], Awaitable[Reply]]


class HttpServer:
    """Serve `handler` on a TCP or Unix socket. See the module docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        max_header_bytes: int = 16384,
        keepalive_timeout_s: float = 75.0,
        header_timeout_s: float = 30.0,
        write_timeout_s: float = 60.0,
        body_timeout_s: float = 60.0,
        max_connections: int = 8192,
        max_held_body_bytes: int = 512 * 1024 * 1024,
        send_buffer_bytes: int = 0,
        error_body: Callable[[int, str, str | None], bytes] | None = None,
        error_headers: Callable[[], Mapping[str, str]] | None = None,
        precheck: Callable[[Request], Response | None] | None = None,
    ) -> None:
        """`error_body(status, message, code)` renders the body of the errors the server answers itself
        (malformed HTTP, limits; `code` names the limit where the status does not); `error_headers()` gives the
        extra headers they carry (e.g. a request id). `precheck(request)`, called when a request's headers have
        arrived and a body follows, may refuse it there with a response (sent, and the connection closed, before
        the body is read: a client without a valid key does not get to send megabytes first, nor a `100 Continue`)."""
        #: What each connection enforces.
        self.limits = Limits(
            max_body_bytes=max_body_bytes,
            max_header_bytes=max_header_bytes,
            keepalive_timeout_s=keepalive_timeout_s,
            header_timeout_s=header_timeout_s,
            write_timeout_s=write_timeout_s,
            body_timeout_s=body_timeout_s,
            max_connections=max_connections,
            max_held_body_bytes=max_held_body_bytes,
            send_buffer_bytes=send_buffer_bytes,
        )
        # What its connections call: the application, and the server's own answers (see the docstring).
        self.handler = handler
        self.error_body = error_body or default_error_body
        self.error_headers = error_headers
        self.precheck = precheck
        # The state its connections share, kept up to date by them (`protocol.Connection`).
        #: The connections open.
        self.live: set[Connection] = set()
        #: Bytes of request bodies held: being received, or received and not yet answered (`max_held_body_bytes`).
        self.held_body_bytes = 0
        #: Requests whose handler runs (or is about to).
        self.requests_in_progress = 0
        #: Shutting down: connections accepted now are closed, drained ones reported (`check_drained`).
        self.closing = False
        #: Stopped accepting: responses close their connections.
        self.draining = False
        #: Requests answered 503 because their body would have taken the held bodies past `max_held_body_bytes`.
        self.refused_bodies = 0
        #: Connections refused because `max_connections` were open.
        self.refused_connections = 0
        self._server: asyncio.Server | None = None
        self._drained: asyncio.Event | None = None  # during shutdown: no connection, no request in progress
        self._port: int | None = None

    @property
    def connections(self) -> int:
        return len(self.live)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._server.sockets) if self._server is not None else ()

    @property
    def port(self) -> int:
        """The TCP port listened on (still known after `stop_accepting`)."""
        if self._port is None:
            raise RuntimeError("Not listening on a TCP socket")
        return self._port

    async def start(
        self,
        host: str,
        port: int,
        *,
        sock: socket.socket | None = None,
        unix_path: str | None = None,
        reuse_port: bool = False,
    ) -> None:
        """Listen. `reuse_port`: SO_REUSEPORT, so that several processes share the port (the kernel
        spreads new connections among them: `lockgate serve --workers`)."""
        loop = asyncio.get_running_loop()

        def factory() -> Connection:
            return Connection(self, loop)

        if unix_path is not None:
            _refuse_live_socket(unix_path)
            self._server = await loop.create_unix_server(factory, unix_path, backlog=1024)
        elif sock is not None:
            self._server = await loop.create_server(factory, sock=sock, backlog=1024)
        else:
            self._server = await loop.create_server(
                factory, host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=1024
            )
        for sock_ in self._server.sockets:
            if sock_.family in (socket.AF_INET, socket.AF_INET6):
                self._port = int(sock_.getsockname()[1])
                break

    def stop_accepting(self) -> None:
        """No new connections; every response from now on says `Connection: close` (a client learns not to send
        more on this connection: the gateway is draining)."""
        self.draining = True
        if self._server is not None:
            self._server.close()

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting, close idle connections, let requests in progress finish (their responses say
        `Connection: close`) for up to `timeout_s`, then abort the rest and wait briefly for their handlers to
        unwind. Safe to call again (also concurrently)."""
        self.closing = True
        self.stop_accepting()
        if self._drained is None:
            self._drained = asyncio.Event()
        for conn in list(self.live):
            conn.close_if_idle()
        self.check_drained()
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        except TimeoutError:
            log.warning(
                "Shutdown: aborting %d connections, %d requests in progress",
                len(self.live),
                self.requests_in_progress,
            )
            for conn in list(self.live):
                conn.abort()
            try:
                async with asyncio.timeout(_CANCEL_GRACE_S):
                    await self._drained.wait()
            except TimeoutError:
                log.error("Shutdown: %d handlers ignored their cancellation", self.requests_in_progress)

    # --- what its connections call (the shared state changes only here) -------------------------------
    def body_fits(self, size: int) -> bool:
        """Whether `size` more bytes of request bodies may be held (`max_held_body_bytes`)."""
        return self.held_body_bytes + size <= self.limits.max_held_body_bytes

    def hold_body(self, size: int) -> None:
        self.held_body_bytes += size

    def release_body(self, size: int) -> None:
        self.held_body_bytes -= size

    def body_refused(self) -> None:
        """A request answered 503: its body would have passed `max_held_body_bytes`."""
        self.refused_bodies += 1

    def request_started(self) -> None:
        self.requests_in_progress += 1

    def request_ended(self) -> None:
        """A request's handler ended (or never started: its connection closed first). During shutdown the last
        one wakes it (a connection that closed before its request's task ran was counted after the check: the
        shutdown then waited out its whole timeout)."""
        self.requests_in_progress -= 1
        if self.closing:
            self.check_drained()

    def check_drained(self) -> None:
        """During shutdown: wake it once no connection is open and no request in progress (its connections call
        this as their requests end)."""
        if self._drained is not None and not self.live and not self.requests_in_progress:
            self._drained.set()

    def connection_gone(self, conn: Connection) -> None:
        """A connection closed (called by it)."""
        self.live.discard(conn)
        if self.closing:
            self.check_drained()


def _refuse_live_socket(path: str) -> None:
    """OSError(EADDRINUSE) when a process listens on the unix socket at `path`: asyncio removes any socket file it
    finds there, so a second gateway would silently take over the first one's address. A socket nobody listens
    on (left by a process that died) is taken over."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        return  # (not a socket: the bind says so)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # refused: stale
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process listens on {path}")
