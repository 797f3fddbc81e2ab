"""The fleet: engine instances, their HTTP sessions and health, grouped into one pool per model.

`Fleet` is an async context manager that owns every background task it starts (health probes,
explicit abort calls) and every upstream connection pool; leaving it closes them all.
An instance serving several models is one `Instance` (keyed by URL) shared by those pools, so its
load is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import aiohttp

from .config import Config, InstanceConfig, ModelConfig
from .engines import AbortCall, Dialect, dialect_for
from .errors import Unavailable
from .metrics import GatewayMetrics
from .routing import InstanceView, Policy, PoolSnapshot, RouteRequest, make_policy

log = logging.getLogger(__name__)


class Instance:
    """One engine process. Mutable runtime state; routing sees it only through `view()`."""

    def __init__(self, config: InstanceConfig, session: aiohttp.ClientSession, base_url: str) -> None:
        self.key = config.key
        self.name = config.name or config.url
        self.url = config.url
        self.dialect: Dialect = dialect_for(config.engine)
        self.max_concurrency = config.max_concurrency
        self.api_key = config.api_key
        self.session = session
        #: Where HTTP requests go (for unix sockets the host part is ignored).
        self.base_url = base_url
        self.healthy = True
        self.in_flight = 0
        self.last_probe_at: float | None = None
        self.last_error: str | None = None
        self.consecutive_failures = 0

    def view(self) -> InstanceView:
        return InstanceView(self.key, self.name, self.healthy, self.in_flight, self.max_concurrency)


class Lease:
    """A routing slot on one instance, held by one request attempt. `release()` is idempotent."""

    __slots__ = ("_metrics", "_released", "instance")

    def __init__(self, instance: Instance, metrics: GatewayMetrics) -> None:
        self.instance = instance
        self._metrics = metrics
        self._released = False
        instance.in_flight += 1
        metrics.permits_in_use.labels(instance.name).inc()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.instance.in_flight -= 1
        if self.instance.in_flight < 0:
            self._metrics.leaks.labels("negative_in_flight").inc()
        self._metrics.permits_in_use.labels(self.instance.name).dec()


class Pool:
    """The instances serving one model, and the policy that picks among them."""

    def __init__(self, config: ModelConfig, instances: list[Instance], served: dict[str, str], policy: Policy) -> None:
        self.config = config
        self.model = config.name
        self.instances = instances
        self._by_key = {i.key: i for i in instances}
        #: Instance key -> the model name that engine knows.
        self.served = served
        self.policy = policy

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(self.model, tuple(i.view() for i in self.instances))

    def choose(self, request: RouteRequest) -> Instance:
        chosen = self.policy.choose(request, self.snapshot())
        if chosen is None:
            raise Unavailable(f"No healthy instance can serve model '{self.model}' right now.", retry_after=1)
        return self._by_key[chosen.key]

    def ready(self) -> bool:
        return any(i.healthy for i in self.instances)


class Fleet:
    def __init__(self, config: Config, metrics: GatewayMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.instances: dict[str, Instance] = {}
        self.pools: dict[str, Pool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> Fleet:
        timeout = self._config.upstream.connect_timeout_ms / 1000
        for model in self._config.models:
            members: list[Instance] = []
            served: dict[str, str] = {}
            for spec in model.instances:
                instance = self.instances.get(spec.key)
                if instance is None:
                    instance = self._make_instance(spec, timeout)
                    self.instances[spec.key] = instance
                members.append(instance)
                served[instance.key] = spec.served_model or model.name
            self.pools[model.name] = Pool(model, members, served, make_policy(model.routing))
        for instance in self.instances.values():
            self._metrics.instance_healthy.labels(instance.name).set(1)
        self._health_task = asyncio.create_task(self._health_loop(), name="lockgate-health")
        return self

    def _make_instance(self, spec: InstanceConfig, connect_timeout: float) -> Instance:
        limit = self._config.upstream.max_connections
        dialect = dialect_for(spec.engine)
        connector: aiohttp.BaseConnector
        if spec.url.startswith("unix://"):
            connector = aiohttp.UnixConnector(
                path=spec.url[len("unix://") :], limit=limit, keepalive_timeout=dialect.keepalive_s
            )
            base_url = "http://localhost"
        else:
            connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300, keepalive_timeout=dialect.keepalive_s)
            base_url = spec.url
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        return Instance(spec, session, base_url)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for instance in self.instances.values():
            await instance.session.close()

    # --- requests ------------------------------------------------------------------------------
    def pool(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def lease(self, instance: Instance) -> Lease:
        return Lease(instance, self._metrics)

    def ready(self) -> bool:
        return bool(self.pools) and all(p.ready() for p in self.pools.values())

    def report_failure(self, instance: Instance, kind: str, detail: str) -> None:
        """Passive health: a connection failure takes the instance out until a probe succeeds."""
        self._metrics.upstream_errors.labels(instance.name, kind).inc()
        instance.consecutive_failures += 1
        instance.last_error = detail
        if kind == "connect":
            self._set_health(instance, False)

    def report_success(self, instance: Instance) -> None:
        instance.consecutive_failures = 0

    def send_abort(self, instance: Instance, call: AbortCall) -> None:
        """Fire an explicit abort call; the fleet owns the task and awaits it on close."""
        if self._closed:
            return
        task = asyncio.create_task(self._abort(instance, call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, instance: Instance, call: AbortCall) -> None:
        try:
            async with asyncio.timeout(2.0):
                async with instance.session.request(call.method, instance.base_url + call.path, json=call.json) as resp:
                    await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("abort call to %s failed: %s", instance.name, exc)

    # --- health --------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        interval = self._config.health.interval_ms / 1000
        while True:
            await self.probe_all()
            await asyncio.sleep(interval)

    async def probe_all(self, instances: Iterable[Instance] | None = None) -> None:
        targets = list(instances if instances is not None else self.instances.values())
        await asyncio.gather(*(self._probe(i) for i in targets))

    async def _probe(self, instance: Instance) -> None:
        timeout = self._config.health.timeout_ms / 1000
        ok = False
        try:
            async with asyncio.timeout(timeout):
                async with instance.session.get(
                    instance.base_url + instance.dialect.health_path, headers=_auth(instance)
                ) as resp:
                    await resp.read()
                    ok = resp.status == 200
                    if not ok:
                        instance.last_error = f"health check answered HTTP {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            instance.last_error = f"health check failed: {exc!r}"
        instance.last_probe_at = time.time()
        self._set_health(instance, ok)

    def _set_health(self, instance: Instance, healthy: bool) -> None:
        if instance.healthy != healthy:
            log.info("instance %s is now %s", instance.name, "healthy" if healthy else "unhealthy")
        instance.healthy = healthy
        self._metrics.instance_healthy.labels(instance.name).set(1 if healthy else 0)


def _auth(instance: Instance) -> dict[str, str]:
    return {"Authorization": f"Bearer {instance.api_key}"} if instance.api_key else {}


def upstream_headers(instance: Instance, request_id: str, *, stream: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if stream and instance.dialect.close_after_stream:
        headers["Connection"] = "close"
    headers.update(_auth(instance))
    return headers
