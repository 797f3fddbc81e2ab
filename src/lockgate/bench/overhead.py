"""`lockgate bench overhead`: the gateway's cost, measured against the engine alone and against peer routers
in the same interleaved rounds.

A simulator in `--fast` mode (no generation delays) and a gateway in front of it run as child processes,
the gateway with every feature of the request path on (default routing policy, priority scheduler, metrics,
usage records, and requests eligible for de-duplication: temperature 0, each prompt unique so that none is
served from a cache). Each round loads, one after the other, the engine directly, the gateway, and each
`--compare` peer (a command started afresh for the round, or a URL), with the same requests. The load
generator is wrk (`bench/wrk.py`: a C program in its own process) when it is installed, else the built-in
client (lockgate's lean pool, in this process; the report says which).

Figures: requests per second (ratio to direct, per round), latency p50/p99 (median over rounds), and the CPU
each process used (from /proc): per request and, for streams, per chunk (a chunk: one token event of the
`--chunks` each stream carries). CPU is the figure that travels: req/s on a shared machine swings with its
other load, and the rounds interleave so that a drift weighs on every target alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .load import closed_loop, cpu_seconds, percentile
from .machine import build, interpreter, machine
from .peer import Peer, spawn, stderr_tail, stop
from .progress import Progress
from .wrk import body_template, run_wrk, wrk_path, wrk_seconds

MODEL = "bench-model"

#: The issue's targets (per small non-streaming request at concurrency 64; per streamed chunk).
TARGET_US_PER_REQUEST = 80.0
TARGET_US_PER_CHUNK = 40.0

__all__ = ["MODEL", "Settings", "build", "free_port", "interpreter", "machine", "report", "run"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def child(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`lockgate <args>` as a child process (stderr to a file: `peer.spawn`), stopped on the way out."""
    proc = spawn([sys.executable, "-m", "lockgate", *args])
    try:
        yield proc
    finally:
        stop(proc)


async def wait_http(url: str, proc: subprocess.Popen[bytes], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"child exited with {proc.returncode}: {stderr_tail(proc)}")
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become ready in {within_s}s")
            await asyncio.sleep(0.05)


@dataclass
class Settings:
    modes: list[str] = field(default_factory=lambda: ["nonstream", "stream"])
    #: Connections for non-streaming requests, and for streams.
    concurrency: list[int] = field(default_factory=lambda: [64])
    stream_concurrency: list[int] = field(default_factory=lambda: [256])
    #: Tokens of a non-streaming answer; token chunks of each stream.
    max_tokens: int = 16
    chunks: int = 20
    rounds: int = 3
    #: "wrk", "builtin", or "auto" (wrk when installed).
    generator: str = "auto"
    #: Seconds per target and round (wrk).
    duration_s: float = 5.0
    #: Requests per target and round (built-in client).
    requests: int = 5000
    #: The built-in client's HTTP stack: "lean" or "aiohttp".
    client: str = "lean"
    compare: list[str] = field(default_factory=list)
    #: None: the engine answers at once (`sim --fast`: a whole stream in one write, read in one network
    #: read). A delay: the engine writes each token this long after the previous one (`sim --tpot-ms`), so
    #: every chunk arrives in a network read of its own, as from a real engine generating tokens.
    tpot_ms: float | None = None
    #: Requests at temperature 1 (not eligible for de-duplication: the direct path, as most sampled traffic
    #: takes) instead of 0 (every request leads a flight).
    sampled: bool = False

    def engine_args(self, port: int) -> list[str]:
        """The simulator's command line."""
        if self.tpot_ms is None:
            return ["sim", "--fast", "--port", str(port), "--model", MODEL]
        # Every stream runs at once (no engine-side queue) and prefill takes no time: only the pacing.
        seqs = max([*self.concurrency, *self.stream_concurrency])
        return [
            "sim",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--tpot-ms",
            f"{self.tpot_ms:g}",
            "--batch-growth",
            "0",
            "--max-num-seqs",
            str(seqs),
            "--max-batched-tokens",
            str(1 << 20),
            "--kv-blocks",
            str(1 << 16),
            "--prefill-tps",
            "1e9",
        ]

    def resolved_generator(self) -> str:
        if self.generator == "auto":
            return "wrk" if wrk_path() is not None else "builtin"
        return self.generator


@dataclass
class Sample:
    """One target in one round."""

    requests: int
    errors: int
    seconds: float
    p50_s: float
    p99_s: float
    engine_cpu_s: float
    #: The loaded process's CPU (None: a peer given by URL, whose process is not ours).
    target_cpu_s: float | None

    @property
    def ok(self) -> int:
        """Requests answered (a failed one is no throughput)."""
        return max(0, self.requests - self.errors)

    @property
    def rps(self) -> float:
        """Successful requests per second."""
        return self.ok / self.seconds if self.seconds else 0.0


