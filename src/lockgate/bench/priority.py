"""`lockgate bench priority`: P0 latency under a P2 flood, P2 progress, shares, rejections.

Two simulators with few sequence slots each and a gateway run as child processes. Phase 1 sends only
a steady trickle of P0 requests (the baseline). Phase 2 sends the same P0 trickle while P2 floods at
about twice the fleet's capacity and P1 arrives at about its capacity (so that P1 and P2 are both
backlogged and their shares can be compared with the configured weights). Arrivals are open-loop
(Poisson); at the end of each phase the requests still waiting are abandoned (clients disconnect),
so a run is bounded by `2 * duration + drain`. Figures are noisy on a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from .load import percentile
from .overhead import child, free_port, wait_http

MODEL = "bench-model"
CLASSES = ("P0", "P1", "P2")
WEIGHTS = {"P1": 0.3, "P2": 0.1}


@dataclass
class Outcome:
    priority: str
    status: int  # 0: abandoned at the end of the phase (or a client error)
    ttft: float | None
    finished_at: float


@dataclass
class Phase:
    name: str
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)

    def ttfts(self, priority: str) -> list[float]:
        return [o.ttft for o in self.outcomes if o.priority == priority and o.status == 200 and o.ttft is not None]

    def count(self, priority: str, status: int) -> int:
        return sum(1 for o in self.outcomes if o.priority == priority and o.status == status)


@dataclass
class Settings:
    duration_s: float = 8.0
    sims: int = 2
    slots_per_sim: int = 4
    tpot_ms: float = 10.0
    max_tokens: int = 24
    p0_rate: float = 4.0
    p2_factor: float = 2.0
    p1_factor: float = 1.0
    headroom: float = 0.125
    max_queue: int = 64
    seed: int = 1


def _config(path: Path, settings: Settings, gateway_port: int, sim_ports: list[int], tmp: str) -> None:
    instances = "".join(
        f"      - {{url: 'http://127.0.0.1:{p}', engine: vllm, max_concurrency: {settings.slots_per_sim}}}\n"
        for p in sim_ports
    )
    q = settings.max_queue
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        f"usage: {{path: {os.path.join(tmp, 'usage.sqlite3')}}}\n"
        "scheduling:\n"
        f"  strict_headroom: {settings.headroom}\n"
        "  classes:\n"
        f"    - {{name: P0, strict: true, max_queue: {q}, queue_timeout_ms: 10000}}\n"
        f"    - {{name: P1, weight: {WEIGHTS['P1']}, max_queue: {q}, queue_timeout_ms: 60000}}\n"
        f"    - {{name: P2, weight: {WEIGHTS['P2']}, max_queue: {q}, queue_timeout_ms: 60000}}\n"
        f"models:\n  - name: {MODEL}\n    routing: least_load\n    instances:\n{instances}"
    )


async def _one(session: aiohttp.ClientSession, url: str, priority: str, n: int, max_tokens: int) -> Outcome:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{priority} request {n}: tell me something"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    start = time.perf_counter()
    ttft: float | None = None
    status = 0
    try:
        async with session.post(url, data=body, headers={"x-priority": priority}) as resp:
            status = resp.status
            async for line in resp.content:
                if (
                    ttft is None
                    and line.startswith(b"data: ")
                    and b'"content":"' in line
                    and b'"content":""' not in line
                ):
                    ttft = time.perf_counter() - start
    except aiohttp.ClientError:
        status = 0
    return Outcome(priority, status, ttft, time.perf_counter())


async def _arrivals(
    session: aiohttp.ClientSession,
    url: str,
    priority: str,
    rate: float,
    seconds: float,
    settings: Settings,
    rng: random.Random,
    tasks: list[asyncio.Task[Outcome]],
) -> None:
    """Open-loop Poisson arrivals; every request's task goes into `tasks` (owned by the phase)."""
    if rate <= 0:
        return
    end = time.perf_counter() + seconds
    n = 0
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.perf_counter() >= end:
            return
        n += 1
        tasks.append(asyncio.create_task(_one(session, url, priority, n, settings.max_tokens)))


