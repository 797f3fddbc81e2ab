"""A closed-loop HTTP load generator and the small statistics the benchmarks print.

Two clients: aiohttp's (~90 us of CPU per small request on this kind of machine) and lockgate's own
lean pool (`lockgate.http`, ~40 us). When the client shares the machine's cores with the engine and the
gateway, its own cost is taken from theirs: the lean one leaves the measurement to what is measured.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..http import HttpClientError, HttpPool

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def poisson_offsets(rate: float, seconds: float, rng: random.Random) -> Iterator[float]:
    """The arrival times (seconds after the start) of a Poisson process at `rate` per second over `seconds`, from
    `rng`'s exponential gaps. A rate that is not positive and finite is refused: a negative one made negative
    gaps, a schedule that never reached its end."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"an arrival rate must be positive and finite, got {rate}")
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return
        yield at


async def open_loop(
    rate: float,
    seconds: float,
    rng: random.Random,
    send: Callable[[int], object],
    *,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> int:
    """Calls `send(n)` (n = 1, 2, ...) at each arrival of `poisson_offsets`, against times fixed from the start: a
    loop woken late sends the arrivals already due at once and the later ones on time (gaps slept one after the
    other added each wake-up's lag, and offered a fraction of the rate). It awaits before every arrival (0 s when
    late), so a cancellation is always heard. Returns the number sent. `clock` and `sleep`: time.perf_counter and
    asyncio.sleep unless given."""
    clock = clock or time.perf_counter
    sleep = sleep or asyncio.sleep
    start = clock()
    n = 0
    for at in poisson_offsets(rate, seconds, rng):
        await sleep(max(0.0, start + at - clock()))
        n += 1
        send(n)
    return n


@dataclass
class LoadResult:
    #: Requests sent, failed ones included.
    requests: int
    #: Requests not answered 200 (a status, or the connection failed).
    errors: int
    seconds: float
    latencies: list[float]
    ttfts: list[float]

    @property
    def ok(self) -> int:
        """Requests answered 200: the throughput (a failed request is no work done)."""
        return max(0, self.requests - self.errors)

    @property
    def rps(self) -> float:
        """Successful requests per second (a gateway whose every request failed fast did not serve them)."""
        return self.ok / self.seconds if self.seconds else 0.0


#: One request: its HTTP status (0 when the client failed) and, for a stream, when it ended being read
#: up to its first chunk (None otherwise).
Post = Callable[[bytes], Awaitable[tuple[int, float | None]]]


async def closed_loop(
    url: str,
    make_body: Callable[[int], dict[str, Any]],
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    headers: dict[str, str] | None = None,
    client: str = "aiohttp",
    on_done: Callable[[], object] | None = None,
) -> LoadResult:
    """`concurrency` workers send `requests` requests in total, each waiting for its answer; `on_done`
    is called after each answer (progress)."""
    run = functools.partial(
        _drive, make_body, concurrency=concurrency, requests=requests, stream=stream, on_done=on_done
    )
    if client == "lean":
        origin, _, rest = url.partition("://")
        host, _, path = rest.partition("/")
        pool = HttpPool(f"{origin}://{host}", max_connections=concurrency * 2)
        lean_headers = [("Content-Type", "application/json"), *(headers or {}).items()]

        async def lean_post(body: bytes) -> tuple[int, float | None]:
            try:
                resp = await pool.request("POST", "/" + path, body, lean_headers)
                return resp.status, await _read(resp.read, resp.chunks(), stream)
            except HttpClientError:
                return 0, None

        try:
            return await run(lean_post)
        finally:
            await pool.aclose()
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=False)
    base_headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def aiohttp_post(body: bytes) -> tuple[int, float | None]:
            try:
                async with session.post(url, data=body, headers=base_headers) as resp:
                    return resp.status, await _read(resp.read, resp.content.iter_any(), stream)
            except aiohttp.ClientError:
                return 0, None

        return await run(aiohttp_post)


async def _read(read: Callable[[], Awaitable[bytes]], chunks: AsyncIterator[bytes], stream: bool) -> float | None:
    """Read a whole answer; for a stream, return when its first chunk arrived."""
    if not stream:
        await read()
        return None
    first = None
    async for _ in chunks:
        if first is None:
            first = time.perf_counter()
    return first or time.perf_counter()


async def _drive(
    make_body: Callable[[int], dict[str, Any]],
    post: Post,
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    on_done: Callable[[], object] | None,
) -> LoadResult:
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    counter = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for n in counter:
            body = orjson.dumps(make_body(n))
            start = time.perf_counter()
            status, first = await post(body)
            if status != 200:
                errors += 1  # not timed: a refusal or a reset is fast, and would flatter the percentiles
            else:
                if first is not None:
                    ttfts.append(first - start)
                latencies.append(time.perf_counter() - start)
            if on_done is not None:
                on_done()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(requests, errors, time.perf_counter() - started, latencies, ttfts)
