"""Access-log lines from usage records: their fields, sampling, prompts only on request."""

from __future__ import annotations

import random

import orjson
import pytest

from lockgate.observe.access_log import AccessLog, entry
from lockgate.observe.config import AccessLogConfig
from lockgate.records import UsageRecord


def record(n: int = 1, **extra: object) -> UsageRecord:
    r = UsageRecord(request_id=f"lg-{n}", tenant="acme", model="m", endpoint="chat", stream=True, **extra)  # type: ignore[arg-type]
    r.started_at, r.first_token_at, r.finished_at = 100.0, 100.25, 101.5
    return r


def test_an_entry_has_the_requests_facts_and_no_prompt_unless_asked() -> None:
    r = record(instance="eng-a", priority="P0", prompt_tokens=12, completion_tokens=3, served_by="miss")
    r.log_prompt = [{"role": "user", "content": "secret plans"}]
    line = entry(r)
    assert line["request_id"] == "lg-1" and line["tenant"] == "acme" and line["instance"] == "eng-a"
    assert (line["status"], line["cancel_reason"], line["cache"]) == ("completed", None, "miss")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (12, 3)
    assert (line["ttft_ms"], line["duration_ms"]) == (250.0, 1500.0)
    assert "prompt" not in line
    assert entry(r, include_prompts=True)["prompt"] == [{"role": "user", "content": "secret plans"}]


def test_lines_go_to_stdout_and_are_sampled(capsys: pytest.CaptureFixture[str]) -> None:
    AccessLog(AccessLogConfig(enabled=True)).write([record(1), record(2)])
    lines = capsys.readouterr().out.splitlines()
    assert [orjson.loads(x)["request_id"] for x in lines] == ["lg-1", "lg-2"]

    none = AccessLog(AccessLogConfig(enabled=True, sample=0.0))
    none.write([record(n) for n in range(100)])
    assert none.lines == 0 and capsys.readouterr().out == ""

    half = AccessLog(AccessLogConfig(enabled=True, sample=0.5), rng=random.Random(7))
    half.write([record(n) for n in range(1000)])
    assert 400 < half.lines < 600
    assert len(capsys.readouterr().out.splitlines()) == half.lines


def test_a_file_is_appended_to(tmp_path) -> None:
    path = tmp_path / "access.log"
    path.write_text('{"earlier": true}\n')
    log = AccessLog(AccessLogConfig(enabled=True, path=str(path)))
    log.open()
    log.write([record(1)])
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and orjson.loads(lines[1])["request_id"] == "lg-1"
