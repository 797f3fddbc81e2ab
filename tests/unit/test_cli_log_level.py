"""The logging level of a command: a bench's gateways do not print the failures the bench injects on purpose."""

from lockgate.cli import build_parser, log_level


def test_bench_logs_errors_only_unless_told_otherwise():
    parser = build_parser()
    bench = parser.parse_args(["bench", "routing"])
    assert log_level(bench.command, bench.log_level) == "ERROR"
    serve = parser.parse_args(["serve"])
    assert log_level(serve.command, serve.log_level) == "WARNING"
    told = parser.parse_args(["--log-level", "info", "bench", "routing"])
    assert log_level(told.command, told.log_level) == "INFO"


def test_the_level_may_follow_the_command():
    parser = build_parser()
    after = parser.parse_args(["serve", "--log-level", "debug"])
    assert log_level(after.command, after.log_level) == "DEBUG"
    before = parser.parse_args(["--log-level", "info", "check-config", "x.yaml"])
    assert log_level(before.command, before.log_level) == "INFO"  # not reset by the command's own default
