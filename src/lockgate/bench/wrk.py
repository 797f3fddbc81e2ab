"""wrk as the load generator: a C program in its own process, so the figures of what it loads cannot be
flattered by a light client (or burdened by a heavy one) sharing their event loop.

`run_wrk` drives one target for a duration over `connections` keep-alive connections (one wrk thread:
ample for loopback at these rates) with a small Lua script: each request a chat completion whose prompt
carries a request counter, so that no two are identical (a gateway that de-duplicates must not serve the
benchmark from its cache). The script's `done()` prints the exact counts and percentiles on one line, which is
parsed here (wrk's human summary rounds them).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_MARK = "@@N@@"


def wrk_path() -> str | None:
    """The `wrk` executable on PATH, if any."""
    return shutil.which("wrk")


@dataclass
class WrkResult:
    requests: int
    #: Answers with a status other than 2xx/3xx, plus socket errors (connect, read, write, timeout).
    errors: int
    seconds: float
    p50_s: float
    p99_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def body_template(model: str, max_tokens: int, *, stream: bool, temperature: float = 0) -> tuple[str, str]:
    """The JSON body before and after the request counter: temperature 0 by default, so the request is eligible
    for de-duplication (`dedup: deterministic`; a sampled one takes the direct path), and a prompt made unique
    by the counter."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Say something short #{_MARK}"}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if stream:
        body["stream"] = True
    head, _, tail = orjson.dumps(body).decode().partition(_MARK)
    return head, tail


def script(path: str, head: str, tail: str) -> str:
    """The Lua script: POST `head .. n .. tail` to `path`, n counting up; `done()` prints one parseable line."""
    return f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
local head = [==[{head}]==]
local tail = [==[{tail}]==]
request = function()
  n = n + 1
  return wrk.format(nil, "{path}", nil, head .. n .. tail)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("LOCKGATE-WRK %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.status + e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def parse(output: str) -> WrkResult:
    """The figures of the script's `done()` line (requests, duration and percentiles in microseconds)."""
    for line in output.splitlines():
        if line.startswith("LOCKGATE-WRK "):
            requests, duration_us, errors, p50_us, p99_us = (int(x) for x in line.split()[1:6])
            return WrkResult(requests, errors, duration_us / 1e6, p50_us / 1e6, p99_us / 1e6)
    raise RuntimeError(f"wrk printed no summary: {output[-1000:]}")


def wrk_seconds(duration_s: float) -> int:
    """The duration wrk runs for `duration_s`: its `-d` takes whole seconds only (`-d1.5s` is a usage error)."""
    return max(1, round(duration_s))


def _write_script(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


async def run_wrk(
    url: str, head: str, tail: str, *, connections: int, duration_s: float, timeout_s: float = 30.0
) -> WrkResult:
    """One wrk run against `url` (scheme, host and path) for `duration_s` seconds."""
    executable = wrk_path()
    if executable is None:
        raise RuntimeError("wrk is not installed")
    origin, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    with tempfile.TemporaryDirectory(prefix="lockgate-wrk-") as tmp:
        lua = _write_script(Path(tmp, "post.lua"), script("/" + path, head, tail))
        proc = await asyncio.create_subprocess_exec(
            executable,
            "-t1",
            f"-c{connections}",
            f"-d{wrk_seconds(duration_s)}s",
            f"--timeout={round(timeout_s)}s",
            "-s",
            lua,
            f"{origin}://{host}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await proc.communicate()
        finally:
            await _reap(proc)
    return parse(out.decode(errors="replace"))


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill wrk unless it has exited, and wait for it: a bench cancelled (Ctrl-C, SIGTERM) left it loading."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