@dataclass
class Row:
    mode: str
    concurrency: int
    target: str
    samples: list[Sample]
    #: This target's req/s over direct's in each round (empty for direct).
    round_ratios: list[float]
    #: Token chunks per request (streams) or 0.
    chunks: int

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.samples)

    @property
    def errors(self) -> int:
        return sum(s.errors for s in self.samples)

    @property
    def rps(self) -> float:
        """Successful requests per second over the rounds (failed ones are no throughput)."""
        seconds = sum(s.seconds for s in self.samples)
        ok = sum(s.ok for s in self.samples)
        return ok / seconds if seconds else 0.0

    def median(self, value: Callable[[Sample], float | None]) -> float | None:
        values = [v for v in (value(s) for s in self.samples) if v is not None]
        return statistics.median(values) if values else None

    def engine_us(self) -> float | None:
        return self.median(lambda s: s.engine_cpu_s / s.requests * 1e6 if s.requests else None)

    def target_us(self) -> float | None:
        if self.target == "direct":
            return None
        return self.median(lambda s: s.target_cpu_s / s.requests * 1e6 if s.requests and s.target_cpu_s else None)


async def run(settings: Settings, progress: Progress | None = None) -> list[Row]:
    """Every (mode, concurrency) in `settings.rounds` rounds of direct, gateway, then each peer."""
    progress = progress or Progress.silent()
    generator = settings.resolved_generator()
    peers = [Peer(spec) for spec in settings.compare]
    engine_port, gateway_port = free_port(), free_port()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        _write_config(Path(config_path), gateway_port, engine_port, tmp)
        with child(settings.engine_args(engine_port)) as sim, child(["serve", "--config", config_path]) as gw:
            engine_url = f"http://127.0.0.1:{engine_port}"
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            progress.phase("starting the engine and the gateway")
            await wait_http(engine_url + "/health", sim)
            await wait_http(gateway_url + "/ready", gw)
            runs = 0
            for mode in settings.modes:
                stream = mode == "stream"
                tokens = settings.chunks if stream else settings.max_tokens
                for concurrency in settings.stream_concurrency if stream else settings.concurrency:
                    parts: dict[str, list[Sample]] = {"direct": [], "gateway": [], **{p.name: [] for p in peers}}
                    for round_ in range(settings.rounds):
                        label = f"{mode} c={concurrency} round {round_ + 1}/{settings.rounds}"
                        targets: list[tuple[str, str, int | None, Peer | None]] = [
                            ("direct", engine_url, None, None),
                            ("gateway", gateway_url, gw.pid, None),
                            *((p.name, "", None, p) for p in peers),
                        ]
                        for name, base, pid, peer in targets:
                            runs += 1
                            progress.phase(f"{label} {name}")
                            measure = _Measure(generator, settings, stream, tokens, concurrency, sim.pid, runs)
                            if peer is None:
                                parts[name].append(await measure(base + "/v1/chat/completions", pid))
                                continue
                            async with peer.started(engine_url, free_port(), MODEL) as running:
                                parts[name].append(await measure(running.url + "/v1/chat/completions", running.pid))
                    direct = parts["direct"]
                    for name, samples in parts.items():
                        ratios = (
                            []
                            if name == "direct"
                            else [s.rps / d.rps if d.rps else 0.0 for d, s in zip(direct, samples, strict=True)]
                        )
                        rows.append(Row(mode, concurrency, name, samples, ratios, tokens if stream else 0))
    return rows


@dataclass
class _Measure:
    generator: str
    settings: Settings
    stream: bool
    tokens: int
    concurrency: int
    engine_pid: int
    run_id: int

    async def __call__(self, url: str, pid: int | None) -> Sample:
        """Warm up (connections, caches, allocator: the built-in client, a few requests a connection), then
        one measured run; CPU read around it."""
        await self._builtin(url, "warm", self.concurrency * 4)
        e0 = cpu_seconds(self.engine_pid)
        t0 = cpu_seconds(pid) if pid is not None else 0.0
        if self.generator == "wrk":
            requests, errors, seconds, p50, p99 = await self._wrk(url, "run", self.settings.duration_s)
        else:
            requests, errors, seconds, p50, p99 = await self._builtin(url, "run", self.settings.requests)
        target_cpu = cpu_seconds(pid) - t0 if pid is not None else None
        return Sample(requests, errors, seconds, p50, p99, cpu_seconds(self.engine_pid) - e0, target_cpu)

    @property
    def temperature(self) -> float:
        return 1.0 if self.settings.sampled else 0.0

    def _tag(self, phase: str) -> str:
        # Unique per run: a prompt of one run never repeats one of another (the result cache keeps answers).
        return f"{phase}{self.run_id}-{os.getpid()}"

    async def _wrk(self, url: str, phase: str, duration_s: float) -> tuple[int, int, float, float, float]:
        head, tail = body_template(MODEL, self.tokens, stream=self.stream, temperature=self.temperature)
        head = head.replace("Say something short #", f"Say something short {self._tag(phase)} #")
        result = await run_wrk(url, head, tail, connections=self.concurrency, duration_s=duration_s)
        return result.requests, result.errors, result.seconds, result.p50_s, result.p99_s

    async def _builtin(self, url: str, phase: str, requests: int) -> tuple[int, int, float, float, float]:
        tag, tokens, stream = self._tag(phase), self.tokens, self.stream

        def make(n: int) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say something short {tag} #{n}"}],
                "max_tokens": tokens,
                "temperature": self.temperature,
            }
            if stream:
                body["stream"] = True
            return body

        result = await closed_loop(
            url, make, concurrency=self.concurrency, requests=requests, stream=stream, client=self.settings.client
        )
        return (
            result.requests,
            result.errors,
            result.seconds,
            percentile(result.latencies, 50),
            percentile(result.latencies, 99),
        )


