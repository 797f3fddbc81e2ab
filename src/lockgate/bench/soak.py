"""`lockgate bench soak`: hours of mixed load, the gateway's memory and file descriptors watched.

A simulator (real step loop, short generations) and a gateway run as child processes; `concurrency` workers
send a mix that exercises every path that keeps state: non-streaming and streaming completions from a small
set of prompts at temperature 0 (so de-duplication coalesces and serves cached results), sampled requests
that bypass it, streams the client abandons after the first chunk (cancellation, aborts), and malformed
bodies (400s). Every `interval_s` one line reports the gateway's RSS (`VmRSS`) and open descriptors
(`/proc/PID/fd`) with the requests so far.

Verdict: after `warmup_s` (caches and pools fill up to their bounds; the soak's configuration keeps those
bounds small so that this happens early), the gateway must not grow: the median of the last three samples
may exceed the median of the first three after warm-up by at most `rss_tolerance_mb` of RSS and
`fd_tolerance` descriptors, and no request may fail unexpectedly (a 5xx or a broken connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from .overhead import child, free_port, wait_http
from .progress import Progress

MODEL = "soak-model"
#: Unexpected answers quoted in the report.
MAX_EXAMPLES = 5
#: Distinct prompts of the de-duplicated share: few, so that flights coalesce and results are reused.
PROMPTS = 64


@dataclass
class Settings:
    duration_s: float = 3600.0
    interval_s: float = 60.0
    warmup_s: float | None = None  # default: min(300 s, a third of the duration)
    concurrency: int = 16
    rss_tolerance_mb: float = 16.0
    fd_tolerance: int = 16

    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(300.0, self.duration_s / 3)


@dataclass
class Sample:
    at_s: float
    rss_mb: float
    fds: int
    requests: int


@dataclass
class Tally:
    requests: int = 0
    #: Answers other than the expected ones: 5xx, or a connection that broke (status 0).
    unexpected: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    #: The first few unexpected answers (status and the start of the body), for the report.
    examples: list[str] = field(default_factory=list)

    def add(self, status: int, expected: bool, body: bytes = b"") -> None:
        self.requests += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if not expected:
            self.unexpected += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{status}: {body[:300].decode(errors='replace')}")


@dataclass
class SoakResult:
    settings: Settings
    samples: list[Sample]
    tally: Tally

    def window(self) -> tuple[list[Sample], list[Sample]]:
        """The first three samples after warm-up, and the last three."""
        after = [s for s in self.samples if s.at_s >= self.settings.warmup()]
        return after[:3], after[-3:]

    def growth(self) -> tuple[float, int] | None:
        """(RSS MB, descriptors) the gateway grew after warm-up; None with fewer than two samples after it."""
        first, last = self.window()
        if len(self.samples) < 2 or not first or first[0] is last[-1]:
            return None
        rss = statistics.median(s.rss_mb for s in last) - statistics.median(s.rss_mb for s in first)
        fds = round(statistics.median(s.fds for s in last) - statistics.median(s.fds for s in first))
        return rss, fds

    def passed(self) -> bool:
        growth = self.growth()
        return (
            growth is not None
            and growth[0] <= self.settings.rss_tolerance_mb
            and growth[1] <= self.settings.fd_tolerance
            and self.tally.unexpected == 0
        )


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def run(settings: Settings, progress: Progress | None = None) -> SoakResult:
    """Soak the gateway for `settings.duration_s`, printing a sample line every `interval_s` (stdout)."""
    progress = progress or Progress.silent()
    engine_port, gateway_port = free_port(), free_port()
    tally = Tally()
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="lockgate-soak-") as tmp:
        config_path = Path(tmp, "soak.yaml")
        _write_config(config_path, gateway_port, engine_port, tmp)
        sim_args = ["sim", "--port", str(engine_port), "--model", MODEL, "--tpot-ms", "1", "--max-num-seqs", "64"]
        with child(sim_args) as sim, child(["serve", "--config", str(config_path)]) as gw:
            progress.phase("starting the engine and the gateway")
            await wait_http(f"http://127.0.0.1:{engine_port}/health", sim)
            await wait_http(f"http://127.0.0.1:{gateway_port}/ready", gw)
            url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            started = time.monotonic()
            deadline = started + settings.duration_s
            progress.phase(f"soak for {settings.duration_s:g} s", round(settings.duration_s))
            connector = aiohttp.TCPConnector(limit=settings.concurrency * 2)
            async with aiohttp.ClientSession(connector=connector) as session:
                workers = [
                    asyncio.create_task(_worker(session, url, w, settings.concurrency, deadline, tally))
                    for w in range(settings.concurrency)
                ]
                try:
                    next_at = started + settings.interval_s
                    while True:
                        now = time.monotonic()
                        if now >= deadline:
                            break
                        await asyncio.sleep(max(0.0, min(next_at, deadline) - now))
                        if time.monotonic() >= next_at - 1e-3:
                            at = time.monotonic() - started
                            sample = Sample(at, rss_mb(gw.pid), open_fds(gw.pid), tally.requests)
                            samples.append(sample)
                            print(line(sample), flush=True)
                            progress.advance(round(settings.interval_s))
                            next_at += settings.interval_s
                    await asyncio.gather(*workers)
                finally:
                    for task in workers:
                        task.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
    return SoakResult(settings, samples, tally)


def line(sample: Sample) -> str:
    return f"t={sample.at_s:7.1f}s  rss={sample.rss_mb:7.1f} MB  fds={sample.fds:4d}  requests={sample.requests}"


async def _worker(
    session: aiohttp.ClientSession, url: str, worker: int, workers: int, deadline: float, tally: Tally
) -> None:
    n = worker
    while time.monotonic() < deadline:
        n += workers
        kind = n % 10
        prompt = f"Tell me about item {n % PROMPTS}"
        body: dict[str, object] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "temperature": 0,
        }
        try:
            if kind == 8:  # malformed: a 400 from the gateway
                async with session.post(url, data=b'{"model": ', headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    tally.add(r.status, r.status == 400)
                continue
            if kind == 9:  # sampled: never shared
                body["temperature"] = 1.0
                body["messages"] = [{"role": "user", "content": f"{prompt} #{n}"}]
            if kind in (4, 5, 6, 7):
                body["stream"] = True
            async with session.post(url, json=body) as resp:
                if kind == 7:  # abandoned after the first chunk
                    await resp.content.readany()
                    resp.close()
                    tally.add(resp.status, resp.status == 200)
                    continue
                answer = await resp.read()
                tally.add(resp.status, resp.status == 200, answer)
        except aiohttp.ClientError as exc:
            tally.add(0, False, repr(exc).encode())


def _write_config(path: Path, gateway_port: int, engine_port: int, tmp: str) -> None:
    # Small bounds, so that caches reach them during warm-up and growth after it means a leak.
    config = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "usage": {"path": os.path.join(tmp, "usage.sqlite3")},
        "result_cache": {"max_entries": 256, "max_bytes": 1 << 20, "ttl_ms": 2000},
        # Lenient health checks: a soak measures memory, and on a saturated machine a probe that times out
        # would take the only engine out and turn requests into 503s (seen: 240 in an hour at load 12).
        "health": {"timeout_ms": 10000, "ejection": {"consecutive_failures": 1000}},
        "models": [
            {
                "name": MODEL,
                "dedup": "deterministic",
                "routing": {"policy": "predicted_ttft", "prefix_index": {"max_bytes": 1 << 20}},
                "instances": [{"url": f"http://127.0.0.1:{engine_port}", "engine": "vllm", "max_concurrency": 256}],
            }
        ],
    }
    path.write_bytes(orjson.dumps(config))  # JSON is YAML


def report(result: SoakResult) -> str:
    s = result.settings
    tally = result.tally
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(tally.statuses.items()))
    lines = [f"{tally.requests} requests ({statuses}); unexpected answers: {tally.unexpected}"]
    lines.extend(f"  unexpected {example}" for example in tally.examples)
    growth = result.growth()
    rule = f"after {s.warmup():g} s of warm-up, at most +{s.rss_tolerance_mb:g} MB RSS and +{s.fd_tolerance} fds"
    if growth is None:
        lines.append(f"FAIL  too few samples after warm-up to judge growth ({rule})")
    else:
        verdict = "PASS" if result.passed() else "FAIL"
        lines.append(f"{verdict}  growth after warm-up: {growth[0]:+.1f} MB RSS, {growth[1]:+d} fds ({rule})")
    with contextlib.suppress(ValueError):
        peak = max(x.rss_mb for x in result.samples)
        lines.append(f"peak RSS {peak:.1f} MB over {len(result.samples)} samples")
    return "\n".join(lines)
