"""Usage records that are never lost.

Theory of operation: a request's owner calls `RecordWriter.submit()` from its `finally`. `submit` is
synchronous and cannot fail: the record goes into an in-memory queue, or — when that queue is full —
is appended to a spill file (JSON lines) on disk and counted. One writer task, owned by the writer,
moves batches from the queue into SQLite (in a worker thread, so the event loop never blocks on disk)
and re-imports the spill file. `aclose()` flushes everything before returning.

When the database fails (locked, disk full, I/O error), a batch goes to the spill file and the database is tried
again after a backoff (1 s, doubling to 30 s), the spill imported once it takes records again. When the spill file
fails too, records are held in memory (at most `queue_size`) and tried again with the database; past that, and
whatever is still held at close, each goes to the log as a JSON line (`usage record not stored: {...}`, counted in
`lockgate_usage_records_logged_total`): a full disk costs memory up to a bound, then log lines, never a silent loss.
The spill file is imported a batch at a time; a line that is no record (torn by a crash) or that the database
refuses is moved aside, not left to block the others; a failed import waits for its own retry (live records still
go to the database). A database file deleted while in use is opened anew at its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import operator
import os
import sqlite3
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import orjson

from .metrics import GatewayMetrics

log = logging.getLogger(__name__)


#: The ends of a request its client chose (`UsageRecord.cancel_reason`): leaving, or its deadline passing.
CLIENT_ENDED = frozenset({"client_disconnect", "timeout"})


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


#: The first wait before the database is tried again after a failed write (doubled after each failure since).
RETRY_FIRST_S = 1.0
#: The longest wait between tries of a failing database.
RETRY_MAX_S = 30.0
#: What the database (or its binding of values) raises for a record it refuses for itself, not for its own state.
_REFUSED_RECORD = (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.ProgrammingError, OverflowError, ValueError)
#: What storing can raise: the database's own failures (locked, full, I/O) and the refusals above.
_STORE_FAILED = (sqlite3.Error, OSError, ValueError, TypeError, OverflowError)


class RecordWriter:
    """Batches records into SQLite (see the module docstring for where a record goes when that fails)."""

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
        #: Records neither stored nor spilled (the database and the spill file both failed): tried again with the
        #: database; at most `queue_size` (past it, and at close, the log takes them).
        self._held: list[UsageRecord] = []
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._db: sqlite3.Connection | None = None
        #: The database file's identity when opened (device, inode): a file deleted or replaced under the running
        #: gateway is noticed at the next write and opened anew.
        self._identity: tuple[int, int] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: After a failed write: the loop time before which the database is not tried again (records go to the
        #: spill file meanwhile), and the wait after the next failure.
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST_S
        #: The same for imports of the spill file (their failures do not keep live records from the database).
        self._import_at = 0.0
        self._import_backoff = RETRY_FIRST_S
        self._spill_failing = False
        self.submitted = 0
        self.written = 0
        #: Records written to the log because nothing else took them.
        self.logged = 0
        metrics.usage_records_pending.set_function(lambda: len(self._queue) + len(self._held))

    async def __aenter__(self) -> RecordWriter:
        await asyncio.to_thread(self._open)
        self._task = asyncio.create_task(self._run(), name="lockgate-usage-writer")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _open(self) -> None:
        _register_adapters()
        if self._access_log is not None:
            self._access_log.open()  # first: nothing to close if it cannot be opened
        self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
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
        self._identity = self._file_identity()
        return db

    def _file_identity(self) -> tuple[int, int] | None:
        if self._path == ":memory:":
            return None
        try:
            stat = os.stat(self._path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

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
        """Append the record to the spill file; if the disk refuses (full, read-only, gone), hold it in memory rather
        than lose it, and past that bound write it to the log. Never raises (`submit()` runs in a request's cleanup)."""
        if self._spill is None:
            self._hold(record)
            return
        try:
            _append(self._spill, _record_line(record))
        except OSError as exc:
            self._spilled([record], exc)
        else:
            self._spilled([record], None)

    async def _spill_batch(self, batch: list[UsageRecord]) -> None:
        """A batch to the spill file in one append, off the event loop (a backoff's worth of records appended one
        by one on the loop cost four system calls each); held in memory if the disk refuses."""
        if self._spill is None:
            for record in batch:
                self._hold(record)
            return
        try:
            await asyncio.to_thread(_append, self._spill, b"".join(_record_line(record) for record in batch))
        except OSError as exc:
            self._spilled(batch, exc)
        else:
            self._spilled(batch, None)

    def _spilled(self, records: list[UsageRecord], error: OSError | None) -> None:
        """What appending `records` to the spill file came to: counted, or (`error`: the disk refused) held in memory;
        said once a failing spell, not once a record (the log may sit on the same full disk)."""
        if error is None:
            if self._spill_failing:
                self._spill_failing = False
                log.warning("usage writer: %s takes records again", self._spill)
            self._metrics.usage_records_spilled.inc(len(records))
            return
        if not self._spill_failing:
            self._spill_failing = True
            log.error("usage writer: cannot append to %s (%s); holding records in memory", self._spill, error)
        for record in records:
            self._hold(record)

    def _hold(self, record: UsageRecord) -> None:
        """Keep a record neither the database nor the spill file took, up to `queue_size`; past that, the log."""
        if len(self._held) < self._queue_size:
            self._held.append(record)
        else:
            self._log_record(record)

    def _log_record(self, record: UsageRecord) -> None:
        """The last resort: the record as a JSON line in the log (an operator's log collector keeps it)."""
        if not self.logged:
            log.error(
                "usage writer: neither %s nor its spill file takes records and %d are held in memory: the next ones "
                "are logged, one a line, as JSON after the words 'usage record not stored', to be imported by hand",
                self._path,
                len(self._held),
            )
        self.logged += 1
        self._metrics.usage_records_logged.inc()
        log.error("usage record not stored: %s", _record_line(record).decode().rstrip("\n"))

    # --- the writer task -------------------------------------------------------------------------
    async def _run(self) -> None:
        # A claimed spill file left by a crash mid-import is imported first (INSERT OR REPLACE: a record
        # imported twice is still one row).
        loop = asyncio.get_running_loop()
        await self._import_spill()
        while True:
            try:
                if await self._step(loop):
                    return
            except Exception:
                # A bug of the writer's own: the task lives on (a dead writer left every later record queued and
                # `aclose` raising), after a pause (no spinning on it); at close, `aclose` flushes what is left.
                log.exception("usage writer: failed; trying again in %.0f s", self._backoff)
                if self._closing:
                    return
                pause = self._backoff
                self._retry_at, self._backoff = self._later(pause)
                await asyncio.sleep(pause)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> bool:
        """One pass of the writer: store, import or wait. True when it is done (closing, nothing left)."""
        now = loop.time()
        write_in = self._retry_at - now  # > 0: the database failed lately, tried again then
        import_in = max(write_in, self._import_at - now)
        spilled = self._spill_pending()
        held = bool(self._held) and write_in <= 0
        due_import = spilled and import_in <= 0
        if not self._queue and not held and not due_import:
            self._idle.set()  # (nothing it can store now: spilled and held records wait for their retry)
            if self._closing:
                return True
            self._wakeup.clear()
            waits = ([write_in] if self._held else []) + ([import_in] if spilled else [])
            if waits:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(waits)):
                        await self._wakeup.wait()
            else:
                await self._wakeup.wait()
            return False
        if self._queue or held:
            await self._write_queued()
        if self._spill_pending() and loop.time() >= max(self._retry_at, self._import_at):
            await self._import_spill()
        return False

    async def _write_queued(self) -> None:
        """One batch of the queue (and the records held in memory) into the database, else to the spill file."""
        if not self._closing and len(self._queue) < self._batch_size:
            # Let a batch gather: one transaction and one thread hop for many records. Also after a
            # write: under load, the records that arrived while it ran would otherwise go as a
            # small batch of their own, paying a transaction and a thread hop for a few records.
            await asyncio.sleep(self._linger_s)
        batch = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
        if asyncio.get_running_loop().time() < self._retry_at:
            await self._spill_batch(batch)  # the database failed lately: to the spill file, tried again later
            return
        batch.extend(self._held)
        self._held = []
        if not batch:
            return
        try:
            await asyncio.shield(asyncio.to_thread(self._write_live, batch))
        except _STORE_FAILED as exc:
            # Never drop: the batch goes to the spill file (counted), imported once the database takes records
            # again (a record the database refuses for itself is moved aside then).
            log.error(
                "usage writer: storing %d record(s) failed (%s); spilling them, the database tried again in %.0f s",
                len(batch),
                exc,
                self._backoff,
            )
            self._retry_at, self._backoff = self._later(self._backoff)
            await self._spill_batch(batch)
            return
        if self._backoff > RETRY_FIRST_S:
            log.warning("usage writer: %s takes records again", self._path)
        self._backoff = RETRY_FIRST_S

    @staticmethod
    def _later(backoff: float) -> tuple[float, float]:
        """When to try again after a failure, and the wait after the next one (doubled, up to `RETRY_MAX_S`)."""
        return asyncio.get_running_loop().time() + backoff, min(RETRY_MAX_S, backoff * 2)

    def _spill_pending(self) -> bool:
        """A spill file to import (not while the queue is full: live records first). Only a file: a directory an
        operator left at the path is no spill (it was renamed as one, and blocked every import after)."""
        if self._spill is None or len(self._queue) >= self._queue_size:
            return False
        return self._spill.is_file() or self._spill.with_suffix(".importing").is_file()

    async def _import_spill(self) -> None:
        """Import the spill file. A failure (the database locked, a full disk) delays the next import by its own
        backoff: live records still go to the database meanwhile (they went to the spill while an import failed)."""
        if self._spill is None:
            return
        claimed = self._spill.with_suffix(".importing")
        # Claim in the event loop's thread: `_spill_one` appends from this thread too, so an append can
        # never land in a file that the import thread has already read (and would then delete).
        try:
            if not claimed.is_file():
                if not self._spill.is_file():
                    return
                self._spill.rename(claimed)
            await asyncio.shield(asyncio.to_thread(self._import_claimed, claimed))
        except _STORE_FAILED as exc:
            log.error(
                "usage writer: importing %s failed (%s); trying again in %.0f s", claimed, exc, self._import_backoff
            )
            self._import_at, self._import_backoff = self._later(self._import_backoff)
        else:
            self._import_backoff = RETRY_FIRST_S

    def _write(self, batch: list[UsageRecord]) -> None:
        if self._file_identity() != self._identity:
            # The file was deleted or replaced under the running gateway (its records went with it): records from
            # now on go to a new file at the configured path, not to an unlinked one nobody can read.
            log.error("usage writer: %s was deleted or replaced while in use; opening it anew", self._path)
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
            self._db = None
            self._db = self._connect()
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
            try:
                self._access_log.write(batch)
            except Exception:  # (stored already: a failing access log must not send the batch to the spill again)
                log.exception("usage writer: the access log failed to take %d record(s)", len(batch))

    def _import_claimed(self, claimed: Path) -> None:
        """Store a claimed spill file's records, a batch at a time (memory: one batch, whatever the file's size), and
        delete it. A line that is no record (torn by a crash or a full disk mid-append), or a record the database
        refuses for itself (a null id, a value it cannot bind: a line added by hand), is moved to
        `<path>.spill.rejected` rather than blocking the others; a failure of the database itself (locked, full)
        raises, and the import resumes later after the last batch stored (`<path>.spill.imported` says where: an
        outside run saw a file imported again from its first line, the rows kept once by INSERT OR REPLACE but the
        batches stored before the failure written to the access log and counted twice)."""
        rejecting = claimed.with_suffix(".rejecting")  # (this file's; appended to `.rejected` once it is done)
        progress = claimed.with_suffix(".imported")
        done, aside_done = _read_progress(progress)
        with claimed.open("rb") as lines, rejecting.open("ab") as aside:
            lines.seek(done)
            aside.truncate(aside_done)  # (lines put aside after the last batch stored are put aside again)
            batch: list[UsageRecord] = []
            while line := lines.readline():
                line = line.rstrip(b"\r\n")
                if not line:
                    continue
                try:
                    batch.append(UsageRecord(**orjson.loads(line)))
                except (orjson.JSONDecodeError, TypeError):
                    aside.write(line + b"\n")
                    continue
                if len(batch) >= self._batch_size:
                    self._write_sorting(batch, aside.write)
                    batch = []
                    aside.flush()
                    _write_progress(progress, lines.tell(), aside.tell())
            self._write_sorting(batch, aside.write)
        put_aside = rejecting.read_bytes()
        if put_aside:
            target = claimed.with_suffix(".rejected")
            _append(target, put_aside)
            log.error(
                "usage writer: %d line(s) of %s are no records; moved to %s", put_aside.count(b"\n"), claimed, target
            )
        rejecting.unlink()
        progress.unlink(missing_ok=True)
        claimed.unlink()

    def _write_live(self, batch: list[UsageRecord]) -> None:
        """Write live records (in the writer's thread); one the database refuses for itself (a token count past its
        integers, a bug) is moved to `<path>.spill.rejected`, not held against the others: it put the whole database
        in backoff, and every record after it in the spill file."""
        refused: list[bytes] = []
        if self._write_sorting(batch, refused.append):
            data = b"".join(refused)
            if self._spill is None:
                log.error("usage writer: the database refused %d record(s): %s", len(refused), data.decode())
                return
            target = self._spill.with_suffix(".rejected")
            _append(target, data)
            log.error("usage writer: the database refused %d record(s); moved to %s", len(refused), target)

    def _write_sorting(self, batch: list[UsageRecord], aside: Callable[[bytes], object]) -> int:
        """Write `batch`; if the database refuses a record of it for itself, write them one by one and put the ones
        it refuses `aside` (as JSON lines). Returns how many were put aside. A failure of the database itself
        (`sqlite3.OperationalError`: locked, full, I/O) raises."""
        if not batch:
            return 0
        try:
            self._write(batch)
            return 0
        except _REFUSED_RECORD:
            pass
        refused = 0
        for record in batch:
            try:
                self._write([record])
            except _REFUSED_RECORD:
                aside(_record_line(record))
                refused += 1
        return refused

    async def wait_flushed(self) -> None:
        """Wait until every record submitted so far is stored, or spilled while the database fails."""
        self._wakeup.set()
        await self._idle.wait()

    async def aclose(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            task, self._task = self._task, None
            try:
                await task
            except Exception:  # (`_run` logs its own failures and lives on: this would be a bug of its own)
                log.exception("usage writer: its task failed; flushing what is left")
        # What is left (records submitted while closing, records held while the database and the spill file both
        # failed): one more try, then the spill file, then the log; never dropped in silence.
        if self._queue or self._held:
            batch = list(self._queue) + self._held
            self._queue.clear()
            self._held = []
            try:
                await asyncio.to_thread(self._write_live, batch)
            except _STORE_FAILED as exc:
                log.error("usage writer: storing %d record(s) at close failed (%s); spilling", len(batch), exc)
                for record in batch:
                    self._spill_one(record)
                held, self._held = self._held, []
                for record in held:
                    self._log_record(record)
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)
        if self._access_log is not None:
            await asyncio.to_thread(self._access_log.close)

    def statistics(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted,
            "written": self.written,
            "pending": len(self._queue) + len(self._held),
            "logged": self.logged,
        }