def _write_config(path: Path, gateway_port: int, engine_port: int, tmp: str) -> None:
    # Every feature on: the default routing policy, de-duplication (deterministic requests), the default
    # priority classes, usage records, metrics. The instance's limit is above any concurrency measured. Health
    # probes are lenient: on a saturated machine a probe may take seconds, and an ejected engine would turn the
    # measurement into one of 503s.
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        "health: {timeout_ms: 10000, ejection: {consecutive_failures: 1000}}\n"
        f"usage: {{path: {os.path.join(tmp, 'usage.sqlite3')}}}\n"
        f"models:\n  - name: {MODEL}\n    dedup: deterministic\n"
        f"    instances:\n      - {{url: 'http://127.0.0.1:{engine_port}', engine: vllm, max_concurrency: 2048}}\n"
    )


def header(settings: Settings) -> list[str]:
    """The lines printed before the table: machine, interpreter, build, load generator."""
    generator = settings.resolved_generator()
    if generator == "wrk":
        gen = f"load generator: wrk ({wrk_path()}), {wrk_seconds(settings.duration_s)} s per target and round"
    else:
        why = " (wrk is not installed)" if settings.generator == "auto" else ""
        gen = f"load generator: built-in ({settings.client} client, in the benchmark's process){why}"
    path = "temperature 1: the direct path" if settings.sampled else "temperature 0: each request leads a flight"
    gen += f"; requests at {path}"
    if settings.tpot_ms is None:
        engine = "engine: simulator --fast (a stream is one write: its chunks reach the gateway in one read)"
    else:
        engine = f"engine: simulator pacing tokens {settings.tpot_ms:g} ms apart (a chunk a network read)"
    return [interpreter(), machine(), build(), gen, engine]


def report(rows: list[Row]) -> str:
    lines = [
        f"{'mode':<10}{'conc':>5} {'target':<14}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'errors':>7}"
        f"{'engine us/req':>14}{'us/req':>8}{'us/chunk':>9}{'ratio':>7}  rounds"
    ]
    verdicts: list[str] = []
    for row in rows:
        p50, p99 = row.median(lambda s: s.p50_s), row.median(lambda s: s.p99_s)
        engine_us, target_us = row.engine_us(), row.target_us()
        us = f"{target_us:.0f}" if target_us is not None else ("-" if row.target == "direct" else "n/a")
        per_chunk = f"{target_us / row.chunks:.1f}" if target_us is not None and row.chunks else ""
        ratio = f"{statistics.median(row.round_ratios):.2f}x" if row.round_ratios else ""
        rounds = " ".join(f"{x:.2f}" for x in row.round_ratios)
        lines.append(
            f"{row.mode:<10}{row.concurrency:>5} {row.target[:13]:<14}{row.rps:>8.0f}"
            f"{(p50 or 0) * 1000:>8.2f}{(p99 or 0) * 1000:>8.2f}{row.errors:>7}"
            f"{(engine_us or 0):>14.0f}{us:>8}{per_chunk:>9}{ratio:>7}  {rounds}"
        )
        if row.target == "gateway" and target_us is not None:
            if row.mode == "nonstream" and row.concurrency == 64:
                met = target_us <= TARGET_US_PER_REQUEST
                verdicts.append(
                    f"target (nonstream, concurrency 64): <= {TARGET_US_PER_REQUEST:.0f} us gateway CPU per request: "
                    f"{target_us:.0f} us: {'met' if met else 'NOT met'}"
                )
            if row.mode == "stream" and row.chunks:
                per = target_us / row.chunks
                verdicts.append(
                    f"target (stream, concurrency {row.concurrency}): <= {TARGET_US_PER_CHUNK:.0f} us gateway CPU per "
                    f"chunk: {per:.1f} us: {'met' if per <= TARGET_US_PER_CHUNK else 'NOT met'}"
                )
    return "\n".join(lines + verdicts)
