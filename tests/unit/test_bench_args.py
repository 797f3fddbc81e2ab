"""`lockgate bench` options checked where they are parsed: a count, duration or rate that measures nothing (or never
ends) is argparse's usage error naming the option, not a hang, a traceback or a PASS over no requests."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from lockgate.argtypes import non_negative_float, non_negative_int, positive_float, positive_int, share
from lockgate.cli import build_parser

# Each of these was accepted before: a hang (inprocess --concurrency 0, overload --levels -1), a ZeroDivisionError
# (inprocess --requests 0, overload --levels 0 / --duration 0), or nonsense figures with exit 0.
BAD = [
    ("inprocess", "--concurrency", "0"),
    ("inprocess", "--requests", "0"),
    ("inprocess", "--requests", "-3"),
    ("overload", "--levels", "-1"),
    ("overload", "--levels", "0"),
    ("overload", "--duration", "0"),
    ("overhead", "--requests", "-5"),
    ("overhead", "--requests", "0"),
    ("overhead", "--rounds", "0"),
    ("overhead", "--duration", "-1"),
    ("hol", "--duration", "0"),
    ("hol", "--duration", "-1"),
    ("cancel", "--trials", "0"),
    ("cancel", "--trials", "-1"),
    ("chaos", "--concurrency", "0"),
    ("chaos", "--duration", "0"),
    ("chaos", "--requests", "0"),
    ("chaos", "--reset", "1.5"),
    ("capacity", "--rounds", "0"),
    ("priority", "--duration", "nan"),
    ("routing", "--rate", "inf"),
    ("soak", "--interval", "0"),
    ("dedup", "--burst", "x"),
]


@pytest.mark.parametrize(("bench", "option", "value"), BAD)
def test_a_meaningless_number_is_a_usage_error(
    bench: str, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", bench, option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "bench",
    ["overhead", "inprocess", "routing", "priority", "hol", "capacity", "dedup", "cancel", "chaos", "overload", "soak"],
)
def test_the_defaults_parse(bench: str) -> None:
    args = build_parser().parse_args(["bench", bench])
    assert args.bench == bench


def test_priority_p1_factor_zero_is_allowed() -> None:
    """0 leaves the P1 + P2 phase out: a meaningful choice, unlike a zero P2 flood."""
    assert build_parser().parse_args(["bench", "priority", "--p1-factor", "0"]).p1_factor == 0


def test_the_validators() -> None:
    assert positive_int("3") == 3
    assert non_negative_int("0") == 0
    assert positive_float("0.5") == 0.5
    assert non_negative_float("0") == 0.0
    assert share("1") == 1.0
    for check, text in [
        (positive_int, "0"),
        (positive_int, "1.5"),
        (non_negative_int, "-1"),
        (positive_float, "0"),
        (positive_float, "-inf"),
        (non_negative_float, "-0.1"),
        (non_negative_float, "nan"),
        (share, "-0.1"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError):
            check(text)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no-such-router-xyz --port {port}", "no such program: 'no-such-router-xyz'"),
        ("/usr/bin/env --port 1", "{port} placeholder"),
    ],
)
def test_a_compare_command_that_cannot_run_is_a_usage_error_naming_it(
    spec: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "overhead", "--compare", spec])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compare:" in err and says in err


def test_a_compare_url_or_existing_program_is_accepted() -> None:
    specs = ["http://127.0.0.1:9000", "env --port {port}"]
    args = build_parser().parse_args(["bench", "overhead", *(x for s in specs for x in ("--compare", s))])
    assert args.compare == specs


def test_the_priority_bench_runs_the_default_routing_unless_told(tmp_path: Any) -> None:
    """An outside run: `bench priority`, the issue's measure "with the default config", routed with `least_load`
    (the default is `predicted_ttft`) without saying so; its report now names the routing and the bench's own
    `max_queue`."""
    from lockgate.bench import priority
    from lockgate.config import ModelConfig, load_config

    path = tmp_path / "c.yaml"
    priority._config(path, priority.Settings(), 8080, [8001, 8002], str(tmp_path))
    default = ModelConfig(name="m", instances=[{"url": "http://127.0.0.1:1"}]).routing.policy  # type: ignore[list-item]
    assert load_config(path).models[0].routing.policy == default == "predicted_ttft"
    priority._config(path, priority.Settings(routing="least_load"), 8080, [8001], str(tmp_path))
    assert load_config(path).models[0].routing.policy == "least_load"
    assert build_parser().parse_args(["bench", "priority", "--routing", "cache_aware"]).routing == "cache_aware"
