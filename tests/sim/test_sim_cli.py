from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import urllib.request

from lockgate.sim.cli import add_arguments, config_from_args


def test_arguments_map_to_config() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--port", "0", "--model", "a", "--model", "b", "--fast", "--tpot-ms", "3", "--kv-blocks", "9"])
    cfg = config_from_args(args)
    assert cfg.models == ("a", "b") and cfg.fast and cfg.tpot_ms == 3.0 and cfg.num_kv_blocks == 9
    assert cfg.tls_cert is None
    tls = config_from_args(p.parse_args(["--tls-cert", "engine.pem", "--tls-key", "engine.key"]))
    assert (tls.tls_cert, tls.tls_key) == ("engine.pem", "engine.key")


def test_runs_until_sigterm_and_exits_0() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockgate.sim", "--port", "0", "--model", "m"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
