"""`lockgate bench cancel`: how fast a client's disconnect reaches the engine, through the gateway.

The gateway runs as a child process (`lockgate serve`, uvloop), in front of a simulator that runs in this
process, next to the client. For each phase — before the first byte (the engine holds the request in
prefill), mid-stream, non-streaming (the engine is generating) — each trial sends one request over a raw
socket, waits until the request is in that phase (observed at the engine), takes `time.monotonic()` and
closes the client socket; the engine's handler notes `time.monotonic()` when it sees its own connection
from the gateway close (`RequestRecord.disconnected_at`). Client and engine share one process and one
clock, so the difference is exactly "client closed" -> "engine saw the upstream connection closed".
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from ..sim import SimConfig, SimServer
from .load import percentile
from .overhead import child, free_port, wait_http
from .progress import Progress

PHASES = ("before_first_byte", "mid_stream", "non_streaming")
MODEL = "bench-model"


@dataclass
class PhaseResult:
    phase: str
    latencies_s: list[float] = field(default_factory=list)
    tokens_after_disconnect: int = 0

    def p(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1000


def _request(port: int, stream: bool, max_tokens: int) -> bytes:
    payload = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a very long story"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _trial(sim: SimServer, port: int, phase: str) -> tuple[float, int]:
    if phase == "before_first_byte":
        sim.control.hold_next = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request(port, stream=phase != "non_streaming", max_tokens=10_000))
        if phase == "before_first_byte":
            await sim.wait_held(1)
        elif phase == "mid_stream":
            seen = b""
            while seen.count(b"data:") < 2:
                chunk = await reader.read(65536)
                if not chunk:
                    raise RuntimeError("the gateway closed the stream")
                seen += chunk
        else:
            await sim.wait_until(lambda s: any(r.completion_tokens >= 2 for r in s.stats.open.values()))
        [request_id] = list(sim.stats.open)
        closed_at = time.monotonic()  # the clock of `disconnected_at` (not loop.time(): uvloop's is coarse)
        writer.transport.close()
    finally:
        writer.close()
    record = await sim.wait_ended(request_id)
    seen_at = record["disconnected_at"]
    if seen_at is None or record["outcome"] != "aborted":
        raise RuntimeError(f"the engine did not see a disconnect: {record}")
    return seen_at - closed_at, int(record["tokens_after_disconnect"])


async def run(trials: int, tpot_ms: float, progress: Progress | None = None) -> list[PhaseResult]:
    progress = progress or Progress.silent()
    results = [PhaseResult(phase) for phase in PHASES]
    async with SimServer(SimConfig(models=(MODEL,), prefill_tps=1e6, tpot_ms=tpot_ms)) as sim:
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "gw.yaml"
            config.write_text(
                f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                f"usage: {{path: '{os.path.join(tmp, 'usage.sqlite3')}'}}\n"
                "health: {interval_ms: 60000}\n"
                f"models:\n  - name: {MODEL}\n    instances:\n      - {{url: '{sim.url}', engine: vllm}}\n"
            )
            with child(["serve", "--config", str(config)]) as gateway:
                progress.phase("starting the gateway")
                await wait_http(f"http://127.0.0.1:{port}/ready", gateway)
                progress.phase("warm-up")
                for _ in range(min(10, trials)):  # warm-up: connections, allocators
                    for phase in PHASES:
                        await _trial(sim, port, phase)
                progress.phase(f"trials of {len(PHASES)} phases", trials)
                for _ in range(trials):
                    for result in results:  # interleaved, so that drift hits every phase alike
                        latency, after = await asyncio.wait_for(_trial(sim, port, result.phase), 10)
                        result.latencies_s.append(latency)
                        result.tokens_after_disconnect += after
                    progress.advance()
    return results


def report(results: list[PhaseResult], target_ms: float = 5.0) -> str:
    lines = [
        "client closes its connection -> the engine sees its upstream connection closed (through lockgate)",
        f"{'phase':<20}{'trials':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'tokens after':>14}",
    ]
    for r in results:
        lines.append(
            f"{r.phase:<20}{len(r.latencies_s):>7}{r.p(50):>9.2f}{r.p(99):>9.2f}"
            f"{max(r.latencies_s, default=float('nan')) * 1000:>9.2f}{r.tokens_after_disconnect:>14}"
        )
    worst = max((r.p(99) for r in results), default=float("nan"))
    verdict = "meets" if worst <= target_ms else "MISSES"
    lines.append(f"worst p99 {worst:.2f} ms: {verdict} the target of p99 <= {target_ms:g} ms")
    return "\n".join(lines)
