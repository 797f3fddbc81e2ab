"""Running a gateway: listening sockets, graceful shutdown, and the embedded simulator fleet.

`GatewayServer` is what both `lockgate serve` and the integration tests use:

    async with GatewayServer(config) as server:   # starts simulators (if any), gateway, listener
        ... server.url ...
        await server.shutdown()                    # the graceful path a SIGTERM takes

With a `cluster:` section the server also joins that cluster once it listens: as a central gateway
(`role="central"`, `lockgate serve`: it discovers the sidecars' engines) or as a sidecar
(`role="sidecar"`, `lockgate sidecar`: it publishes its own engines and takes the engine a central
gateway names in `x-lockgate-engine`). See `lockgate.cluster`.

Shutdown: `/ready` fails at once; the listening socket closes (new connections are refused) and new
requests on open keep-alive connections get 503; requests in flight may finish until
`shutdown.drain_ms` (or a second SIGINT/SIGTERM: `hurry()`); then each is cancelled (its upstream aborted, a final
SSE error event for streams); open dashboards' streams end; records are flushed; everything is closed. SIGHUP
reloads the configuration (`reload.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, InstanceConfig
from .edge.server import HttpServer
from .embedded import start_simulators, with_instances
from .errors import edge_error_body
from .exchange import Phase
from .gateway import Gateway
from .observe.access_log import AccessLogUnavailable
from .reload import Reloader, summary
from .request_ids import new_request_id
from .summary import keys_configured, redact_url
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from .cluster.member import Role
    from .workerset import WorkerSet

log = logging.getLogger(__name__)

#: How long stopped requests may take to write their final error before they are cut off.
STOP_GRACE_S = 1.0


class StartupError(Exception):
    """The gateway could not start (a port in use, a usage database it cannot open, ...): one line
    saying what and why, for the command line."""


class GatewayServer:
    def __init__(
        self,
        config: Config,
        *,
        port: int | None = None,
        host: str | None = None,
        usage_path: str | None = None,
        config_path: str | Path | None = None,
        role: Role = "central",
        reuse_port: bool = False,
        workers: WorkerSet | None = None,
    ) -> None:
        """`config` as read from `config_path` (which SIGHUP and `POST /admin/reload` re-read; None:
        nothing to reload); `host`/`port` override `listen` (the command line's `--host`/`--port`);
        `reuse_port`: share the port with other processes (`--workers`); `workers`: this worker's others (it also
        listens on its socket for them)."""
        self._config = config
        self._role: Role = role
        self._reuse_port = reuse_port
        self._workers = workers
        #: The listener on this worker's socket (`--workers`), for the other workers' operator requests.
        self._private: HttpServer | None = None
        self._port = config.listen.port if port is None else port
        self._host = config.listen.host if host is None else host
        self._usage_path = usage_path
        self._config_path = config_path
        self._stack = contextlib.AsyncExitStack()
        self._http: HttpServer | None = None
        self._stopped = False
        self.gateway: Gateway | None = None
        self.simulated: dict[str, list[InstanceConfig]] = {}
        #: The cluster role's state (`Discovery` or `Publisher`) when the config has a `cluster:` section.
        self.cluster: Any = None
        self.url = ""
        #: Why the server must stop (set once: a sidecar whose node name proved taken), and the event `serve` awaits.
        self.failure: str | None = None
        self.failed = asyncio.Event()

    @property
    def role(self) -> Role:
        """`central` (`lockgate serve`) or `sidecar`: what its `cluster:` section, if any, makes it do."""
        return self._role

    async def __aenter__(self) -> GatewayServer:
        try:
            await self._start()
        except BaseException:
            await self._close_http()
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        try:
            #: The simulators' instances, by model: a reload adds them to the new config's models.
            self.simulated = await start_simulators(self._config, self._stack)
        except OSError as exc:
            raise StartupError(f"cannot start the simulated engines: {_reason(exc)}") from exc
        config = with_instances(self._config, self.simulated)
        usage = self._usage_path or config.usage.path
        gateway = Gateway(config, usage_path=self._usage_path)
        if config.cluster is not None and self._role == "sidecar":
            if config.cluster.engine_choice == "central":
                from .cluster.keys import ENGINE_HEADER

                gateway.fleet.pin_header = ENGINE_HEADER
            if config.cluster.central_keys:
                from .cluster.identity import Relayed

                gateway.relayed = Relayed(config.cluster.central_keys, gateway.admission.book.default.default_priority)
        elif config.cluster is not None:
            gateway.fleet.placement_blocks = config.cluster.placement_blocks
            gateway.fleet.placement_choices = config.cluster.placement_choices
            gateway.fleet.shared_residency = True
            gateway.relays_identity = True
            gateway.dedup.flights.keeps_stored = False  # (another replica may delete a stored response unseen)
        try:
            self.gateway = await self._stack.enter_async_context(gateway)
        except AccessLogUnavailable as exc:
            raise StartupError(str(exc)) from exc
        except (OSError, sqlite3.Error) as exc:
            raise StartupError(f"cannot open the usage database {usage!r}: {_reason(exc)}") from exc
        if self._config_path is not None:
            self.gateway.reloader = Reloader(self._config_path, self._config, self.gateway, self.simulated)
        self._http = self._edge(config)
        http, metrics = self._http, self.gateway.metrics
        metrics.client_connections.set_function(lambda: http.connections)
        metrics.client_connections_refused.read = lambda: http.refused_connections
        metrics.request_body_bytes_held.set_function(lambda: http.held_body_bytes)
        metrics.request_bodies_refused.read = lambda: http.refused_bodies
        listen = config.listen
        where = listen.unix or f"{self._host}:{self._port}"
        try:
            if listen.unix:
                await self._http.start(self._host, 0, unix_path=listen.unix)
                self.url = f"unix://{listen.unix}"
            else:
                await self._http.start(self._host, self._port, reuse_port=self._reuse_port)
                self.url = f"http://{self._host}:{self._http.port}"
        except OSError as exc:
            raise StartupError(f"cannot listen on {where}: {_reason(exc)}") from exc
        if self._workers is not None:
            self._private = self._edge(config)
            try:
                await self._private.start(self._host, 0, unix_path=self._workers.socket)
            except OSError as exc:
                raise StartupError(f"cannot listen on {self._workers.socket}: {_reason(exc)}") from exc
            self.gateway.workers = self._workers
            self.gateway.fleet.private = frozenset(spec.key for specs in self.simulated.values() for spec in specs)
            self.gateway.fleet.split_between(self._workers.index, self._workers.count)
            self.gateway.dedup.flights.keeps_stored = False  # (another worker may delete a stored response unseen)
            self.gateway.slo.records_path = config.usage.path  # `/admin/slo` over every worker's records
        if config.cluster is not None:
            from .cluster.member import join
            from .cluster.publisher import NodeNameTaken, Publisher

            try:
                self.cluster = await self._stack.enter_async_context(
                    join(self._role, config.cluster, self.gateway, self.url)
                )
            except NodeNameTaken as exc:
                raise StartupError(str(exc)) from exc
            if isinstance(self.cluster, Publisher):
                self.cluster.failed = self.fail

    def fail(self, reason: str) -> None:
        """Stop serving for `reason` (`serve` shuts down gracefully and exits 1)."""
        if self.failure is None:
            self.failure = reason
            self.failed.set()

    def _edge(self, config: Config) -> HttpServer:
        """An HTTP server in front of the gateway, with the configuration's limits."""
        assert self.gateway is not None
        limits = config.limits
        return HttpServer(
            self.gateway.handle,
            max_body_bytes=limits.max_body_bytes,
            max_header_bytes=limits.max_header_bytes,
            keepalive_timeout_s=limits.keepalive_timeout_ms / 1000,
            header_timeout_s=limits.header_timeout_ms / 1000,
            write_timeout_s=limits.write_timeout_ms / 1000,
            body_timeout_s=limits.body_timeout_ms / 1000,
            max_connections=limits.max_connections,
            max_held_body_bytes=limits.max_held_body_bytes,
            send_buffer_bytes=limits.send_buffer_bytes,
            error_body=edge_error_body,
            error_headers=lambda: {"x-request-id": new_request_id()},
            precheck=self.gateway.precheck,
        )

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def hurry(self) -> None:
        """A second stop signal during the drain: the requests in flight are stopped now (each recorded as shut down,
        a stream ended with its final error event), not at the drain's deadline."""
        if self.gateway is not None:
            for exchange in self.gateway.registry.all():
                exchange.cancel("shutdown")

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
        # Open dashboards kept watching the drain; their streams end now, or the connections would hold
        # the HTTP server's shutdown until its timeout.
        if gateway.dashboard is not None:
            gateway.dashboard.close()
        await self._close_http()
        await self._stack.aclose()

    async def _close_http(self) -> None:
        """Close the client connections (idle ones at once; every request has ended by now)."""
        if self._http is not None:
            http, self._http = self._http, None
            await http.shutdown(timeout_s=5.0)
        if self._private is not None:
            private, self._private = self._private, None
            await private.shutdown(timeout_s=1.0)
            if self._workers is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._workers.socket)  # gone with the worker (a supervisor killed outright leaves it)
        if self._workers is not None:
            await self._workers.aclose()


