"""The usage writer never loses a record: a full queue spills (counted), a failed write spills, a crash
mid-import leaves a claimed file that the next start imports."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import orjson
import pytest

from lockgate.metrics import GatewayMetrics
from lockgate.records import RecordWriter, UsageRecord, read_records
from tests.integration.cancel_support import total


def exists(path: str) -> bool:
    return Path(path).exists()


def write_file(path: str, data: bytes) -> None:
    Path(path).write_bytes(data)


def read_file(path: str) -> bytes:
    return Path(path).read_bytes()


def remove(path: str) -> None:
    Path(path).unlink(missing_ok=True)


def make_dir(path: str) -> None:
    Path(path).mkdir()


def is_dir(path: str) -> bool:
    return Path(path).is_dir()


def spill(path: str, rec: UsageRecord) -> None:
    Path(path).write_bytes(orjson.dumps(asdict(rec)) + b"\n")


def lock(writer: RecordWriter, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the writer's database answer "locked" while the returned flag's one item is true."""
    original = writer._write
    locked = [True]

    def write(batch: list[UsageRecord]) -> None:
        if locked[0]:
            raise sqlite3.OperationalError("database is locked")
        original(batch)

    monkeypatch.setattr(writer, "_write", write)
    return locked


def record(n: int) -> UsageRecord:
    return UsageRecord(request_id=f"r{n}", tenant="t", model="m", endpoint="chat", stream=False, started_at=n)


async def test_full_queue_spills_counts_and_everything_lands_once(tmp_path: Path) -> None:
    path = str(tmp_path / "u.sqlite3")
    metrics = GatewayMetrics()
    async with RecordWriter(path, metrics, queue_size=5, batch_size=3) as writer:
        for n in range(40):  # no await in between: the writer cannot drain, the queue overflows
            writer.submit(record(n))
        assert total(metrics.usage_records_spilled, "_total") == 35
        await writer.wait_flushed()
        assert [r["request_id"] for r in read_records(path)] == [f"r{n}" for n in range(40)]
    assert not exists(path + ".spill.jsonl")
    assert len(read_records(path)) == 40


async def test_claimed_spill_left_by_a_crash_is_imported_at_start(tmp_path: Path) -> None:
    path = str(tmp_path / "u.sqlite3")
    spill(path + ".spill.importing", record(1))
    spill(path + ".spill.jsonl", record(2))
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()
    assert {r["request_id"] for r in read_records(path)} == {"r1", "r2"}
    assert not exists(path + ".spill.importing")


async def test_failed_write_spills_the_batch_instead_of_losing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "u.sqlite3")
    metrics = GatewayMetrics()
    async with RecordWriter(path, metrics) as writer:
        original = writer._write
        failures = [sqlite3.OperationalError("disk I/O error")]

        def flaky(batch: list[UsageRecord]) -> None:
            if failures:
                raise failures.pop()
            original(batch)

        monkeypatch.setattr(writer, "_write", flaky)
        for n in range(3):
            writer.submit(record(n))
        await writer.wait_flushed()
        assert total(metrics.usage_records_spilled, "_total") == 3
    # The spilled records wait on disk; the next start imports them.
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()
    assert [r["request_id"] for r in read_records(path)] == ["r0", "r1", "r2"]


async def test_a_spill_file_that_cannot_be_written_keeps_records_in_memory(tmp_path: Path) -> None:
    """Disk full or gone: `submit()` (called from a request's cleanup) never raises and loses nothing."""
    path = str(tmp_path / "u.sqlite3")
    metrics = GatewayMetrics()
    async with RecordWriter(path, metrics, queue_size=5, batch_size=5) as writer:
        writer._spill = tmp_path / "missing-dir" / "u.spill.jsonl"  # every append fails with an OSError
        for n in range(10):
            writer.submit(record(n))
        assert total(metrics.usage_records_spilled, "_total") == 0  # (none reached the file)
        assert next(iter(metrics.usage_records_pending.collect())).samples[0].value == 10  # 5 queued, 5 held
        await writer.wait_flushed()
    assert sorted(r["request_id"] for r in read_records(path)) == sorted(f"r{n}" for n in range(10))


