"""Scraping engine metrics: one concurrent round over the fleet per interval, each call with a timeout.

`parse_load()` is pure: it reads the load signals a dialect names (`engines/*.py`, first name that is
present wins, series summed over labels such as `model_name`) from Prometheus text. `Scraper.run()` is
the loop the fleet owns: a round never overlaps the next (it waits for the slowest call, which the
timeout bounds), so a slow engine is never asked twice at once (llm-d #1842: scraping that stalls the
engine). A failed scrape keeps the last good one, which then ages past `stale_after` and is ignored.
Outside the loop, `Scraper.fresh` scrapes one engine on demand (a strict request's look at its queue,
`Lease.queue_ahead`); every scrape of an instance goes through `fetch`, which joins the one under way, so
the loop and the lookers never ask an engine twice at once either.

Scrapes go through the instance's own lean pool of one connection (`Instance.scrapes`, `lockgate.http`), not
aiohttp: several a second per engine, a scrape cost ~0.6 ms of CPU through aiohttp. The page is bounded by
`MAX_METRICS_BYTES` (`ResponseTooLarge`, a failed scrape).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..engines import MetricNames
from ..http import HttpClientError
from ..routing.config import ScrapeConfig
from .bounded import MAX_METRICS_BYTES
from .state import EngineLoad

if TYPE_CHECKING:
    from .instance import Instance

log = logging.getLogger(__name__)


class HttpStatusError(Exception):
    """The engine answered the scrape with a status other than 200."""


def parse_load(text: str, names: MetricNames, scraped_at: float) -> EngineLoad:
    wanted = names.all()
    sums: dict[str, float] = {}
    cache_tokens: int | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        if end <= 0 or line[:end] not in wanted:
            continue
        # `name{labels} value [timestamp]`; label values may contain spaces.
        rest = line[line.rindex("}") + 1 :] if line[end] == "{" else line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        name = line[:end]
        if name in names.cache_info:
            cache_tokens = _cache_tokens(line) or cache_tokens
            continue
        sums[name] = sums.get(name, 0.0) + value

    def first(options: tuple[str, ...]) -> float | None:
        for name in options:
            if name in sums:
                return sums[name]
        return None

    return EngineLoad(
        scraped_at=scraped_at,
        waiting=first(names.waiting),
        running=first(names.running),
        kv_usage=first(names.kv_usage),
        prefix_hits=first(names.prefix_hits),
        prefix_queries=first(names.prefix_queries),
        tpot_seconds=first(names.tpot_seconds),
        tpot_tokens=first(names.tpot_tokens),
        cache_tokens=cache_tokens,
        prefix_hit_rate=first(names.prefix_hit_rate),
    )


def _cache_tokens(line: str) -> int | None:
    """`num_gpu_blocks` x `block_size` from an info metric's labels (vLLM `cache_config_info`)."""
    labels: dict[str, str] = {}
    for part in line[line.find("{") + 1 : line.rfind("}")].split(","):
        name, sep, value = part.partition("=")
        if sep:
            labels[name.strip()] = value.strip().strip('"')
    try:
        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return tokens if tokens > 0 else None


class Scraper:
    def __init__(
        self,
        instances: Callable[[], Iterable[Instance]],
        config: ScrapeConfig,
        on_result: Callable[[Instance, bool], None],
    ) -> None:
        self._instances = instances
        self._config = config
        self._on_result = on_result
        #: The scrape of each instance under way: a second asker joins it (an engine is never asked twice at once).
        self._loading: dict[Instance, asyncio.Task[EngineLoad | None]] = {}

    async def run(self) -> None:
        interval = self._config.interval_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_all()
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))

    async def scrape_all(self) -> None:
        targets = [i for i in self._instances() if i.dialect.metrics_path]
        await asyncio.gather(*(self._scrape(i) for i in targets))

    async def _scrape(self, instance: Instance) -> None:
        load = await self.fetch(instance)
        self._on_result(instance, load is not None)

    async def fresh(self, instance: Instance, max_age: float) -> EngineLoad | None:
        """The engine's load at most `max_age` seconds old: the last scrape's, else a scrape now (`fetch`)."""
        load = instance.engine_load
        if load is not None and instance.scrape_error is None and time.monotonic() - load.scraped_at <= max_age:
            return load
        return await self.fetch(instance)

    async def fetch(self, instance: Instance) -> EngineLoad | None:
        """Scrape `instance` now (None: the scrape failed), or join its scrape under way. Sets its `engine_load` or
        `scrape_error`; the caller that sees the result decides what else to do with it (the loop: `on_result`).
        A caller cancelled leaves the scrape to finish for the others (bounded by the timeout; `aclose`)."""
        task = self._loading.get(instance)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._get(instance), name="lockgate-scrape-one")
            self._loading[instance] = task
            task.add_done_callback(lambda done: self._loaded(instance, done))
        return await asyncio.shield(task)

    def _loaded(self, instance: Instance, task: asyncio.Task[EngineLoad | None]) -> None:
        if self._loading.get(instance) is task:
            del self._loading[instance]

    async def aclose(self) -> None:
        """Cancel the scrapes under way (the loop's own task is its owner's to cancel)."""
        tasks = list(self._loading.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _get(self, instance: Instance) -> EngineLoad | None:
        path = instance.dialect.metrics_path
        assert path is not None
        try:
            async with asyncio.timeout(self._config.timeout_ms / 1000):
                response = await instance.scrapes.request("GET", path, b"", instance.auth_headers().items())
                try:
                    body = await response.read(MAX_METRICS_BYTES)
                except BaseException:
                    response.close()  # cancelled (the timeout) or broken mid-body: the connection is not reused
                    raise
            if response.status != 200:
                raise HttpStatusError(f"HTTP {response.status}")
            text = body.decode()
        except (HttpClientError, HttpStatusError, OSError, TimeoutError, UnicodeDecodeError) as exc:
            instance.scrape_error = f"metrics scrape failed: {exc!r}"[:300]
            return None
        load = instance.engine_load = parse_load(text, instance.dialect.metrics, time.monotonic())
        instance.scrape_error = None
        return load
