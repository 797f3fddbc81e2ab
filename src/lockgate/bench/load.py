"""A closed-loop HTTP load generator and the small statistics the benchmarks print.

Two clients: aiohttp's (~90 us of CPU per small request on this kind of machine) and lockgate's own
lean pool (`lockgate.http`, ~40 us). When the client shares the machine's cores with the engine and the
gateway, its own cost is taken from theirs: the lean one leaves the measurement to what is measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    ttfts: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def closed_loop(
    url: str,
    make_body: Callable[[int], dict],
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    headers: dict[str, str] | None = None,
    client: str = "aiohttp",
) -> LoadResult:
    """`concurrency` workers send `requests` requests in total, each waiting for its answer."""
    if client == "lean":
        return await _lean_loop(
            url, make_body, concurrency=concurrency, requests=requests, stream=stream, headers=headers
        )
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=False)
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    counter = iter(range(requests))
    base_headers = {"Content-Type": "application/json", **(headers or {})}

    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal errors
            for n in counter:
                body = orjson.dumps(make_body(n))
                start = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=base_headers) as resp:
                        if stream:
                            first = None
                            async for _ in resp.content.iter_any():
                                if first is None:
                                    first = time.perf_counter()
                            ttfts.append((first or time.perf_counter()) - start)
                        else:
                            await resp.read()
                        if resp.status != 200:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return LoadResult(requests, errors, elapsed, latencies, ttfts)


async def _lean_loop(
    url: str,
    make_body: Callable[[int], dict],
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    headers: dict[str, str] | None,
) -> LoadResult:
    """`closed_loop` over `lockgate.http`'s keep-alive pool."""
    origin, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    pool = HttpPool(f"{origin}://{host}", max_connections=concurrency * 2)
    request_headers = [("Content-Type", "application/json"), *(headers or {}).items()]
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    counter = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for n in counter:
            body = orjson.dumps(make_body(n))
            start = time.perf_counter()
            try:
                resp = await pool.request("POST", "/" + path, body, request_headers)
                if stream:
                    first = None
                    async for _ in resp.chunks():
                        if first is None:
                            first = time.perf_counter()
                    ttfts.append((first or time.perf_counter()) - start)
                else:
                    await resp.read()
                if resp.status != 200:
                    errors += 1
            except HttpClientError:
                errors += 1
            latencies.append(time.perf_counter() - start)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        await pool.aclose()
    return LoadResult(requests, errors, elapsed, latencies, ttfts)
