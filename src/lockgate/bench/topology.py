"""Gateways of `bench routing --replicas N` as child processes, the way the cluster shape runs.

Every gateway of a replicas run (the single gateway it is compared with, each central replica, each
sidecar) is its own `lockgate serve|sidecar --config FILE` process; the simulators and the client stay
in the bench process, the same for both shapes. In one process and one event loop, the centrals and
sidecars would queue behind each other's work (and behind the simulators'), which says nothing about
how the cluster behaves.

Resource handling: `Children` is a context manager owning the processes, their configuration files,
logs and usage stores (in a directory of its own); every process is stopped on every way out (SIGTERM,
then SIGKILL). `records(command)` reads a command's usage stores once its processes stopped (`hops.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml

from .hops import Record, read_records
from .load import cpu_seconds
from .overhead import free_port
from .peer import stop


class _ExitedEarly(RuntimeError):
    """A child exited before it answered."""


class Children:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: Each child: its process and command.
        self._procs: list[tuple[subprocess.Popen[bytes], str]] = []
        #: Each child's command and usage store.
        self._stores: list[tuple[str, Path]] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for proc, _ in procs:
            stop(proc)

    def spawn(self, command: str, config: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str, Path]:
        """Start `lockgate <command>` with `config` (its `listen` replaced by a free port, its usage records
        kept in a store of its own): the process, its URL and its log."""
        port = free_port()
        n = len(self._procs)
        path = self.directory / f"{command}-{n}.yaml"
        store = self.directory / f"{command}-{n}.sqlite3"
        listen = {"host": "127.0.0.1", "port": port}
        path.write_text(yaml.safe_dump({**config, "listen": listen, "usage": {"path": str(store)}}))
        self._stores.append((command, store))
        log = self.directory / f"{command}-{n}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lockgate", command, "--config", str(path)],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self._procs.append((proc, command))
        return proc, f"http://127.0.0.1:{port}", log

    def cpu(self, command: str) -> float:
        """CPU seconds (user + system) the running `command` children have used so far."""
        return sum(cpu_seconds(proc.pid) for proc, name in self._procs if name == command and proc.poll() is None)

    def records(self, command: str) -> list[Record]:
        """The usage records of every `command` child (call after `close`: a child flushes them as it stops)."""
        return [r for name, store in self._stores if name == command for r in read_records(store)]

    async def start(
        self, command: str, config: dict[str, Any], *, ready_instances: tuple[str, int] | None = None
    ) -> str:
        """`spawn`, then its URL once it answers; `ready_instances` (model, count): once that many of the
        model's instances are routable there (a central replica discovering the sidecars' engines).
        A child that exits before it answers is started again on another port (twice at most): the free
        port it was given may have been taken meanwhile by another process on a shared machine."""
        for attempt in range(3):
            proc, url, log = self.spawn(command, config)
            try:
                await _wait_ready(url, proc, log, ready_instances)
            except _ExitedEarly:
                if attempt == 2:
                    raise
                continue
            return url
        raise AssertionError("unreachable")  # pragma: no cover


async def _wait_ready(
    url: str, proc: subprocess.Popen[bytes], log: Path, instances: tuple[str, int] | None, within_s: float = 60.0
) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise _ExitedEarly(f"{proc.args!r} exited with {proc.returncode}: {_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                if instances is None:
                    async with session.get(url + "/health") as resp:
                        if resp.status == 200:
                            return
                else:
                    async with session.get(url + "/admin/fleet") as resp:
                        if resp.status == 200 and _routable(await resp.json(), instances[0]) >= instances[1]:
                            return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} was not ready within {within_s} s: {_tail(log)}")
            await asyncio.sleep(0.05)  # another process's state: nothing to wait on but its answers


def _routable(fleet: dict[str, Any], model: str) -> int:
    pools = [p for p in fleet.get("pools", ()) if p.get("model") == model]
    if not pools:
        return 0
    names = set(pools[0].get("instances", ()))
    return sum(1 for i in fleet.get("instances", ()) if i.get("name") in names and i.get("routable"))


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]
