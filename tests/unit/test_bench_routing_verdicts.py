"""`bench routing --replicas N`'s verdict states the hit-rate difference in points, as its target does."""

from __future__ import annotations

from lockgate.bench.routing import RunResult, verdicts


def _run(replicas: int, hit_rate: float) -> RunResult:
    return RunResult(
        "chat", "small", "round_robin", 7, 100, seconds=1.0, hit_rate=hit_rate, ttfts=[0.01] * 10, replicas=replicas
    )


def test_the_replicas_hit_rate_difference_is_in_points() -> None:
    texts = [text for text, _ in verdicts([_run(1, 0.50), _run(2, 0.52)])]
    (hit,) = [t for t in texts if "hit rate within 5 points" in t]
    assert "median +2.0, +2.0 to +2.0 points" in hit
    assert "%" not in hit