async def _phase(name: str, url: str, rates: dict[str, float], settings: Settings, drain_s: float) -> Phase:
    phase = Phase(name, settings.duration_s)
    rng = random.Random(settings.seed)
    tasks: list[asyncio.Task[Outcome]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            await asyncio.gather(
                *(
                    _arrivals(session, url, p, r, settings.duration_s, settings, random.Random(rng.random()), tasks)
                    for p, r in rates.items()
                )
            )
            if tasks:
                await asyncio.wait(tasks, timeout=drain_s)
        finally:
            for task in tasks:
                task.cancel()  # abandon what is still waiting: the client disconnects
            results = await asyncio.gather(*tasks, return_exceptions=True)
    phase.outcomes = [r for r in results if isinstance(r, Outcome)]
    return phase


async def run(settings: Settings) -> tuple[Phase, Phase, dict[str, float]]:
    capacity = settings.sims * settings.slots_per_sim
    service_s = settings.max_tokens * settings.tpot_ms / 1000
    capacity_rps = capacity / service_s
    sim_ports = [free_port() for _ in range(settings.sims)]
    gateway_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "bench.yaml"
        _config(config_path, settings, gateway_port, sim_ports, tmp)
        sim_args = [
            [
                "sim",
                "--port",
                str(p),
                "--model",
                MODEL,
                "--max-num-seqs",
                str(settings.slots_per_sim),
                "--tpot-ms",
                str(settings.tpot_ms),
                "--seed",
                str(i),
            ]
            for i, p in enumerate(sim_ports)
        ]
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(child(cmd)) for cmd in [*sim_args, ["serve", "--config", str(config_path)]]]
            for port, proc in zip(sim_ports, procs, strict=False):
                await wait_http(f"http://127.0.0.1:{port}/health", proc)
            await wait_http(f"http://127.0.0.1:{gateway_port}/ready", procs[-1])
            url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            drain = 2.0
            baseline = await _phase("P0 only", url, {"P0": settings.p0_rate}, settings, drain)
            flood = await _phase(
                "P0 + P1 + P2 flood",
                url,
                {
                    "P0": settings.p0_rate,
                    "P1": settings.p1_factor * capacity_rps,
                    "P2": settings.p2_factor * capacity_rps,
                },
                settings,
                drain,
            )
    return baseline, flood, {"capacity": capacity, "capacity_rps": capacity_rps}


def report(baseline: Phase, flood: Phase, info: dict[str, float], settings: Settings) -> str:
    def ms(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:8.1f}" if values else "     n/a"

    lines = [
        f"fleet: {settings.sims} sims x {settings.slots_per_sim} slots = {int(info['capacity'])} slots, "
        f"~{info['capacity_rps']:.0f} req/s at {settings.max_tokens} tokens x {settings.tpot_ms:g} ms; "
        f"P0 {settings.p0_rate:g}/s, P1 {settings.p1_factor:g}x, P2 {settings.p2_factor:g}x capacity; "
        f"{settings.duration_s:g} s per phase; strict headroom {settings.headroom:g}",
        f"{'phase':<20}{'class':<6}{'sent':>6}{'ok':>6}{'429':>6}{'503':>6}{'left':>6}"
        f"{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'ok/s':>7}",
    ]
    for phase in (baseline, flood):
        for priority in CLASSES:
            sent = sum(1 for o in phase.outcomes if o.priority == priority)
            if not sent:
                continue
            ttfts = phase.ttfts(priority)
            ok = phase.count(priority, 200)
            lines.append(
                f"{phase.name:<20}{priority:<6}{sent:>6}{ok:>6}{phase.count(priority, 429):>6}"
                f"{phase.count(priority, 503):>6}{phase.count(priority, 0):>6}"
                f"{ms(ttfts, 50):>13}{ms(ttfts, 99):>13}{ok / phase.seconds:>7.1f}"
            )
    base99 = percentile(baseline.ttfts("P0"), 99)
    flood99 = percentile(flood.ttfts("P0"), 99)
    ratio = flood99 / base99 if base99 else float("nan")
    lines.append(
        f"P0 TTFT p99: {base99 * 1000:.1f} ms alone, {flood99 * 1000:.1f} ms under the flood: "
        f"ratio {ratio:.2f}x (target <= 1.25x)"
    )
    ok = Counter(o.priority for o in flood.outcomes if o.status == 200 and o.priority in WEIGHTS)
    total = sum(ok.values())
    if total:
        total_w = sum(WEIGHTS.values())
        shares = ", ".join(f"{p} {ok[p] / total:.2f} (configured {w / total_w:.2f})" for p, w in WEIGHTS.items())
        lines.append(f"shares of completed P1+P2 under the flood: {shares}")
    p2_ok = ok["P2"]
    lines.append(
        f"P2 throughput under the flood: {p2_ok / flood.seconds:.1f} req/s ({'progressing' if p2_ok else 'STARVED'})"
    )
    by_status: defaultdict[str, int] = defaultdict(int)
    for o in flood.outcomes:
        if o.status in (429, 503):
            by_status[f"{o.priority}:{o.status}"] += 1
    lines.append(
        "rejections under the flood: " + (", ".join(f"{k}={v}" for k, v in sorted(by_status.items())) or "none")
    )
    return "\n".join(lines)
