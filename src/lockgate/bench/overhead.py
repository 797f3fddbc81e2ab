"""`lockgate bench overhead`: the gateway's cost, measured against the engine alone in one run.

A simulator in `--fast` mode (no generation delays) and a gateway in front of it run as child
processes; this process drives load straight at the simulator, then through the gateway, with the
same requests, for each mode and concurrency, and prints throughput, latency and the CPU each
process used per request (read from /proc), with the ratios gateway/direct.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .load import LoadResult, closed_loop, cpu_seconds, percentile
from .progress import Progress

MODEL = "bench-model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def child(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockgate", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


async def wait_http(url: str, proc: subprocess.Popen[bytes], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"child exited with {proc.returncode}: {err[-2000:]}")
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
class Row:
    mode: str
    concurrency: int
    target: str
    result: LoadResult
    engine_cpu: float
    gateway_cpu: float
    #: gateway/direct req/s of each round (the same on both rows of a pair).
    round_ratios: list[float]


def _body(stream: bool, max_tokens: int) -> Callable[[int], dict[str, Any]]:
    def make(n: int) -> dict[str, Any]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Say something short #{n % 97}"}],
            "max_tokens": max_tokens,
        }
        if stream:
            body["stream"] = True
        return body

    return make


async def run(
    concurrencies: list[int],
    requests: int,
    max_tokens: int,
    modes: list[str],
    rounds: int = 3,
    client: str = "lean",
    progress: Progress | None = None,
) -> list[Row]:
    """Each (mode, concurrency) is measured in `rounds` rounds, direct then gateway in each, so that a
    drift of the machine (the client, engine and gateway share its cores) weighs on both alike; a row
    sums its rounds (requests / total time, CPU over all of them) and keeps each round's ratio."""
    progress = progress or Progress.silent()
    engine_port, gateway_port = free_port(), free_port()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        _write_config(Path(config_path), gateway_port, engine_port, tmp)
        sim_args = ["sim", "--fast", "--port", str(engine_port), "--model", MODEL]
        with child(sim_args) as sim, child(["serve", "--config", config_path]) as gw:
            engine_url = f"http://127.0.0.1:{engine_port}"
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            progress.phase("starting the engine and the gateway")
            await wait_http(engine_url + "/health", sim)
            await wait_http(gateway_url + "/ready", gw)
            for mode in modes:
                stream = mode == "stream"
                make = _body(stream, max_tokens)
                for concurrency in concurrencies:
                    parts: dict[str, list[tuple[LoadResult, float, float]]] = {"direct": [], "gateway": []}
                    for round_ in range(rounds):
                        for target, base in (("direct", engine_url), ("gateway", gateway_url)):
                            url = base + "/v1/chat/completions"
                            progress.phase(f"{mode} c={concurrency} round {round_ + 1}/{rounds} {target}", requests)
                            parts[target].append(
                                await _measure(url, make, concurrency, requests, stream, sim, gw, client, progress)
                            )
                    ratios = [g[0].rps / d[0].rps for d, g in zip(parts["direct"], parts["gateway"], strict=True)]
                    for target in ("direct", "gateway"):
                        rows.append(_combine(mode, concurrency, target, parts[target], ratios))
    return rows


async def _measure(
    url: str,
    make: Callable[[int], dict[str, Any]],
    concurrency: int,
    requests: int,
    stream: bool,
    sim: subprocess.Popen[bytes],
    gw: subprocess.Popen[bytes],
    client: str,
    progress: Progress,
) -> tuple[LoadResult, float, float]:
    """One round against one target: its result and the engine's and gateway's CPU seconds."""
    # Warm-up: connections, caches, allocator.
    await closed_loop(url, make, concurrency=concurrency, requests=concurrency * 4, stream=stream, client=client)
    e0, g0 = cpu_seconds(sim.pid), cpu_seconds(gw.pid)
    result = await closed_loop(
        url, make, concurrency=concurrency, requests=requests, stream=stream, client=client, on_done=progress.advance
    )
    return result, cpu_seconds(sim.pid) - e0, cpu_seconds(gw.pid) - g0


def _combine(
    mode: str, concurrency: int, target: str, parts: list[tuple[LoadResult, float, float]], ratios: list[float]
) -> Row:
    results = [p[0] for p in parts]
    combined = LoadResult(
        requests=sum(r.requests for r in results),
        errors=sum(r.errors for r in results),
        seconds=sum(r.seconds for r in results),
        latencies=[x for r in results for x in r.latencies],
        ttfts=[x for r in results for x in r.ttfts],
    )
    return Row(mode, concurrency, target, combined, sum(p[1] for p in parts), sum(p[2] for p in parts), ratios)


def _write_config(path: Path, gateway_port: int, engine_port: int, tmp: str) -> None:
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        f"usage: {{path: {os.path.join(tmp, 'usage.sqlite3')}}}\n"
        f"models:\n  - name: {MODEL}\n    routing: least_load\n"
        f"    instances:\n      - {{url: 'http://127.0.0.1:{engine_port}', engine: vllm, max_concurrency: 1024}}\n"
    )


def interpreter() -> str:
    """The Python that runs the engine and the gateway (children started with this one's executable). Its
    build moves CPU per request by ~20%: see docs/decisions.md, "The interpreter"."""
    line = f"interpreter: {platform.python_implementation()} {platform.python_version()} at {sys.executable}"
    return line + (" (libpython loaded as a shared library)" if _shared_libpython() else "")


def _shared_libpython() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libpython" in line for line in maps)
    except OSError:  # not Linux
        return False


#: The issue's target for small non-streaming completions at concurrency 64.
TARGET_RATIO = 0.6
TARGET_CPU_US = 120.0


def report(rows: list[Row]) -> str:
    lines = [
        f"{'mode':<10}{'conc':>5} {'target':<8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'errors':>7}{'engine us/req':>15}{'gateway us/req':>16}{'ratio':>7}  rounds"
    ]
    direct: dict[tuple[str, int], Row] = {}
    verdict = ""
    for row in rows:
        r = row.result
        ratio = rounds = gateway_us = ""
        if row.target == "direct":
            direct[(row.mode, row.concurrency)] = row
        else:
            gateway_us = f"{row.gateway_cpu / r.requests * 1e6:.0f}"
            rounds = " ".join(f"{x:.2f}" for x in row.round_ratios)
            base = direct.get((row.mode, row.concurrency))
            if base is not None and base.result.rps:
                value = r.rps / base.result.rps
                ratio = f"{value:.2f}x"
                if row.mode == "nonstream" and row.concurrency == 64:
                    cpu = row.gateway_cpu / r.requests * 1e6
                    met = value >= TARGET_RATIO and cpu <= TARGET_CPU_US
                    verdict = (
                        f"target (nonstream, concurrency 64): >= {TARGET_RATIO}x direct and <= {TARGET_CPU_US:.0f} us "
                        f"gateway CPU per request: {value:.2f}x, {cpu:.0f} us: {'met' if met else 'NOT met'}"
                    )
        lines.append(
            f"{row.mode:<10}{row.concurrency:>5} {row.target:<8}{r.rps:>9.0f}"
            f"{percentile(r.latencies, 50) * 1000:>9.2f}{percentile(r.latencies, 99) * 1000:>9.2f}"
            f"{r.errors:>7}{row.engine_cpu / r.requests * 1e6:>15.0f}{gateway_us:>16}{ratio:>7}  {rounds}"
        )
    if verdict:
        lines.append(verdict)
    return "\n".join(lines)