async def serve(
    config: Config,
    *,
    config_path: str | Path | None = None,
    host: str | None = None,
    port: int | None = None,
    announce: Callable[[str], object] = print,
    role: Role = "central",
    usage_path: str | None = None,
    reuse_port: bool = False,
    workers: WorkerSet | None = None,
) -> int:
    """Run until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reloads `config_path`. Returns the
    exit status. Raises `StartupError` if the gateway cannot start."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hangup = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hangup.set)
    try:
        async with GatewayServer(
            config,
            host=host,
            port=port,
            config_path=config_path,
            role=role,
            usage_path=usage_path,
            reuse_port=reuse_port,
            workers=workers,
        ) as server:
            assert server.gateway is not None
            tune_gc()
            # `--workers`: the first worker says it all; the others one line each.
            announce(_banner(server) if workers is None or workers.index == 0 else _worker_line(server, workers))
            for warning in server.gateway.unsaid_warnings():
                log.warning("%s", warning)
            reloads = asyncio.create_task(_reload_on_hangup(server.gateway, hangup, announce), name="lockgate-sighup")
            stopping = asyncio.create_task(stop.wait(), name="lockgate-stop")
            failing = asyncio.create_task(server.failed.wait(), name="lockgate-failed")
            try:
                await asyncio.wait((stopping, failing), return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(reloads, stopping, failing)
            if server.failure is not None:
                print(f"lockgate: stopping: {server.failure}", file=sys.stderr, flush=True)
            announce("lockgate: shutting down (draining requests in flight; a second SIGINT/SIGTERM stops them now)")

            def hurry() -> None:
                announce("lockgate: stopping the requests in flight now")
                server.hurry()

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, hurry)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    announce("lockgate: stopped")
    return 1 if server.failure is not None else 0


async def _reload_on_hangup(gateway: Gateway, hangup: asyncio.Event, announce: Callable[[str], object]) -> None:
    """Each SIGHUP reloads the configuration file (signals that arrive during a reload make one more)."""
    while True:
        await hangup.wait()
        hangup.clear()
        if gateway.reloader is None:
            announce("lockgate: SIGHUP: nothing to reload (the embedded default runs; start with --config FILE)")
            continue
        try:
            diff = await gateway.reloader.reload()
        except ConfigError as exc:
            announce(f"lockgate: reload rejected, the running configuration stays:\n{exc}")
            continue
        announce(f"lockgate: configuration reloaded: {summary(diff)}")
        if diff.restart_required:
            announce(f"lockgate: changed but kept until a restart: {', '.join(diff.restart_required)}")


def _reason(exc: BaseException) -> str:
    """An error's reason without its class name or errno prefix (`address already in use`)."""
    if isinstance(exc, OSError) and (exc.errno or exc.strerror):
        # asyncio's bind error puts the address into `strerror`; the errno's own text is the reason.
        text = os.strerror(exc.errno) if exc.errno else str(exc.strerror)
        return text[0].lower() + text[1:]
    return str(exc) or type(exc).__name__


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


