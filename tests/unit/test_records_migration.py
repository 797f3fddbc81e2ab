"""A usage-record file written before a column existed still takes new records (columns are added)."""

from __future__ import annotations

import sqlite3
from typing import Any

from lockgate.metrics import GatewayMetrics
from lockgate.records import RecordWriter, UsageRecord, read_records


async def test_old_usage_file_gains_the_new_columns(tmp_path: Any) -> None:
    path = str(tmp_path / "old.sqlite3")
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE usage (request_id TEXT PRIMARY KEY, tenant TEXT, model TEXT, endpoint TEXT, stream INTEGER)"
    )
    db.execute("INSERT INTO usage VALUES ('old', 't', 'm', 'chat', 0)")
    db.commit()
    db.close()
    async with RecordWriter(path, GatewayMetrics()) as writer:
        record = UsageRecord(request_id="new", tenant="t", model="m", endpoint="chat", stream=True, started_at=1.0)
        record.preemptions = 2
        writer.submit(record)
        await writer.wait_flushed()
    rows = {r["request_id"]: r for r in read_records(path)}
    assert rows["new"]["preemptions"] == 2 and rows["new"]["restarts"] == 0
    assert rows["old"]["preemptions"] == 0 and rows["old"]["served_by"] == "upstream"
