"""`lockgate bench dedup` runs end to end and meets its target on a small workload."""

from __future__ import annotations

import pytest

from lockgate.bench import dedup


@pytest.mark.parametrize("stream_share", [0.0, 1.0])
async def test_bench_dedup_small_run(stream_share):
    """Clients of a prompt that agree on streaming share one engine call (a JSON one, or a stream)."""
    result = await dedup.run(
        windows=2, burst=20, dup_share=0.75, stream_share=stream_share, max_tokens=4, spread_ms=0, tpot_ms=1.0
    )
    assert result.errors == 0
    assert result.requests == 40 and result.distinct == 10
    assert result.engine_calls == result.distinct  # every duplicate coalesced or served from the cache
    assert result.outcomes["miss"] == 10 and result.outcomes["coalesced"] + result.outcomes["hit"] == 30
    assert "engine calls / distinct: 1.000" in dedup.report(result)


async def test_bench_dedup_mixed_streaming_costs_at_most_a_call_per_kind():
    """A streaming duplicate never waits for a JSON flight's whole answer: it may lead a streaming flight of
    its own (a prompt costs at most two engine calls, one of each kind); after that the model's flights
    stream, so the second window is on target."""
    result = await dedup.run(
        windows=2, burst=20, dup_share=0.75, stream_share=0.5, max_tokens=4, spread_ms=0, tpot_ms=1.0
    )
    assert result.errors == 0 and result.requests == 40 and result.distinct == 10
    assert result.distinct <= result.engine_calls <= 2 * result.distinct
    assert result.outcomes["miss"] == result.engine_calls
    assert result.outcomes["coalesced"] + result.outcomes["hit"] == 40 - result.engine_calls
    assert result.windows_on_target >= 1