async def test_past_the_memory_bound_and_at_close_records_go_to_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The database and the spill file both refuse (a full disk): records are held in memory up to `queue_size`
    (an outside run saw ~560 bytes a record grow without end, and one error line a record), then logged as JSON
    lines, counted; what is still held at close is logged too, never dropped in silence (the run's clean shutdown
    exited 0 with 31,103 records gone)."""
    path = str(tmp_path / "u.sqlite3")
    metrics = GatewayMetrics()
    async with RecordWriter(path, metrics, queue_size=3, batch_size=3) as writer:
        writer._spill = tmp_path / "missing-dir" / "u.spill.jsonl"

        def refuse(batch: list[UsageRecord]) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(writer, "_write", refuse)
        for n in range(8):
            writer.submit(record(n))  # 3 queued, 3 held, 2 logged
        assert total(metrics.usage_records_logged, "_total") == 2
        await writer.wait_flushed()  # the queued 3 failed: held 3 more would pass the bound, so logged
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("usage record not stored: ")]
    ids = sorted(orjson.loads(m.removeprefix("usage record not stored: "))["request_id"] for m in logged)
    assert ids == sorted(f"r{n}" for n in range(8))  # every record, once
    assert total(metrics.usage_records_logged, "_total") == 8
    cannot_append = [r for r in caplog.records if "cannot append" in r.getMessage()]
    assert len(cannot_append) == 1  # said once, not once a record


async def test_records_arriving_during_a_write_wait_for_a_batch_to_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load, records keep arriving while a batch is being written. They must gather for the
    linger before the next write, not go at once as a small batch of their own (a transaction and a
    thread hop for a handful of records: this cost ~10 us per request in `bench overhead`)."""
    import asyncio
    import threading

    events: list[str] = []
    real_sleep = asyncio.sleep

    async def linger(seconds: float) -> None:
        events.append("linger")
        await real_sleep(0)

    monkeypatch.setattr("lockgate.records.asyncio.sleep", linger)
    writing, release = threading.Event(), threading.Event()
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics(), batch_size=100) as writer:
        original = writer._write

        def write(batch: list[UsageRecord]) -> None:
            events.append(f"write {len(batch)}")
            if len(events) == 2:  # the first write: hold it until a record arrived meanwhile
                writing.set()
                release.wait(10)
            original(batch)

        monkeypatch.setattr(writer, "_write", write)
        writer.submit(record(1))
        assert await asyncio.to_thread(writing.wait, 10), events
        writer.submit(record(2))
        release.set()
        await writer.wait_flushed()
    assert events == ["linger", "write 1", "linger", "write 1"]
    assert [r["request_id"] for r in read_records(path)] == ["r1", "r2"]


async def test_batches_larger_than_one_statement_land_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics(), batch_size=1200, queue_size=5000) as writer:
        for n in range(1200):
            writer.submit(record(n))
        await writer.wait_flushed()
    assert len(read_records(path)) == 1200


async def test_a_failed_write_is_rolled_back_and_the_next_one_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lockgate.records as records_module

    monkeypatch.setattr(records_module, "_ROWS_PER_STATEMENT", 1)
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        bad = record(2)
        bad.error = {"not": "bindable"}  # type: ignore[assignment]
        with pytest.raises(sqlite3.Error):
            writer._write([record(1), bad])  # the first statement succeeded, the second failed
        writer._write([record(3)])  # no transaction left open
    assert [r["request_id"] for r in read_records(path)] == ["r3"]


@pytest.mark.parametrize("rows", [1, 2, 3, 255, 256, 257, 700, 1200])
def test_batches_use_few_distinct_statements(rows: int) -> None:
    """Each batch is cut into power-of-two statements (parsed once, then cached), never more than
    `_ROWS_PER_STATEMENT` rows each, covering every row."""
    from lockgate.records import _ROWS_PER_STATEMENT, _statement_sizes

    sizes = list(_statement_sizes(rows))
    assert sum(sizes) == rows
    assert all(size & (size - 1) == 0 and size <= _ROWS_PER_STATEMENT for size in sizes)
    assert sizes == sorted(sizes, reverse=True)


