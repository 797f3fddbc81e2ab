"""`bench capacity` and `bench overhead` count answered requests only: a gateway whose every request failed at once
(its child killed) was reported at many chunks/s, PASS, exit 0."""

from __future__ import annotations

from lockgate.bench import capacity, load
from lockgate.bench.capacity import Large, Settings, Small
from lockgate.bench.load import LoadResult
from lockgate.bench.overhead import Row, Sample

SETTINGS = Settings(max_tokens=20)


def _result(requests: int, errors: int, ttft_s: float = 0.05) -> LoadResult:
    ok = requests - errors
    return LoadResult(requests, errors, 1.0, [0.2] * ok, [ttft_s] * ok)


def test_failed_requests_are_no_throughput() -> None:
    assert _result(1000, 1000).rps == 0
    assert _result(1000, 250).rps == 750


def test_a_gateway_whose_every_request_failed_does_not_pass() -> None:
    large = Large(direct=[_result(1000, 0)], gateway=[_result(5000, 5000)])
    text = capacity.report(large, None, SETTINGS)
    assert not capacity.passed(large, None, SETTINGS)
    assert "PASS" not in text
    assert "MISS  no failed request (direct 0, gateway 5000)" in text
    assert "MISS  chunks/s 0.00x direct" in text


def test_a_healthy_run_passes() -> None:
    large = Large(direct=[_result(1000, 0)], gateway=[_result(980, 0, 0.06)])
    small = Small(limits=[(t / 2, 8) for t in range(13)], result=_result(300, 0))
    assert capacity.passed(large, small, SETTINGS)
    assert "MISS" not in capacity.report(large, small, SETTINGS)


def test_the_small_engines_failures_are_shown_and_fail_the_run() -> None:
    small = Small(limits=[(t / 2, 8) for t in range(13)], result=_result(300, 40))
    text = capacity.report(None, small, SETTINGS)
    assert "40 of 300 streams failed" in text
    assert "MISS  no failed request (40 of 300)" in text
    assert not capacity.passed(None, small, SETTINGS)


def test_overhead_rows_count_answered_requests_only() -> None:
    samples = [Sample(1000, 1000, 1.0, 0.001, 0.002, 0.1, 0.1), Sample(1000, 0, 1.0, 0.001, 0.002, 0.1, 0.1)]
    assert samples[0].rps == 0
    assert Row("nonstream", 64, "gateway", samples, [], 0).rps == 500


async def test_failed_requests_are_not_timed() -> None:
    """A refusal is fast: timing it made the gateway's p50 look better the more it failed."""
    statuses = iter([500, 200, 0, 200])

    async def post(body: bytes) -> tuple[int, float | None]:
        return next(statuses), None

    result = await load._drive(lambda n: {"n": n}, post, concurrency=1, requests=4, stream=False, on_done=None)
    assert (result.requests, result.errors, len(result.latencies)) == (4, 2, 2)
