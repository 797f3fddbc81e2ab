"""`lockgate bench soak` and `lockgate bench overload`, run for a few seconds as a user runs them (child
processes, real sockets): the soak reports one sample per interval and its verdict, and passes (no leak, no
unexpected answer); the overload sweep refuses beyond capacity, fails nothing, and writes an SVG curve. Speed
is not asserted."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from lockgate.bench.soak import MAX_EXAMPLES, Settings, SoakResult, Tally, report


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", *args], capture_output=True, text=True, timeout=60
    )


def test_a_short_soak_samples_every_interval_and_passes() -> None:
    done = _bench("soak", "--duration", "4", "--interval", "1", "--warmup", "1", "--concurrency", "4")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    samples = [x for x in done.stdout.splitlines() if x.startswith("t=")]
    assert len(samples) == 4
    assert all(re.match(r"t=\s*\d+\.\ds  rss=\s*\d+\.\d MB  fds=\s*\d+  requests=\d+$", x) for x in samples)
    assert re.search(r"unexpected answers: 0\n", done.stdout)
    assert re.search(r"^PASS  growth after warm-up: [+-]\d+\.\d MB RSS, [+-]\d+ fds", done.stdout, re.M)


def test_overload_refuses_beyond_capacity_and_draws_the_curve(tmp_path: Path) -> None:
    svg = tmp_path / "curve.svg"
    args = ["--levels", "0.5", "2", "--duration", "1", "--slots", "2", "--tpot-ms", "5", "--max-tokens", "4"]
    done = _bench("overload", *args, "--svg", str(svg))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    rows = {
        m[1]: m
        for m in (
            re.match(r"\s*([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s", x) for x in done.stdout.splitlines()
        )
        if m
    }
    assert set(rows) == {"0.5", "2"}
    assert float(rows["2"][4]) > 0  # refused per second at twice the capacity
    assert all(m[5] == "0" for m in rows.values())  # nothing failed
    assert re.search(r"^at 2x capacity: lockgate's added p99 .* ms", done.stdout, re.M)
    root = ET.fromstring(svg.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) >= 3


def test_the_soak_report_quotes_its_first_unexpected_answers() -> None:
    tally = Tally()
    tally.add(200, True, b"fine")
    for n in range(MAX_EXAMPLES + 3):
        tally.add(503, False, b'{"error": {"message": "no instance %d"}}' % n)
    result = SoakResult(Settings(duration_s=10, interval_s=1), samples=[], tally=tally)
    text = report(result)
    assert f"unexpected answers: {MAX_EXAMPLES + 3}" in text
    quoted = [line for line in text.splitlines() if line.startswith("  unexpected 503: ")]
    assert len(quoted) == MAX_EXAMPLES and "no instance 0" in quoted[0]
