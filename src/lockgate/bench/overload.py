"""`lockgate bench overload`: offered load swept past the engine's capacity; throughput and tail latency.

A simulator with `slots` sequence slots (real step loop: `tpot_ms` per token, `max_tokens` tokens an
answer) and a gateway in front of it, its instance limited to the same `slots` and every priority class's
queue to `max_queue` (0 by default: a request that finds no free slot is refused at once with 429, never
queued behind the engine), run as child processes.

1. Capacity: a closed loop of `slots` clients straight at the engine keeps it exactly full; its throughput is
   the capacity, and its latency p99 the engine's own time for a request at full load.
2. Sweep: for each multiple of the capacity in `levels`, an open loop (Poisson arrivals, fixed seed) offers
   that rate through the gateway for `duration_s`; admitted answers (200) and refusals (429/503) are timed.

lockgate's added p99 at a level is the admitted requests' p99 minus the engine's p99 at capacity (the gateway
never lets more than `slots` requests reach the engine, so the engine is at most that full). The curve —
throughput and p99 against offered load — is written as a self-contained SVG (`svg()`, drawn by hand).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from .load import closed_loop, open_loop, percentile
from .overhead import child, free_port, wait_http
from .progress import Progress

MODEL = "overload-model"
#: The issue's bound on lockgate's added p99 for admitted requests at 2x capacity.
TARGET_ADDED_P99_MS = 5.0


@dataclass
class Settings:
    levels: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5])
    duration_s: float = 5.0
    slots: int = 8
    tpot_ms: float = 10.0
    max_tokens: int = 8
    max_queue: int = 0
    seed: int = 7
    #: Scrape the engine's metrics (and so discover its concurrency limit) as a default deployment does.
    scrape: bool = False


@dataclass
class Level:
    factor: float
    offered_rps: float
    seconds: float
    admitted: list[float]
    #: Latencies of refusals (429 / 503).
    refused: list[float]
    #: Other answers (errors, broken connections).
    failed: int

    @property
    def throughput(self) -> float:
        return len(self.admitted) / self.seconds if self.seconds else 0.0

    @property
    def refused_rps(self) -> float:
        return len(self.refused) / self.seconds if self.seconds else 0.0


@dataclass
class OverloadResult:
    settings: Settings
    capacity_rps: float
    engine_p50_s: float
    engine_p99_s: float
    levels: list[Level]

    def added_p99_ms(self, level: Level) -> float:
        return (percentile(level.admitted, 99) - self.engine_p99_s) * 1000 if level.admitted else float("nan")


def _body(n: int, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Count to ten #{n}"}], "max_tokens": max_tokens}


async def run(settings: Settings, progress: Progress | None = None) -> OverloadResult:
    progress = progress or Progress.silent()
    engine_port, gateway_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="lockgate-overload-") as tmp:
        config_path = Path(tmp, "overload.yaml")
        _write_config(config_path, settings, gateway_port, engine_port, tmp)
        sim_args = [
            "sim",
            "--port",
            str(engine_port),
            "--model",
            MODEL,
            "--tpot-ms",
            str(settings.tpot_ms),
            "--max-num-seqs",
            str(settings.slots),
        ]
        with child(sim_args) as sim, child(["serve", "--config", str(config_path)]) as gw:
            progress.phase("starting the engine and the gateway")
            await wait_http(f"http://127.0.0.1:{engine_port}/health", sim)
            await wait_http(f"http://127.0.0.1:{gateway_port}/ready", gw)
            direct = f"http://127.0.0.1:{engine_port}/v1/chat/completions"
            progress.phase(f"engine capacity ({settings.slots} clients, {settings.duration_s:g} s)")

            def body(n: int) -> dict[str, object]:
                return _body(n, settings.max_tokens)

            await closed_loop(direct, body, concurrency=settings.slots, requests=settings.slots * 2, stream=False)
            capacity = await _closed_for(direct, settings)
            levels: list[Level] = []
            url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            rng = random.Random(settings.seed)
            for factor in settings.levels:
                rate = capacity[0] * factor
                progress.phase(f"offered {factor:g}x capacity ({rate:.0f} req/s)")
                levels.append(await _open_loop(url, rate, factor, settings, rng))
    return OverloadResult(settings, capacity[0], capacity[1], capacity[2], levels)


async def _closed_for(url: str, settings: Settings) -> tuple[float, float, float]:
    """(req/s, p50 s, p99 s) of `slots` clients straight at the engine for `duration_s`."""
    latencies: list[float] = []
    deadline = time.monotonic() + settings.duration_s
    async with aiohttp.ClientSession() as session:

        async def client(c: int) -> None:
            n = c
            while time.monotonic() < deadline:
                n += settings.slots
                start = time.perf_counter()
                async with session.post(url, json=_body(n, settings.max_tokens)) as resp:
                    await resp.read()
                if resp.status == 200:
                    latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(settings.slots)))
        seconds = time.perf_counter() - started
    return len(latencies) / seconds, percentile(latencies, 50), percentile(latencies, 99)


async def _open_loop(url: str, rate: float, factor: float, settings: Settings, rng: random.Random) -> Level:
    """Poisson arrivals at `rate` for `duration_s`, each its own request; waits for the last answer."""
    admitted: list[float] = []
    refused: list[float] = []
    failed = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(n: int) -> None:
            nonlocal failed
            start = time.perf_counter()
            try:
                async with session.post(url, json=_body(n, settings.max_tokens)) as resp:
                    await resp.read()
            except aiohttp.ClientError:
                failed += 1
                return
            elapsed = time.perf_counter() - start
            if resp.status == 200:
                admitted.append(elapsed)
            elif resp.status in (429, 503):
                refused.append(elapsed)
            else:
                failed += 1

        async with asyncio.TaskGroup() as group:
            await open_loop(rate, settings.duration_s, rng, lambda n: group.create_task(one(n)))
    return Level(factor, rate, settings.duration_s, admitted, refused, failed)


def _write_config(path: Path, settings: Settings, gateway_port: int, engine_port: int, tmp: str) -> None:
    classes = [
        {"name": "P0", "weight": 0.6, "strict": True, "max_queue": settings.max_queue},
        {"name": "P1", "weight": 0.3, "max_queue": settings.max_queue},
        {"name": "P2", "weight": 0.1, "max_queue": settings.max_queue},
    ]
    # Scrapes off: the instance's limit stays at `slots`. With them, the discovered concurrency limit
    # (fleet/capacity.py) read the simulator's momentary queue as saturation and cut the limit below its slots,
    # so that the gateway refused requests the engine had room for (goodput 14-43 req/s of a 71 req/s capacity at
    # 0.75-2.5x offered, in one run): `--scrape` measures that.
    config = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "usage": {"path": os.path.join(tmp, "usage.sqlite3")},
        "scrape": {"enabled": settings.scrape},
        "scheduling": {"classes": classes},
        "models": [
            {
                "name": MODEL,
                "instances": [
                    {"url": f"http://127.0.0.1:{engine_port}", "engine": "vllm", "max_concurrency": settings.slots}
                ],
            }
        ],
    }
    path.write_bytes(orjson.dumps(config))  # JSON is YAML


def report(result: OverloadResult) -> str:
    s = result.settings
    lines = [
        f"engine: {s.slots} slots, {s.tpot_ms:g} ms/token, {s.max_tokens} tokens an answer: capacity "
        f"{result.capacity_rps:.1f} req/s, latency at capacity p50 {result.engine_p50_s * 1000:.1f} ms, "
        f"p99 {result.engine_p99_s * 1000:.1f} ms; gateway queues: {s.max_queue}; scrapes "
        f"{'on (concurrency discovered)' if s.scrape else 'off (limit fixed at the slots)'}",
        f"{'offered':>8}{'req/s':>8}{'ok/s':>8}{'refused/s':>10}{'failed':>7}{'ok p50 ms':>10}{'ok p99 ms':>10}"
        f"{'added p99':>10}{'refusal p99 ms':>15}",
    ]
    verdict = ""
    for level in result.levels:
        added = result.added_p99_ms(level)
        lines.append(
            f"{level.factor:>7g}x{level.offered_rps:>8.1f}{level.throughput:>8.1f}{level.refused_rps:>10.1f}"
            f"{level.failed:>7}{percentile(level.admitted, 50) * 1000:>10.1f}"
            f"{percentile(level.admitted, 99) * 1000:>10.1f}{added:>10.1f}"
            f"{percentile(level.refused, 99) * 1000:>15.2f}"
        )
        if level.factor == 2.0:
            met = added <= TARGET_ADDED_P99_MS
            verdict = (
                f"at 2x capacity: lockgate's added p99 {added:.1f} ms (target <= {TARGET_ADDED_P99_MS:g} ms): "
                f"{'met' if met else 'NOT met'}; refusals p99 {percentile(level.refused, 99) * 1000:.2f} ms"
            )
    if verdict:
        lines.append(verdict)
    return "\n".join(lines)


def svg(result: OverloadResult) -> str:
    """Two panels: throughput (admitted, refused) and p99 latency (admitted, refusals, the engine's own at
    capacity) against offered load, in req/s."""
    xs = [lv.offered_rps for lv in result.levels]
    x_max = max(xs, default=1.0) * 1.05 or 1.0
    ok = [(lv.offered_rps, lv.throughput) for lv in result.levels]
    ref = [(lv.offered_rps, lv.refused_rps) for lv in result.levels]
    p99 = [(lv.offered_rps, percentile(lv.admitted, 99) * 1000) for lv in result.levels if lv.admitted]
    rp99 = [(lv.offered_rps, percentile(lv.refused, 99) * 1000) for lv in result.levels if lv.refused]
    engine_ms = result.engine_p99_s * 1000
    y1 = max([y for _, y in ok + ref] + [result.capacity_rps], default=1.0) * 1.1 or 1.0
    y2 = max([y for _, y in p99 + rp99] + [engine_ms], default=1.0) * 1.1 or 1.0
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="960" height="400" font-family="sans-serif" font-size="12">',
        '<rect width="960" height="400" fill="white"/>',
        f'<text x="480" y="20" text-anchor="middle" font-size="14">lockgate under overload: engine capacity '
        f"{result.capacity_rps:.0f} req/s ({result.settings.slots} slots), gateway queue {result.settings.max_queue}"
        "</text>",
    ]
    panels = (
        (
            40,
            "throughput (req/s)",
            y1,
            [("admitted", "#1f77b4", ok), ("refused", "#d62728", ref)],
            ("capacity", result.capacity_rps),
        ),
        (
            520,
            "p99 latency (ms)",
            y2,
            [("admitted p99", "#1f77b4", p99), ("refusal p99", "#d62728", rp99)],
            ("engine p99 at capacity", engine_ms),
        ),
    )
    for left, title, y_max, series, (ref_name, ref_y) in panels:
        parts += _panel(left, title, x_max, y_max, series, ref_name, ref_y)
    parts.append("</svg>")
    return "\n".join(parts)


def _panel(
    left: float,
    title: str,
    x_max: float,
    y_max: float,
    series: list[tuple[str, str, list[tuple[float, float]]]],
    ref_name: str,
    ref_y: float,
) -> list[str]:
    top, width, height = 50.0, 400.0, 290.0
    x0, y0 = left + 50, top + height

    def px(x: float) -> float:
        return x0 + x / x_max * (width - 50)

    def py(y: float) -> float:
        return y0 - y / y_max * height

    out = [
        f'<text x="{x0 + (width - 50) / 2:.0f}" y="{top - 10:.0f}" text-anchor="middle">{title}</text>',
        f'<line x1="{x0}" y1="{y0}" x2="{x0 + width - 50}" y2="{y0}" stroke="black"/>',
        f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{top}" stroke="black"/>',
        f'<text x="{x0 + (width - 50) / 2:.0f}" y="{y0 + 35:.0f}" text-anchor="middle">offered load (req/s)</text>',
    ]
    for i in range(6):
        xv, yv = x_max * i / 5, y_max * i / 5
        out.append(f'<text x="{px(xv):.1f}" y="{y0 + 15:.0f}" text-anchor="middle">{xv:.0f}</text>')
        out.append(f'<text x="{x0 - 5:.0f}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
        out.append(f'<line x1="{x0}" y1="{py(yv):.1f}" x2="{x0 + width - 50}" y2="{py(yv):.1f}" stroke="#eee"/>')
    out.append(
        f'<line x1="{x0}" y1="{py(ref_y):.1f}" x2="{x0 + width - 50}" y2="{py(ref_y):.1f}" stroke="#888" '
        'stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{x0 + width - 55}" y="{py(ref_y) - 4:.1f}" text-anchor="end" fill="#555">{ref_name}</text>')
    for index, (name, color, points) in enumerate(series):
        if points:
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in points]
        out.append(f'<rect x="{x0 + 10}" y="{top + 5 + index * 16}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x0 + 25}" y="{top + 14 + index * 16}">{name}</text>')
    return out
