"""The benchmarks' load generator: both clients count answers, errors and first chunks alike; only answers are
timed and make throughput."""

from __future__ import annotations

from typing import Any

import pytest

from lockgate.bench.load import closed_loop


def body(n: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 3}


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_closed_loop_counts_every_request(start_sim, client: str, stream: bool) -> None:
    sim = await start_sim(prefill_tps=1e6, tpot_ms=0.5)

    def make(n: int) -> dict[str, Any]:
        return {**body(n), "stream": True} if stream else body(n)

    result = await closed_loop(
        sim.url + "/v1/chat/completions", make, concurrency=4, requests=12, stream=stream, client=client
    )
    assert (result.requests, result.errors, len(result.latencies)) == (12, 0, 12)
    assert len(result.ttfts) == (12 if stream else 0)
    assert all(0 < t <= lat for t, lat in zip(sorted(result.ttfts), sorted(result.latencies), strict=False))
    assert sim.statistics()["requests_finished"] == 12


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_closed_loop_counts_refusals_and_unreachable_servers_as_errors(start_sim, client: str) -> None:
    sim = await start_sim()
    wrong = await closed_loop(
        sim.url + "/v1/chat/completions",
        lambda n: {**body(n), "model": "nope"},
        concurrency=2,
        requests=4,
        stream=False,
        client=client,
    )
    # Failures are counted, neither timed (a fast refusal flattered the percentiles) nor throughput.
    assert (wrong.errors, len(wrong.latencies), wrong.rps) == (4, 0, 0)
    gone = await closed_loop(
        "http://127.0.0.1:1/v1/chat/completions", body, concurrency=2, requests=4, stream=True, client=client
    )
    assert (gone.errors, len(gone.latencies), gone.ttfts, gone.rps) == (4, 0, [], 0)
