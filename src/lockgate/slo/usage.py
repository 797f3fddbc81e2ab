"""Counting the record-based objectives' events in the usage records (SQLite), synchronously.

A request counts in the windows containing its end (`finished_at`, what the record writer indexes): the
same instant its metrics are counted at. Callers run these functions off the event loop
(`asyncio.to_thread`) on a read-only connection, so a CLI reading a live gateway's file never takes the
writer's lock. Two shapes:
- `count_windows`: exact, one range query per window aggregating every objective in one pass (the CLI);
- `count_buckets`: the same aggregates per fixed time bucket since an instant, for `BucketedWindows`, which
  keeps windows up to date by re-reading only their recent buckets (the gateway).
"""

from __future__ import annotations

import contextlib
import glob
import math
import re
import sqlite3
from collections.abc import Mapping
from pathlib import Path

from .config import SloConfig
from .objectives import Counts

#: A generation's record, not a stored response's route's (`responses.retrieve`, ...: no request de-duplication
#: could save, nor one a client cancels mid-answer).
_GENERATION = "endpoint NOT LIKE 'responses.%'"

# The events of each objective (`objectives.py` states them in words). `:p` is the priority class,
# `:ttft` the TTFT threshold in seconds.
_AGGREGATES = {
    "p0_success": (
        "priority = :p AND NOT (status = 'cancelled' AND cancel_reason IN ('client_disconnect', 'admin'))",
        "priority = :p AND (status = 'error' OR (status = 'cancelled' AND cancel_reason IN ('timeout', 'shutdown'))"
        " OR (status = 'rejected' AND http_status >= 500))",
    ),
    "p0_ttft": (
        "priority = :p AND stream = 1 AND status != 'rejected'"
        " AND (first_token_at IS NOT NULL OR finished_at - started_at > :ttft)",
        "priority = :p AND stream = 1 AND status != 'rejected'"
        " AND COALESCE(first_token_at, finished_at) - started_at > :ttft",
    ),
    "cancel_rate": (f"status != 'rejected' AND {_GENERATION}", f"status = 'cancelled' AND {_GENERATION}"),
    "dedup_saving": (
        f"status != 'rejected' AND {_GENERATION} AND served_by IN ('miss', 'coalesced', 'hit', 'semantic')",
        f"status != 'rejected' AND {_GENERATION} AND served_by = 'miss'",
    ),
}
#: The objectives counted from the usage records.
RECORD_OBJECTIVES = tuple(_AGGREGATES)

_SUMS = ", ".join(f"COALESCE(SUM({events}), 0), COALESCE(SUM({bad}), 0)" for events, bad in _AGGREGATES.values())
_SELECT = f"SELECT {_SUMS} FROM usage WHERE finished_at > :since AND finished_at <= :now"
_SELECT_BUCKETS = (
    f"SELECT CAST(finished_at / :bucket AS INTEGER) AS b, {_SUMS} FROM usage WHERE finished_at > :since GROUP BY b"
)

#: One bucket's (or window's) aggregates: events and bad events of each record objective, in order.
Sums = tuple[float, ...]


class UsageUnavailable(Exception):
    """The usage records cannot be read (no such file, not a lockgate usage database)."""


def connect_readonly(path: str) -> sqlite3.Connection:
    """A read-only connection to a usage database; UsageUnavailable if there is none at `path`."""
    file = Path(path)
    if path == ":memory:" or not file.is_file():
        raise UsageUnavailable(f"no usage records at {path}")
    try:
        return sqlite3.connect(file.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False)
    except sqlite3.Error as exc:
        raise UsageUnavailable(f"{path}: {exc}") from None


def _params(config: SloConfig) -> dict[str, float | str]:
    return {"p": config.klass, "ttft": config.ttft_threshold_ms / 1000}


def _counts(sums: Sums) -> dict[str, Counts]:
    return {name: Counts(events=sums[2 * i], bad=sums[2 * i + 1]) for i, name in enumerate(RECORD_OBJECTIVES)}


def count_windows(
    db: sqlite3.Connection, config: SloConfig, now: float, windows: Mapping[str, int]
) -> dict[str, dict[str, Counts]]:
    """`result[objective][window]` for the record-based objectives, each window ending at `now` (wall clock)."""
    out: dict[str, dict[str, Counts]] = {name: {} for name in RECORD_OBJECTIVES}
    for window, seconds in windows.items():
        try:
            row = db.execute(_SELECT, {**_params(config), "now": now, "since": now - seconds}).fetchone()
        except sqlite3.Error as exc:
            raise UsageUnavailable(f"cannot read the usage records: {exc}") from None
        for name, counts in _counts(tuple(row)).items():
            out[name][window] = counts
    return out


def count_buckets(db: sqlite3.Connection, config: SloConfig, since: float, bucket_s: int) -> dict[int, Sums]:
    """Aggregates per bucket (index: `finished_at // bucket_s`) of the requests that finished after `since`."""
    try:
        rows = db.execute(_SELECT_BUCKETS, {**_params(config), "since": since, "bucket": bucket_s}).fetchall()
    except sqlite3.Error as exc:
        raise UsageUnavailable(f"cannot read the usage records: {exc}") from None
    return {int(row[0]): tuple(row[1:]) for row in rows}


