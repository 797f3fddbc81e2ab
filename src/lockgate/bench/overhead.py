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
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .load import LoadResult, closed_loop, cpu_seconds, percentile

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


def _body(stream: bool, max_tokens: int):
    def make(n: int) -> dict:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Say something short #{n % 97}"}],
            "max_tokens": max_tokens,
        }
        if stream:
            body["stream"] = True
        return body

    return make


async def run(concurrencies: list[int], requests: int, max_tokens: int, modes: list[str]) -> list[Row]:
    engine_port, gateway_port = free_port(), free_port()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        _write_config(Path(config_path), gateway_port, engine_port, tmp)
        sim_args = ["sim", "--fast", "--port", str(engine_port), "--model", MODEL]
        with child(sim_args) as sim, child(["serve", "--config", config_path]) as gw:
            engine_url = f"http://127.0.0.1:{engine_port}"
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            await wait_http(engine_url + "/health", sim)
            await wait_http(gateway_url + "/ready", gw)
            for mode in modes:
                stream = mode == "stream"
                make = _body(stream, max_tokens)
                for concurrency in concurrencies:
                    for target, base in (("direct", engine_url), ("gateway", gateway_url)):
                        url = base + "/v1/chat/completions"
                        # Warm-up: connections, caches, JIT-free but allocator-warm.
                        await closed_loop(url, make, concurrency=concurrency, requests=concurrency * 4, stream=stream)
                        e0, g0 = cpu_seconds(sim.pid), cpu_seconds(gw.pid)
                        result = await closed_loop(url, make, concurrency=concurrency, requests=requests, stream=stream)
                        e1, g1 = cpu_seconds(sim.pid), cpu_seconds(gw.pid)
                        rows.append(Row(mode, concurrency, target, result, e1 - e0, g1 - g0))
    return rows


def _write_config(path: Path, gateway_port: int, engine_port: int, tmp: str) -> None:
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        f"usage: {{path: {os.path.join(tmp, 'usage.sqlite3')}}}\n"
        f"models:\n  - name: {MODEL}\n    routing: least_load\n"
        f"    instances:\n      - {{url: 'http://127.0.0.1:{engine_port}', engine: vllm, max_concurrency: 1024}}\n"
    )


def report(rows: list[Row]) -> str:
    lines = [
        f"{'mode':<8}{'conc':>5} {'target':<8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'errors':>7}{'engine us/req':>15}{'gateway us/req':>16}{'ratio':>7}"
    ]
    direct: dict[tuple[str, int], Row] = {}
    for row in rows:
        r = row.result
        ratio = ""
        if row.target == "direct":
            direct[(row.mode, row.concurrency)] = row
        else:
            base = direct.get((row.mode, row.concurrency))
            if base is not None and base.result.rps:
                ratio = f"{r.rps / base.result.rps:.2f}x"
        gateway_us = "" if row.target == "direct" else f"{row.gateway_cpu / r.requests * 1e6:.0f}"
        lines.append(
            f"{row.mode:<8}{row.concurrency:>5} {row.target:<8}{r.rps:>9.0f}"
            f"{percentile(r.latencies, 50) * 1000:>9.2f}{percentile(r.latencies, 99) * 1000:>9.2f}"
            f"{r.errors:>7}{row.engine_cpu / r.requests * 1e6:>15.0f}{gateway_us:>16}{ratio:>7}"
        )
    return "\n".join(lines)
