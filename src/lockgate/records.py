"""Usage records that are never lost.

Theory of operation: a request's owner calls `RecordWriter.submit()` from its `finally`. `submit` is
synchronous and cannot fail: the record goes into an in-memory queue, or — when that queue is full —
is appended to a spill file (JSON lines) on disk and counted. One writer task, owned by the writer,
moves batches from the queue into SQLite (in a worker thread, so the event loop never blocks on disk)
and re-imports the spill file. `aclose()` flushes everything before returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import sqlite3
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import orjson

from .metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class UsageRecord:
    request_id: str
    tenant: str
    model: str
    endpoint: str
    stream: bool
    instance: str | None = None
    priority: str | None = None
    status: str = "completed"
    cancel_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    #: Tokens actually delivered to the client.
    completion_tokens: int = 0
    attempts: int = 0
    #: The client's own `x-request-id`, if it sent one (not unique: clients reuse them).
    client_request_id: str | None = None
    served_by: str = "upstream"
    #: Times the request was stopped for a more urgent one (and resumed or restarted).
    preemptions: int = 0
    #: Of those, the times its output so far was thrown away and it started again from scratch.
    restarts: int = 0
    started_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    #: The client's W3C `traceparent`, when it sent a valid one (forwarded to the engine as well).
    traceparent: str | None = None
    #: The request's messages or prompt, kept only for an access log with `include_prompts`; never stored.
    log_prompt: Any = field(default=None, metadata={"column": False}, compare=False, repr=False)


def _null(value: None) -> None:
    return None


def _register_adapters() -> None:
    """Python's sqlite3 binds only exact ints, floats and strings directly: for anything else (None and bool
    included) it looks for an adapter, and on finding none raises and clears two AttributeErrors (`__adapt__`,
    `__conform__`) per value. A record has about eight None or bool fields: these adapters, which bind exactly
    what sqlite3 binds without them, took writing from ~4.1 to ~3.3 us per record. (sqlite3's adapter registry
    is process-wide; registering the same two again is harmless.)"""
    sqlite3.register_adapter(type(None), _null)
    sqlite3.register_adapter(bool, int)


def _column_fields() -> list[Field[Any]]:
    """The record's fields stored as columns (and in spill files)."""
    return [f for f in fields(UsageRecord) if f.metadata.get("column", True)]


_COLUMNS = [f.name for f in _column_fields()]
#: One C call turns a record into its row.
_ROW = operator.attrgetter(*_COLUMNS)
_SQL_TYPES = {"bool": "INTEGER", "int": "INTEGER", "float": "REAL"}


def _schema() -> str:
    cols = []
    for f in _column_fields():
        base = str(f.type).split("|")[0].strip()
        sql_type = _SQL_TYPES.get(base, "TEXT")
        cols.append(f"{f.name} {sql_type}{' PRIMARY KEY' if f.name == 'request_id' else ''}")
    # Keyed by request id alone (no rowid): one B-tree per insert instead of a table and its key index.
    return f"CREATE TABLE IF NOT EXISTS usage ({', '.join(cols)}) WITHOUT ROWID"


