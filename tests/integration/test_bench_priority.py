"""`lockgate bench priority`, shrunk: it runs its three phases end to end (P0 from a process of its own)
and `--trace` explains the slowest P0 requests (figures are measured, never asserted)."""

from __future__ import annotations

import re

from lockgate.bench import priority


async def test_priority_runs_its_phases_and_explains_the_slowest_p0() -> None:
    settings = priority.Settings(duration_s=0.6, max_tokens=8, p0_rate=10.0, p1_factor=0, trace=True, drain_s=0.3)
    phases, info = await priority.run(settings)
    assert [p.name for p in phases] == ["P0 only", "P0 + P2 flood"]  # no P1: the mixed flood is skipped
    assert all(p.ttfts("P0") for p in phases)
    assert all(p.samples and len(p.engine_records) == settings.sims for p in phases)
    text = priority.report(phases, info, settings)
    assert re.search(r"under the P2 flood: ratio \d+\.\d\dx", text)
    trace = priority.diagnose(phases)
    assert trace.count("limits at start:") == 2
    assert re.search(r"slow P0 \+\d+\.\ds engine \d: engine TTFT \d+ ms; found ", trace)
