"""`lockgate serve --workers N`: N gateway processes on one port, replicas of the configuration's cluster.

One lockgate process runs on one core. `--workers N` starts N of them (`lockgate serve --worker i`),
each listening on the same port with SO_REUSEPORT (the kernel spreads new connections among them),
and each a central replica of the `cluster:` section: they share state the way replicas on different
hosts do (engines and their load through the sidecars' records, prefix placement, tenant limit shares,
duplicates meeting at the sidecar), so a configuration without `cluster:` is refused. Each worker
writes its usage records to `<usage.path>.worker-<i>` (one SQLite writer per file).

This process only supervises: it forwards SIGINT, SIGTERM and SIGHUP to every worker and exits when
they all have, with the first non-zero status among theirs (0 if none; a worker ended by the stop signal itself, one
that came before it could drain, counts as 0). A worker still running `KILL_GRACE_S` past `shutdown.drain_ms` after
the stop signal (stopped, hung) is killed (SIGKILL). A worker that ends on its own after it
started (killed, out of memory, a signal of its own, whatever its status) is started again, at once the first time,
then after pauses of 1, 2, 4 and 8 s (`MAX_RESTARTS` a minute), then every `RETRY_S` while the others serve: one
that cannot start again (a configuration file broken since the launch) neither spins nor takes the healthy workers
down; only when none is left running does the supervisor stop. One that fails within `START_GRACE_S` of the launch
(it cannot start: a port, a file) stops the others. Workers start with SIGHUP ignored until they handle it (a reload
forwarded to a worker still starting ended it). A worker reloaded over HTTP
(`POST /admin/reload`) asks this process to reload every worker (SIGHUP), and a worker whose supervisor is gone
(even by SIGKILL) stops itself (Linux): no worker goes on serving the port unsupervised. It also makes the private
directory of the workers' sockets, through which operator requests reach every worker (`workerset.py`), and removes
it when it exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from types import FrameType

from . import response_ids, workerset
from .config import Config

log = logging.getLogger(__name__)

#: Set in each worker's environment: its supervisor's process id.
SUPERVISOR_ENV = "LOCKGATE_SUPERVISOR_PID"
#: A worker that fails this soon after the launch could not start: starting it again would fail again.
START_GRACE_S = 5.0
#: Restarts of one worker within a minute (after pauses of 0, 1, 2, 4 and 8 s) before it is tried only every `RETRY_S`.
MAX_RESTARTS = 5
RETRY_S = 30.0
#: While stopping, how often the supervisor looks whether a worker is past its time (`KILL_GRACE_S`).
_CHECK_S = 0.25
#: A worker still running this long after `shutdown.drain_ms` has passed since the stop signal is killed (SIGKILL):
#: its drain ended by then, and its shutdown (records flushed, connections closed) takes well under a second.
KILL_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


class WorkersError(Exception):
    """`--workers` cannot be used with this configuration."""


def run_workers(
    config: Config,
    config_path: str | None,
    workers: int,
    *,
    host: str | None,
    port: int | None,
    log_level: str | None = None,
) -> int:
    if config.cluster is None or config_path is None:
        raise WorkersError(
            "--workers needs a configuration file with a `cluster:` section: the workers are replicas that "
            "share engines, load, limits and affinity through etcd"
        )
    if config.listen.unix or (port if port is not None else config.listen.port) == 0:
        raise WorkersError("--workers needs a TCP port (listen.port or --port, not 0 or a unix socket)")
    command = worker_command(config_path, host=host, port=port, log_level=log_level)
    return _Supervisor(command, workers, drain_s=config.shutdown.drain_ms / 1000).run()


def worker_command(config_path: str, *, host: str | None, port: int | None, log_level: str | None) -> list[str]:
    """Each worker's command line (before its `--worker i`): the supervisor's own options passed on."""
    command = [sys.executable, "-m", "lockgate", "serve", "--config", config_path]
    if host is not None:
        command += ["--host", host]
    if port is not None:
        command += ["--port", str(port)]
    if log_level is not None:
        command += ["--log-level", log_level]  # it was not: a worker's reload summaries (INFO) were never logged
    return command


class _Supervisor:
    def __init__(self, command: list[str], workers: int, *, drain_s: float = 10.0) -> None:
        """`drain_s`: the workers' `shutdown.drain_ms`; a worker still running `KILL_GRACE_S` after it, counted from
        the stop signal, is killed (SIGKILL)."""
        self._command = command
        self._kill_after_s = drain_s + KILL_GRACE_S
        #: When the stop signal came (monotonic; None: none yet), and whether the workers left were killed.
        self._stop_at: float | None = None
        self._killed = False
        #: The workers' sockets, through which the one an operator request reaches asks the others (`workerset.py`).
        self._sockets = tempfile.mkdtemp(prefix="lockgate-workers-")
        self._env = {
            **os.environ,
            # One secret for every worker's response ids (a client's follow-up may reach any of them), unless set (an
            # empty one is unset: each worker drew a random one of its own, and follow-ups failed across workers).
            response_ids.SECRET_ENV: os.environ.get(response_ids.SECRET_ENV) or os.urandom(32).hex(),
            SUPERVISOR_ENV: str(os.getpid()),
            workerset.DIRECTORY_ENV: self._sockets,
            workerset.COUNT_ENV: str(workers),
        }
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # worker index -> its process
        self._count = workers
        self._launched = time.monotonic()
        self._restarts: dict[int, deque[float]] = {n: deque() for n in range(workers)}
        self._stopping = False
        self._stop_signal: int = signal.SIGTERM
        self._codes: list[int] = []
        #: Workers waiting to be started again, and when (monotonic).
        self._due: dict[int, float] = {}

    def _spawn(self, n: int) -> None:
        # Started with SIGHUP ignored (inherited across exec) until its gateway handles it: a reload forwarded while
        # a worker was still starting ended it (the default action), and at the launch that stopped every worker.
        child = subprocess.Popen([*self._command, "--worker", str(n)], env=self._env, preexec_fn=_ignore_hangup)
        self._children[n] = child
        if self._stopping:  # (the stop signal came while it was being started: `_forward` did not know it yet)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, self._stop_signal)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGHUP:
            self._stopping = True
            self._stop_signal = signum
            if self._stop_at is None:
                self._stop_at = time.monotonic()
        # Every child in `_children` is unreaped (the loop reaps, then removes it), so its pid is not reused yet.
        # (`Popen.poll` or `send_signal` here would reap one behind the loop's back: it then waited for it forever.)
        for child in self._children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    def run(self) -> int:
        try:
            return self._supervise()
        finally:
            shutil.rmtree(self._sockets, ignore_errors=True)

    def _supervise(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._forward)
        self._launched = time.monotonic()
        for index in range(self._count):
            self._spawn(index)
        while self._children or (self._due and not self._stopping):
            self._start_due()
            if self._stopping:
                timeout: float | None = _CHECK_S
            else:
                timeout = max(0.0, min(self._due.values()) - time.monotonic()) if self._due else None
            ended = self._wait(timeout)
            if ended is None:
                # (The stop signal is not sent again: a second one hurries a draining worker, and one arriving after it
                # gave its handler back ended it with the signal's status, which read as a failure.)
                self._kill_late()
                continue
            pid, status = ended
            n = next((i for i, child in self._children.items() if child.pid == pid), None)
            if n is None:
                continue
            child = self._children.pop(n)
            child.returncode = os.waitstatus_to_exitcode(status)
            if self._stopping:
                # (Ended by the stop signal itself, which reached it before its handler: it stopped as asked.)
                self._codes.append(0 if child.returncode == -self._stop_signal else child.returncode)
                continue
            self._ended(n, child.returncode)
        return next((code for code in self._codes if code != 0), 0)

    def _kill_late(self) -> None:
        """Kill (SIGKILL) the workers still running `kill_after_s` after the stop signal: one stopped (SIGSTOP) or hung
        in a deadlock never ends on SIGTERM, and the supervisor waited for it for good (an outside run: 50 s, until it
        was continued)."""
        if self._killed or self._stop_at is None or time.monotonic() - self._stop_at < self._kill_after_s:
            return
        self._killed = True
        late = sorted(self._children)
        log.error(
            "lockgate: workers %s still running %g s after the stop signal: killing them",
            ", ".join(map(str, late)),
            self._kill_after_s,
        )
        for n in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._children[n].pid, signal.SIGKILL)

    def _wait(self, timeout: float | None) -> tuple[int, int] | None:
        """A child that ended (pid, wait status), waiting at most `timeout` seconds (None: until one does), or None
        as soon as a stop signal comes. (Polled: a blocking `waitpid` is resumed after a signal's handler, and a stop
        signal that no worker heeded left the supervisor waiting in it for good.)"""
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        stopping = self._stopping
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # none running: every worker waits for its restart
                pid = 0
            if pid:
                return pid, status
            left = deadline - time.monotonic()
            if left <= 0 or (self._stopping and not stopping):
                return None
            time.sleep(min(left, 0.05))

    def _start_due(self) -> None:
        if self._stopping:
            self._due.clear()
            return
        now = time.monotonic()
        for n, at in list(self._due.items()):
            if at <= now:
                del self._due[n]
                self._spawn(n)

    def _ended(self, n: int, status: int) -> None:
        """Worker `n` ended on its own (status `status`): start it again, at once or after a pause, or stop."""
        now = time.monotonic()
        # (A worker killed by a signal crashed, it did not fail to start: an outside run's worker SIGKILLed while
        # serving, within the grace, stopped every worker.)
        if now - self._launched < START_GRACE_S and not self._restarts[n] and status >= 0:
            self._stop_all(n, status, f"within {START_GRACE_S:g} s of the launch (it cannot start)")
            return
        recent = self._restarts[n]
        while recent and now - recent[0] > 60.0:
            recent.popleft()
        if len(recent) < MAX_RESTARTS:
            # Backed off: a worker that cannot start again (a configuration file broken since the launch) does not
            # spin, and a single crash is repaired at once.
            delay = 0.0 if not recent else min(RETRY_S, 2.0 ** (len(recent) - 1))
            recent.append(now)
            log.warning("lockgate: worker %d ended (status %d); starting it again in %g s", n, status, delay)
            self._due[n] = now + delay
        elif self._children:  # others still run (it was taken out)
            log.error(
                "lockgate: worker %d ended (status %d) after %d restarts within a minute; the other workers go on "
                "serving, and it is tried again every %g s",
                n,
                status,
                MAX_RESTARTS,
                RETRY_S,
            )
            self._due[n] = now + RETRY_S
        else:
            self._stop_all(n, status, f"after {MAX_RESTARTS} restarts within a minute, and no worker is running")

    def _stop_all(self, n: int, status: int, why: str) -> None:
        log.error("lockgate: worker %d ended (status %d) %s: stopping every worker", n, status, why)
        self._codes.append(status)
        self._forward(signal.SIGTERM, None)


def _ignore_hangup() -> None:
    """In a worker's process before it runs lockgate (`preexec_fn`; the supervisor has no threads)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def follow_supervisor() -> None:
    """In a worker: stop (SIGTERM: drain and exit) when the supervisor dies, even by SIGKILL (Linux's
    parent-death signal), and at once if it is gone already. Elsewhere a no-op."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != supervisor:
        os.kill(os.getpid(), signal.SIGTERM)


def reload_all_workers() -> bool:
    """In a worker: ask the supervisor to reload every worker (it forwards SIGHUP to each, this one
    included: reloading an unchanged file again changes nothing). False outside `--workers`."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor is None:
        return False
    try:
        os.kill(int(supervisor), signal.SIGHUP)
    except (OSError, ValueError):
        return False
    return True