async def test_values_are_stored_with_their_sql_types(tmp_path: Path) -> None:
    """Booleans are integers 0/1, absent values NULL, times REAL: what sqlite3 binds by itself (the writer
    registers adapters for None and bool only to spare sqlite3 its failed adapter lookups)."""
    path = str(tmp_path / "u.sqlite3")
    rec = UsageRecord(request_id="r1", tenant="t", model="m", endpoint="chat", stream=True, started_at=1.5)
    rec.attempts, rec.prompt_tokens = 1, 12
    async with RecordWriter(path, GatewayMetrics()) as writer:
        writer.submit(rec)
        writer.submit(record(2))
        await writer.wait_flushed()
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT request_id, stream, typeof(stream), instance, typeof(instance), started_at, typeof(started_at),"
            " prompt_tokens FROM usage ORDER BY request_id"
        ).fetchall()
    assert rows == [
        ("r1", 1, "integer", None, "null", 1.5, "real", 12),
        ("r2", 0, "integer", None, "null", 2.0, "real", 0),
    ]


async def test_a_torn_spill_line_is_moved_aside_and_the_rest_imported(tmp_path: Path) -> None:
    """A spill file whose last line a crash or a full disk cut short: the other records are imported (each start
    failed on the whole file before, forever), the torn line kept in `.spill.rejected` for a person to read."""
    path = str(tmp_path / "u.sqlite3")
    good = [orjson.dumps(asdict(record(n))) for n in range(3)]
    write_file(path + ".spill.importing", b"\n".join(good) + b"\n" + good[0][:17])
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()
    assert sorted(r["request_id"] for r in read_records(path)) == ["r0", "r1", "r2"]
    assert read_file(path + ".spill.rejected") == good[0][:17] + b"\n"
    assert not exists(path + ".spill.importing")


def test_an_append_the_disk_cuts_short_is_taken_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk takes part of a line: the file is cut back to where it was (no torn line is left)."""
    import os

    from lockgate import records as records_module

    target = tmp_path / "u.spill.jsonl"
    records_module._append(target, b"first\n")
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:4]))
    with pytest.raises(OSError):
        records_module._append(target, b"second line\n")
    assert target.read_bytes() == b"first\n"


async def test_a_database_that_fails_for_a_while_takes_the_spilled_records_once_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locked by another process, then free again: the records spilled meanwhile are imported by the running
    gateway after a backoff (one failure stopped every import until a restart)."""
    import lockgate.records as records_module

    monkeypatch.setattr(records_module, "RETRY_FIRST_S", 3600.0)  # (the test ends the backoff itself)
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        locked = lock(writer, monkeypatch)
        for n in range(3):
            writer.submit(record(n))
        await writer.wait_flushed()  # spilled: the database failed
        assert exists(path + ".spill.jsonl") and read_records(path) == []
        locked[0] = False
        writer._retry_at = writer._import_at = 0.0  # the backoff is over (what its timer does)
        writer.submit(record(3))
        await writer.wait_flushed()  # stored, and the spill imported: nothing left to do
    assert sorted(r["request_id"] for r in read_records(path)) == ["r0", "r1", "r2", "r3"]
    assert not exists(path + ".spill.jsonl")


async def test_a_database_file_deleted_while_in_use_is_opened_anew(tmp_path: Path) -> None:
    """Records written after the file was deleted went to the unlinked file, lost with no word; now they land in a
    new file at the configured path."""
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        writer.submit(record(1))
        await writer.wait_flushed()
        for suffix in ("", "-wal", "-shm"):
            remove(path + suffix)
        writer.submit(record(2))
        await writer.wait_flushed()
    assert [r["request_id"] for r in read_records(path)] == ["r2"]


