"""`lockgate bench inprocess`: the gateway's whole request path in one process, for exact comparisons.

A raw-socket client (`concurrency` keep-alive connections), a real `GatewayServer` and a canned engine (it
answers every request with the same small completion at once) run on one event loop, on loopback. The result
is the process's CPU per request, minus the same client against the canned engine directly: what the gateway
adds.

CPU time drifts with the machine (20-30% on a shared 2-core one); instruction counts do not. Run
`lockgate bench inprocess --target gateway` under `valgrind --tool=callgrind` at two sizes (`--requests 500` and
`2500`, `--warmup 300`) and divide the difference of the "Collected" totals by the difference in requests:
start-up cancels out, and two runs of the same code agree to ~1%. `--target direct` measures the client and
canned engine alone (~16k instructions per request) the same way (see docs/decisions.md, "The overhead target
and what it took"). Everything the gateway does per request runs here
except what only a real engine triggers (scrapes are off, health is probed once).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from typing import cast

import httptools
import orjson

from ..config import parse_config
from ..server import GatewayServer, tune_gc
from .progress import Progress

_COMPLETION = orjson.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "bench-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello there " * 8}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
    }
)
_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_COMPLETION),
    _COMPLETION,
)


def _body(*, stream: bool, deterministic: bool, usage: bool = True) -> tuple[bytes, bytes]:
    """A request's JSON body, split where a deterministic request's unique number goes (see `_Load`). A stream asks
    for usage unless `usage` is false (then the engine's chunks pass through unchanged)."""
    body: dict[str, object] = {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say something short #"}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    if deterministic:
        body["temperature"] = 0
    head, tail = orjson.dumps(body).split(b"#", 1)
    return head, tail


def _chunk(payload: dict[str, object]) -> bytes:
    event = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _stream_pieces(tokens: int = 16) -> list[bytes]:
    """The streamed completion: the head with the role event, then `tokens` tokens, finish, usage and `[DONE]`
    (19 events for 16 tokens), one chunk each."""
    head = {"id": "cmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "bench-model"}

    def choice(delta: dict[str, str], finish: str | None = None) -> bytes:
        return _chunk({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    events = [choice({"role": "assistant", "content": ""})]
    events += [choice({"content": "hello "}) for _ in range(tokens)]
    events.append(choice({}, "length"))
    usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
    events.append(_chunk({**head, "choices": [], "usage": usage}))
    done = b"data: [DONE]\n\n"
    events.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    head_bytes = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head_bytes + events[0], *events[1:]]


class _Engine(asyncio.Protocol):
    """Answers every request (health probes included) with the same completion, streamed when asked: at once
    (one write), or `paced`, one event per loop iteration (each reaches the gateway in a read of its own, as a
    real engine's tokens do)."""

    def __init__(self, paced: bool = False, tokens: int = 16) -> None:
        self._paced = paced
        self._pieces = _stream_pieces(tokens)
        self._whole = b"".join(self._pieces)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._parser = httptools.HttpRequestParser(self)
        self._body = b""
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._body = b""

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if self._body.find(b'"stream":true') < 0:
            self._transport.write(_ANSWER)
        elif self._paced:
            self._write_piece(0)
        else:
            self._transport.write(self._whole)

    def _write_piece(self, n: int) -> None:
        if self._transport.is_closing():
            return
        self._transport.write(self._pieces[n])
        if n + 1 < len(self._pieces):
            self._loop.call_soon(self._write_piece, n + 1)


class _Load:
    """A closed loop over `connections` keep-alive connections until `requests` have been answered. A
    `deterministic` load sends temperature 0 with a prompt made unique by a counter: every request is eligible
    for de-duplication and leads a flight of its own (nothing to coalesce, nothing cached to reuse)."""

    def __init__(
        self,
        port: int,
        requests: int,
        connections: int,
        stream: bool = False,
        deterministic: bool = False,
        usage: bool = True,
    ) -> None:
        self._port = port
        self._head, self._tail = _body(stream=stream, deterministic=deterministic, usage=usage)
        self._deterministic = deterministic
        self._count = 0
        self._fixed = self._request(b"")
        self.left = requests
        self.ok = 0
        self.open = connections
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _request(self, unique: bytes) -> bytes:
        body = self._head + unique + self._tail
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (self._port, len(body), body)
        )

    def next_request(self) -> bytes:
        if not self._deterministic:
            return self._fixed
        self._count += 1
        return self._request(b"%d" % self._count)


class _Client(asyncio.Protocol):
    def __init__(self, load: _Load) -> None:
        self._load = load

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._parser = httptools.HttpResponseParser(self)
        self._send()

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self._load.ok += self._parser.get_status_code() == 200
        self._send()

    def _send(self) -> None:
        load = self._load
        if load.left > 0:
            load.left -= 1
            self._transport.write(load.next_request())
            return
        load.open -= 1
        if load.open == 0 and not load.done.done():
            load.done.set_result(None)


async def _drive(
    port: int, requests: int, connections: int, stream: bool = False, deterministic: bool = False, usage: bool = True
) -> int:
    """`requests` over `connections` keep-alive connections; the number answered 200. No connection would wait
    forever (the last one closing is what ends the load)."""
    if connections < 1:
        raise ValueError(f"at least one connection is needed, got {connections}")
    loop = asyncio.get_running_loop()
    load = _Load(port, requests, connections, stream, deterministic, usage)
    transports = [
        (await loop.create_connection(lambda: _Client(load), "127.0.0.1", port))[0] for _ in range(connections)
    ]
    try:
        await load.done
    finally:
        for transport in transports:
            transport.close()
    return load.ok


@dataclass
class InProcessResult:
    requests: int
    #: Requests answered 200 through the gateway (or straight, when only that was measured).
    ok: int
    #: Process CPU (user + system) per request, through the gateway and straight to the canned engine (None: not
    #: measured).
    gateway_us: float | None
    direct_us: float | None


async def _measured(
    port: int, requests: int, connections: int, stream: bool, deterministic: bool, usage: bool
) -> tuple[int, float]:
    start = time.process_time()
    ok = await _drive(port, requests, connections, stream, deterministic, usage)
    return ok, (time.process_time() - start) / requests * 1e6


async def run(
    requests: int = 10_000,
    warmup: int = 1000,
    concurrency: int = 64,
    target: str = "both",
    progress: Progress | None = None,
    *,
    stream: bool = False,
    instances: int = 1,
    routing: str = "least_load",
    paced: bool = False,
    deterministic: bool = False,
    tokens: int = 16,
    usage: bool = True,
) -> InProcessResult:
    """`target`: "gateway", "direct" (the client and the canned engine alone) or "both". `stream`: streamed
    answers (`tokens` token events from the engine, 19 events in all for 16), `paced`: written one loop iteration
    apart; `instances`: the canned engine listed that many times (under different names), so that `routing`
    chooses among them on every request; `deterministic`: temperature 0 and unique prompts (every request leads
    a de-duplication flight); `usage`: streams ask for usage (`stream_options`), so that each chunk is rewritten
    for the client (`usage: null`); without, they pass through unchanged."""
    progress = progress or Progress.silent()
    loop = asyncio.get_running_loop()
    engine = await loop.create_server(lambda: _Engine(paced, tokens), "0.0.0.0" if instances > 1 else "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    try:
        with tempfile.TemporaryDirectory(prefix="lockgate-inprocess-") as tmp:
            config = parse_config(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "usage": {"path": os.path.join(tmp, "usage.sqlite3")},
                    "scrape": {"enabled": False},
                    # Lenient (one probe at start; connections): under valgrind everything is ~50x slower, and a
                    # probe or a connection that timed out would take the instance out (every request a 503).
                    "health": {"interval_ms": 3_600_000, "timeout_ms": 60_000},
                    "upstream": {"connect_timeout_ms": 60_000},
                    "models": [
                        {
                            "name": "bench-model",
                            "routing": routing,
                            "instances": [
                                {
                                    "url": f"http://127.0.0.{1 + n}:{engine_port}",
                                    "engine": "vllm",
                                    "max_concurrency": 1024,
                                }
                                for n in range(instances)
                            ],
                        }
                    ],
                },
                "bench inprocess",
            )
            async with GatewayServer(config, port=0) as gateway:
                gateway_port = int(gateway.url.rsplit(":", 1)[1])
                tune_gc()  # as `lockgate serve` does
                ok = 0
                direct_us = gateway_us = None
                if target in ("direct", "both"):
                    progress.phase(f"straight to the canned engine ({warmup} + {requests} requests)")
                    await _drive(engine_port, warmup, concurrency, stream, deterministic, usage)
                    ok, direct_us = await _measured(engine_port, requests, concurrency, stream, deterministic, usage)
                if target in ("gateway", "both"):
                    progress.phase(f"through the gateway ({warmup} + {requests} requests)")
                    await _drive(gateway_port, warmup, concurrency, stream, deterministic, usage)
                    ok, gateway_us = await _measured(gateway_port, requests, concurrency, stream, deterministic, usage)
    finally:
        engine.close()
    return InProcessResult(requests, ok, gateway_us, direct_us)


def report(result: InProcessResult) -> str:
    through, direct = result.gateway_us, result.direct_us
    head = f"{result.requests} requests, {result.ok} answered 200; CPU per request in this process:"
    if through is not None and direct is not None:
        return (
            f"{head} {through:.1f} us through the gateway, {direct:.1f} us straight to the canned engine: "
            f"the gateway adds {through - direct:.1f} us"
        )
    if through is not None:
        return f"{head} {through:.1f} us through the gateway (client and canned engine included)"
    return f"{head} {direct:.1f} us straight to the canned engine (client included)"
