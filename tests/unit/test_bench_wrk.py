"""The wrk driver's pure parts: the request body around its counter, the Lua script, the summary line; and the
`--compare` peer specification."""

from __future__ import annotations

import orjson
import pytest

from lockgate.bench.peer import Peer
from lockgate.bench.wrk import body_template, parse, script, wrk_seconds


def test_body_template_makes_each_request_a_distinct_deterministic_completion() -> None:
    head, tail = body_template("m", 7, stream=True)
    body = orjson.loads(head + "42" + tail)
    assert body["messages"][0]["content"].endswith("#42")
    assert body["temperature"] == 0 and body["stream"] is True and body["max_tokens"] == 7
    assert "stream" not in orjson.loads("".join(body_template("m", 7, stream=False)))


def test_script_posts_to_the_path_and_prints_one_summary_line() -> None:
    lua = script("/v1/chat/completions", '{"a":"', '"}')
    assert 'wrk.format(nil, "/v1/chat/completions", nil, head .. n .. tail)' in lua
    assert "LOCKGATE-WRK" in lua


def test_parse_reads_the_summary_line_among_wrk_output() -> None:
    result = parse("Running 1s test\nLOCKGATE-WRK 1000 2000000 3 1500 9000\nRequests/sec: 500\n")
    assert (result.requests, result.errors, result.seconds) == (1000, 3, 2.0)
    assert (result.p50_s, result.p99_s, result.rps) == (0.0015, 0.009, 500.0)
    with pytest.raises(RuntimeError, match="no summary"):
        parse("unable to connect\n")


def test_peer_is_a_url_or_a_command_with_a_port_placeholder() -> None:
    assert Peer("http://127.0.0.1:9000/").is_url
    assert Peer("/opt/bin/vllm-router --worker-urls {engine} --port {port}").name == "vllm-router"
    with pytest.raises(ValueError, match="port"):
        Peer("vllm-router --worker-urls {engine}")


def test_wrk_runs_whole_seconds_and_the_header_says_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """wrk's `-d` takes whole seconds: the header said 0.3 s while wrk ran 1 s."""
    from lockgate.bench import overhead

    assert (wrk_seconds(0.3), wrk_seconds(2.6), wrk_seconds(5)) == (1, 3, 5)
    monkeypatch.setattr(overhead, "wrk_path", lambda: "/usr/bin/wrk")
    lines = overhead.header(overhead.Settings(generator="wrk", duration_s=0.3))
    assert any("wrk (/usr/bin/wrk), 1 s per target and round" in line for line in lines)


def test_overhead_duration_is_whole_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    from lockgate.cli import build_parser

    assert build_parser().parse_args(["bench", "overhead", "--duration", "2"]).duration == 2
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "overhead", "--duration", "1.5"])
    assert exit_.value.code == 2
    assert "argument --duration:" in capsys.readouterr().err
