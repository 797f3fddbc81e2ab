"""`lockgate bench dedup` runs end to end and meets its target on a small workload."""

from __future__ import annotations

from lockgate.bench import dedup


async def test_bench_dedup_small_run():
    result = await dedup.run(
        windows=2, burst=20, dup_share=0.75, stream_share=0.5, max_tokens=4, spread_ms=0, tpot_ms=1.0
    )
    assert result.errors == 0
    assert result.requests == 40 and result.distinct == 10
    assert result.engine_calls == result.distinct  # every duplicate coalesced or served from the cache
    assert result.outcomes["miss"] == 10 and result.outcomes["coalesced"] + result.outcomes["hit"] == 30
    assert "engine calls / distinct: 1.000" in dedup.report(result)
