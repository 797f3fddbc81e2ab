"""`lockgate bench inprocess` runs as a user runs it and answers every request (the figures are not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def test_bench_inprocess_answers_every_request_and_reports_what_the_gateway_adds() -> None:
    args = ["--requests", "300", "--warmup", "50", "--concurrency", "8"]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "inprocess", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.fullmatch(
        r"300 requests, 300 answered 200; CPU per request in this process: "
        r"([\d.]+) us through the gateway, ([\d.]+) us straight to the canned engine: the gateway adds (-?[\d.]+) us",
        done.stdout.strip(),
    )
    assert match, done.stdout
    through, direct, added = (float(x) for x in match.groups())
    assert through > 0 and direct > 0 and abs(through - direct - added) < 0.2
    # Progress goes to stderr (plain lines: not a terminal), never into the results on stdout.
    progress = done.stderr.splitlines()
    phase = "lockgate bench inprocess: through the gateway (50 + 300 requests)"
    assert any(line.startswith(phase) for line in progress), done.stderr[-2000:]
    assert progress[-1].startswith("lockgate bench inprocess: finished in"), done.stderr[-2000:]


def test_one_target_alone_for_instruction_counts() -> None:
    for target, says in (
        ("gateway", "through the gateway (client and canned engine included)"),
        ("direct", "straight to the canned engine (client included)"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "lockgate",
                "bench",
                "inprocess",
                "--requests",
                "100",
                "--warmup",
                "10",
                "--concurrency",
                "4",
                "--target",
                target,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith("100 requests, 100 answered 200;") and done.stdout.strip().endswith(says)


def test_streams_over_a_choice_of_instances_are_answered_too() -> None:
    args = ["--requests", "100", "--warmup", "20", "--concurrency", "8", "--target", "gateway"]
    args += ["--stream", "--instances", "2", "--routing", "predicted_ttft"]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "inprocess", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("100 requests, 100 answered 200;"), done.stdout


@pytest.mark.parametrize(
    "shape",
    [
        ["--deterministic"],  # every request leads a de-duplication flight
        ["--no-usage", "--tokens", "40"],  # a longer stream whose chunks pass through unchanged
    ],
)
def test_paced_streams_of_each_shape_are_answered(shape: list[str]) -> None:
    """`--deterministic` makes every request lead a flight; `--tokens` sets a streamed answer's length (two sizes
    give a chunk's cost) and `--no-usage` sends the engine's chunks through unchanged."""
    args = ["--requests", "60", "--warmup", "10", "--concurrency", "8", "--target", "gateway"]
    args += ["--stream", "--paced", *shape]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "inprocess", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("60 requests, 60 answered 200;"), done.stdout
