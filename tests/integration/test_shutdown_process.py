"""Graceful shutdown end to end: `lockgate serve --config ...` as a child process receives SIGTERM.

A held request (the engine has not answered) and two streams are in flight: `/ready` fails at once, the
short stream finishes within the drain deadline, after it the held request gets 503 + Retry-After and the
long stream a final SSE error event; every record is flushed and the process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import orjson

from lockgate.records import read_records
from tests.integration.cancel_support import StreamReader, body, cancel_and_wait, wait_sim_idle

DRAIN_MS = 2000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_config(path: Path, port: int, engine_url: str, usage: Path, drain_ms: int = DRAIN_MS) -> None:
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"usage: {{path: '{usage}'}}\n"
        f"shutdown: {{drain_ms: {drain_ms}}}\n"
        "health: {interval_ms: 60000}\n"
        f"models:\n  - name: m\n    instances:\n      - {{url: '{engine_url}', engine: vllm}}\n"
    )


async def serve(config: Path) -> asyncio.subprocess.Process:
    """`lockgate serve --config config` as a child process, its stdout piped."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lockgate", "serve", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


async def read_line_with(stream: asyncio.StreamReader, text: str) -> None:
    while True:
        line = await stream.readline()
        assert line, f"the gateway exited before printing {text!r}"
        if text in line.decode():
            return


async def test_sigterm_drains_then_stops_and_exits_zero(start_sim, tmp_path) -> None:
    sim = await start_sim(prefill_tps=1e6, tpot_ms=10.0)
    port = free_port()
    usage = tmp_path / "usage.sqlite3"
    config = tmp_path / "gw.yaml"
    write_config(config, port, sim.url, usage)
    proc = await serve(config)
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}"
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(20):
            await read_line_with(proc.stdout, "lockgate listening on")
        async with (
            aiohttp.ClientSession() as http,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as probe,
        ):
            async with probe.get(url + "/ready") as resp:  # keeps a connection open for after SIGTERM
                assert resp.status == 200
            results: dict[str, object] = {}
            first_tokens = {"short": asyncio.Event(), "long": asyncio.Event()}

            async def held() -> None:
                async with http.post(url + "/v1/chat/completions", json=body(False)) as resp:
                    results["held"] = (resp.status, resp.headers.get("Retry-After"), await resp.read())

            async def streamed(name: str, max_tokens: int) -> None:
                async with http.post(url + "/v1/chat/completions", json=body(True, max_tokens)) as resp:
                    assert resp.status == 200
                    reader = StreamReader(resp)
                    await reader.read_tokens(1)
                    first_tokens[name].set()
                    await reader.read_to_end()
                    results[name] = reader

            async with asyncio.timeout(15):
                sim.control.hold_next = 1
                tasks.append(asyncio.create_task(held()))
                await sim.wait_held(1)
                tasks.append(asyncio.create_task(streamed("short", 30)))
                tasks.append(asyncio.create_task(streamed("long", 5000)))
                for event in first_tokens.values():
                    await event.wait()
                proc.send_signal(signal.SIGTERM)
                await read_line_with(proc.stdout, "shutting down")
                async with probe.get(url + "/ready") as resp:
                    assert resp.status == 503  # at once, while the streams still run
                    assert resp.headers.get("Connection") == "close"  # draining: not to be used again
                assert not any(t.done() for t in tasks)
                await asyncio.gather(*tasks)
                assert await proc.wait() == 0
                await wait_sim_idle(sim)
    finally:
        for task in tasks:
            await cancel_and_wait(task)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    short, long = results["short"], results["long"]
    assert isinstance(short, StreamReader) and isinstance(long, StreamReader)
    assert short.done and short.tokens == 30 and not short.errors()
    assert not long.done and [e["code"] for e in long.errors()] == ["cancelled"]
    held_result = results["held"]
    assert isinstance(held_result, tuple)
    status, retry_after, raw = held_result
    assert status == 503 and int(retry_after) >= 1
    assert orjson.loads(raw)["error"]["type"] == "cancelled"
    rows = {(r["stream"], r["completion_tokens"] == 30): r for r in read_records(str(usage))}
    assert len(rows) == 3
    assert rows[(1, True)]["status"] == "completed"
    assert rows[(0, False)]["cancel_reason"] == "shutdown" and rows[(0, False)]["completion_tokens"] == 0
    assert rows[(1, False)]["cancel_reason"] == "shutdown"
    assert rows[(1, False)]["completion_tokens"] == long.tokens
    engine = sim.statistics()
    assert engine["requests_finished"] == 1 and engine["requests_aborted"] == 2


async def test_a_second_sigterm_stops_the_requests_in_flight_at_once(start_sim, tmp_path) -> None:
    """An operator who cannot wait for the drain (10 minutes here) sends the signal again: the streams in flight end
    now with their final error event, each recorded as shut down, and the process exits 0 (it ignored the second
    signal before)."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=10.0)
    port = free_port()
    usage = tmp_path / "usage.sqlite3"
    config = tmp_path / "gw.yaml"
    write_config(config, port, sim.url, usage, drain_ms=600_000)
    proc = await serve(config)
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(20):
            await read_line_with(proc.stdout, "lockgate listening on")
        async with aiohttp.ClientSession() as http, asyncio.timeout(30):  # bounds a hang only
            async with http.post(url + "/v1/chat/completions", json=body(True, 5000)) as resp:
                assert resp.status == 200
                reader = StreamReader(resp)
                await reader.read_tokens(1)
                proc.send_signal(signal.SIGTERM)
                await read_line_with(proc.stdout, "shutting down")
                proc.send_signal(signal.SIGTERM)
                await read_line_with(proc.stdout, "stopping the requests in flight now")
                await reader.read_to_end()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not reader.done and [e["code"] for e in reader.errors()] == ["cancelled"]
    [record] = read_records(str(usage))
    assert (record["status"], record["cancel_reason"]) == ("cancelled", "shutdown")