def _record_line(record: UsageRecord) -> bytes:
    """The record as a JSON line (a spill file's; the log's, for a record nothing else takes). A value orjson cannot
    write (an integer past 64 bits) is written by the standard library's encoder: no record is dropped for it."""
    row = dict(zip(_COLUMNS, _ROW(record), strict=True))
    try:
        return orjson.dumps(row) + b"\n"
    except TypeError:
        return json.dumps(row, separators=(",", ":"), default=repr).encode() + b"\n"


def _read_progress(path: Path) -> tuple[int, int]:
    """How far an earlier import of a spill file got (`RecordWriter._import_claimed`): the bytes of the file stored,
    and of its put-aside lines; (0, 0) if it got nowhere (or the note cannot be read: the file is imported whole)."""
    try:
        done, aside = path.read_text().split()
        return max(0, int(done)), max(0, int(aside))
    except (OSError, ValueError):
        return 0, 0


def _write_progress(path: Path, done: int, aside: int) -> None:
    """Note how far an import got, replacing the note whole (a crash leaves the old one or the new one)."""
    partial = path.with_suffix(".imported-new")
    partial.write_text(f"{done} {aside}\n")
    partial.replace(path)


def _append(path: Path, data: bytes) -> None:
    """Append `data` to `path` whole or not at all: a write the disk cuts short (full) is taken back, so that no
    torn line is left for the import to trip over."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def read_records(path: str) -> list[dict[str, Any]]:
    """All stored records (for tests and the admin API)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM usage ORDER BY started_at")]
