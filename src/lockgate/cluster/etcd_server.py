"""A local etcd server as a child process: for `lockgate bench routing --replicas`, the cluster example
and the tests. Not for production (run etcd as its operators do).

`LocalEtcd` starts the `etcd` binary (Debian's `etcd-server`) on free loopback ports with its data in a
directory of the caller's, waits for its `/health`, and can be stopped and started again on the same
ports and data (an outage and its return). The election timeout is short (heartbeat 50 ms, election
500 ms) so that etcd accepts 1 s lease TTLs, and history is compacted every 1000 revisions (sidecars
rewrite their record every 100 ms; without compaction etcd keeps every revision until its quota).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class EtcdMissing(RuntimeError):
    """No etcd binary on this machine."""


def etcd_binary() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found is None:
        raise EtcdMissing("etcd is not installed (Debian: apt-get install etcd-server; scripts/system-deps.sh)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalEtcd:
    def __init__(self, data_dir: Path) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"etcd-{self.client_port}.log"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start etcd and return once it answers `/health` (blocking; at most `timeout_s`)."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--name=lockgate",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={self.url}",
                    f"--advertise-client-urls={self.url}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=lockgate={peer}",
                    "--heartbeat-interval=50",
                    "--election-timeout=500",
                    "--auto-compaction-mode=revision",
                    "--auto-compaction-retention=1000",
                    "--log-level=error",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not become healthy within {timeout_s}s")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop etcd (idempotent); its data stays for a later `start()`."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
