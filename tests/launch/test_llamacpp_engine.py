"""The llama.cpp launcher against the real engine (SmolLM2-135M on CPU, loads in well under a second)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import socket
import urllib.request
from collections.abc import Iterator

import pytest

from lockgate.launch.llamacpp import (
    SMOLLM2_GGUF,
    EngineStartError,
    LlamaCppEngine,
    SyncLlamaCppEngine,
    find_smollm2_gguf,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None,
    reason="xllamacpp is not installed (optional extra: pip install 'lockgate[llamacpp]')",
)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def _port_is_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def engine() -> Iterator[SyncLlamaCppEngine]:
    with SyncLlamaCppEngine(parallel=2, alias="smollm2") as eng:
        yield eng


def test_find_smollm2_gguf() -> None:
    path = find_smollm2_gguf()
    assert path.name == SMOLLM2_GGUF
    assert path.stat().st_size > 50_000_000


def test_health_and_models(engine: SyncLlamaCppEngine) -> None:
    assert engine.url == f"http://127.0.0.1:{engine.port}"
    assert _get(f"{engine.url}/health") == (200, '{"status":"ok"}')
    status, body = _get(f"{engine.url}/v1/models")
    assert status == 200
    assert '"id":"smollm2"' in body


def test_chat_completion_with_openai_sdk(engine: SyncLlamaCppEngine) -> None:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        resp = client.chat.completions.create(
            model=engine.alias,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 8

        stream = client.chat.completions.create(
            model=engine.alias,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4


def test_metrics_use_llamacpp_names(engine: SyncLlamaCppEngine) -> None:
    status, text = _get(f"{engine.url}/metrics")
    assert status == 200
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
    ):
        assert f"\n{name} " in text, name


def test_slots_endpoint(engine: SyncLlamaCppEngine) -> None:
    status, body = _get(f"{engine.url}/slots")
    assert status == 200
    assert body.count('"is_processing"') == 2


async def test_async_engine_stops_child_cleanly() -> None:
    async with LlamaCppEngine(parallel=1, alias="tiny", ctx=512) as eng:
        pid, port = eng.pid, eng.port
        assert pid is not None
        assert eng.alias == "tiny"
        assert not _port_is_closed(port)
    assert eng.returncode == 0  # SIGTERM is handled: the child exits 0
    assert _process_is_gone(pid)
    assert _port_is_closed(port)
    await eng.aclose()  # idempotent


def test_sync_engine_stops_child_cleanly() -> None:
    with SyncLlamaCppEngine(parallel=1, ctx=512) as eng:
        pid, port = eng.pid, eng.port
        assert pid is not None
    assert eng.returncode == 0
    assert _process_is_gone(pid)
    assert _port_is_closed(port)
    eng.close()  # idempotent


async def test_start_failure_reports_child_stderr(tmp_path: pathlib.Path) -> None:
    bogus = tmp_path / "missing.gguf"
    eng = LlamaCppEngine(model_path=bogus)
    with pytest.raises(EngineStartError, match="exited with code 1") as excinfo:
        await eng.start()
    assert "missing.gguf" in str(excinfo.value)  # llama.cpp's own log line, quoted from stderr
    assert eng.returncode == 1
