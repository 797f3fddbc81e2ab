"""The gateway's SLO evaluator: cached evaluations for `GET /admin/slo` and the dashboard.

Theory of operation: one task, owned by `SloService` (an async context manager), samples the engines'
busy signals every `slo.idle_sample_ms` (a loop over the instances: nothing per request) and, when the
dashboard asked for a fresh evaluation, makes one. An evaluation reads the usage records in a worker
thread into per-bucket aggregates kept in memory (`usage.BucketedWindows`), re-reading only recent buckets:
windows up to an hour in 1-minute buckets, the last 2 minutes re-read each time; longer ones (the period)
in 5-minute buckets, the last 15 minutes re-read at most once a minute. It is reused for `slo.cache_ms`:
however many dashboards and `/admin/slo` callers there are, the records are read at most that often.
`cached()` never waits: it returns the last evaluation and asks for a new one when it is stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..tasks import cancel_and_wait
from .config import SloConfig
from .idle import MAX_HORIZON_S, IdleSamples, busy_and_idle, waiting_for
from .objectives import Counts, evaluate
from .usage import BucketedWindows, UsageUnavailable, add_counts, connect_readonly, record_files

if TYPE_CHECKING:
    from ..fleet.fleet import Fleet

log = logging.getLogger(__name__)

#: Windows up to this long are refreshed at every evaluation; longer ones at most every `_LONG_WINDOW_REFRESH_S`.
_SHORT_WINDOW_S = 3600
_LONG_WINDOW_REFRESH_S = 60.0
#: The longer windows' buckets, and how far back each refresh re-reads them (a record is written after its request
#: ended: the writer's batching, a spill file's re-import).
_LONG_BUCKET_S = 300
_LONG_SETTLE_S = 900


class SloService:
    def __init__(
        self,
        config: SloConfig,
        usage_path: str,
        fleet: Fleet,
        *,
        stale_after_s: float,
        queued: Callable[[str], int] = lambda model: 0,
    ) -> None:
        """`queued(model)`: requests waiting at the gateway's admission for `model` (engine idle time counts
        only while its model had requests waiting)."""
        self.config = config
        self._queued = queued
        #: The configured usage path whose records are read: its file and every `<path>.worker-<i>` (`record_files`;
        #: under `--workers` the server sets the configuration's path, each worker writing a file of its own).
        self.records_path = usage_path
        self._fleet = fleet
        self._stale_after_s = stale_after_s
        self._windows = config.windows()
        horizon = max((s for s in self._windows.values() if s <= MAX_HORIZON_S), default=3600)
        self._interval_s = config.idle_sample_ms / 1000
        self.idle = IdleSamples(horizon, self._interval_s)
        self._files: dict[str, _Records] = {}
        #: Held by the worker thread reading the records: a caller cancelled while it runs (a client gone from
        #: `/admin/slo`, shutdown) releases the asyncio lock, not the connection and the buckets.
        self._reading = threading.Lock()
        self._closed = False
        self._evaluation: dict[str, Any] | None = None
        self._evaluated_at = -math.inf
        self._lock = asyncio.Lock()
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Evaluations made (for tests and statistics).
        self.evaluations = 0

    async def __aenter__(self) -> SloService:
        self._task = asyncio.create_task(self._run(), name="lockgate-slo")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop sampling and close the records connection; safe to call twice."""
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait(task)
        async with self._lock:
            await asyncio.to_thread(self._close)

    def _close(self) -> None:
        with self._reading:
            self._closed = True
            files, self._files = self._files, {}
            for records in files.values():
                records.db.close()

    def cached(self) -> Mapping[str, Any] | None:
        """The last evaluation (None before the first); asks the service's task for a new one when it is
        older than `slo.cache_ms`. For `Gateway.slo_provider`: never waits, never reads the records itself."""
        if time.monotonic() - self._evaluated_at > self.config.cache_ms / 1000:
            self._wanted.set()
        return self._evaluation

    async def evaluate(self) -> dict[str, Any]:
        """An evaluation at most `slo.cache_ms` old (`objectives.evaluate`'s shape, plus `records_error`
        when the usage records cannot be read: their objectives are then unknown)."""
        async with self._lock:
            now = time.monotonic()
            if self._evaluation is not None and now - self._evaluated_at <= self.config.cache_ms / 1000:
                return self._evaluation
            counts: dict[str, dict[str, Counts]] = {}
            error: str | None = None
            try:
                counts.update(await asyncio.to_thread(self._count_records, now, time.time()))
            except UsageUnavailable as exc:
                error = str(exc)
            counts["engine_idle"] = self.idle.counts(now, self._windows)
            evaluation = evaluate(self.config, counts)
            if error is not None:
                evaluation["records_error"] = error
            self._evaluation, self._evaluated_at = evaluation, now
            self.evaluations += 1
            return evaluation

    def _count_records(self, now: float, wall: float) -> dict[str, dict[str, Counts]]:
        """In a worker thread: every window's counts, from buckets brought up to date, summed over the usage
        databases (another worker's that cannot be read yet is left out; none readable: UsageUnavailable)."""
        with self._reading:
            if self._closed:
                raise UsageUnavailable("the gateway is shutting down")
            counts: dict[str, dict[str, Counts]] = {}
            unavailable: UsageUnavailable | None = None
            for path in record_files(self.records_path) or [self.records_path]:
                records = self._files.get(path)
                if records is None:
                    try:
                        records = self._files[path] = _Records(self.config, self._windows, connect_readonly(path))
                    except UsageUnavailable as exc:
                        unavailable = exc
                        continue
                add_counts(counts, records.counts(now, wall))
            if not counts and unavailable is not None:
                raise unavailable
            return counts

    def sample(self) -> None:
        """Sample the engines' busy signals once (the task does this every `slo.idle_sample_ms`)."""
        now = time.monotonic()
        wanted = waiting_for(self._fleet.pools.values(), self._queued, now, self._stale_after_s)
        busy, idle = busy_and_idle(self._fleet.instances.values(), now, self._stale_after_s, wanted)
        self.idle.add(now, busy, idle)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_sample = loop.time()
        while True:
            if loop.time() >= next_sample:
                self.sample()
                next_sample = loop.time() + self._interval_s
            if self._wanted.is_set():
                self._wanted.clear()
                try:
                    await self.evaluate()
                except Exception:  # a bug must not stop the sampling; the dashboard shows the last evaluation
                    log.warning("SLO evaluation failed", exc_info=True)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(next_sample):
                    await self._wanted.wait()


