"""Shared fixtures: simulators and gateways on free loopback ports, in the test's own event loop."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from lockgate.config import parse_config
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from tests.etcd_support import EtcdServer


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as s:
        yield s


@pytest.fixture
def start_sim(stack: contextlib.AsyncExitStack) -> Callable[..., Awaitable[SimServer]]:
    async def start(models: tuple[str, ...] = ("m",), **kwargs: Any) -> SimServer:
        return await stack.enter_async_context(SimServer(SimConfig(models=models, **kwargs)))

    return start


@pytest.fixture
def start_gateway(stack: contextlib.AsyncExitStack, tmp_path: Any) -> Callable[..., Awaitable[GatewayServer]]:
    async def start(models: list[dict[str, Any]], **extra: Any) -> GatewayServer:
        data = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "health": {"interval_ms": 60000},
            "usage": {"path": str(tmp_path / "usage.sqlite3")},
            "models": models,
            **extra,
        }
        server = GatewayServer(parse_config(data, "test"), port=0)
        return await stack.enter_async_context(server)

    return start


@pytest.fixture
def serve_app(stack: contextlib.AsyncExitStack) -> Callable[[web.Application], Awaitable[str]]:
    """Serve a test's own aiohttp app (a fake engine) on a free loopback port; returns its base URL."""

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site.port}"

    return serve


def instance(sim: SimServer, **extra: Any) -> dict[str, Any]:
    return {"url": sim.url, "engine": "vllm", **extra}


@pytest.fixture
def client_writes(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], list[bytes]]:
    """`watch(url)`: the list, filled from then on, of the bytes of each socket write a server at `url` (the
    gateway) makes to its clients. Counted at asyncio's transport, the last Python layer under the edge server
    (whose classes are native in the compiled build, where patching their methods would count nothing)."""
    from asyncio import selector_events
    from urllib.parse import urlsplit

    watched: dict[int, list[bytes]] = {}
    transport: Any = selector_events._SelectorSocketTransport  # type: ignore[attr-defined]  # private, stable since 3.4
    original = transport.write

    def write(self: Any, data: Any) -> None:
        sockname = self.get_extra_info("sockname")
        if isinstance(sockname, tuple) and sockname[1] in watched:
            watched[sockname[1]].append(bytes(data))
        original(self, data)

    monkeypatch.setattr(transport, "write", write)

    def watch(url: str) -> list[bytes]:
        port = urlsplit(url).port
        assert port is not None
        return watched.setdefault(port, [])

    return watch


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the session (tests keep apart by cluster name); tests that stop etcd start their own."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_binary() -> None:
    """The test starts etcd itself (e.g. through a benchmark): skipped without one, failed under CI=true."""
    from lockgate.cluster.etcd_server import EtcdMissing, etcd_binary

    try:
        etcd_binary()
    except EtcdMissing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