async def test_a_record_the_database_refuses_is_moved_aside_and_the_others_land(tmp_path: Path) -> None:
    """A spill line that parses but that the database refuses (a null id: a line added by hand) blocked the whole
    file's import on every retry, and live records went to the spill meanwhile; the torn line beside it was copied
    to `.rejected` once per retry (14 copies, an outside run). Now both are moved aside once, the rest imported."""
    path = str(tmp_path / "u.sqlite3")
    good = orjson.dumps(asdict(record(1)))
    null_id = orjson.dumps({**asdict(record(2)), "request_id": None})
    write_file(path + ".spill.jsonl", good + b"\n" + good[:20] + b"\n" + null_id + b"\n")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()
        writer.submit(record(3))
        await writer.wait_flushed()
        assert not exists(path + ".spill.jsonl")  # the live record went to the database
    assert sorted(r["request_id"] for r in read_records(path)) == ["r1", "r3"]
    rejected = read_file(path + ".spill.rejected").splitlines()
    assert len(rejected) == 2 and rejected[0] == good[:20]
    assert orjson.loads(rejected[1])["request_id"] is None
    assert not exists(path + ".spill.importing") and not exists(path + ".spill.rejecting")


def test_a_spill_file_is_imported_a_batch_at_a_time(tmp_path: Path) -> None:
    """An hour of spill (1.8 GB at 1,000 req/s) was read whole at import: ~3x its size in memory (an outside run's
    145 MB file took the gateway to 490 MB). Now a batch at a time: the memory it takes is a batch's."""
    import tracemalloc

    path = str(tmp_path / "u.sqlite3")
    claimed = Path(path + ".spill.importing")
    claimed.write_bytes(b"".join(orjson.dumps(asdict(record(n))) + b"\n" for n in range(20_000)))
    size = claimed.stat().st_size
    writer = RecordWriter(path, GatewayMetrics(), batch_size=256)
    writer._open()
    try:
        tracemalloc.start()
        try:
            writer._import_claimed(claimed)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        assert writer._db is not None
        writer._db.close()
    assert len(read_records(path)) == 20_000 and not claimed.exists()
    assert peak < size / 4, (peak, size)  # (read whole: more than twice the file)


def test_an_import_that_fails_midway_resumes_after_the_last_batch_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside run: a spill import failing at a later batch (the database locked again) was imported again from
    the file's first line: INSERT OR REPLACE kept the rows once, but every batch stored before the failure was
    written to the access log and counted in `lockgate_usage_records_written_total` twice (512 requests billed twice
    from the access log). The import resumes after the last batch stored; lines put aside before it stay aside
    once."""
    path = str(tmp_path / "u.sqlite3")
    claimed = Path(path + ".spill.importing")
    lines = [orjson.dumps(asdict(record(n))) for n in range(10)]
    lines.insert(1, lines[0][:17])  # a torn line in the first batch
    claimed.write_bytes(b"".join(line + b"\n" for line in lines))
    writer = RecordWriter(path, GatewayMetrics(), batch_size=3)
    writer._open()
    stored: list[str] = []
    original = writer._write
    calls = [0]

    def write(batch: list[UsageRecord]) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise sqlite3.OperationalError("database is locked")
        original(batch)
        stored.extend(r.request_id for r in batch)

    monkeypatch.setattr(writer, "_write", write)
    try:
        with pytest.raises(sqlite3.OperationalError):
            writer._import_claimed(claimed)  # two batches stored, the third refused
        assert stored == ["r0", "r1", "r2", "r3", "r4", "r5"] and claimed.exists()
        writer._import_claimed(claimed)  # later: resumes at the third batch
    finally:
        assert writer._db is not None
        writer._db.close()
    assert stored == [f"r{n}" for n in range(10)]  # each once: what the access log and the counter see
    assert writer.written == 10 and len(read_records(path)) == 10
    assert read_file(path + ".spill.rejected") == lines[1] + b"\n"
    assert not claimed.exists() and not exists(path + ".spill.imported") and not exists(path + ".spill.rejecting")


async def test_a_directory_at_the_spill_path_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's directory at the spill path was renamed as a claimed spill and blocked every import after;
    now it is no spill file: the records it could not take are held, then stored once the database works."""
    import lockgate.records as records_module

    monkeypatch.setattr(records_module, "RETRY_FIRST_S", 3600.0)  # (the test ends the backoff itself)
    path = str(tmp_path / "u.sqlite3")
    make_dir(path + ".spill.jsonl")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        locked = lock(writer, monkeypatch)
        writer.submit(record(1))
        await writer.wait_flushed()  # held: neither the database nor the spill (a directory) took it
        locked[0] = False
        writer._retry_at = 0.0  # the backoff is over (what its timer does)
        writer.submit(record(2))
        await writer.wait_flushed()  # both stored: the held one with the new one
    assert is_dir(path + ".spill.jsonl") and not exists(path + ".spill.importing")


