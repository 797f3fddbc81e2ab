"""`HttpPool`: keep-alive HTTP/1.1 connections to one origin (TCP, TLS over TCP, or a unix socket).

Theory of operation
-------------------
The pool owns *slots*: at most `max_connections` connections exist at once, counting those still
connecting. Every slot is in exactly one place:

* `_idle`: a LIFO stack of reusable connections, oldest first (`idle_since` ascending). Checkout pops the
  newest; when the newest is older than `keepalive_s`, all are, and all are closed. A `call_at` sweep (armed
  only while connections are idle, one timer at a time) closes expired ones so sockets do not linger.
* `_in_use`: connections connecting or carrying an exchange (from checkout until the response is released).
* in flight to a waiter: a request that found no idle connection and no free slot queues a future in
  `_waiters` (FIFO). A connection handed back, or a slot freed by a closing connection, is given directly to
  the first waiter (`Connection`, or `None` meaning "the slot is yours, open a new one") instead of going
  idle or back to the count. A waiter cancelled after being handed something gives it back, so nothing leaks.

Stalls: a request made with a `watch` (seconds) that waits that long for the server's next byte (its head, or the
rest of its body) fails with `StalledError` and its connection is closed (`Connection.stalled`). One timer checks the
connections in use every quarter of the shortest watch out, armed only while a watched request is out.

A connection tells the pool exactly once that it closed (`_forget`, from `Connection.abort()` or
`connection_lost`); whoever held it then simply holds a closed connection. `aclose()` aborts every idle and
in-use connection and fails the waiters.

Stale keep-alive race: a server may close an idle connection just as a request is written on it. If a
*reused* connection fails before any response byte arrives, the request is sent once more on a fresh
connection; a fresh connection failing that way raises `DisconnectedError` to the caller.

TLS (`https://`): asyncio's TLS transport under the same protocol; the handshake is part of connecting (within
the connect timeout) and its failures, a rejected certificate included, are `ConnectError`s. Plain-HTTP
connections take no TLS step at all.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

from .. import awaitpoints, header_lines
from .connection import Connection, Response
from .errors import ConnectError, DisconnectedError


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    idle: int
    in_use: int
    #: Requests queued for a connection.
    waiting: int
    #: Slots taken: connections open or being opened, plus slots just handed to a waiter (= idle + in_use
    #: whenever no hand-over is in flight).
    slots: int
    max_connections: int


class HttpPool:
    """Keep-alive connections to one origin: `http[s]://host[:port][/prefix]` or `unix:///path/to.sock`.

    For `https://`, `ssl_context` (default: `ssl.create_default_context()`, the system's trust store) verifies
    the server, and `server_name` is sent as SNI and checked against the certificate (default: the URL's host).
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 1024,
        keepalive_s: float = 15.0,
        connect_timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        parts = urlsplit(url)
        self._ssl: ssl.SSLContext | None = None
        self._server_name: str | None = None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"no socket path in {url!r}")
            self._socket_path: str | None = parts.path
            self._host, self._port, self._prefix, authority = "", 0, "", "localhost"
        elif parts.scheme in ("http", "https"):
            if not parts.hostname:
                raise ValueError(f"no host in {url!r}")
            self._socket_path = None
            tls = parts.scheme == "https"
            self._host, self._port = parts.hostname, parts.port or (443 if tls else 80)
            self._prefix = parts.path.rstrip("/")
            authority = parts.netloc.rpartition("@")[2]
            if tls:
                self._ssl = ssl_context or ssl.create_default_context()
                self._server_name = server_name or parts.hostname
        else:
            raise ValueError(f"unsupported URL scheme in {url!r} (http://, https:// or unix:// only)")
        self._host_line = f"Host: {authority}\r\n"
        self._max = max_connections
        self._keepalive = keepalive_s
        self._connect_timeout = connect_timeout_s
        self._idle: list[Connection] = []
        self._in_use: set[Connection] = set()
        self._waiters: collections.deque[asyncio.Future[Connection | None]] = collections.deque()
        self._slots = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._stall_check: asyncio.TimerHandle | None = None
        #: The armed check's period (a quarter of the shortest watch out when it was armed).
        self._stall_period = 0.0
        self._closed = False

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(len(self._idle), len(self._in_use), len(self._waiters), self._slots, self._max)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Collection[tuple[str, str]] = (),
        *,
        watch: float | None = None,
    ) -> Response:
        """Send a request; returns once the response's status line and headers have arrived.

        Sends `Host` and `Content-Length` plus `headers` (names and values must not contain CR or LF).
        The caller owns the returned response: it must be read to its end, released or closed. If this is
        cancelled while waiting, the connection is closed at once and never reused. With a `watch` (seconds), waiting
        that long for the server's next byte fails the request (`StalledError`).
        """
        if awaitpoints.hook is not None:
            await awaitpoints.hook("HttpPool.request", None)
        head = self._render(method, path, len(body), headers)
        head_only = method == "HEAD"
        fresh = False
        while True:
            conn = (None if fresh else self._checkout_nowait()) or await self._checkout(fresh)
            future = conn.send(head, body, head_only=head_only, watch=watch or 0.0)
            if watch and (self._stall_check is None or _period(watch) < self._stall_period):
                self._arm_stall_check(conn.loop, watch)
            try:
                if conn.unsent is not None:
                    await conn.send_rest()
                return await future
            except DisconnectedError:
                if fresh or not conn.reused or self._closed:
                    raise
                fresh = True  # the stale keep-alive race: once more, on a new connection
            except BaseException:
                future.cancel()  # nobody will await it: keep abort() from setting an exception on it
                conn.abort()
                raise
            finally:
                # An exception the future holds has this frame in its traceback: the frame must not hold the future
                # (a reference cycle, the connection in it, until the collector's next full pass).
                del future

    async def aclose(self) -> None:
        """Close every connection, idle and in use (their readers see a ProtocolError); fail waiters."""
        self._closed = True
        for timer in (self._sweep, self._stall_check):
            if timer is not None:
                timer.cancel()
        self._sweep = self._stall_check = None
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectError("pool is closed", "the gateway is closing its connections"))
        conns = [*self._idle, *self._in_use]
        for conn in conns:
            conn.abort()
        # Let the transports finish closing (asyncio closes sockets on the next loop iteration).
        await asyncio.sleep(0)

    # -- request head ---------------------------------------------------------------------------------------

    def _render(self, method: str, path: str, length: int, headers: Collection[tuple[str, str]]) -> bytes:
        line = f"{method} {self._prefix}{path}"
        if not path.startswith("/") or line.count(" ") != 1 or header_lines.has_crlf(line):
            raise ValueError(f"invalid request line: {method!r} {path!r}")
        fields = header_lines.render(headers)
        return f"{line} HTTP/1.1\r\n{self._host_line}Content-Length: {length}\r\n{fields}\r\n".encode("latin-1")

    # -- slots ------------------------------------------------------------------------------------------------

    def _checkout_nowait(self) -> Connection | None:
        """The newest idle connection unless it has expired (then all have, and are closed), else None."""
        idle = self._idle
        if not idle or self._closed:
            return None
        conn = idle.pop()
        if conn.loop.time() - conn.idle_since < self._keepalive:
            self._in_use.add(conn)
            return conn
        conn.abort()
        self._expire(len(idle))
        return None

    async def _checkout(self, fresh: bool) -> Connection:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise ConnectError("pool is closed", "the gateway is closing its connections")
            if not fresh and (conn := self._checkout_nowait()) is not None:
                return conn
            idle = self._idle
            if self._slots < self._max:
                self._slots += 1
                return await self._open()
            if idle:  # `fresh` at the limit: make room by closing the oldest idle connection
                idle[0].abort()
                continue
            waiter: asyncio.Future[Connection | None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                got = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._give_back(waiter.result())
                else:
                    self._remove_waiter(waiter)
                raise
            if got is None:
                return await self._open()  # the slot was handed over with the future
            if not got.closed:
                return got
            # closed between hand-over and now: its slot went on to someone else; queue again

    async def _open(self) -> Connection:
        """Open a connection on a slot already counted in `_slots`; on failure the slot is released."""
        conn = Connection(self._checkin, self._forget)
        self._in_use.add(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._socket_path is not None:
                    await loop.create_unix_connection(lambda: conn, self._socket_path)
                elif self._ssl is None:
                    await loop.create_connection(lambda: conn, self._host, self._port)
                else:
                    await loop.create_connection(
                        lambda: conn, self._host, self._port, ssl=self._ssl, server_hostname=self._server_name
                    )
        except TimeoutError as exc:
            conn.abort()
            raise ConnectError(
                f"connect to {self._where()} timed out after {self._connect_timeout}s", "the connection timed out"
            ) from exc
        except ssl.SSLCertVerificationError as exc:
            conn.abort()
            raise ConnectError(
                f"TLS: the certificate of {self._where()} was rejected ({exc.verify_message}; "
                f"server name {self._server_name!r})",
                "its TLS certificate was rejected",
            ) from exc
        except ssl.SSLError as exc:
            conn.abort()
            raise ConnectError(
                f"TLS handshake with {self._where()} failed: {exc.reason or exc}", "the TLS handshake failed"
            ) from exc
        except OSError as exc:
            conn.abort()
            refused = isinstance(exc, ConnectionRefusedError)
            reason = "the connection was refused" if refused else "the connection failed"
            raise ConnectError(f"cannot connect to {self._where()}: {exc}", reason) from exc
        except BaseException:
            conn.abort()
            raise
        return conn

    def _checkin(self, conn: Connection) -> None:
        """A released, reusable connection: to the first waiter, else onto the idle stack."""
        if self._closed:
            conn.abort()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)  # stays in `_in_use`
                return
        self._in_use.discard(conn)
        loop = conn.loop
        conn.idle_since = loop.time()
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = loop.call_at(conn.idle_since + self._keepalive, self._sweep_idle)

    def _forget(self, conn: Connection) -> None:
        """A connection closed (called once per connection): its slot goes to a waiter or back to the count."""
        if conn in self._in_use:
            self._in_use.remove(conn)
        elif conn in self._idle:  # else already taken off the idle stack by whoever closed it
            self._idle.remove(conn)
        self._release_slot()

    def _give_back(self, got: Connection | None) -> None:
        """A cancelled waiter had just been handed `got`: pass it on as if it had been released."""
        if got is None:
            self._release_slot()
        elif not got.closed:
            self._checkin(got)

    def _release_slot(self) -> None:
        """A counted slot is free: hand it to the first live waiter, else uncount it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._slots -= 1

    def _remove_waiter(self, waiter: asyncio.Future[Connection | None]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def _expire(self, count: int) -> None:
        """Close the `count` oldest idle connections."""
        expired = self._idle[:count]
        del self._idle[:count]
        for conn in expired:
            conn.abort()

    def _sweep_idle(self) -> None:
        self._sweep = None
        idle = self._idle
        deadline = asyncio.get_running_loop().time() - self._keepalive
        count = 0
        while count < len(idle) and idle[count].idle_since <= deadline:
            count += 1
        self._expire(count)
        if idle:
            self._sweep = asyncio.get_running_loop().call_at(idle[0].idle_since + self._keepalive, self._sweep_idle)

    # -- stalls ---------------------------------------------------------------------------------------------------

    def _arm_stall_check(self, loop: asyncio.AbstractEventLoop, watch: float) -> None:
        if self._stall_check is not None:
            self._stall_check.cancel()
        self._stall_period = _period(watch)
        self._stall_check = loop.call_later(self._stall_period, self._check_stalls)

    def _check_stalls(self) -> None:
        """Fail the watched requests that have waited their watch for their server; re-armed while any is out."""
        self._stall_check = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        shortest = 0.0
        for conn in list(self._in_use):  # (a stalled connection leaves `_in_use` as it closes)
            if conn.watch and not conn.stalled(now) and not conn.closed:
                shortest = min(shortest, conn.watch) if shortest else conn.watch
        if shortest:
            self._arm_stall_check(loop, shortest)

    def _where(self) -> str:
        return self._socket_path if self._socket_path is not None else f"{self._host}:{self._port}"


def _period(watch: float) -> float:
    """How often the connections are checked for stalls while requests watched for `watch` seconds are out."""
    return max(watch / 4, 0.005)
