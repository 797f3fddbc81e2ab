"""Running a gateway: listening sockets, graceful shutdown, and the embedded simulator fleet.

`GatewayServer` is what both `lockgate serve` and the integration tests use:

    async with GatewayServer(config) as server:   # starts simulators (if any), gateway, listener
        ... server.url ...
        await server.shutdown()                    # the graceful path a SIGTERM takes

Shutdown: `/ready` fails at once and new requests get 503; the listening socket closes; requests in
flight may finish until `shutdown.drain_ms`; then each is cancelled (its upstream aborted, a final
SSE error event for streams); records are flushed; everything is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any

from .config import Config
from .edge.server import HttpServer
from .embedded import start_simulators
from .exchange import Phase
from .gateway import Gateway

log = logging.getLogger(__name__)

#: How long stopped requests may take to write their final error before they are cut off.
STOP_GRACE_S = 1.0


class GatewayServer:
    def __init__(self, config: Config, *, port: int | None = None, usage_path: str | None = None) -> None:
        self._config = config
        self._port = config.listen.port if port is None else port
        self._usage_path = usage_path
        self._stack = contextlib.AsyncExitStack()
        self._http: HttpServer | None = None
        self._stopped = False
        self.gateway: Gateway | None = None
        self.url = ""

    async def __aenter__(self) -> GatewayServer:
        try:
            config = await start_simulators(self._config, self._stack)
            self.gateway = await self._stack.enter_async_context(Gateway(config, usage_path=self._usage_path))
            limits = config.limits
            self._http = HttpServer(
                self.gateway.handle,
                max_body_bytes=limits.max_body_bytes,
                max_header_bytes=limits.max_header_bytes,
                keepalive_timeout_s=limits.keepalive_timeout_ms / 1000,
                header_timeout_s=limits.header_timeout_ms / 1000,
                write_timeout_s=limits.write_timeout_ms / 1000,
                error_body=Gateway.edge_error_body,
            )
            listen = config.listen
            if listen.unix:
                await self._http.start(listen.host, 0, unix_path=listen.unix)
                self.url = f"unix://{listen.unix}"
            else:
                await self._http.start(listen.host, self._port)
                self.url = f"http://{listen.host}:{self._http.port}"
        except BaseException:
            await self._close_http()
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def shutdown(self, drain_s: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        gateway = self.gateway
        assert gateway is not None
        if drain_s is None:
            drain_s = self._config.shutdown.drain_ms / 1000
        gateway.draining = True
        # Queued requests will not be served: they get 503 + Retry-After now, not at the drain deadline.
        for exchange in gateway.registry.all():
            if exchange.phase is Phase.QUEUED:
                exchange.cancel("shutdown")
        if self._http is not None:
            self._http.stop_accepting()  # no new connections
        try:
            async with asyncio.timeout(drain_s):
                await gateway.registry.wait_empty()
        except TimeoutError:
            log.info("drain deadline passed; stopping %d request(s)", len(gateway.registry))
        for exchange in gateway.registry.all():
            exchange.cancel("shutdown")
        try:
            # Ending a stream writes one last SSE event; a client that does not read could block that
            # write forever and, with it, the exit (and the flush of every record).
            async with asyncio.timeout(STOP_GRACE_S):
                await gateway.registry.wait_empty()
        except TimeoutError:
            for exchange in gateway.registry.all():
                exchange.stop_now()
            await gateway.registry.wait_empty()
        await self._close_http()
        await self._stack.aclose()

    async def _close_http(self) -> None:
        """Close the client connections (idle ones at once; every request has ended by now)."""
        if self._http is not None:
            http, self._http = self._http, None
            await http.shutdown(timeout_s=5.0)


async def serve(config: Config, *, announce: Any = print) -> int:
    """Run until SIGINT/SIGTERM, then shut down gracefully. Returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with GatewayServer(config) as server:
        assert server.gateway is not None
        tune_gc()
        announce(_banner(server))
        await stop.wait()
        announce("lockgate: shutting down (draining requests in flight)")
    announce("lockgate: stopped")
    return 0


#: Container allocations (net) between young-generation collections; CPython's default is 700.
GC_THRESHOLDS = (20_000, 50, 100)


def tune_gc() -> None:
    """Garbage collection for a long-running server, once everything is loaded.

    Every object alive at this point (modules, configuration, the fleet) moves to the permanent
    generation: full collections no longer walk it. The young generation is collected after 20,000
    net allocations instead of 700: a request allocates a few hundred containers, nearly all freed by
    reference counting, so collections were running every couple of requests to find nothing.
    Measured under `lockgate bench overhead`: garbage collection fell from ~17 us to ~1 us per request
    (most of it full collections walking the whole heap)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _banner(server: GatewayServer) -> str:
    assert server.gateway is not None
    config = server.gateway.config
    lines = [f"lockgate listening on {server.url}"]
    for model in config.models:
        urls = ", ".join(i.name or i.url for i in model.instances)
        lines.append(f"  model {model.name!r}: {len(model.instances)} instance(s): {urls}")
    if config.models and server.url.startswith("http"):
        example = config.models[0].name
        lines += [
            "Try it:",
            f"  curl -s {server.url}/v1/chat/completions -H 'Content-Type: application/json' \\",
            f'    -d \'{{"model": "{example}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'',
            f"Metrics: {server.url}/metrics   Fleet: {server.url}/admin/fleet",
        ]
    return "\n".join(lines)