class _Records:
    """One usage database's connection and per-bucket aggregates (`usage.BucketedWindows`)."""

    def __init__(self, config: SloConfig, windows: Mapping[str, int], db: sqlite3.Connection) -> None:
        self.db = db
        self._short = BucketedWindows(
            config, {w: s for w, s in windows.items() if s <= _SHORT_WINDOW_S}, bucket_s=60, settle_s=120
        )
        self._long = BucketedWindows(
            config,
            {w: s for w, s in windows.items() if s > _SHORT_WINDOW_S},
            bucket_s=_LONG_BUCKET_S,
            settle_s=_LONG_SETTLE_S,
        )
        self._long_at = -math.inf

    def counts(self, now: float, wall: float) -> dict[str, dict[str, Counts]]:
        if now - self._long_at >= _LONG_WINDOW_REFRESH_S:
            self._long.refresh(self.db, wall)
            self._long_at = now
        self._short.refresh(self.db, wall)
        counts = self._short.counts(wall)
        # The long windows' last settled bucket bound; after it, the short windows' buckets (re-read now) count.
        split = math.floor((wall - _LONG_SETTLE_S) / _LONG_BUCKET_S) * _LONG_BUCKET_S
        recent = (split, self._short.total(split)) if self._short.covers(split, wall) else None
        for name, by_window in self._long.counts(wall, recent).items():
            counts[name].update(by_window)
        return counts
