"""Outlier ejection with exponential backoff, driven by a hand-held clock."""

from __future__ import annotations

from lockgate.fleet.ejection import Ejection, ejection_allowed
from lockgate.routing.config import EjectionConfig


def make() -> Ejection:
    return Ejection(EjectionConfig(consecutive_failures=3, base_ms=1000, max_ms=5000))


def test_consecutive_failures_eject_and_a_success_resets_the_count():
    e = make()
    assert not e.failure(0.0) and not e.failure(0.1)
    e.success()
    assert not e.failure(0.2) and not e.failure(0.3)
    assert e.failure(0.4) and e.ejected
    assert e.ejected_until == 1.4
    assert not e.failure(0.5)  # failures while ejected change nothing
    assert e.ejected_until == 1.4


def test_backoff_doubles_on_failed_probes_up_to_the_cap_and_returns_after_a_good_probe():
    e = make()
    for t in (0.0, 0.0, 0.0):
        e.failure(t)
    assert not e.probe_due(0.9) and e.probe_due(1.0)
    lengths: list[float] = []
    now = 1.0
    for _ in range(4):
        assert not e.probed(False, now)
        assert e.ejected_until is not None
        lengths.append(e.ejected_until - now)
        now = e.ejected_until
    assert lengths == [2.0, 4.0, 5.0, 5.0]
    assert e.probed(True, now) and not e.ejected


def test_flapping_instance_keeps_its_backoff_a_behaving_one_starts_over():
    e = make()
    e.eject_now(0.0)
    e.probed(False, 1.0)  # 2 s
    e.probed(True, 3.0)
    e.eject_now(3.5)  # back for 0.5 s < last backoff: 4 s now
    assert e.ejected_until == 7.5
    e.probed(True, 7.5)
    e.success()
    e.eject_now(20.0)  # served, and behaved for 12.5 s: starts over at 1 s
    assert e.ejected_until == 21.0


def test_ejection_allowed_never_takes_the_last_routable_instance_nor_more_than_the_share():
    # A pool of one is never ejected, whatever the share.
    assert not ejection_allowed(members=1, ejected=0, routable_others=0, max_percent=50)
    assert not ejection_allowed(members=1, ejected=0, routable_others=0, max_percent=100)
    # 50% of two or three: one at a time.
    assert ejection_allowed(members=2, ejected=0, routable_others=1, max_percent=50)
    assert not ejection_allowed(members=2, ejected=1, routable_others=0, max_percent=50)
    assert ejection_allowed(members=3, ejected=0, routable_others=2, max_percent=50)
    assert not ejection_allowed(members=3, ejected=1, routable_others=1, max_percent=50)
    assert ejection_allowed(members=4, ejected=1, routable_others=2, max_percent=50)
    # 100% still keeps one routable instance; 0% turns passive ejection off.
    assert ejection_allowed(members=2, ejected=0, routable_others=1, max_percent=100)
    assert not ejection_allowed(members=3, ejected=1, routable_others=0, max_percent=100)
    assert not ejection_allowed(members=4, ejected=0, routable_others=3, max_percent=0)
    # The others are out for another reason (failed health checks): this one stays.
    assert not ejection_allowed(members=4, ejected=0, routable_others=0, max_percent=50)


def test_refused_ejection_keeps_the_instance_in_and_the_next_failure_asks_again():
    e = make()
    answers = iter([False, False, True])
    asked = 0

    def may_eject() -> bool:
        nonlocal asked
        asked += 1
        return next(answers)

    assert not e.failure(0.0, may_eject) and not e.failure(0.1, may_eject)
    assert asked == 0  # not asked before the threshold
    assert not e.failure(0.2, may_eject) and not e.ejected and e.held_back == 1
    assert not e.failure(0.3, may_eject) and e.held_back == 2
    assert e.failure(0.4, may_eject) and e.ejected and asked == 3
    assert e.ejected_until == 1.4
    e.probed(True, 1.4)
    assert e.consecutive_failures == 0


def test_an_ejection_after_a_silent_call_asks_for_an_answer_and_a_good_probe_clears_it():
    e = make()
    e.failure(0.0, silent=True)
    e.success()  # a success between: the streak starts over, silence with it
    e.failure(0.1)
    e.failure(0.2)
    assert e.failure(0.3) and not e.silent
    e.probed(True, 1.3)
    e.failure(2.0)
    e.failure(2.1, silent=True)
    assert e.failure(2.2) and e.silent  # one silent call in the streak is enough
    assert not e.probed(False, 10.0) and e.silent  # still out, still asking for an answer
    assert e.probed(True, 20.0) and not e.silent


def test_an_instance_that_served_nothing_since_its_return_keeps_doubling():
    """An engine that fails everything it is sent returned after each backoff and, back for longer than the backoff
    before its next failures (a stall takes `upstream.stall_timeout_ms` to show), started over at `base`."""
    e = make()
    e.eject_now(0.0)
    e.probed(True, 1.0)
    e.eject_now(30.0)  # back for 29 s, but nothing served: 2 s
    assert e.ejected_until == 32.0
    e.probed(True, 32.0)
    e.success()
    e.eject_now(60.0)  # served, and back for longer than its backoff: starts over
    assert e.ejected_until == 61.0
