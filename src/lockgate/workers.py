"""`lockgate serve --workers N`: N gateway processes on one port, replicas of the configuration's cluster.

One lockgate process runs on one core. `--workers N` starts N of them (`lockgate serve --worker i`),
each listening on the same port with SO_REUSEPORT (the kernel spreads new connections among them),
and each a central replica of the `cluster:` section: they share state the way replicas on different
hosts do (engines and their load through the sidecars' records, prefix placement, tenant limit shares,
duplicates meeting at the sidecar), so a configuration without `cluster:` is refused. Each worker
writes its usage records to `<usage.path>.worker-<i>` (one SQLite writer per file).

This process only supervises: it forwards SIGINT, SIGTERM and SIGHUP to every worker and exits when
they all have, with the first non-zero status among theirs (0 if none); a worker that fails (e.g. it
cannot start) stops the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

from .config import Config


class WorkersError(Exception):
    """`--workers` cannot be used with this configuration."""


def run_workers(config: Config, config_path: str | None, workers: int, *, host: str | None, port: int | None) -> int:
    if config.cluster is None or config_path is None:
        raise WorkersError(
            "--workers needs a configuration file with a `cluster:` section: the workers are replicas that "
            "share engines, load, limits and affinity through etcd"
        )
    if config.listen.unix or (port if port is not None else config.listen.port) == 0:
        raise WorkersError("--workers needs a TCP port (listen.port or --port, not 0 or a unix socket)")
    command = [sys.executable, "-m", "lockgate", "serve", "--config", config_path]
    if host is not None:
        command += ["--host", host]
    if port is not None:
        command += ["--port", str(port)]
    children = [subprocess.Popen([*command, "--worker", str(n)]) for n in range(workers)]

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    by_pid = {child.pid: child for child in children}
    codes: list[int] = []
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, 0)
        child = by_pid.get(pid)
        if child is None:
            continue
        child.returncode = os.waitstatus_to_exitcode(status)
        codes.append(child.returncode)
        if child.returncode != 0:
            forward(signal.SIGTERM, None)  # one worker failed (e.g. could not start): stop the others
    return next((code for code in codes if code != 0), 0)