def _sql_default(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return "NULL"


_INSERT = f"INSERT OR REPLACE INTO usage ({', '.join(_COLUMNS)}) VALUES "
_ROW_PLACEHOLDERS = f"({', '.join('?' * len(_COLUMNS))})"
#: Most rows per INSERT statement (a power of two): one statement, one `sqlite3_step` for many rows.
#: Python's sqlite3 lets go of the GIL around every step, and with the event loop running each of those
#: is a thread switch: one statement per row cost ~10 us per record in `bench overhead`.
_ROWS_PER_STATEMENT = 256


@functools.cache
def _insert_sql(rows: int) -> str:
    return _INSERT + ", ".join([_ROW_PLACEHOLDERS] * rows)


def _statement_sizes(rows: int) -> Iterator[int]:
    """Split `rows` into statements of power-of-two sizes (256, 128, ..., 1): a handful of distinct
    statements, each parsed once and then found in sqlite3's statement cache. Parsing a statement of
    hundreds of rows cost more than inserting them (~2 us per record when every batch size was new)."""
    while rows > 0:
        size = min(_ROWS_PER_STATEMENT, 1 << (rows.bit_length() - 1))
        yield size
        rows -= size


class RecordSink(Protocol):
    """Where stored batches also go, in the writer's thread (the access log, `observe/access_log.py`)."""

    def open(self) -> None: ...

    def write(self, records: Iterable[UsageRecord]) -> None: ...

    def close(self) -> None: ...


class RecordWriter:
    def __init__(
        self,
        path: str,
        metrics: GatewayMetrics,
        *,
        batch_size: int = 256,
        queue_size: int = 10000,
        linger_s: float = 0.05,
        access_log: RecordSink | None = None,
    ) -> None:
        self._path = path
        #: Stored batches are handed to it, in the writer's thread (see `observe/access_log.py`).
        self._access_log = access_log
        self._metrics = metrics
        self._batch_size = batch_size
        self._queue_size = queue_size
        self._linger_s = linger_s
        self._queue: deque[UsageRecord] = deque()
        self._spill = None if path == ":memory:" else Path(path + ".spill.jsonl")
        self._spilled_in_memory: list[UsageRecord] = []
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._db: sqlite3.Connection | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._import_failed = False
        self.submitted = 0
        self.written = 0
        metrics.usage_records_pending.set_function(lambda: len(self._queue))

    async def __aenter__(self) -> RecordWriter:
        self._db = await asyncio.to_thread(self._open)
        self._task = asyncio.create_task(self._run(), name="lockgate-usage-writer")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _open(self) -> sqlite3.Connection:
        _register_adapters()
        if self._access_log is not None:
            self._access_log.open()  # first: nothing to close if it cannot be opened
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        if self._path != ":memory:":
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute(_schema())
        # Files written by an older lockgate lack the newer columns: add them (with their defaults).
        have = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
        for f in _column_fields():
            if f.name not in have:
                sql_type = _SQL_TYPES.get(str(f.type).split("|")[0].strip(), "TEXT")
                db.execute(f"ALTER TABLE usage ADD COLUMN {f.name} {sql_type} DEFAULT {_sql_default(f.default)}")
        # Time-range queries (SLO windows, `slo/usage.py`). Records are written in about the order their
        # requests finish, so inserts land at the end of this index.
        db.execute("CREATE INDEX IF NOT EXISTS usage_finished_at ON usage (finished_at)")
        return db

    # --- the synchronous, infallible entry point -------------------------------------------------
    def submit(self, record: UsageRecord) -> None:
        self.submitted += 1
        if not self._queue:
            # The writer may be idle, asleep on `_wakeup` (it sleeps only once the queue is empty, so
            # while records wait it is busy already: nothing to do for them, the common case).
            self._idle.clear()
            self._wakeup.set()
        if len(self._queue) >= self._queue_size or (self._closing and self._task is None):
            self._spill_one(record)
        else:
            self._queue.append(record)

    def _spill_one(self, record: UsageRecord) -> None:
        self._metrics.usage_records_spilled.inc()
        if self._spill is None:
            self._spilled_in_memory.append(record)
            return
        try:
            with self._spill.open("ab") as fh:
                fh.write(orjson.dumps(dict(zip(_COLUMNS, _ROW(record), strict=True))) + b"\n")
        except OSError as exc:
            # The disk refused the spill (full, read-only, gone): keep the record in memory rather than
            # lose it. `submit()` runs in a request's cleanup and must never raise.
            log.error("usage writer: cannot append to %s (%s); keeping the record in memory", self._spill, exc)
            self._spilled_in_memory.append(record)

    # --- the writer task -------------------------------------------------------------------------
    async def _run(self) -> None:
        # A claimed spill file left by a crash mid-import is imported first (INSERT OR REPLACE: a record
        # imported twice is still one row).
        await self._import_spill()
        while True:
            in_memory = self._spilled_in_memory and not self._import_failed
            if not self._queue and not in_memory and not self._spill_pending():
                self._idle.set()
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self._closing and len(self._queue) < self._batch_size:
                # Let a batch gather: one transaction and one thread hop for many records. Also after a
                # write: under load, the records that arrived while it ran would otherwise go as a
                # small batch of their own, paying a transaction and a thread hop for a few records.
                await asyncio.sleep(self._linger_s)
            batch = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
            if not self._import_failed:
                batch.extend(self._spilled_in_memory)
                self._spilled_in_memory = []
            if batch:
                try:
                    await asyncio.shield(asyncio.to_thread(self._write, batch))
                except (sqlite3.Error, OSError) as exc:
                    # Never drop: the batch goes to the spill file (counted) and is imported later.
                    log.error("usage writer: storing %d record(s) failed (%s); spilling them", len(batch), exc)
                    self._import_failed = True
                    for record in batch:
                        self._spill_one(record)
            if self._spill_pending():
                await self._import_spill()

    def _spill_pending(self) -> bool:
        return (
            self._spill is not None
            and not self._import_failed
            and self._spill.exists()
            and len(self._queue) < self._queue_size
        )

    async def _import_spill(self) -> None:
        if self._spill is None:
            return
        claimed = self._spill.with_suffix(".importing")
        # Claim in the event loop's thread: `_spill_one` appends from this thread too, so an append can
        # never land in a file that the import thread has already read (and would then delete).
        if not claimed.exists():
            if not self._spill.exists():
                return
            self._spill.rename(claimed)
        try:
            await asyncio.shield(asyncio.to_thread(self._import_claimed, claimed))
        except (sqlite3.Error, OSError, ValueError) as exc:
            # Keep the claimed file for the next start; stop importing until then (no hot loop).
            log.error("usage writer: importing %s failed (%s); it stays for the next start", claimed, exc)
            self._import_failed = True

    def _write(self, batch: list[UsageRecord]) -> None:
        assert self._db is not None
        db = self._db
        db.execute("BEGIN")
        try:
            start = 0
            for size in _statement_sizes(len(batch)):
                chunk = batch[start : start + size]
                start += size
                db.execute(_insert_sql(size), [value for record in chunk for value in _ROW(record)])
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")  # the next batch can start its own transaction
            raise
        db.execute("COMMIT")
        self.written += len(batch)
        self._metrics.usage_records_written.inc(len(batch))
        if self._access_log is not None:
            self._access_log.write(batch)

    def _import_claimed(self, claimed: Path) -> None:
        records = [UsageRecord(**orjson.loads(line)) for line in claimed.read_bytes().splitlines() if line]
        for start in range(0, len(records), self._batch_size):
            self._write(records[start : start + self._batch_size])
        claimed.unlink()

    async def wait_flushed(self) -> None:
        """Wait until every record submitted so far is stored."""
        self._wakeup.set()
        await self._idle.wait()

    async def aclose(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
            self._task = None
        # Records submitted while closing (there should be none) still land.
        if self._queue or self._spilled_in_memory:
            batch = list(self._queue) + self._spilled_in_memory
            self._queue.clear()
            self._spilled_in_memory = []
            try:
                await asyncio.to_thread(self._write, batch)
            except (sqlite3.Error, OSError) as exc:
                log.error("usage writer: storing %d record(s) at close failed (%s); spilling", len(batch), exc)
                for record in batch:
                    self._spill_one(record)
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)
        if self._access_log is not None:
            await asyncio.to_thread(self._access_log.close)

    def statistics(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted,
            "written": self.written,
            "pending": len(self._queue),
        }


def read_records(path: str) -> list[dict[str, Any]]:
    """All stored records (for tests and the admin API)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM usage ORDER BY started_at")]