def _worker_line(server: GatewayServer, workers: WorkerSet) -> str:
    return f"lockgate listening on {server.url} (worker {workers.index + 1} of {workers.count})"


def _banner(server: GatewayServer) -> str:
    assert server.gateway is not None
    config = server.gateway.config
    lines = [f"lockgate listening on {server.url}"]
    for model in config.models:
        urls = ", ".join(i.name or redact_url(i.url) for i in model.instances)
        lines.append(f"  model {model.name!r}: {len(model.instances)} instance(s): {urls}")
    cluster = config.cluster
    if cluster is not None:
        endpoints = ", ".join(redact_url(url) for url in cluster.endpoints)
        doing = "publishing these engines" if server.role == "sidecar" else "discovering the sidecars' engines"
        lines.append(f"  cluster {cluster.name!r}: {doing} through etcd at {endpoints}")
    if server.role == "sidecar" and cluster is not None:
        lines.append("  clients reach these engines through the cluster's central gateways (`lockgate serve`)")
    elif config.models and server.url.startswith("http"):
        example = config.models[0].name
        # With tenant keys the gateway wants one (401 otherwise): the lines say where it goes.
        keyed = keys_configured(config)
        key = "<a tenant key>" if keyed else "unused"
        auth = f" -H 'Authorization: Bearer {key}'" if keyed else ""
        lines += [
            "Try it:",
            f"  curl -s {server.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
            f'    -d \'{{"model": "{example}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'',
        ]
        if importlib.util.find_spec("openai") is None:
            lines.append(f"  OpenAI SDK (not installed here): {sys.executable} -m pip install openai")
        # Tenant keys and no admin key: the operator routes are closed (403), and the lines say why.
        closed = "   (closed: no `admin.keys` configured)" if keyed and not config.admin.keys else ""
        lines += [
            f'  from openai import OpenAI; client = OpenAI(base_url="{server.url}/v1", api_key="{key}")',
            f"Metrics: {server.url}/metrics   Fleet: {server.url}/admin/fleet{closed}",
        ]
        if server.gateway.dashboard is not None:
            lines.append(f"Dashboard: {server.url}/dashboard{closed}")
    return "\n".join(lines)
