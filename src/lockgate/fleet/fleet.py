"""The fleet: every engine instance, their HTTP sessions, health and background probes, and one `Pool` per model.

`Fleet` is an async context manager that owns every background task it starts (health probes, metric
scrapes, explicit abort calls) and every upstream connection pool; leaving it closes them all. It builds the
pools from the configuration, applies reloads (instances added, retired once idle), adopts instances discovered at
run time (cluster mode), and keeps health: an instance is out of rotation when it fails an active health check (or
a connection to it fails: what a check would see) or when passive signals eject it (`pool.py` has the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from ..changes import Changes
from ..config import Config, InstanceConfig, ModelConfig
from ..engines import AbortCall, dialect_for
from ..http import HttpPool
from ..metrics import GatewayMetrics
from ..routing.config import RoutingConfig
from ..routing.factory import make_policy
from ..routing.residency import Residency
from ..tasks import cancel_and_wait
from .answers import answers
from .bounded import side_call
from .capacity import ConcurrencyLimit, prefill_backlog_s
from .declared import ask_parallelism
from .ejection import Ejection
from .instance import Instance, Lease
from .metrics import FleetCollector
from .pool import Pool
from .scrape import Scraper
from .state import Ewma

if TYPE_CHECKING:
    from ..config_diff import ConfigDiff

log = logging.getLogger(__name__)
#: An engine's refusals of the gateway's own credentials: failures of the instance, as a 5xx is, not the request's.
_CREDENTIALS_REFUSED = ("http_401", "http_403", "http_407")
#: An engine that does not do what was asked (an endpoint it does not serve): says nothing about its health (an
#: outside run: a llama.cpp without `--embedding` answering the fleet's embeddings was charged a failure for each).
_NOT_IMPLEMENTED = "http_501"
#: An engine's KV-cache use at which it runs what fits there rather than what its slots allow
#: (`ConcurrencyLimit.observe`'s `kv_full`).
KV_FULL = 0.9
#: Failures that count against an instance's health (with a 5xx): it broke the connection, the answer or the stream,
#: or went silent in it.
_ENGINE_FAILURES = ("disconnect", "protocol", "stream", "stall")
#: How old a scrape may be for a strict request's look at its engine's queue (`Lease.queue_ahead`): a fresher one is
#: taken again, an older one is scraped anew (a look per strict request at most, joined while one is under way).
_LOOK_MAX_AGE_S = 0.01
#: How long a model that only discovered instances served answers 503 (retry) after its last one left, rather
#: than 404 (a model nobody serves): a sidecar restarting takes seconds.
GONE_GRACE_S = 60.0


class Fleet:
    """Every instance (once, however many models it serves) and the pools built over them; see the module."""

    def __init__(self, config: Config, metrics: GatewayMetrics) -> None:
        self._config = config
        self._metrics = metrics
        #: What an engine may send (`max_response_bytes`, `max_event_bytes`), read by `UpstreamCall`.
        self.upstream = config.upstream
        self.instances: dict[str, Instance] = {}
        self.pools: dict[str, Pool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self.scraper = Scraper(self.instances.values, config.scrape, self._scraped)
        self._health_wake = asyncio.Event()
        self._changes = Changes()
        #: Notified when an instance's long prefill, or a strict request holding it, is answered or ends: requests
        #: waiting for their turn (`Pool.long_turn`, `Pool.unheld`) look again.
        self.prefills = Changes()
        #: Instances a reload removed, each closed by its task once its requests have ended.
        self._retiring: dict[Instance, asyncio.Task[None]] = {}
        #: Answer probes under way, of instances ejected after their engine went silent (`_answer_probe`).
        self._answering: dict[Instance, asyncio.Task[None]] = {}
        #: Called (synchronously) after every health or ejection change, e.g. to resize admission.
        self.listeners: list[Callable[[], None]] = []
        self._closed = False
        #: Sidecars: the header naming the engine chosen by a central gateway (set before entering).
        self.pin_header: str | None = None
        #: Central replicas: anchor depth of the shared default placement of prefixes (0 = off), and
        #: whether pools keep the residency the sidecars report (set before entering).
        self.placement_blocks = 0
        self.placement_choices = 1
        self.shared_residency = False
        #: Sidecars: told of every routing decision, to report residency (set by the publisher).
        self.report_routed: Callable[[str, tuple[int, ...]], None] | None = None
        #: Bumped when the set of models or their members changes (instances discovered or gone).
        self.generation = 0
        #: Instances discovered at run time (cluster mode): key -> (spec, models, routing of new pools).
        self._discovered: dict[str, tuple[InstanceConfig, tuple[str, ...], RoutingConfig | None]] = {}
        #: Extra sections of `GET /admin/fleet` (cluster mode adds the etcd view), by name.
        self.reports: dict[str, Callable[[], Any]] = {}
        #: Models only discovered instances served, gone with the last of them: when, and their pool (`gone_recently`,
        #: `gone_pools`).
        self._gone: dict[str, tuple[float, Pool]] = {}
        #: A cluster's central that has not read etcd yet (`cluster.discovery`; `discovered`): a model it does not
        #: know may be one its sidecars serve.
        self.discovering = False
        #: Under `--workers`: (this worker's index, the workers' count), given to every instance (`Instance.share`).
        self.share: tuple[int, int] | None = None
        #: Instances this process runs for itself (the embedded simulators: each worker starts its own), never shared.
        self.private: frozenset[str] = frozenset()

    def split_between(self, index: int, count: int) -> None:
        """This gateway is worker `index` of `count` (`--workers`): each instance it reaches directly takes its part
        of the engine's limit (`Instance.share`), those of later reloads too."""
        self.share = (index, count) if count > 1 else None
        for instance in self.instances.values():
            instance.share = self._share_of(instance.key)
        self._notify()

    def _share_of(self, key: str) -> tuple[int, int] | None:
        """The part of instance `key`'s engine this worker takes (`share`): all of it for one of its own (`private`:
        an embedded simulator, each worker's; split, it capped a gateway of three workers at one simulator's slots)."""
        return None if key in self.private else self.share

    async def __aenter__(self) -> Fleet:
        self._build(self._config)
        # Per-instance load state, read from the fleet when /metrics is scraped (nothing on the hot path).
        self._metrics.registry.register(FleetCollector(self))
        self._health_task = asyncio.create_task(self._health_loop(), name="lockgate-health")
        if self._config.scrape.enabled:
            self._scrape_task = asyncio.create_task(self.scraper.run(), name="lockgate-scrape")
        return self

    def _build(self, config: Config, previous: Mapping[str, Pool] | None = None) -> None:
        """Create the instances `config` lists that do not exist yet, and a pool for each model
        (reusing a previous pool's prefix index when its options are the same)."""
        timeout = config.upstream.connect_timeout_ms / 1000
        pools: dict[str, Pool] = {}
        for model in config.models:
            members: list[Instance] = []
            served: dict[str, str] = {}
            for spec in model.instances:
                instance = self.instances.get(spec.key)
                if instance is None:
                    instance = self._make_instance(spec, timeout)
                    self.instances[spec.key] = instance
                    self._watch(instance)
                members.append(instance)
                served[instance.key] = spec.served_model or model.name
            pool = Pool(
                model,
                members,
                served,
                make_policy(model.routing),
                stale_after=config.scrape.stale_after_ms / 1000,
                metrics=self._metrics,
            )
            self._share(pool)
            before = (previous or {}).get(model.name)
            if before is not None and before.config.routing.prefix_index == model.routing.prefix_index:
                pool.index = before.index  # what the engines have cached did not change
                pool.residency = before.residency
            pools[model.name] = pool
        self.pools = pools
        for key, (_, models, routing) in self._discovered.items():
            self._adopt(self.instances[key], models, routing)

    def _share(self, pool: Pool) -> None:
        """The cluster roles' settings of a pool (see the attributes set before entering)."""
        pool.pin_header = self.pin_header
        pool.report_routed = self.report_routed
        pool.placement_blocks = self.placement_blocks
        pool.placement_choices = self.placement_choices
        if self.shared_residency:
            pool.residency = Residency(max(1024, pool.index.max_entries))

    def _watch(self, instance: Instance) -> None:
        self._metrics.instance_healthy.labels(instance.name).set(1 if instance.healthy else 0)
        # Read when scraped: the hot path only moves plain integers.
        self._metrics.permits_in_use.labels(instance.name).set_function(lambda i=instance: self.in_flight_shown(i))
        self._metrics.concurrency_limit.labels(instance.name).set_function(lambda i=instance: i.max_concurrency)
        self._metrics.prefix_hit_rate_gap.labels(instance.name).set_function(lambda i=instance: i.hit_gap.value)
        calls = self._metrics.upstream_calls_in_flight.labels(instance.name)
        calls.set_function(lambda i=instance: self._calls_open(i))

    def in_flight_shown(self, instance: Instance) -> int:
        """`instance`'s requests in flight as its series show them: with those of the instances a reload retired under
        its name at another URL (one series a name: theirs would vanish under it)."""
        return instance.in_flight + sum(r.in_flight for r in self._departed(instance) if r.successor is None)

    def _calls_open(self, instance: Instance) -> int:
        """Engine calls open on `instance`'s connections and on those of the instances a reload retired that count
        under it (`_departed`)."""
        return instance.open_calls + sum(retired.open_calls for retired in self._departed(instance))

    def _departed(self, instance: Instance) -> list[Instance]:
        """The instances a reload retired, still running requests, that show under `instance`: those it replaced at
        their URL (`Instance.hand_over`, through a chain of reloads), and those of its name at another URL."""
        departed = []
        for retired in self._retiring:
            at = retired.successor
            if at is None:
                if retired.name == instance.name and retired is not instance:
                    departed.append(retired)
                continue
            while at is not None and at is not instance:
                at = at.successor
            if at is instance:
                departed.append(retired)
        return departed

    # --- instances discovered at run time (cluster mode) ------------------------------------------
    def attach(
        self,
        spec: InstanceConfig,
        models: Sequence[str],
        *,
        key: str,
        headers: Sequence[tuple[str, str]] = (),
        routing: RoutingConfig | None = None,
    ) -> Instance:
        """Add the instance `key` to the pools of `models` (and only those), creating the pool of a model
        nobody configured (with `routing`). `headers` go on every generation request sent to it.
        Idempotent. A reload keeps discovered instances in their pools."""
        instance = self.instances.get(key)
        if instance is None:
            instance = self._make_instance(spec, self._config.upstream.connect_timeout_ms / 1000, key)
            instance.request_headers = [*instance.request_headers, *headers]
            self.instances[key] = instance
            self._watch(instance)
            self._health_wake.set()
        self._discovered[key] = (spec, tuple(models), routing)
        if self._adopt(instance, models, routing):
            self.generation += 1
            self._notify()
        return instance

    def _adopt(self, instance: Instance, models: Sequence[str], routing: RoutingConfig | None) -> bool:
        """Make `instance` a member of exactly the pools of `models`; whether anything changed."""
        changed = False
        for model in models:
            pool = self.pools.get(model)
            if pool is None:
                self._gone.pop(model, None)
                config = ModelConfig(name=model, instances=[], routing=routing or RoutingConfig())
                pool = Pool(
                    config,
                    [],
                    {},
                    make_policy(config.routing),
                    stale_after=self._config.scrape.stale_after_ms / 1000,
                    metrics=self._metrics,
                )
                pool.discovered = True
                self._share(pool)
                self.pools[model] = pool
            if not pool.holds(instance.key):  # (a node that left and came back under its old key is added again)
                pool.add(instance, model)
                changed = True
        for name, pool in list(self.pools.items()):
            if name not in models and pool.holds(instance.key):
                self._leave(pool, instance.key)
                changed = True
        return changed

    def detach(self, key: str) -> None:
        """Take a discovered instance out of every pool: no new requests reach it, and it is closed
        once its requests in flight end. A model only discovered instances served goes with its last."""
        if self._discovered.pop(key, None) is None:
            return
        instance = self.instances.pop(key)
        for pool in list(self.pools.values()):
            if pool.holds(key):
                self._leave(pool, key)
                pool.lend_from(instance)
        self._retire(instance)
        self.generation += 1
        self._notify()

    def _leave(self, pool: Pool, key: str) -> None:
        pool.discard(key)
        if pool.discovered and not pool.instances:
            del self.pools[pool.model]
            now = time.monotonic()
            self._gone = {model: gone for model, gone in self._gone.items() if now - gone[0] < GONE_GRACE_S}
            self._gone[pool.model] = (now, pool)

    def gone_recently(self, model: str) -> bool:
        """Whether `model` was served by discovered instances until less than `GONE_GRACE_S` ago (a sidecar
        restarting, a node replaced): its clients get a 503 to retry, not a 404 their SDKs take for final."""
        gone = self._gone.get(model)
        return gone is not None and time.monotonic() - gone[0] < GONE_GRACE_S

    def gone_pools(self) -> list[Pool]:
        """The pools of the models `gone_recently`: a stored response made on one of their instances is told to retry
        (`stored.py`), as a follow-up to it is."""
        return [pool for model, (_, pool) in self._gone.items() if self.gone_recently(model)]

    def set_health(self, instance: Instance, healthy: bool, *, cache_lost: bool = True) -> None:
        """Health from another source (a sidecar's publication): applied and announced like a probe's.
        `cache_lost=False`: out of service while its engine still runs (its prefixes stay believed)."""
        if instance.healthy != healthy:
            self._set_health(instance, healthy, cache_lost=cache_lost)
            self._notify()

    def set_concurrency(self, instance: Instance, limit: int) -> None:
        """A concurrency limit from another source (what a sidecar publishes for its engine): fixed,
        not discovered here from scrapes."""
        if instance.concurrency.limit != limit or instance.concurrency.adaptive:
            instance.concurrency = ConcurrencyLimit(max(1, limit), adaptive=False, stated=True)
            self._notify()

    # --- reload --------------------------------------------------------------------------------
    def apply(self, config: Config, diff: ConfigDiff) -> None:
        """Serve `config` from now on (synchronous: atomic for every request that starts after it).

        Removed and replaced instances retire: no new request reaches them, and each is closed once
        its requests in flight end (those keep the instance they hold; their next attempts route
        through `pools`, see `attempt.py`). New instances are probed at once and scraped with the
        others. Unchanged pools stay as they are."""
        retired = [self.instances.pop(key) for key in (*diff.removed_instances, *diff.changed_instances)]
        for instance in retired:
            self._retire(instance)
        previous = self.pools
        # A model the file adds may have a pool already: a central replica's, built from the engines it discovered
        # (with defaults): the file's settings replace it.
        renewed = {*diff.changed_models, *diff.removed_models, *diff.added_models}
        unchanged = {name: pool for name, pool in previous.items() if name not in renewed}
        self._build(config, previous)
        self.pools = {name: unchanged.get(name, pool) for name, pool in self.pools.items()}
        # An instance at the URL of one retired (now, or by an earlier reload that removed it: it came back) takes its
        # requests over: the engine is the same.
        for instance in (*retired, *(r for r in self._retiring if r not in retired)):
            if instance.successor is not None:
                continue
            successor = next((i for i in self.instances.values() if i.url == instance.url), None)
            if successor is not None:
                instance.hand_over(successor)
                self._unwatch(instance.name)  # (renamed: its requests show under the new name only)
        for name, pool in self.pools.items():
            before = previous.get(name)
            if before is None or pool is before:
                continue
            for instance in (*before.lenders, *(i for i in before.instances if i.retired)):
                pool.lend_from(instance)
        self._config = config
        if diff.added_instances or diff.changed_instances:
            self._health_wake.set()
        self._notify()

    def _retire(self, instance: Instance) -> None:
        instance.retired = True
        # Each of its requests that ends gives back what its pool lent (`Pool.lent`).
        instance.on_vacated = self._notify
        log.info("instance %s retires (%d request(s) in flight)", instance.name, instance.in_flight)
        if self._closed:
            return
        self._retiring[instance] = asyncio.create_task(self._close_when_idle(instance), name="lockgate-retire")

    async def _close_when_idle(self, instance: Instance) -> None:
        await instance.wait_idle()
        # An abort call may still be on its way to the engine (each is bounded by its timeout).
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close_instance(instance)
        self._retiring.pop(instance, None)
        for pool in self.pools.values():
            if instance in pool.lenders:
                pool.lenders.remove(instance)
        log.info("instance %s closed", instance.name)

    async def _close_instance(self, instance: Instance) -> None:
        await instance.aclose()
        self._unwatch(instance.name)

    def _unwatch(self, name: str) -> None:
        """Drop the gauges of an instance name no longer served, unless one of that name serves now (its own, then)."""
        if all(i.name != name for i in self.instances.values()):
            for gauge in (
                self._metrics.instance_healthy,
                self._metrics.permits_in_use,
                self._metrics.concurrency_limit,
                self._metrics.prefix_hit_rate_gap,
                self._metrics.upstream_calls_in_flight,
            ):
                gauge.remove(name)

    def rename(self, instance: Instance, name: str) -> None:
        """A discovered engine its sidecar now publishes under another name (a reload there): its series, routing
        counters and records follow (an outside run: centrals showed the old name for good, the answers' headers the
        new one)."""
        old = instance.name
        if name == old:
            return
        instance.name = name
        self._unwatch(old)
        self._watch(instance)
        for pool in self.pools.values():
            pool.renamed(instance)
        self._notify()

    @property
    def retiring(self) -> Iterable[Instance]:
        """The instances a reload removed whose requests have not all ended yet (closed once they have)."""
        return tuple(self._retiring)

    async def wait_retired(self) -> None:
        """Wait until every retired instance has been closed (tests, admin)."""
        while self._retiring:
            await asyncio.gather(*self._retiring.values(), return_exceptions=True)

    def _make_instance(self, spec: InstanceConfig, connect_timeout: float, key: str | None = None) -> Instance:
        limit = self._config.upstream.max_connections
        dialect = dialect_for(spec.engine)
        # One TLS context per https:// instance, shared by its engine client and its aiohttp session.
        tls = spec.tls_context()
        server_name = spec.tls.server_name if spec.tls is not None else None
        connector: aiohttp.BaseConnector
        if spec.url.startswith("unix://"):
            connector = aiohttp.UnixConnector(
                path=spec.url[len("unix://") :], limit=limit, keepalive_timeout=dialect.keepalive_s
            )
            base_url = "http://localhost"
        else:
            connector = aiohttp.TCPConnector(
                limit=limit, ttl_dns_cache=300, keepalive_timeout=dialect.keepalive_s, ssl=tls or True
            )
            base_url = spec.url
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        http, scrapes = (
            HttpPool(
                spec.url,
                max_connections=connections,
                keepalive_s=dialect.keepalive_s,
                connect_timeout_s=connect_timeout,
                ssl_context=tls,
                server_name=server_name,
            )
            for connections in (limit, 1)
        )
        instance = Instance(
            spec,
            session,
            base_url,
            Ejection(self._config.health.ejection),
            http,
            max_connections=limit,
            key=key,
            scrapes=scrapes,
        )
        instance.own.on_turn = self.prefills.notify
        instance.share = self._share_of(instance.key)
        if self._config.scrape.enabled and dialect.metrics_path:
            instance.look = functools.partial(self.scraper.fresh, instance, _LOOK_MAX_AGE_S)
        return instance

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await cancel_and_wait(self._health_task, self._scrape_task, *self._answering.values())
        await self.scraper.aclose()
        retiring, self._retiring = self._retiring, {}
        for task in retiring.values():
            task.cancel()
        if retiring:
            await asyncio.gather(*retiring.values(), return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for instance in (*self.instances.values(), *retiring):
            await instance.aclose()

    # --- requests ------------------------------------------------------------------------------
    def pool(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def lease(
        self,
        instance: Instance,
        model: str,
        uncached_tokens: int = 0,
        prompt_tokens: int = 0,
        long: bool = False,
        *,
        whole: bool = False,
    ) -> Lease:
        """A slot on `instance` for a request of the pool `model` (`whole`: answered as one body)."""
        return Lease(instance, self._metrics, uncached_tokens, prompt_tokens, long, model, whole=whole)

    def watch_s(self, instance: Instance, stream: bool) -> float | None:
        """How long an engine call may wait for the engine's next byte before it is closed as hung (None: as long as
        it takes): a stream's next event `upstream.stall_timeout_ms`, a whole answer `upstream.answer_timeout_ms`
        (nothing comes until its end). Behind a sidecar the wait may also be the sidecar's own queue, up to the
        longest `queue_timeout_ms` of a class (the sidecar watches its engines itself): that long more, or no watch
        while a class may queue without end."""
        upstream = self._config.upstream
        watch_ms = upstream.stall_timeout_ms if stream else upstream.answer_timeout_ms
        if not watch_ms:
            return None
        if instance.published is not None:
            queued = [c.queue_timeout_ms for c in self._config.scheduling.classes]
            if None in queued:
                return None
            watch_ms += max(q for q in queued if q is not None)
        return watch_ms / 1000

    def ready(self) -> bool:
        return bool(self.pools) and all(p.ready() for p in self.pools.values())

    def report_failure(self, instance: Instance, kind: str, detail: str) -> None:
        """Passive health: nothing listening takes the instance out at once (a failed connection is what
        an active check would see); other failures (a broken stream, a 5xx) eject it after
        `health.ejection.consecutive_failures` in a row, unless its pools need it (`may_eject`). Either
        way it returns after a successful probe."""
        self._metrics.upstream_errors.labels(instance.name, kind).inc()
        now = time.monotonic()
        refused = (kind[:6] == "http_4" and kind not in _CREDENTIALS_REFUSED) or kind == _NOT_IMPLEMENTED
        if not refused:
            # The instance's errors (`/admin/fleet`), not the requests it refused (an outside run read a client's
            # bad requests there as the engine failing).
            instance.last_error = detail
            instance.own.error(now)
        if kind == "connect":
            self._set_health(instance, False)
            ejected = instance.ejection.eject_now(now)
            if instance.published is not None:
                # Engines behind one sidecar share its address: none of them can be reached either.
                for other in self.instances.values():
                    if other.url == instance.url and other is not instance and not other.ejection.ejected:
                        other.last_error = f"its sidecar cannot be reached ({detail})"  # (it said "no reason known")
                        self._set_health(other, False)
                        other.ejection.eject_now(now)
        elif (
            kind in _ENGINE_FAILURES
            or (kind[:6] == "http_5" and kind != _NOT_IMPLEMENTED)
            or kind in _CREDENTIALS_REFUSED
        ):
            if kind in _CREDENTIALS_REFUSED and not instance.told_credentials:
                instance.told_credentials = True  # once per instance: its `api_key` (or the engine's) is wrong
                log.warning(
                    "instance %s refused the gateway's credentials (%s): check its `api_key`", instance.name, kind[5:]
                )
            held_back = instance.ejection.held_back
            # An engine that went silent returns only once it answers (`_answer_probe`); one behind a sidecar is the
            # sidecar's to probe so (the sidecar's own health check stands for it here).
            silent = kind == "stall" and instance.published is None
            ejected = instance.ejection.failure(now, lambda: self.may_eject(instance), silent=silent)
            if instance.ejection.held_back != held_back:
                self._metrics.ejections_held_back.labels(instance.name).inc()
        else:
            ejected = False  # the engine refused this request (4xx): says nothing about its health
            if kind == "http_404" and not instance.told_not_found and "model" in detail.lower():
                instance.told_not_found = True  # once per instance: the usual cause is its configuration
                # (not for a 404 naming something else: a previous response the engine no longer holds)
                log.warning(
                    "instance %s answered 404 (%s): if its engine serves the model under another name, set the "
                    "model's `served_model`",
                    instance.name,
                    detail[:120],
                )
        if ejected:
            log.warning(
                "instance %s ejected for %.1fs after failures (%s)", instance.name, instance.ejection.backoff(), detail
            )
            self._metrics.ejections.labels(instance.name).inc()
            self._health_wake.set()
            self._notify()

    def may_eject(self, instance: Instance) -> bool:
        """Passive signals may take `instance` out only if every pool it serves can spare it."""
        limit = self._config.health.ejection.max_ejection_percent
        # Looked up when asked (only when failures call for an ejection): a reload may have regrouped the pools.
        pools = [pool for pool in self.pools.values() if instance in pool.instances]
        return all(pool.may_eject(instance, limit) for pool in pools)

    def report_success(self, instance: Instance) -> None:
        instance.ejection.success()

    def _scraped(self, instance: Instance, ok: bool) -> None:
        self._metrics.scrapes.labels(instance.name, "ok" if ok else "error").inc()
        load = instance.engine_load
        tokens = instance.cache_tokens or (load.cache_tokens if ok and load is not None else None)
        ratio = self._token_ratio(instance) if tokens is not None else None
        if tokens is not None and ratio is not None:
            # The cache's size (configured, else as the engine reports it), in the index's blocks with
            # what the engine's usage taught about its tokens (not before: a wrong guess of the engine's
            # tokenizer would make the index forget prefixes the engine still holds): model its evictions.
            changed = [
                pool.set_cache_tokens(instance.key, tokens, ratio)
                for pool in self.pools.values()
                if instance.key in pool.served
            ]
            if any(changed):
                self._notify()
        if ok and load is not None:
            instance.hit_gap.observe(instance.predicted_hits, instance.predicted_queries, load)
            before = instance.concurrency.limit
            own = instance.own
            now = time.monotonic()
            filled = instance.filled_to >= instance.max_concurrency
            instance.filled_to = instance.in_flight
            # (Its peers' measures are looked up only for a queue there, which is all they judge.)
            queue = load.waiting is not None and load.waiting >= 1
            rate = own.prefill_tps.value
            if not rate and queue:
                rate = self._peers_mean(instance, lambda peer: peer.own.prefill_tps) or 0.0
            backlog_s = prefill_backlog_s(own.queued_prompt_tokens, rate, own.default_tps)
            if instance.concurrency.observe(
                load.running,
                load.waiting,
                instance.engine_in_flight(),
                backlog_s,
                self._decode_s(instance, now) if queue else own.decode_s(now),
                own.overdue(now),
                load.kv_usage is not None and load.kv_usage >= KV_FULL,
                own.queued_beyond(load.waiting, load.scraped_at) if queue and load.waiting is not None else None,
                (now, own.answered),
                filled,
            ):
                log.info(
                    "instance %s: concurrency limit %d -> %d (engine runs %s, %s waiting)",
                    instance.name,
                    before,
                    instance.concurrency.limit,
                    load.running,
                    load.waiting,
                )
                self._notify()

    def _decode_s(self, instance: Instance, now: float) -> float:
        """How long a request holds a slot at `instance` after its first token (`OwnAccounting.decode_s`); before
        any ended there, at least its peers' (`_peers_mean`): how long a generation lasts is mostly the workload's
        (its lengths), and an engine added or restarted during a flood would otherwise count no queue as a slot's
        until its first generation ended there."""
        own = instance.own.decode_s(now)
        if instance.own.decode.samples:
            return own
        return max(own, self._peers_mean(instance, lambda peer: peer.own.decode) or 0.0)

    def _peers_mean(self, instance: Instance, measure: Callable[[Instance], Ewma]) -> float | None:
        """The mean of a measure over the instances serving a model with `instance` that have measured it (None: none
        has): what an unmeasured instance is judged by until it measures its own, as routing judges it
        (`routing.cost`: an engine added during a flood is unmeasured exactly when its queue matters)."""
        values = {
            other.key: measure(other).value
            for pool in self.pools.values()
            if instance.key in pool.served
            for other in pool.instances
            if measure(other).samples
        }
        return sum(values.values()) / len(values) if values else None

    def _token_ratio(self, instance: Instance) -> float | None:
        """Engine tokens per estimated token for `instance`: what its own answers taught, else the mean of
        the instances serving a model with it that have answered (engines of one model share a
        tokenizer), else unknown. Borrowing matters: an instance whose cache size is unknown counts as
        full for routing, so one that had answered nothing would never be given a request to learn from."""
        if instance.token_ratio.samples:
            return instance.token_ratio.value
        return self._peers_mean(instance, lambda peer: peer.token_ratio)

    # --- waiting for state changes (tests, admin) ------------------------------------------------
    def _notify(self) -> None:
        self._changes.notify()
        for listener in self.listeners:
            listener()

    def discovered(self) -> None:
        """A cluster's central read etcd for the first time: the models it does not know are not served."""
        self.discovering = False
        self._notify()

    async def wait_until(self, predicate: Callable[[Fleet], bool]) -> None:
        """Wait until `predicate(self)` holds, re-checked on every health/ejection change (no polling)."""
        await self._changes.wait_until(lambda: predicate(self))

    def send_abort(self, instance: Instance, call: AbortCall) -> None:
        """Fire an explicit abort call; the fleet owns the task and awaits it on close."""
        if self._closed:
            return
        task = asyncio.create_task(self._abort(instance, call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, instance: Instance, call: AbortCall) -> None:
        try:
            await side_call(instance, call.method, call.path, 2.0, json=call.json)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("abort call to %s failed: %s", instance.name, exc)

    # --- health --------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        """Active checks every interval, a probe of each ejected instance when its backoff ends, and of
        each new instance at once.
        Between them it waits on an event (a new ejection) with a timeout (the next due time)."""
        interval = self._config.health.interval_ms / 1000
        loop = asyncio.get_running_loop()
        next_check = loop.time()
        while True:
            now = time.monotonic()
            # Due: ejected instances whose backoff ended, and instances never probed (added by a reload).
            # An engine behind a sidecar (cluster mode) has its health published: probed only when ejected.
            due = [
                i
                for i in self.instances.values()
                if i.ejection.probe_due(now) or (i.last_probe_at is None and i.published is None)
            ]
            for instance in due:
                if instance.ejection.silent and instance.ejection.probe_due(now) and instance not in self._answering:
                    task = asyncio.create_task(self._answer_probe(instance), name="lockgate-answer-probe")
                    self._answering[instance] = task
            due = [i for i in due if i not in self._answering]
            if loop.time() >= next_check:
                next_check = loop.time() + interval
                await self.probe_all([i for i in self.instances.values() if i.published is None or i in due])
            elif due:
                await self.probe_all(due)
            now = time.monotonic()
            wake_in = next_check - loop.time()
            for instance in self.instances.values():
                until = instance.ejection.ejected_until
                if until is not None and instance not in self._answering:
                    wake_in = min(wake_in, until - now)
            self._health_wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake_in)):
                    await self._health_wake.wait()

    async def probe_all(self, instances: Iterable[Instance] | None = None) -> None:
        targets = list(instances if instances is not None else self.instances.values())
        await asyncio.gather(*(self._probe(i) for i in targets))

    async def _probe(self, instance: Instance) -> None:
        ok = await self._check(instance)
        if ok and not instance.parallelism_asked and instance.published is None:
            # Once per start of the engine (a restart may come with other slots): see `_set_health`.
            instance.parallelism_asked = True
            declared = await ask_parallelism(instance, self._config.health.timeout_ms / 1000)
            before = instance.concurrency.limit
            if instance.concurrency.declare(declared):
                log.info(
                    "instance %s: concurrency limit %d -> %d (the engine runs %s at once)",
                    instance.name,
                    before,
                    instance.concurrency.limit,
                    declared,
                )
        now = time.monotonic()
        ejection = instance.ejection
        if ejection.probe_due(now) and not ejection.silent and ejection.probed(ok, now):
            log.warning("instance %s returns after a successful probe", instance.name)
        self._set_health(instance, ok)
        self._notify()

    async def _answer_probe(self, instance: Instance) -> None:
        """The probe of an instance ejected after its engine went silent in a call while its health check passed: it
        returns only once it answers a one-token request (`health.answer_probe_timeout_ms`); otherwise it stays out
        for twice as long. Its own task (it may take that long): the health loop goes on meanwhile."""
        try:
            pool = next((p for p in self.pools.values() if instance.key in p.served), None)
            ok = pool is not None and await answers(
                instance, pool.served[instance.key], self._config.health.answer_probe_timeout_ms / 1000
            )
            now = time.monotonic()
            if instance.ejection.probe_due(now) and instance.ejection.probed(ok, now):
                log.warning("instance %s returns: it answered a one-token request", instance.name)
            elif not ok:
                backoff = instance.ejection.backoff()
                log.warning("instance %s stays out for %.1fs: %s", instance.name, backoff, instance.last_error)
        finally:
            self._answering.pop(instance, None)
            self._health_wake.set()
            self._notify()

    async def _check(self, instance: Instance) -> bool:
        timeout = self._config.health.timeout_ms / 1000
        ok = False
        try:
            # Only the status counts: a provider's long model list (`/v1/models`, the openai dialect's check) is no
            # failure (its connection is dropped past the side calls' bound).
            status = (await side_call(instance, "GET", instance.dialect.health_path, timeout)).status
            ok = status == 200
            if not ok:
                instance.last_error = f"health check answered HTTP {status}"
        except TimeoutError:
            instance.last_error = f"health check failed: no answer within {timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            instance.last_error = f"health check failed: {str(exc) or exc.__class__.__name__}"
        instance.last_probe_at = time.time()
        return ok

    def _set_health(self, instance: Instance, healthy: bool, *, cache_lost: bool = True) -> None:
        if instance.healthy != healthy:
            if healthy:  # (at WARNING, as the failure was: a log that shows only failures reads as a fleet gone)
                log.warning("instance %s is now healthy", instance.name)
            else:  # (an instance starts healthy: one never reachable is reported at its first check)
                log.warning("instance %s is now unhealthy: %s", instance.name, instance.last_error or "no reason known")
            if not healthy and cache_lost:
                # Down (a failed check, a refused connection): when it answers again it is most likely a
                # restarted engine with an empty cache; believing it still holds its prefixes would send
                # their traffic there to miss. (Passive ejection keeps the residency: the engine runs.)
                # It may also have restarted with another parallelism: asked again when it is back.
                instance.parallelism_asked = False
                for pool in self.pools.values():
                    if instance.key in pool.served:
                        pool.index.forget(instance.key)
        instance.healthy = healthy
        if self.instances.get(instance.key) is instance:
            # (A check or a failure of a call from before a reload may land once the instance is closed: its series
            # is gone with it and must not come back, `_close_instance`.)
            self._metrics.instance_healthy.labels(instance.name).set(1 if healthy else 0)
