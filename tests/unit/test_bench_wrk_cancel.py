"""`bench overhead` cancelled (Ctrl-C, SIGTERM) while wrk runs: wrk is killed and reaped, not left loading."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import pytest

from lockgate.bench import wrk


@pytest.mark.skipif(wrk.wrk_path() is None, reason="wrk is not installed")
async def test_a_cancelled_run_kills_and_reaps_wrk(monkeypatch: pytest.MonkeyPatch) -> None:
    procs: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def recording(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await spawn(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording)
    connected = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        connected.set()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    head, tail = wrk.body_template("m", 1, stream=False)
    task = asyncio.create_task(
        wrk.run_wrk(f"http://127.0.0.1:{port}/v1/chat/completions", head, tail, connections=1, duration_s=60)
    )
    try:
        await asyncio.wait_for(connected.wait(), 10)  # wrk is running and loading the server
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (proc,) = procs
        assert proc.returncode is not None  # killed and waited for
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)  # reaped: no such process, not even a zombie
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
