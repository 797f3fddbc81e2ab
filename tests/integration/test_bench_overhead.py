"""`lockgate bench overhead` runs end to end as a user runs it: engine and gateway as child processes, a peer
router started per round by `--compare` (here a second simulator standing in for one), wrk as the load
generator when it is installed, every request answered, the machine/interpreter/build lines, every target's
row and the verdicts printed (the figures themselves are not asserted)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys


def test_bench_overhead_measures_direct_gateway_and_a_peer_in_the_same_rounds() -> None:
    generator = "wrk" if shutil.which("wrk") else "builtin"
    peer = f"{sys.executable} -m lockgate sim --fast --port {{port}} --model bench-model"
    args = ["--generator", generator, "--duration", "1", "--requests", "300", "--rounds", "1"]
    args += ["--concurrency", "16", "--stream-concurrency", "16", "--chunks", "4", "--compare", peer]
    done = subprocess.run(
        [sys.executable, "-m", "lockgate", "bench", "overhead", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"interpreter: CPython {sys.version_info.major}.{sys.version_info.minor}")
    assert re.match(r"machine: \d+ cores, ", lines[1])
    assert lines[2] in ("build: pure Python",) or lines[2].startswith("build: compiled (mypyc)")
    assert lines[3].startswith(f"load generator: {'wrk' if generator == 'wrk' else 'built-in'}")
    rows = {
        (m[1], m[2]): m
        for m in (re.match(r"(nonstream|stream)\s+16 (direct|gateway|python\S*)\s+(\d+)\s", x) for x in lines)
        if m
    }
    targets = {"direct", "gateway", next(t for _, t in rows if t.startswith("python"))}
    assert set(rows) == {(mode, target) for mode in ("nonstream", "stream") for target in targets}
    assert all(int(m[3]) > 0 for m in rows.values())  # requests per second
    gateway = next(x for x in lines if re.match(r"stream\s+16 gateway", x))
    assert re.search(r"\s\d+\s+\d+\.\d\s+\d+\.\d\dx  \d+\.\d\d$", gateway)  # us/req, us/chunk, ratio, the round's
    assert re.match(r"target \(stream, concurrency 16\): <= 40 us gateway CPU per chunk: .*: (met|NOT met)$", lines[-1])
