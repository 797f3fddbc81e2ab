"""`lockgate bench cancel` runs end to end (a few trials; the figures themselves are not asserted)."""

from __future__ import annotations

from lockgate.bench import cancel


async def test_bench_cancel_smoke() -> None:
    results = await cancel.run(trials=3, tpot_ms=5.0)
    assert [r.phase for r in results] == list(cancel.PHASES)
    # A bound on a hang only (each trial gives up after 10 s); a loaded machine must not fail it.
    assert all(len(r.latencies_s) == 3 and all(0 <= x < 10 for x in r.latencies_s) for r in results)
    text = cancel.report(results)
    assert "p99" in text and "before_first_byte" in text
