"""``SimServer``: one simulated vLLM instance serving HTTP on TCP or a unix socket.

Resource handling: ``start()`` binds the socket and starts the step-loop task, which the server owns;
``aclose()`` (idempotent) releases held requests, stops accepting, cancels in-flight handlers and awaits the
step loop. Use it as ``async with SimServer(SimConfig(models=["m"])) as sim: ... sim.url ...``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..tasks import cancel_and_wait
from .config import SimConfig
from .control import SimControl
from .engine import Engine
from .handlers import Api
from .metrics import LiveGauges, SimMetrics
from .stats import SimStats


class SimServer:
    def __init__(self, config: SimConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SimConfig(**overrides)
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.stats = SimStats(config.requests_seen_limit)
        self.control = SimControl()
        self.engine: Engine | None = None
        self.metrics = SimMetrics(
            config.model_name,
            self._gauges,
            num_gpu_blocks=None if config.fast else config.num_kv_blocks,
            block_size=config.block_size,
        )
        if not config.fast:
            self.engine = Engine(config.scheduler_config(), self.stats, self.metrics)
        self.api = Api(config, self.stats, self.metrics, self.control, self.engine)
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.api.add_routes(self.app)
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._fail_task: asyncio.Task[None] | None = None
        self.failed = False
        self._port: int | None = None
        self._closed = False
        #: With TLS: the server name (SNI) the last client asked for, and how many handshakes asked for one.
        self.last_server_name: str | None = None
        self.server_name_handshakes = 0

    def _tls_context(self) -> ssl.SSLContext | None:
        cfg = self.config
        if cfg.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        context.sni_callback = self._server_name_seen
        return context

    def _server_name_seen(self, _conn: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
        if name is not None:
            self.last_server_name = name
            self.server_name_handshakes += 1

    def _gauges(self) -> LiveGauges:
        if self.engine is None:
            return LiveGauges(0, 0, 0.0)
        return self.engine.gauges()

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> SimServer:
        if self._runner is not None:
            raise RuntimeError("already started")
        cfg = self.config
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.05)
        await runner.setup()
        self._runner = runner
        try:
            site: web.BaseSite
            if cfg.uds is not None:
                site = web.UnixSite(runner, cfg.uds)
            else:
                family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
                sock = socket.create_server((cfg.host, cfg.port), family=family, backlog=1024)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._port = sock.getsockname()[1]
                site = web.SockSite(runner, sock, backlog=1024, ssl_context=self._tls_context())
            await site.start()
            if self.engine is not None:
                self._loop_task = asyncio.create_task(self.engine.run(), name=f"sim-step-loop:{self.url}")
            if cfg.fail_after_s is not None:
                self._fail_task = asyncio.create_task(self._fail_later(cfg.fail_after_s), name=f"sim-fail:{self.url}")
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.control.release()
        try:
            if self._runner is not None:
                await self._runner.cleanup()
        finally:
            await cancel_and_wait(self._fail_task, self._loop_task)
            self._fail_task = self._loop_task = None

    async def __aenter__(self) -> SimServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- failure -------------------------------------------------------------------------------------------
    def fail(self) -> int:
        """Crash the engine (idempotent): streams in flight break (their connections are reset), then
        /health and every generation request answer 503 (until ``/sim/control`` says otherwise).
        Returns how many requests in flight were broken."""
        self.failed = True
        self.control.update({"healthy": False, "fail_status": 503})
        broken = self.engine.crash() if self.engine is not None else 0
        self.stats.notify()
        return broken

    async def _fail_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.fail()

    # -- addresses -----------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("not listening on TCP (not started, or serving a unix socket)")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, without ``/v1``. For a unix socket it is ``http://localhost`` (connect via ``uds``)."""
        if self.config.uds is not None:
            return "http://localhost"
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.config.tls_cert is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    @property
    def uds(self) -> str | None:
        return self.config.uds

    # -- test helpers --------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """The same snapshot as ``GET /sim/stats``."""
        return self.api.snapshot()

    # These wait without a deadline: bound them with ``asyncio.timeout`` (tests also have pytest-timeout).
    async def wait_until(self, predicate: Callable[[SimServer], bool]) -> None:
        """Wait until ``predicate(self)`` holds, re-checked on every stats change (no polling)."""
        await self.stats.wait_until(lambda: predicate(self))

    async def wait_held(self, n: int = 1) -> None:
        await self.stats.wait_until(lambda: self.stats.held >= n)

    async def wait_ended(self, request_id: str) -> dict[str, Any]:
        """Wait until the request with this id has ended; return its record."""

        def ended() -> bool:
            rec = self.stats.find(request_id)
            return rec is not None and rec.ended_at is not None

        await self.stats.wait_until(ended)
        rec = self.stats.find(request_id)
        assert rec is not None
        return rec.as_dict()

    def release(self) -> int:
        """Release held requests (like ``POST /sim/release``); returns how many were held."""
        held = self.stats.held
        self.control.release()
        return held

    def reset_stats(self) -> None:
        self.stats.reset()
