"""The `lockgate` command as a user runs it: a real child process (in process where only the output
matters, to keep the suite fast).

SIGHUP reloads `serve --config FILE` with a stream in flight (and refuses a broken file, which the
process survives); start-up failures print one line and exit non-zero (a traceback only with
`--log-level debug`); `check-config` says what will be served; `--version`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from lockgate.admission.tenants import hash_key
from lockgate.cli import main
from lockgate.gateway import Gateway
from lockgate.server import StartupError, _reload_on_hangup
from tests.integration.cancel_support import StreamReader, body, cancel_and_wait
from tests.integration.test_shutdown_process import free_port, read_line_with

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def lockgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate", *args], capture_output=True, text=True, timeout=30, env=env or ENV
    )


def config_text(port: int, usage: Path, engine_url: str, keys: list[str]) -> str:
    digests = ", ".join(f"'{hash_key(k)}'" for k in keys)
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"usage: {{path: '{usage}'}}\n"
        "health: {interval_ms: 60000}\n"
        f"models:\n  - name: m\n    instances:\n      - {{url: '{engine_url}', engine: vllm}}\n"
        f"tenants:\n  - {{name: t, keys: [{digests}]}}\n"
    )


async def test_sighup_reloads_with_a_stream_in_flight_and_survives_a_broken_file(
    start_sim: Any, tmp_path: Path
) -> None:
    sim = await start_sim(prefill_tps=1e6, tpot_ms=1.0)
    port = free_port()
    usage = tmp_path / "usage.sqlite3"
    path = tmp_path / "gw.yaml"
    path.write_text(config_text(port, usage, sim.url, ["sk-old"]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lockgate", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    task: asyncio.Task[StreamReader] | None = None
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as http:
            await read_line_with(proc.stdout, "lockgate listening on")

            async def stream() -> StreamReader:
                headers = {"Authorization": "Bearer sk-old"}
                async with http.post(url, json=body(True, 30), headers=headers) as resp:
                    assert resp.status == 200
                    reader = StreamReader(resp)
                    await reader.read_to_end()
                    return reader

            async def status(key: str) -> int:
                async with http.post(url, json=body(False, 5), headers={"Authorization": f"Bearer {key}"}) as resp:
                    await resp.read()
                    return resp.status

            sim.control.hold_next = 1
            task = asyncio.create_task(stream())
            await sim.wait_held(1)
            assert await status("sk-new") == 401

            path.write_text(config_text(port, usage, sim.url, ["sk-old", "sk-new"]))
            proc.send_signal(signal.SIGHUP)
            await read_line_with(proc.stdout, "configuration reloaded: tenants changed")
            assert await status("sk-new") == 200
            sim.release()
            reader = await task
            assert reader.done and reader.tokens == 30 and not reader.errors()

            path.write_text(config_text(port, usage, sim.url, ["sk-old"]).replace("engine: vllm", "engine: vlm"))
            proc.send_signal(signal.SIGHUP)
            await read_line_with(proc.stdout, "reload rejected, the running configuration stays")
            await read_line_with(proc.stdout, "models[0].instances[0].engine")
            assert await status("sk-new") == 200  # the old configuration still runs
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
    finally:
        if task is not None:
            await cancel_and_wait(task)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_busy_port_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "gw.yaml"
        path.write_text(config_text(port, tmp_path / "u.sqlite3", "http://127.0.0.1:9", ["k"]))
        result = lockgate("serve", "--config", str(path))
        assert result.returncode == 1
        # (The config's engine, at port 9, is down: its first health check may report it before the port is tried.)
        lines = [line for line in result.stderr.strip().splitlines() if "is now unhealthy" not in line]
        assert lines == [f"lockgate: cannot start: cannot listen on 127.0.0.1:{port}: address already in use"]
        # `--log-level debug` lets the exception (and its traceback) through.
        with pytest.raises(StartupError, match="address already in use"):
            main(["--log-level", "debug", "serve", "--config", str(path)])


def test_config_problems_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = lockgate("serve", "--config", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("lockgate: invalid configuration: ") and "cannot read" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    path = tmp_path / "gw.yaml"
    text = config_text(8080, tmp_path / "u.sqlite3", "http://127.0.0.1:9", ["k"])
    path.write_text(text.replace("port: 8080", "port: '${LOCKGATE_TEST_UNSET}'"))
    assert main(["check-config", str(path)]) == 2
    assert "listen.port: environment variable ${LOCKGATE_TEST_UNSET} is not set" in capsys.readouterr().err


def test_check_config_says_what_is_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "models:\n  - {name: real, instances: [{url: 'http://u:pw@127.0.0.1:9', name: n1}]}\n"
        "  - {name: demo-model, timeout_ms: 5000}\n"
        "simulate:\n  - {models: [demo-model], count: 2}\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pw" not in out
    assert "model 'real': 1 instance(s), routing predicted_ttft: n1 (http://***@127.0.0.1:9, openai)" in out
    assert "model 'demo-model': 2 instance(s)" in out and "sim-2 (simulated vllm)" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"lockgate {version('lockgate')}"


def test_a_usage_database_that_cannot_be_opened_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gw.yaml"
    usage = tmp_path / "a-directory"  # (its directory exists: the configuration is valid)
    usage.mkdir()
    path.write_text(config_text(free_port(), usage, "http://127.0.0.1:9", ["k"]))
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lockgate: cannot start: cannot open the usage database '{usage}': unable to open database file"]
    # A directory that does not exist is the configuration's mistake, found by `check-config` too (exit 2).
    missing = tmp_path / "missing-dir" / "usage.sqlite3"
    path.write_text(config_text(free_port(), missing, "http://127.0.0.1:9", ["k"]))
    assert main(["check-config", str(path)]) == 2
    assert f"usage.path: the directory of '{missing}'" in capsys.readouterr().err


async def test_sighup_without_a_config_file_says_there_is_nothing_to_reload() -> None:
    said: list[str] = []
    announced = asyncio.Event()

    def announce(text: str) -> None:
        said.append(text)
        announced.set()

    hangup = asyncio.Event()
    hangup.set()
    gateway = cast(Gateway, SimpleNamespace(reloader=None))  # the embedded default: no file
    task = asyncio.create_task(_reload_on_hangup(gateway, hangup, announce))
    try:
        async with asyncio.timeout(5):
            await announced.wait()
    finally:
        await cancel_and_wait(task)
    assert said == ["lockgate: SIGHUP: nothing to reload (the embedded default runs; start with --config FILE)"]
