"""Counting the record-based objectives' events in the usage records (SQLite), synchronously.

Callers run `count_windows` off the event loop (`asyncio.to_thread`): each window is one range query over
the `started_at` index the record writer creates, aggregating every objective's counts in one pass. The
connection is read-only, so a CLI reading a live gateway's file never takes the writer's lock.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Mapping
from pathlib import Path

from .config import SloConfig
from .objectives import Counts

# The events of each objective (`objectives.py` states them in words). `:p` is the priority class,
# `:ttft` the TTFT threshold in seconds.
_AGGREGATES = {
    "p0_success": (
        "priority = :p AND NOT (status = 'cancelled' AND cancel_reason IN ('client_disconnect', 'admin'))",
        "priority = :p AND (status = 'error' OR (status = 'cancelled' AND cancel_reason IN ('timeout', 'shutdown'))"
        " OR (status = 'rejected' AND http_status >= 500))",
    ),
    "p0_ttft": (
        "priority = :p AND stream = 1 AND status = 'completed' AND first_token_at IS NOT NULL",
        "priority = :p AND stream = 1 AND status = 'completed' AND first_token_at IS NOT NULL"
        " AND first_token_at - started_at > :ttft",
    ),
    "cancel_rate": ("status != 'rejected'", "status = 'cancelled'"),
    "dedup_saving": (
        "status = 'completed'",
        "status = 'completed' AND served_by NOT IN ('coalesced', 'hit', 'semantic')",
    ),
}
#: The objectives counted from the usage records.
RECORD_OBJECTIVES = tuple(_AGGREGATES)

_SELECT = (
    "SELECT "
    + ", ".join(f"COALESCE(SUM({events}), 0), COALESCE(SUM({bad}), 0)" for events, bad in _AGGREGATES.values())
    + " FROM usage WHERE started_at >= :since AND started_at <= :now"
)


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


def count_windows(
    db: sqlite3.Connection, config: SloConfig, now: float, windows: Mapping[str, int]
) -> dict[str, dict[str, Counts]]:
    """`result[objective][window]` for the record-based objectives, each window ending at `now` (wall clock)."""
    out: dict[str, dict[str, Counts]] = {name: {} for name in RECORD_OBJECTIVES}
    params: dict[str, float | str] = {"p": config.klass, "ttft": config.ttft_threshold_ms / 1000, "now": now}
    for window, seconds in windows.items():
        try:
            row = db.execute(_SELECT, {**params, "since": now - seconds}).fetchone()
        except sqlite3.Error as exc:
            raise UsageUnavailable(f"cannot read the usage records: {exc}") from None
        for index, name in enumerate(RECORD_OBJECTIVES):
            out[name][window] = Counts(events=row[2 * index], bad=row[2 * index + 1])
    return out


def count_file(path: str, config: SloConfig, now: float) -> dict[str, dict[str, Counts]]:
    """`count_windows` over every window of `config`, on a connection of its own."""
    with contextlib.closing(connect_readonly(path)) as db:
        return count_windows(db, config, now, config.windows())
