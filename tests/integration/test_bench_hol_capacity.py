"""`lockgate bench hol` and `lockgate bench capacity`, shrunk: they run end to end and print their figures
(the figures themselves are not asserted: performance is measured, never asserted)."""

from __future__ import annotations

import re
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
