"""`lockgate bench hol` and `lockgate bench capacity`, shrunk: they run end to end and print their figures
(the figures themselves are not asserted: performance is measured, never asserted)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from lockgate.bench import capacity, hol


async def test_hol_measures_short_requests_alone_and_behind_long_ones() -> None:
    settings = hol.Settings(duration_s=0.8, short_rate=15.0, long_words=400, prefill_tps=20000.0)
    phases = await hol.run(settings)
    assert [p.name for p in phases] == ["short alone", "short + long", "turns on"]
    assert all(p.errors == 0 for p in phases)
    alone, mixed, turns = phases
    assert alone.ttfts("short") and not alone.ttfts("long")
    for phase in (mixed, turns):
        assert len(phase.ttfts("short")) == len(alone.ttfts("short")) and phase.ttfts("long")
    assert all(len(p.limits) == settings.sims for p in phases)
    text = hol.report(phases, settings)
    assert re.search(r"short TTFT with long requests vs alone: p50 \d+\.\d\dx, p99 \d+\.\d\dx", text)
    assert re.search(r"turns \(routing.long_prefill_ms: 100\): p50 \d+\.\d\dx, p99 \d+\.\d\dx", text)
    assert re.search(r"long TTFT with turns vs without: p50 \d+\.\d\dx, p99 \d+\.\d\dx", text)


def test_capacity_large_mode_prints_both_targets() -> None:
    args = ["--modes", "large", "--large-seqs", "16", "--streams", "16", "--requests", "48", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "capacity", *args, "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"^direct\s+\d+", out, re.M) and re.search(r"^gateway\s+\d+", out, re.M)
    assert re.search(r"^(PASS|MISS)  chunks/s \d+\.\d\dx direct", out, re.M)
    assert re.search(r"^(PASS|MISS)  first-chunk p99 [+-]\d+\.\d ms vs direct", out, re.M)


def test_capacity_report_says_where_the_small_engines_limit_settled() -> None:
    settings = capacity.Settings(small_seqs=8, settle_s=4.0)
    small = capacity.Small(limits=[(0.2, 256), (0.5, 256), (1.0, 8), (2.0, 8), (2.5, 9), (3.0, 8), (3.9, 8)])
    text = capacity.report(None, small, settings)
    assert "settled at 8 (second half: min 8, max 9)" in text
    assert text.endswith("PASS  the limit settles at about 8")


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def test_a_bench_stopped_by_sigterm_stops_the_engine_and_gateway_it_started() -> None:
    """A CI job's timeout or a `kill` sends SIGTERM: the bench stops like Ctrl-C stops it (exit 143), and the
    simulator and gateway it started as child processes are stopped with it, not left running."""
    args = ["--modes", "large", "--large-seqs", "16", "--streams", "16", "--requests", "100000", "--rounds", "1"]
    command = [sys.executable, "-m", "lockgate", "bench", "capacity", *args]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as bench:
        try:
            assert bench.stderr is not None
            for line in bench.stderr:  # the progress line of the first measurement: both children are up
                if b"round 1/1" in line:
                    break
            children = _children(bench.pid)
            assert len(children) == 2  # the simulated engine and the gateway
            bench.send_signal(signal.SIGTERM)
            assert bench.wait(timeout=30) == 143
            assert not [pid for pid in children if _alive(pid)]
        finally:
            if bench.poll() is None:
                bench.kill()


def _alive(pid: int) -> bool:
    """Not gone, nor a zombie waiting to be reaped by a parent that has left."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