async def test_a_failed_import_does_not_keep_live_records_from_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import that fails waits for its own retry; records arriving meanwhile still go to the database (they went
    to the spill file for as long as the import kept failing: 2,098 of 2,180, an outside run)."""
    path = str(tmp_path / "u.sqlite3")
    write_file(path + ".spill.jsonl", orjson.dumps(asdict(record(1))) + b"\n")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()
    write_file(path + ".spill.jsonl", orjson.dumps(asdict(record(2))) + b"\n")

    def fail(self: RecordWriter, claimed: Path) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(RecordWriter, "_import_claimed", fail)
    async with RecordWriter(path, GatewayMetrics()) as writer:
        await writer.wait_flushed()  # the import failed: tried again later
        writer.submit(record(3))
        await writer.wait_flushed()
        assert sorted(r["request_id"] for r in read_records(path)) == ["r1", "r3"]
    assert exists(path + ".spill.importing")  # (r2 waits for the next start, or the import's retry)


async def test_a_failing_access_log_does_not_send_stored_records_to_the_spill(tmp_path: Path) -> None:
    """The access log failing after the commit counted as the database's failure: the stored batch went to the
    spill file and was stored (and logged) again, and a healthy database went into backoff (a second review)."""

    class Broken:
        def open(self) -> None:
            pass

        def write(self, records: Iterable[UsageRecord]) -> None:
            raise RuntimeError("the access log's disk is gone")

        def close(self) -> None:
            pass

    path = str(tmp_path / "u.sqlite3")
    metrics = GatewayMetrics()
    async with RecordWriter(path, metrics, access_log=Broken()) as writer:
        for n in range(3):
            writer.submit(record(n))
        await writer.wait_flushed()
        assert writer.written == 3 and not exists(path + ".spill.jsonl")
        assert total(metrics.usage_records_spilled, "_total") == 0


async def test_a_record_the_database_refuses_live_is_moved_aside_without_a_backoff(tmp_path: Path) -> None:
    """A token count past SQLite's integers (an engine's 2**64) put the whole database in backoff, and every record
    after it in the spill file: now that record alone is moved aside, the others stored at once."""
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        bad = record(2)
        bad.prompt_tokens = 2**64
        for rec in (record(1), bad, record(3)):
            writer.submit(rec)
        await writer.wait_flushed()
        writer.submit(record(4))
        await writer.wait_flushed()
        assert sorted(r["request_id"] for r in read_records(path)) == ["r1", "r3", "r4"]
    assert orjson.loads(read_file(path + ".spill.rejected"))["prompt_tokens"] == 2**64
    assert not exists(path + ".spill.jsonl")


async def test_the_writer_lives_on_after_a_bug_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the writer did not foresee ended its task: later records stayed queued, `wait_flushed` hung and
    `aclose` raised with records unstored. Now it logs, pauses and goes on; `aclose` stores what is left."""
    import lockgate.records as records_module

    monkeypatch.setattr(records_module, "RETRY_FIRST_S", 0.01)
    path = str(tmp_path / "u.sqlite3")
    async with RecordWriter(path, GatewayMetrics()) as writer:
        real = writer._spill_pending
        bugs = [RuntimeError("a bug")]

        def pending() -> bool:
            if bugs:
                raise bugs.pop()
            return real()

        monkeypatch.setattr(writer, "_spill_pending", pending)
        writer.submit(record(1))
        await writer.wait_flushed()  # (idle only once the pass after the error stored it)
        assert [r["request_id"] for r in read_records(path)] == ["r1"]
        writer.submit(record(2))
    assert sorted(r["request_id"] for r in read_records(path)) == ["r1", "r2"]