class BucketedWindows:
    """Windows from per-bucket aggregates kept in memory, so that each refresh re-reads only the last
    `settle_s` of records instead of whole windows (30 days of records took ~1 s per 200,000 to scan).

    The first refresh reads the longest window once; later ones re-read the buckets from `settle_s`
    before the previous refresh (records are written shortly after their request ends; the settle time
    covers the writer's batching, and for long windows a spill file's re-import). A window starts at the
    bound of the bucket holding its start, so it may reach up to one bucket further back. Bound: the
    longest window / `bucket_s` + 2 buckets (30 days in 5-minute buckets: 8,642)."""

    def __init__(self, config: SloConfig, windows: Mapping[str, int], *, bucket_s: int, settle_s: int) -> None:
        self._config = config
        self._windows = dict(windows)
        self._horizon_s = max(windows.values(), default=0)
        self._bucket_s = bucket_s
        self._settle_s = settle_s
        self._buckets: dict[int, Sums] = {}
        self._refreshed_at: float | None = None

    def __len__(self) -> int:
        return len(self._buckets)

    def refresh(self, db: sqlite3.Connection, now: float) -> None:
        """Bring the buckets up to `now` (wall clock)."""
        oldest = now - self._horizon_s - self._bucket_s
        since = oldest if self._refreshed_at is None else max(oldest, self._refreshed_at - self._settle_s)
        first = math.floor(since / self._bucket_s)
        fresh = count_buckets(db, self._config, first * self._bucket_s, self._bucket_s)
        keep = math.floor(oldest / self._bucket_s)
        self._buckets = {b: s for b, s in self._buckets.items() if keep <= b < first}
        self._buckets.update(fresh)
        self._refreshed_at = now

    def counts(self, now: float, recent: tuple[float, Sums] | None = None) -> dict[str, dict[str, Counts]]:
        """`result[objective][window]`: the buckets from the one containing `now - window` on. `recent`: the sums
        from an instant (a bucket bound) on, counted by finer windows refreshed more often: these buckets' count
        stops there (a 6 h window read up to a minute ago counted fewer events than the last hour read now)."""
        out: dict[str, dict[str, Counts]] = {name: {} for name in RECORD_OBJECTIVES}
        for window, seconds in self._windows.items():
            if recent is None:
                total = self.total(now - seconds)
            else:
                split, sums = recent
                total = tuple(a + b for a, b in zip(self.total(now - seconds, split), sums, strict=True))
            for name, counts in _counts(total).items():
                out[name][window] = counts
        return out

    def covers(self, start: float, now: float) -> bool:
        """Whether these buckets hold every record since `start` (within their horizon)."""
        return start >= now - self._horizon_s

    def total(self, start: float, end: float | None = None) -> Sums:
        """The sums of the buckets from the one containing `start` on (up to the one starting at `end`, excluded)."""
        first = math.floor(start / self._bucket_s)
        last = math.inf if end is None else end / self._bucket_s
        total = [0.0] * (2 * len(RECORD_OBJECTIVES))
        for b, sums in self._buckets.items():
            if first <= b < last:
                for i, value in enumerate(sums):
                    total[i] += value
        return tuple(total)


#: What follows `usage.path` in a worker's usage database (`--workers`); its SQLite companions (-wal) do not match.
_WORKER_FILE = re.compile(r"\.worker-\d+")


def record_files(path: str) -> list[str]:
    """The usage databases of a gateway configured with `usage.path: path`: that file, and every `<path>.worker-<i>`
    written under `--workers` (this run's or an earlier one's: the same gateway's records), those that exist."""
    base = Path(path)
    workers = sorted(
        (
            str(p)
            for p in base.parent.glob(glob.escape(base.name) + ".worker-*")
            if _WORKER_FILE.fullmatch(p.name[len(base.name) :])
        ),
        key=lambda name: int(name.rsplit("-", 1)[1]),
    )
    return ([path] if base.is_file() else []) + workers


def add_counts(into: dict[str, dict[str, Counts]], more: Mapping[str, Mapping[str, Counts]]) -> None:
    """`into` += `more`, window by window (the records of several workers)."""
    for name, by_window in more.items():
        target = into.setdefault(name, {})
        for window, counts in by_window.items():
            had = target.get(window)
            target[window] = counts if had is None else Counts(had.events + counts.events, had.bad + counts.bad)


def count_file(path: str, config: SloConfig, now: float) -> dict[str, dict[str, Counts]]:
    """`count_windows` over every window of `config` in the records of `usage.path: path` (its workers' files
    too: `record_files`), on connections of their own (the CLI: exact, once)."""
    files = record_files(path)
    if not files:
        raise UsageUnavailable(f"no usage records at {path}")
    out: dict[str, dict[str, Counts]] = {}
    for file in files:
        with contextlib.closing(connect_readonly(file)) as db:
            add_counts(out, count_windows(db, config, now, config.windows()))
    return out
