"""`lockgate bench overhead` runs end to end as a user runs it: engine and gateway as child processes, every
request answered, both targets and the verdict printed (the figures themselves are not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_overhead_prints_direct_and_gateway_figures_and_the_verdict() -> None:
    args = ["--concurrency", "64", "--requests", "300", "--rounds", "2", "--modes", "nonstream", "stream"]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "overhead", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"interpreter: CPython {sys.version_info.major}.{sys.version_info.minor}")
    rows = {
        (m[1], m[2]): m
        for m in (re.match(r"(nonstream|stream)\s+64 (direct|gateway)\s+(\d+)\s", x) for x in lines)
        if m
    }
    assert set(rows) == {(mode, target) for mode in ("nonstream", "stream") for target in ("direct", "gateway")}
    assert all(int(m[3]) > 0 for m in rows.values())  # requests per second
    gateway = next(x for x in lines if re.match(r"nonstream\s+64 gateway", x))
    assert re.search(r"\d+\.\d\dx  \d\.\d\d \d\.\d\d$", gateway)  # the ratio, then each round's
    assert re.match(r"target \(nonstream, concurrency 64\): .*: (met|NOT met)$", lines[-1])
