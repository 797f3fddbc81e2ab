"""`FaultProxy`: a TCP proxy on loopback that resets, or freezes, a fraction of the engine requests crossing it.

Theory of operation
-------------------
Each accepted connection is piped to the target by two pumps (client -> target, target -> client), each
reading at most `CHUNK` bytes and waiting for the other side to drain before reading more, so the proxy
holds at most a chunk per direction per connection. A request is recognised by a client -> target chunk
that starts with one of `methods` and a path under `paths` (the gateway writes a request's head in one
write; health probes and metric scrapes are left alone, so only the request path sees faults). With
probability `reset_fraction` such a request arms a reset at a random point of the answer: before the
request reaches the target, or after 1..`max_offset` bytes of what the target sends back. At that point
both sockets are closed with `SO_LINGER` 0, so each peer sees a TCP reset, as from a crashing engine or a
middlebox. A request that ends before its reset point leaves the reset armed for the connection's next bytes.
With probability `stall_fraction` a request (one not reset) arms a stall the same way instead: at that point of
the answer nothing more is passed on — a hung engine, its connection open — until the client closes its side; then
the target's connection is closed too (the engine sees its client gone).

Resource handling: `FaultProxy` is an async context manager; it owns its listener and one task per
connection, which `aclose()` cancels and awaits (aborting both sockets). The random source is seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from dataclasses import dataclass

from ..tasks import cancel_and_wait

#: Bytes read at a time in each direction.
CHUNK = 64 * 1024


@dataclass(slots=True)
class ProxyStatistics:
    connections: int = 0
    #: Connections open now (from the client side, i.e. the gateway's upstream connections).
    open: int = 0
    requests: int = 0
    resets_before_answer: int = 0
    resets_mid_answer: int = 0
    #: Answers frozen (at their stall point).
    stalls: int = 0

    @property
    def resets(self) -> int:
        return self.resets_before_answer + self.resets_mid_answer


class _Link:
    """One proxied connection: its reset or stall point (bytes of answer still to let through), if armed."""

    __slots__ = ("client", "closed", "gone", "reset_in", "stall_in", "target")

    def __init__(self, client: asyncio.StreamWriter, target: asyncio.StreamWriter) -> None:
        self.client = client
        self.target = target
        self.reset_in: int | None = None
        self.stall_in: int | None = None
        self.closed = False
        #: The client's side has ended (closed or reset): a stalled answer waits for it.
        self.gone = asyncio.Event()

    def reset(self) -> None:
        """Close both sockets with a TCP reset (once)."""
        if self.closed:
            return
        self.closed = True
        for writer in (self.client, self.target):
            if not writer.transport.is_closing():
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError, ValueError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class FaultProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        reset_fraction: float = 0.0,
        stall_fraction: float = 0.0,
        max_offset: int = 4096,
        seed: int = 0,
        methods: tuple[bytes, ...] = (b"POST ",),
        paths: tuple[bytes, ...] = (b"/v1/",),
    ) -> None:
        self._target = (target_host, target_port)
        #: May be changed while running (e.g. 0 during a warm-up).
        self.reset_fraction = reset_fraction
        self.stall_fraction = stall_fraction
        self._max_offset = max(0, max_offset)
        self._rng = random.Random(seed)
        self._starts = tuple(m + p for m in methods for p in paths)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = ProxyStatistics()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.connections += 1
        self.stats.open += 1
        try:
            try:
                target_reader, target_writer = await asyncio.open_connection(*self._target)
            except OSError:
                writer.transport.abort()
                return
            link = _Link(writer, target_writer)
            for w in (writer, target_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upward = asyncio.create_task(self._requests(link, reader, target_writer))
            try:
                await self._answers(link, target_reader, writer)
            except OSError:
                link.reset()
            finally:
                target_writer.transport.abort()
                await cancel_and_wait(upward)
        except asyncio.CancelledError:
            pass  # closed by aclose() (a cancelled connection task is logged as an error on 3.11)
        finally:
            writer.transport.abort()
            self.stats.open -= 1
            self._tasks.discard(task)

    async def _requests(self, link: _Link, reader: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        """Client -> target; arms resets on requests. Ends at the client's EOF (passed on as a half-close)."""
        try:
            while (chunk := await reader.read(CHUNK)) and not link.closed:
                if chunk.startswith(self._starts):
                    self.stats.requests += 1
                    if self.reset_fraction and self._rng.random() < self.reset_fraction:
                        offset = self._rng.randrange(0, self._max_offset + 1)
                        if offset == 0:
                            self.stats.resets_before_answer += 1
                            link.reset()
                            return
                        link.reset_in = offset
                    elif self.stall_fraction and self._rng.random() < self.stall_fraction:
                        link.stall_in = self._rng.randrange(0, self._max_offset + 1)
                target.write(chunk)
                await target.drain()
            if not link.closed and not target.transport.is_closing() and target.can_write_eof():
                target.write_eof()
        except OSError:
            link.reset()
        finally:
            link.gone.set()

    async def _answers(self, link: _Link, reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """Target -> client, until the target closes (then the client is closed too) or a reset point."""
        while (chunk := await reader.read(CHUNK)) and not link.closed:
            if client.transport.is_closing():  # the client went away
                return
            stall_in = link.stall_in
            if stall_in is not None:
                if len(chunk) >= stall_in:
                    client.write(chunk[:stall_in])
                    self.stats.stalls += 1
                    await link.gone.wait()  # hung, until the client gives up on it
                    return
                link.stall_in = stall_in - len(chunk)
            reset_in = link.reset_in
            if reset_in is not None and len(chunk) >= reset_in:
                client.write(chunk[:reset_in])
                self.stats.resets_mid_answer += 1
                link.reset()
                return
            if reset_in is not None:
                link.reset_in = reset_in - len(chunk)
            client.write(chunk)
            await client.drain()
        client.close()
