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
from dataclasses import replace
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


#: The largest sample taken from an engine's page (a count of requests, tokens or blocks; a fraction). A larger one,
#: a negative one or one not finite is an engine's bug, skipped as a line no parser foresaw is: the gateway's
#: arithmetic on it (`+Inf` requests waiting times a prompt's tokens) must not fail every request routed past it.
MAX_SAMPLE = 1e15
#: The largest KV cache taken from an engine's `cache_config_info` (blocks x block size, in tokens).
MAX_CACHE_TOKENS = 1 << 40
#: The share of a core the loop's scrapes of one engine may cost: an engine whose page takes longer to decode and
#: parse is scraped less often (an outside run's page of 90,000 series, under the size bound, cost 21% of a core at
#: the default 200 ms; a vLLM page parses in well under a millisecond and keeps the configured interval).
MAX_SCRAPE_SHARE = 0.02
#: A page smaller than this keeps the configured interval whatever it was measured to cost: a fraction of a
#: millisecond, whose measure on a busy process would be the collector's pauses, not the page's.
MIN_COSTLY_PAGE = 256 * 1024


def scrape_interval(interval_s: float, cost_s: float) -> float:
    """How long the loop waits before scraping an engine again, given what reading its last page cost."""
    return max(interval_s, cost_s / MAX_SCRAPE_SHARE)


def parse_load(text: str, names: MetricNames, scraped_at: float) -> EngineLoad | None:
    """The load signals in an engine's Prometheus page (None: the page holds none of them, e.g. a login page served
    at `/metrics`: a failed scrape, not an engine that is idle). Malformed lines and samples outside [0,
    `MAX_SAMPLE`] are skipped; fractions (KV-cache usage, a hit rate) are capped at 1."""
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
        if line[end] == "{":
            close = line.rfind("}")
            if close < 0:
                continue
            rest = line[close + 1 :]
        else:
            rest = line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        name = line[:end]
        if name in names.cache_info:
            cache_tokens = _cache_tokens(line) or cache_tokens
            continue
        if not 0.0 <= value <= MAX_SAMPLE:  # (NaN is neither)
            continue
        sums[name] = sums.get(name, 0.0) + value
    if not sums and cache_tokens is None:
        return None

    def first(options: tuple[str, ...]) -> float | None:
        for name in options:
            if name in sums:
                return sums[name]
        return None

    return EngineLoad(
        scraped_at=scraped_at,
        waiting=first(names.waiting),
        running=first(names.running),
        kv_usage=_fraction(first(names.kv_usage)),
        prefix_hits=first(names.prefix_hits),
        prefix_queries=first(names.prefix_queries),
        tpot_seconds=first(names.tpot_seconds),
        tpot_tokens=first(names.tpot_tokens),
        cache_tokens=cache_tokens,
        prefix_hit_rate=_fraction(first(names.prefix_hit_rate)),
    )


def _fraction(value: float | None) -> float | None:
    return None if value is None else min(1.0, value)


def _cache_tokens(line: str) -> int | None:
    """`num_gpu_blocks` x `block_size` from an info metric's labels (vLLM `cache_config_info`), if in (0,
    `MAX_CACHE_TOKENS`]."""
    labels: dict[str, str] = {}
    for part in line[line.find("{") + 1 : line.rfind("}")].split(","):
        name, sep, value = part.partition("=")
        if sep:
            labels[name.strip()] = value.strip().strip('"')
    try:
        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):  # (a number of more than 4,300 digits is a ValueError too)
        return None
    return tokens if 0 < tokens <= MAX_CACHE_TOKENS else None


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
        #: When the loop may scrape an instance again, for those whose pages cost more than their interval allows
        #: (`scrape_interval`), on the monotonic clock.
        self._due: dict[Instance, float] = {}

    async def run(self) -> None:
        interval = self._config.interval_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_all()
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))

    async def scrape_all(self) -> None:
        now, due = time.monotonic(), self._due
        targets = [i for i in self._instances() if i.dialect.metrics_path]
        if due:
            self._due = due = {i: at for i, at in due.items() if at > now and i in targets}
        await asyncio.gather(*(self._scrape(i) for i in targets if i not in due))

    async def _scrape(self, instance: Instance) -> None:
        """One instance's scrape and what the fleet makes of it. Never raises (but for cancellation): an error here
        would end the loop, and every instance's signals would go stale with no word (an outside run's malformed
        line did that)."""
        try:
            load = await self.fetch(instance)
            self._on_result(instance, load is not None)
        except Exception:
            log.exception("instance %s: its scrape failed in the gateway", instance.name)

    async def fresh(self, instance: Instance, max_age: float) -> EngineLoad | None:
        """The engine's load at most `max_age` seconds old: the last scrape's, else a scrape now (`fetch`). None if
        the scrape failed, or if the engine's page is too costly to read again yet (`scrape_interval`): an asker
        must not undo the schedule that bounds what its scrapes cost."""
        load, now = instance.engine_load, time.monotonic()
        if load is not None and instance.scrape_error is None and now - load.scraped_at <= max_age:
            return load
        if self._due.get(instance, now) > now:
            return None
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
            started = time.thread_time()  # (the CPU this thread spends: not the time it waits for the cores)
            text = body.decode("utf-8", "replace")  # (a stray byte in a comment lost the whole page)
        except (HttpClientError, HttpStatusError, OSError, TimeoutError) as exc:
            instance.scrape_error = f"metrics scrape failed: {exc!r}"[:300]
            return None
        load = parse_load(text, instance.dialect.metrics, time.monotonic())
        if len(body) >= MIN_COSTLY_PAGE:
            interval = self._config.interval_ms / 1000
            wait = scrape_interval(interval, time.thread_time() - started)
            if wait > interval:
                self._due[instance] = time.monotonic() + wait
        if load is None:
            instance.scrape_error = f"metrics scrape found none of the engine's metrics in {path} ({len(body)} bytes)"
            return None
        load = replace(load, own_left=instance.own.left_unanswered)
        instance.engine_load = load
        instance.scrape_error = None
        return load
