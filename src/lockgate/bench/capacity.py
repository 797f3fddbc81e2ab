"""`lockgate bench capacity`: a large engine is not capped by the gateway, a small one is found.

A simulator (real step loop, not `--fast`) and a gateway with the default configuration (no
`max_concurrency`: the limit is discovered) run as child processes.

- **large**: the engine runs `large_seqs` (256) sequences at once; `streams` (256) clients stream
  `max_tokens` (20) chunks each in a closed loop, straight to the engine and then through the gateway,
  in alternating rounds. Reported: chunks/s and first-chunk p50/p99 of each, and the issue's targets
  (>= 0.9x direct chunks/s, first-chunk p99 within 50 ms of direct).
- **small**: the engine runs `small_seqs` (8); `4 x small_seqs` clients stream through the gateway
  for `settle_s` seconds while the instance's limit (`GET /admin/fleet`) is sampled: where it settles.
  (P0 protection at that limit: `lockgate bench priority --sims 1 --slots 8`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .load import LoadResult, closed_loop, percentile
from .overhead import child, free_port, wait_http
from .progress import Progress

MODEL = "bench-model"


@dataclass(frozen=True, slots=True)
class Settings:
    large_seqs: int = 256
    streams: int = 256
    max_tokens: int = 20
    requests: int = 1024  # per round and target
    rounds: int = 2
    tpot_ms: float = 10.0
    small_seqs: int = 8
    settle_s: float = 6.0


@dataclass
class Large:
    direct: list[LoadResult] = field(default_factory=list)
    gateway: list[LoadResult] = field(default_factory=list)


@dataclass
class Small:
    #: (seconds since the load started, the instance's limit)
    limits: list[tuple[float, int]] = field(default_factory=list)
    result: LoadResult | None = None


def _config(path: Path, gateway_port: int, engine_port: int, tmp: str) -> None:
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        f"usage: {{path: {os.path.join(tmp, 'usage.sqlite3')}}}\n"
        f"models:\n  - name: {MODEL}\n"
        f"    instances:\n      - {{url: 'http://127.0.0.1:{engine_port}', engine: vllm}}\n"
    )


def _body(max_tokens: int) -> Any:
    def make(n: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Stream something #{n}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }

    return make


@contextlib.asynccontextmanager
async def _fleet(seqs: int, settings: Settings, progress: Progress) -> Any:
    engine_port, gateway_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "bench.yaml"
        _config(config_path, gateway_port, engine_port, tmp)
        sim_args = ["sim", "--port", str(engine_port), "--model", MODEL, "--max-num-seqs", str(seqs)]
        sim_args += ["--tpot-ms", str(settings.tpot_ms)]
        with child(sim_args) as sim, child(["serve", "--config", str(config_path)]) as gw:
            progress.phase(f"starting an engine of {seqs} sequences and the gateway")
            engine, gateway = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
            await wait_http(engine + "/health", sim)
            await wait_http(gateway + "/ready", gw)
            yield engine, gateway


async def run_large(settings: Settings, progress: Progress) -> Large:
    out = Large()
    make = _body(settings.max_tokens)
    async with _fleet(settings.large_seqs, settings, progress) as (engine, gateway):
        for round_ in range(settings.rounds):
            for target, base, into in (("direct", engine, out.direct), ("gateway", gateway, out.gateway)):
                progress.phase(f"{settings.streams} streams, round {round_ + 1}/{settings.rounds}, {target}")
                url = base + "/v1/chat/completions"
                # Warm-up (connections), then the measured round.
                await closed_loop(
                    url, make, concurrency=settings.streams, requests=settings.streams, stream=True, client="lean"
                )
                into.append(
                    await closed_loop(
                        url, make, concurrency=settings.streams, requests=settings.requests, stream=True, client="lean"
                    )
                )
    return out


async def run_small(settings: Settings, progress: Progress) -> Small:
    out = Small()
    make = _body(settings.max_tokens)
    async with _fleet(settings.small_seqs, settings, progress) as (_, gateway):
        progress.phase(f"{4 * settings.small_seqs} streams through an engine of {settings.small_seqs}")
        started = time.monotonic()
        stop = asyncio.Event()

        async def sample() -> None:
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    async with session.get(gateway + "/admin/fleet") as resp:
                        body = await resp.json()
                    out.limits.append((time.monotonic() - started, int(body["instances"][0]["max_concurrency"])))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)

        async def load() -> None:
            try:
                per_s = settings.small_seqs / (settings.max_tokens * settings.tpot_ms / 1000)
                out.result = await closed_loop(
                    gateway + "/v1/chat/completions",
                    make,
                    concurrency=4 * settings.small_seqs,
                    requests=int(per_s * settings.settle_s),
                    stream=True,
                    client="lean",
                )
            finally:
                stop.set()

        async with asyncio.TaskGroup() as group:
            group.create_task(sample())
            group.create_task(load())
    return out


def _sum(results: list[LoadResult]) -> LoadResult:
    return LoadResult(
        requests=sum(r.requests for r in results),
        errors=sum(r.errors for r in results),
        seconds=sum(r.seconds for r in results),
        latencies=[x for r in results for x in r.latencies],
        ttfts=[x for r in results for x in r.ttfts],
    )


def _large_lines(large: Large, settings: Settings) -> tuple[list[str], list[tuple[bool, str]]]:
    """The large engine's table and its checks: chunks/s of answered streams only (a gateway whose every request
    failed at once made many "requests" per second), no request failed."""
    direct, gateway = _sum(large.direct), _sum(large.gateway)
    lines = [
        f"large: engine runs {settings.large_seqs} at once, {settings.streams} clients streaming "
        f"{settings.max_tokens} chunks, no max_concurrency",
        f"{'target':<9}{'chunks/s':>10}{'first p50 ms':>14}{'first p99 ms':>14}{'errors':>8}",
    ]
    for name, r in (("direct", direct), ("gateway", gateway)):
        lines.append(
            f"{name:<9}{r.rps * settings.max_tokens:>10.0f}{percentile(r.ttfts, 50) * 1000:>14.1f}"
            f"{percentile(r.ttfts, 99) * 1000:>14.1f}{r.errors:>8}"
        )
    ratio = gateway.rps / direct.rps if direct.rps else float("nan")
    gap = (percentile(gateway.ttfts, 99) - percentile(direct.ttfts, 99)) * 1000
    rounds = " ".join(
        f"{g.rps / d.rps:.2f}" if d.rps else "-" for d, g in zip(large.direct, large.gateway, strict=True)
    )
    checks = [
        (direct.errors + gateway.errors == 0, f"no failed request (direct {direct.errors}, gateway {gateway.errors})"),
        (ratio >= 0.9, f"chunks/s {ratio:.2f}x direct (rounds: {rounds}; target >= 0.9x)"),
        (gap <= 50, f"first-chunk p99 {gap:+.1f} ms vs direct (target <= +50 ms)"),
    ]
    return lines, checks


def _small_lines(small: Small, settings: Settings) -> tuple[list[str], list[tuple[bool, str]]]:
    """Where the small engine's limit settled, and the load's failures (none expected: the gateway queues)."""
    errors = small.result.errors if small.result is not None else 0
    requests = small.result.requests if small.result is not None else 0
    if not small.limits:
        return [f"small: engine runs {settings.small_seqs}; no limit sampled"], [
            (False, f"the limit settles at about {settings.small_seqs}: never sampled"),
            (errors == 0, f"no failed request ({errors} of {requests})"),
        ]
    settled = [limit for t, limit in small.limits if t >= settings.settle_s / 2]
    trail = " ".join(f"{t:.1f}s:{limit}" for t, limit in small.limits[:: max(1, len(small.limits) // 12)])
    final = settled[-1] if settled else small.limits[-1][1]
    lines = [
        f"small: engine runs {settings.small_seqs}; limit over time: {trail}; settled at {final} "
        f"(second half: min {min(settled, default=final)}, max {max(settled, default=final)}); "
        f"{errors} of {requests} streams failed"
    ]
    ok = abs(final - settings.small_seqs) <= max(1, settings.small_seqs // 4)
    return lines, [
        (errors == 0, f"no failed request ({errors} of {requests})"),
        (ok, f"the limit settles at about {settings.small_seqs}"),
    ]


def _parts(
    large: Large | None, small: Small | None, settings: Settings
) -> list[tuple[list[str], list[tuple[bool, str]]]]:
    """Each mode that ran: its lines and its checks."""
    parts = [_large_lines(large, settings)] if large is not None else []
    return parts + ([_small_lines(small, settings)] if small is not None else [])


def passed(large: Large | None, small: Small | None, settings: Settings) -> bool:
    """Every target met and no request failed (the command exits 1 otherwise)."""
    return all(ok for _, part_checks in _parts(large, small, settings) for ok, _ in part_checks)


def report(large: Large | None, small: Small | None, settings: Settings) -> str:
    parts = _parts(large, small, settings)
    lines: list[str] = []
    for text, part_checks in parts:
        lines += text + [f"{'PASS' if ok else 'MISS'}  {what}" for ok, what in part_checks]
    return "\n".join(lines)
