"""A peer router measured in the same rounds as lockgate (`bench overhead --compare`).

A peer is either a URL (a router already running, in front of an engine of the caller's choosing: its CPU
cannot be read, only its throughput and latency) or a command, started afresh for each round with `{engine}`
replaced by the engine's URL and `{port}` by a free port, stopped (SIGTERM, then SIGKILL) after the round;
its CPU is read from /proc for its process id, so the command must be the router itself (no shell wrapper).

Resource handling: `Peer.started()` is a context manager; the process is stopped on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO

import aiohttp


@dataclass
class Running:
    #: Where the peer listens (scheme, host and port).
    url: str
    #: Its process id, when lockgate started it (its CPU can then be measured).
    pid: int | None


class Peer:
    def __init__(self, spec: str) -> None:
        """`spec`: `http://host:port` or a command line with `{engine}` and `{port}` placeholders."""
        self.spec = spec
        self.is_url = spec.startswith(("http://", "https://"))
        if not self.is_url and "{port}" not in spec:
            raise ValueError(f"--compare command needs a {{port}} placeholder: {spec!r}")
        first = spec if self.is_url else shlex.split(spec)[0]
        #: The command's program (the URL for a URL).
        self.program = first
        #: A short label for the report (the URL, or the command's program name).
        self.name = first.rstrip("/") if self.is_url else first.rsplit("/", 1)[-1]

    @contextlib.asynccontextmanager
    async def started(self, engine_url: str, port: int, model: str) -> AsyncIterator[Running]:
        """The peer, ready to answer a chat completion for `model`."""
        if self.is_url:
            yield Running(self.spec.rstrip("/"), None)
            return
        argv = [part.replace("{engine}", engine_url).replace("{port}", str(port)) for part in shlex.split(self.spec)]
        proc = spawn(argv)
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_answering(url, model, proc)
            yield Running(url, proc.pid)
        finally:
            stop(proc)


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start `argv` with its stdout discarded and its stderr written to a temporary file (`stderr_tail` reads
    it back): a pipe that nobody reads blocks the child for good once it has written 64 KiB (a gateway that
    logged an error per request stalled there mid-benchmark, and every later request timed out)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by `stop`, with the process
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    except BaseException:
        log.close()
        raise
    _LOGS[proc.pid] = log
    return proc


def stderr_tail(proc: subprocess.Popen[bytes], size: int = 2000) -> str:
    """The last `size` bytes the child wrote to stderr (as text)."""
    log = _LOGS.get(proc.pid)
    if log is None:
        return ""
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - size))
    return log.read().decode(errors="replace")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; its stderr file is closed (and gone)."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = _LOGS.pop(proc.pid, None)
    if log is not None:
        log.close()


#: The stderr file of each child started by `spawn`, by process id, until `stop`.
_LOGS: dict[int, IO[bytes]] = {}


async def _wait_answering(url: str, model: str, proc: subprocess.Popen[bytes], within_s: float = 60.0) -> None:
    """Until a chat completion through the peer answers 200 (its workers may be discovered after it listens)."""
    deadline = time.monotonic() + within_s
    body = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"peer exited with {proc.returncode}: {stderr_tail(proc)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer at {url} did not answer in {within_s}s")
            await asyncio.sleep(0.1)
