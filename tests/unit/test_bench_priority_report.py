"""`lockgate bench priority`'s report says when its baseline is not an idle fleet: P0 alone already keeping most
of the slots busy makes the ratio compare two queues."""

from __future__ import annotations

from lockgate.bench.priority import Outcome, Phase, Settings, p0_load, report


def _phases() -> list[Phase]:
    def phase(name: str) -> Phase:
        return Phase(name, 1.0, [Outcome("P0", 200, 0.02, 1.0), Outcome("P0", 200, 0.03, 1.0)])

    return [phase("P0 only"), phase("P0 + P2 flood")]


def test_the_report_notes_a_baseline_that_p0_alone_loads() -> None:
    idle = Settings()  # 4 P0/s x 24 tokens x 10 ms over 8 slots
    assert p0_load(idle) == 4 * 24 * 0.01 / 8
    busy = Settings(sims=1, slots_per_sim=4, p0_rate=20.0, p0_max_tokens=12)  # 2.4 of 4 slots
    assert abs(p0_load(busy) - 0.6) < 1e-9
    info = {"capacity": 8.0, "capacity_rps": 33.0}
    assert "note: P0 alone" not in report(_phases(), info, idle)
    text = report(_phases(), info, busy)
    assert "note: P0 alone keeps 60% of the slots busy" in text
    assert "ratio 1.00x" in text


def _flood(name: str) -> Phase:
    outcomes = [Outcome("P0", 200, 0.02, 1.0), Outcome("P2", 200, 0.5, 1.0)]
    if "P1" in name:
        outcomes.append(Outcome("P1", 200, 0.3, 1.0))
    return Phase(name, 1.0, outcomes)


def test_the_p1_p2_figures_only_when_that_phase_ran() -> None:
    """`--p1-factor 0` runs no P1 + P2 flood: its shares and P2 throughput were printed from the P2-only flood."""
    info = {"capacity": 8.0, "capacity_rps": 33.0}
    without = report([_flood("P0 only"), _flood("P0 + P2 flood")], info, Settings(p1_factor=0))
    assert "under the P1 + P2 flood" not in without
    assert "P1 + P2 flood: not run (--p1-factor 0)" in without
    with_ = report([_flood("P0 only"), _flood("P0 + P2 flood"), _flood("P0 + P1 + P2 flood")], info, Settings())
    assert "shares of completed P1+P2 under the P1 + P2 flood: P1 0.50" in with_
    assert "P2 throughput under the P1 + P2 flood: 1.0 req/s" in with_


def test_the_report_gives_the_targets_verdict_and_says_a_short_run_is_mostly_a_floods_start() -> None:
    """A newcomer's `--duration 5` run printed "ratio 3.03x (target <= 1.25x)" and no word on it."""
    info = {"capacity": 8.0, "capacity_rps": 33.0}
    slow = Phase("P0 + P2 flood", 5.0, [Outcome("P0", 200, 0.09, 1.0)])
    text = report([_flood("P0 only"), slow], info, Settings(p1_factor=0))
    assert "ratio 4.50x (target <= 1.25x: NOT met; measured over 60 s (--duration 60)" in text
    long = Phase("P0 + P2 flood", 60.0, [Outcome("P0", 200, 0.021, 1.0)])
    assert "ratio 1.05x (target <= 1.25x: met)" in report([_flood("P0 only"), long], info, Settings(p1_factor=0))
