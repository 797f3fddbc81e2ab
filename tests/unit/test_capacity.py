"""The discovered concurrency limit: settles at what the engine runs, grows back, ignores transients."""

from __future__ import annotations

from lockgate.fleet.capacity import _ANSWER_SCRAPES, ConcurrencyLimit, prefill_backlog_s


def test_starts_at_the_ceiling_and_settles_at_the_engines_parallelism() -> None:
    limit = ConcurrencyLimit(256)
    assert limit.limit == 256
    # An engine that runs 8: the flood waits inside it, two scrapes in a row.
    # The first scrape holds the limit at what it runs (discovery), the second confirms it.
    assert limit.observe(running=8, waiting=120, in_flight=128) and limit.limit == 8
    assert not limit.observe(running=8, waiting=100, in_flight=108)
    assert limit.limit == 8
    # At the limit with nothing waiting there: after the cooldown it tries a little more, then learns again.
    for _ in range(limit.cooldown - 1):
        assert not limit.observe(running=8, waiting=0, in_flight=8)
    assert limit.observe(running=8, waiting=0, in_flight=8) and limit.limit == 9
    # The probe's own request waits there: refuted by that one scrape.
    assert limit.observe(running=8, waiting=1, in_flight=9) and limit.limit == 8


def test_a_transient_wait_at_low_load_does_not_cut_the_limit() -> None:
    limit = ConcurrencyLimit(64)
    # A request waits one engine step at low load; the next scrape sees more running, nothing waiting.
    for running, waiting in [(3, 1), (5, 0), (2, 1), (6, 1), (12, 1), (20, 0)]:
        limit.observe(running=running, waiting=waiting, in_flight=running + waiting)
    assert limit.limit == 64


def test_grows_back_when_the_engine_takes_more_up_to_the_ceiling() -> None:
    limit = ConcurrencyLimit(64)
    limit.observe(running=16, waiting=5, in_flight=21)
    limit.observe(running=16, waiting=5, in_flight=21)
    assert limit.limit == 16
    for _ in range(limit.cooldown + 40):
        limit.observe(running=limit.limit, waiting=0, in_flight=limit.limit)
    assert limit.limit == 64
    assert not limit.observe(running=64, waiting=0, in_flight=64)  # never above the ceiling


def test_no_signal_or_not_adaptive_keeps_the_limit() -> None:
    limit = ConcurrencyLimit(32)
    assert not limit.observe(running=None, waiting=None, in_flight=40)
    fixed = ConcurrencyLimit(32, adaptive=False)
    fixed.observe(running=4, waiting=9, in_flight=13)
    fixed.observe(running=4, waiting=9, in_flight=13)
    assert fixed.limit == 32


def test_a_queue_explained_by_prefill_work_does_not_cut_the_limit() -> None:
    # Chunked prefill: one long prompt takes the engine's step budget, short requests wait for it with free
    # slots. The gateway has ~0.5 s of prefill outstanding there, requests hold a slot ~0.1 s decoding.
    limit = ConcurrencyLimit(256)
    for _ in range(10):
        assert not limit.observe(running=1, waiting=3, in_flight=4, prefill_backlog_s=0.5, decode_s=0.1)
    assert limit.limit == 256
    # The same queue with little prefill outstanding is the engine's parallelism: it counts.
    assert limit.observe(running=8, waiting=20, in_flight=28, prefill_backlog_s=0.01, decode_s=0.1)
    assert not limit.observe(running=8, waiting=20, in_flight=28, prefill_backlog_s=0.01, decode_s=0.1)
    assert limit.limit == 8


def test_a_queue_while_the_engine_runs_below_its_recent_peak_does_not_cut_the_limit() -> None:
    """`bench hol` (seed 7): an engine of 16 slots ran 13 at once, then one long prompt took a whole prefill step
    while short requests arrived: 1 running, 2 waiting, and the gateway's prefill estimate too small to explain
    it. The first backlog held the limit at 13, later cuts took it to 10-11, and short requests queued in the
    gateway. Its slots were free: requests that wait while it runs far fewer than it just did wait for a step."""
    limit = ConcurrencyLimit(256)
    for running in [9, 13, 12, 11]:
        assert not limit.observe(running=running, waiting=0, in_flight=running, decode_s=0.9)
    for running, waiting in [(1, 2), (1, 4), (6, 5), (6, 5)]:
        assert not limit.observe(running=running, waiting=waiting, in_flight=running + waiting, decode_s=0.9)
    assert limit.limit == 256
    # At its peak, the same queue is the engine's parallelism.
    assert limit.observe(running=13, waiting=13, in_flight=26, decode_s=0.9) and limit.limit == 13


def test_a_queue_none_of_whose_requests_is_overdue_does_not_cut_the_limit() -> None:
    """Requests that wait for a slot wait for a generation to end: within a few steps the gateway's own timing
    calls one of them overdue (`OwnAccounting.overdue`). A queue of requests all within their due time waits
    for a step (arrivals during a long prefill step), not for a slot; not knowing (None) leaves the other rules."""
    limit = ConcurrencyLimit(256)
    for _ in range(4):
        assert not limit.observe(running=8, waiting=8, in_flight=16, decode_s=0.4, overdue=False)
    assert limit.limit == 256
    assert limit.observe(running=8, waiting=8, in_flight=16, decode_s=0.4, overdue=True) and limit.limit == 8
    other = ConcurrencyLimit(256)
    assert other.observe(running=8, waiting=8, in_flight=16, decode_s=0.4, overdue=None) and other.limit == 8


def test_no_queue_counts_before_the_instance_answered_a_request() -> None:
    # The first long prompts of a run queue behind each other's prefill before any timing is measured.
    limit = ConcurrencyLimit(256)
    for _ in range(5):
        assert not limit.observe(running=1, waiting=4, in_flight=5, prefill_backlog_s=0.0, decode_s=0.0)
    assert limit.limit == 256


def test_prefill_backlog_counts_before_the_rate_is_measured() -> None:
    # A fresh instance sent two long prompts: 5,500 tokens of prefill, no rate measured yet (0.0).
    assert prefill_backlog_s(5500, 0.0, 8000.0) == 5500 / 8000
    assert prefill_backlog_s(5500, 11000.0, 8000.0) == 0.5
    assert prefill_backlog_s(-3, 11000.0, 8000.0) == 0.0
    # Fed to the limit, it keeps that queue from counting as saturation (it fell to 2 when it counted as 0).
    limit = ConcurrencyLimit(256)
    for _ in range(4):
        limit.observe(
            running=2, waiting=1, in_flight=3, prefill_backlog_s=prefill_backlog_s(5500, 0.0, 8000.0), decode_s=0.08
        )
    assert limit.limit == 256


def test_one_request_waiting_for_the_next_step_of_a_busy_engine_is_not_saturation() -> None:
    """A busy engine below its parallelism has a request waiting for its next step at most scrapes; `bench
    overload --scrape` saw the limit of an 8-slot engine cut to 4-6 by exactly that, refusing a third of the
    requests it had room for."""
    limit = ConcurrencyLimit(256)
    for running in [5, 5, 6, 6, 5, 6, 6, 6]:
        assert not limit.observe(running=running, waiting=1, in_flight=running + 1, decode_s=None)
    assert limit.limit == 256
    # A real backlog (the flood reaches the engine): two scrapes and the limit is what it runs.
    assert limit.observe(running=8, waiting=12, in_flight=20, decode_s=None) and limit.limit == 8
    assert not limit.observe(running=8, waiting=14, in_flight=22, decode_s=None) and limit.limit == 8


def test_a_full_limit_does_not_ratchet_down_on_slots_freed_a_moment_ago() -> None:
    """At a full limit a slot freed just before a scrape shows one running fewer and one waiting; cutting to
    that count each time walked an 8-slot engine's limit down to 1-2 (`bench overload --scrape`: 11 of 72
    req/s served at 2.5x capacity). The limit never falls below what the engine recently ran at once."""
    limit = ConcurrencyLimit(8)
    for running in [8, 7, 7, 8, 7, 7, 6, 6, 7, 7] * 3:
        limit.observe(running=running, waiting=1, in_flight=8, decode_s=None)
    assert limit.limit == 8


def test_probes_that_find_the_same_limit_come_ever_more_rarely() -> None:
    """Each probe above the engine's parallelism queues a request inside it, where a P0 waits; a stable engine
    is probed after the cooldown, then after twice as long, and so on (at most ten cooldowns)."""
    limit = ConcurrencyLimit(64, cooldown=4)
    limit.observe(running=8, waiting=9, in_flight=17, decode_s=None)
    limit.observe(running=8, waiting=9, in_flight=17, decode_s=None)
    assert limit.limit == 8
    waits = []
    for _ in range(4):
        calm = 0
        while not limit.observe(running=8, waiting=0, in_flight=limit.limit, decode_s=None):
            calm += 1
        waits.append(calm + 1)
        assert limit.limit == 9  # the probe
        assert limit.observe(running=8, waiting=1, in_flight=9, decode_s=None) and limit.limit == 8
    assert waits == [4, 8, 16, 32]


def test_a_probe_the_gateway_leaves_empty_lapses_back() -> None:
    """The strict reserve keeps a slot free in the gateway; on a probed instance that free slot is the probe,
    and P0 was routed there into the full engine's queue while the limit stayed one above the engine for 45 s
    (`bench priority --duration 60 --trace`, P0 TTFT p99 5x under the P1 + P2 flood). An unfilled probe is
    taken back after a few scrapes."""
    limit = ConcurrencyLimit(256, cooldown=3)
    assert limit.observe(running=4, waiting=9, in_flight=13, decode_s=None) and limit.limit == 4  # held at once
    assert not limit.observe(running=4, waiting=9, in_flight=13, decode_s=None) and limit.limit == 4  # confirmed
    while not limit.observe(running=4, waiting=0, in_flight=4, decode_s=None):
        pass
    assert limit.limit == 5
    changes = [limit.observe(running=4, waiting=0, in_flight=4, decode_s=None) for _ in range(5)]
    assert changes == [False, False, False, False, True] and limit.limit == 4
    # And it is tried again after the same wait (nothing was refuted).
    assert [limit.observe(running=4, waiting=0, in_flight=4, decode_s=None) for _ in range(3)] == [False, False, True]
    assert limit.limit == 5


def test_a_confirmed_probe_grows_on_by_an_eighth() -> None:
    """The first step above a learned limit is one slot (a refuted probe queues one request inside the engine,
    not an eighth of it); once the engine runs more, growth goes on by an eighth per scrape."""
    limit = ConcurrencyLimit(256, cooldown=2)
    assert not limit.observe(running=64, waiting=30, in_flight=94, decode_s=None)  # shorter than the batch
    assert limit.observe(running=64, waiting=30, in_flight=94, decode_s=None) and limit.limit == 64
    assert not limit.observe(running=64, waiting=0, in_flight=64, decode_s=None)
    assert limit.observe(running=64, waiting=0, in_flight=64, decode_s=None) and limit.limit == 65
    assert not limit.observe(running=65, waiting=0, in_flight=65, decode_s=None)  # confirmed
    assert limit.observe(running=65, waiting=0, in_flight=65, decode_s=None) and limit.limit == 65 + 65 // 8


def test_a_prefill_bound_queue_neither_confirms_nor_refutes_a_probe() -> None:
    limit = ConcurrencyLimit(64, cooldown=1)
    assert limit.observe(running=8, waiting=9, in_flight=17, decode_s=None) and limit.limit == 8  # held at once
    assert not limit.observe(running=8, waiting=9, in_flight=17, decode_s=None) and limit.limit == 8  # confirmed
    assert limit.observe(running=8, waiting=0, in_flight=8, decode_s=0.1) and limit.limit == 9
    bound = [limit.observe(running=8, waiting=2, in_flight=9, prefill_backlog_s=1.0, decode_s=0.1) for _ in range(5)]
    assert bound == [False] * 4 + [True] and limit.limit == 8  # lapsed, not refuted


def test_discovery_holds_the_limit_at_the_first_backlog_and_undoes_a_hold_the_engine_outgrows() -> None:
    """Before any saturation is learned a flood queues inside a small engine for the two scrapes saturation
    takes, and P0 arriving then waits there (`bench priority --trace`: 0.4-0.7 s on 4-slot engines). The first
    backlog holds the limit at once; a burst into a large engine that is still taking requests in (running
    grows past the hold) gets its limit back on the next scrape, and so does a queue that went away."""
    burst = ConcurrencyLimit(256)
    assert burst.observe(running=100, waiting=156, in_flight=256) and burst.limit == 100
    assert burst.observe(running=256, waiting=0, in_flight=256) and burst.limit == 256
    short = ConcurrencyLimit(256)  # a queue shorter than the batch: a step's arrivals, no hold
    assert not short.observe(running=6, waiting=3, in_flight=9) and short.limit == 256
    blip = ConcurrencyLimit(256)
    assert blip.observe(running=3, waiting=3, in_flight=6) and blip.limit == 3
    assert not blip.observe(running=2, waiting=0, in_flight=2) and blip.limit == 3  # demand fell: kept
    assert blip.observe(running=4, waiting=0, in_flight=4) and blip.limit == 256  # outgrown: undone
    # A flood into a 4-slot engine, held at 4. The gateway holding one fewer there for a moment does not undo
    # it (that let the flood queue inside the engine again); the first probe is refuted and the hold learned.
    flood = ConcurrencyLimit(256)
    assert flood.observe(running=4, waiting=7, in_flight=11) and flood.limit == 4
    assert not flood.observe(running=4, waiting=0, in_flight=3) and flood.limit == 4
    assert flood.observe(running=4, waiting=0, in_flight=4) and flood.limit == 5  # the probe
    assert flood.observe(running=4, waiting=1, in_flight=5) and flood.limit == 4  # refuted
    for _ in range(10):
        assert not flood.observe(running=4, waiting=0, in_flight=4) and flood.limit == 4
    ramp = ConcurrencyLimit(256)
    assert ramp.observe(running=40, waiting=60, in_flight=100) and ramp.limit == 40
    assert ramp.observe(running=90, waiting=10, in_flight=100) and ramp.limit == 256  # outgrown: undone
    assert not ramp.observe(running=100, waiting=5, in_flight=105)  # one hold per backlog
    assert ramp.limit == 256


def test_discovery_holds_a_shorter_backlog_when_the_gateways_own_requests_there_are_overdue() -> None:
    """A 16-slot engine under a flood: a hold waited for 16 requests waiting (`bench priority --slots 16 --tpot-ms
    25 --trace`: ~0.7 s, P0 waiting there 100 ms). A backlog of a quarter of the batch holds as soon as a request the
    gateway sent there is overdue (it waits for a slot, not for the next step); not without that evidence, where a
    short queue is more often a step's arrivals."""
    flood = ConcurrencyLimit(256)
    assert flood.observe(running=16, waiting=4, in_flight=20, decode_s=0.5, overdue=True) and flood.limit == 16
    assert not flood.observe(running=16, waiting=4, in_flight=20, decode_s=0.5, overdue=True)  # confirmed
    assert flood.limit == 16 and flood.known_slots() == 16
    for overdue in (None, False):
        quiet = ConcurrencyLimit(256)
        assert not quiet.observe(running=16, waiting=4, in_flight=20, decode_s=0.5, overdue=overdue)
        assert quiet.limit == 256 and quiet.known_slots() is None
    one = ConcurrencyLimit(256)  # one waiting is a step's arrival even when overdue: no backlog
    assert not one.observe(running=16, waiting=1, in_flight=17, decode_s=0.5, overdue=True) and one.limit == 256


def test_discovery_holds_a_lone_waiting_request_older_than_a_step_while_one_of_the_gateways_is_overdue() -> None:
    """P0 traffic alone on a fast 4-slot engine next to a slow 32-slot one: its queue rarely grew past one, so its
    limit was never learned, and routing kept sending P0s into its queue for a whole generation (p99 ~0.4-0.6 s, the
    slow engine with room). One request waiting counts when it waits for a slot: older than a step (`aged`) while
    one of the gateway's is overdue there, the engine at the most it ran lately. Either alone is a step's arrival."""
    lone = ConcurrencyLimit(256)
    assert lone.observe(running=4, waiting=1, in_flight=5, decode_s=0.8, overdue=True, aged=True)
    assert lone.limit == 4 and lone.known_slots() == 4
    assert not lone.observe(running=4, waiting=1, in_flight=5, decode_s=0.8, overdue=True, aged=True)  # confirmed
    assert lone.limit == 4
    for overdue, aged in ((True, None), (True, False), (None, True), (False, True)):
        quiet = ConcurrencyLimit(256)
        assert not quiet.observe(running=4, waiting=1, in_flight=5, decode_s=0.8, overdue=overdue, aged=aged)
        assert quiet.limit == 256 and quiet.known_slots() is None
    other = ConcurrencyLimit(256)  # the waiting one is another client's: the gateway's own all run
    assert not other.observe(running=4, waiting=1, in_flight=4, decode_s=0.8, overdue=True, aged=True)
    assert other.limit == 256
    below = ConcurrencyLimit(256)  # the engine ran more a moment ago: it has free slots, the wait is for its step
    below.observe(running=12, waiting=0, in_flight=12, decode_s=0.8)
    assert not below.observe(running=4, waiting=1, in_flight=5, decode_s=0.8, overdue=True, aged=True)
    assert below.limit == 256
    learned = ConcurrencyLimit(256)  # once a limit is learned, one waiting is weak evidence (the rule below)
    learned.observe(running=8, waiting=9, in_flight=17)
    learned.observe(running=8, waiting=9, in_flight=17)
    assert learned.limit == 8
    assert not learned.observe(running=7, waiting=1, in_flight=8, decode_s=0.8, overdue=True, aged=True)
    assert learned.limit == 8


def test_one_waiting_at_a_full_limit_does_not_cut_below_the_learned_limit() -> None:
    """With the strict reserve keeping a slot free, a 4-slot engine ran 3 for seconds at a time; a slot freed a
    moment before two scrapes (one waiting, the gateway's whole limit there) then cut its limit to 3 (`bench
    priority --trace`, P1 + P2 flood). Only a real backlog lowers a learned limit."""
    limit = ConcurrencyLimit(256)
    limit.observe(running=4, waiting=9, in_flight=13)
    limit.observe(running=4, waiting=9, in_flight=13)
    assert limit.limit == 4
    for _ in range(40):
        limit.observe(running=3, waiting=1, in_flight=4)
    assert limit.limit == 4
    # A real backlog at 3 (the engine now runs fewer: longer prompts fill its cache) still cuts.
    limit.observe(running=3, waiting=4, in_flight=7)
    limit.observe(running=3, waiting=4, in_flight=7)
    assert limit.limit == 3


def test_a_declared_parallelism_is_the_limit_before_any_traffic_and_a_ceiling_for_probes() -> None:
    """An engine that says what it runs at once (llama.cpp's slots, SGLang's `max_running_requests`) has no
    discovery window: its limit is that number from the start, a flood never fills its own queue first."""
    limit = ConcurrencyLimit(256)
    assert limit.declare(4) and limit.limit == 4 and limit.declared == 4
    for _ in range(limit.cooldown * 3):  # at the limit, nothing waiting: no probe above what it said
        assert not limit.observe(running=4, waiting=0, in_flight=4)
    assert limit.limit == 4
    # A KV cache that fits fewer than its slots: a lasting backlog still cuts below (once what it ran at once
    # in recent scrapes is 3), and probes grow back to what it said.
    cut = [limit.observe(running=3, waiting=4, in_flight=7) for _ in range(30)]
    assert any(cut) and limit.limit == 3
    for _ in range(limit.cooldown + 10):
        limit.observe(running=limit.limit, waiting=0, in_flight=limit.limit)
    assert limit.limit == 4
    # Never above the configured ceiling; an engine that no longer says goes back to discovering under it.
    capped = ConcurrencyLimit(8)
    assert not capped.declare(16) and capped.limit == 8 and capped.ceiling == 8
    assert not capped.declare(None) and capped.declared is None and capped.ceiling == 8
    assert capped.observe(running=5, waiting=6, in_flight=8) and capped.limit == 5  # discovery again
    restarted = ConcurrencyLimit(256)
    restarted.declare(4)
    assert restarted.declare(6) and restarted.limit == 6  # restarted with more slots
    fixed = ConcurrencyLimit(32, adaptive=False)  # a fixed limit (a sidecar's publication) ignores it
    assert not fixed.declare(4) and fixed.limit == 32


def test_the_slots_an_engine_is_known_to_have() -> None:
    """`known_slots`: what a strict request may count on (`Lease.engine_full`); the ceiling and a limit still
    growing after a confirmed probe are guesses, not knowledge."""
    limit = ConcurrencyLimit(256, cooldown=2)
    assert limit.known_slots() is None  # the ceiling
    assert limit.observe(running=4, waiting=9, in_flight=13, decode_s=None) and limit.known_slots() == 4  # held
    assert not limit.observe(running=4, waiting=9, in_flight=13, decode_s=None) and limit.known_slots() == 4
    while not limit.observe(running=4, waiting=0, in_flight=4, decode_s=None):
        pass
    assert limit.limit == 5 and limit.known_slots() == 4  # a probe on trial: the limit it started from
    assert not limit.observe(running=5, waiting=0, in_flight=5, decode_s=None)  # confirmed: it runs more
    assert limit.known_slots() is None
    declared = ConcurrencyLimit(256)
    declared.declare(6)
    assert declared.known_slots() == 6
    stated = ConcurrencyLimit(4, stated=True)  # `max_concurrency: 4`: the operator's number for this engine
    assert stated.known_slots() == 4


def test_an_engine_whose_kv_cache_is_full_is_saturated_at_what_fits_there() -> None:
    """An outside run: a 16-slot engine whose KV cache fitted 8-14 sequences ran 15 at the flood's first scrape, then
    8-12 with ~40 waiting. Running well under that first peak read as free slots (the queue then waits for a prefill
    step, not a slot) and the moving count was never steady: the limit stayed at the ceiling for 9-20 s while P0
    waited inside the engine behind the flood (p99 38-41x idle). With the cache full, neither rule applies."""
    # (The flood's first scrape: its requests were just sent, none overdue yet.)
    signals = [(15, 33, False), (12, 36, True), (9, 38, True), (10, 38, True), (11, 37, True), (10, 38, True)]
    unseen = ConcurrencyLimit(256)
    for running, waiting, overdue in signals:
        unseen.observe(running=running, waiting=waiting, in_flight=48, decode_s=0.9, overdue=overdue)
    assert unseen.limit == 256  # without the cache's word: free slots, a prefill queue
    full = ConcurrencyLimit(256)
    for running, waiting, overdue in signals:
        full.observe(running=running, waiting=waiting, in_flight=48, decode_s=0.9, overdue=overdue, kv_full=True)
    assert full.limit == 15  # what it ran at once lately (later scrapes take it to what runs now)


def test_a_limit_a_full_kv_cache_set_is_probed_again_as_soon_as_the_cache_has_room() -> None:
    """An outside run: 20 clients that never read held long streams on a 64-slot engine until its KV cache was full;
    the limit fell to what fitted (9) and stayed there for 13 minutes of ordinary traffic after they left, its probes
    each a cooldown or more apart (and ever rarer). What a full cache set is probed again at once when the cache has
    room; a limit learned with room in the cache waits for the cooldown as before."""
    limit = ConcurrencyLimit(64, cooldown=300)
    for _ in range(3):
        limit.observe(running=9, waiting=12, in_flight=21, decode_s=None, kv_full=True)
    assert limit.limit == 9
    assert not limit.observe(running=9, waiting=0, in_flight=9, decode_s=None, kv_full=True)  # still full: no probe
    assert limit.observe(running=9, waiting=0, in_flight=9, decode_s=None) and limit.limit == 10  # room: a probe
    assert not limit.observe(running=10, waiting=0, in_flight=10, decode_s=None)  # confirmed
    assert limit.observe(running=10, waiting=0, in_flight=10, decode_s=None) and limit.limit == 11  # and on it grows
    slots = ConcurrencyLimit(64, cooldown=300)
    for _ in range(3):
        slots.observe(running=9, waiting=12, in_flight=21, decode_s=None)
    assert slots.limit == 9
    assert not any(slots.observe(running=9, waiting=0, in_flight=9, decode_s=None) for _ in range(100))


def _queue(
    limit: ConcurrencyLimit,
    scrapes: int,
    *,
    running: int,
    waiting: int,
    backlog_s: float,
    decode_s: float,
    every_s: float = 0.2,
    answers_each: int = 0,
    first: tuple[float, int] = (0.0, 0),
) -> list[bool]:
    """`scrapes` scrapes of an engine queue the gateway's own overdue requests wait in, `backlog_s` of prefill work by
    its count, the engine letting `answers_each` in between scrapes `every_s` apart: whether each changed the limit."""
    start, answered = first
    return [
        limit.observe(
            running=running,
            waiting=waiting,
            in_flight=running + waiting,
            prefill_backlog_s=backlog_s,
            decode_s=decode_s,
            overdue=True,
            aged=True,
            answered=(start + n * every_s, answered + n * answers_each),
        )
        for n in range(scrapes)
    ]


def test_a_queue_that_drains_far_slower_than_its_prefill_explains_waits_for_slots() -> None:
    """An outside run, a 4-slot engine next to a 64-slot one: a flood's first P2s (short prompts) went 60-90 deep into
    the small one before its limit was known, and at a prefill rate measured on short prompts their tokens made
    0.2-1.8 s of backlog, more than half a generation (0.3-0.6 s): read as prefill work, the queue never counted, for
    14 s. The engine let in ~8 a second: at that pace the queue takes ~10 s to drain, not the backlog's time. The pace
    is judged from the fifth scrape of the queue (over its first steps it is a step's luck)."""
    limit = ConcurrencyLimit(256)
    changes = _queue(limit, 6, running=4, waiting=70, backlog_s=1.2, decode_s=0.43, answers_each=2)
    assert changes[:4] == [False] * 4 and changes[4] and limit.limit == 4
    # A flood's first scrapes: a 24-slot engine taking prompts in 2,048 tokens a step let in a few a second, and a
    # pace judged then read its queue as slot-bound (held at 9).
    start = ConcurrencyLimit(256)
    assert _queue(start, 4, running=9, waiting=23, backlog_s=1.2, decode_s=1.9, answers_each=1) == [False] * 4
    # Long prompts waiting for the engine's prefill drain at about the backlog's pace: 8 of 3,000 tokens at 20,000
    # tokens a second is 1.2 s, and the engine lets in ~6.7 a second.
    bound = ConcurrencyLimit(256)
    assert not any(_queue(bound, 10, running=2, waiting=8, backlog_s=1.2, decode_s=0.5, every_s=0.3, answers_each=2))
    # The pace counts since the queue appeared: before, the engine let in what arrived (here 2 a second, a quiet
    # phase's arrivals), not what it can.
    quiet = ConcurrencyLimit(256)
    for step in range(10):
        quiet.observe(running=1, waiting=0, in_flight=1, decode_s=0.5, answered=(step * 0.2, step // 2))
    # (20 a second while they wait: the backlog's second drains 20, near enough 30)
    assert not any(_queue(quiet, 6, running=4, waiting=30, backlog_s=1.0, decode_s=0.5, answers_each=4, first=(2.0, 9)))
    # No first token lately (a very long prompt in prefill): the pace is not known, and the backlog decides.
    still = ConcurrencyLimit(256)
    assert not any(_queue(still, 5, running=1, waiting=4, backlog_s=2.0, decode_s=0.5, first=(0.0, 7)))


def test_a_limit_reached_between_scrapes_is_probed() -> None:
    """An outside run, long prompts on two 8-slot engines: a flood's start held one at 2, and it was never probed:
    requests came and went between scrapes, and at each scrape the gateway held one fewer than the limit there.
    Reached at some moment since the last scrape (`filled`), it counts."""
    limit = ConcurrencyLimit(256)
    assert limit.observe(running=2, waiting=6, in_flight=8, decode_s=0.5, overdue=True) and limit.limit == 2  # held
    for _ in range(3):
        assert not limit.observe(running=1, waiting=0, in_flight=1, decode_s=0.5)
    assert limit.observe(running=1, waiting=0, in_flight=1, decode_s=0.5, filled=True) and limit.limit == 3


def test_a_probe_is_not_refuted_by_requests_sent_within_the_last_step() -> None:
    """An outside run: a 64-slot engine at 90 ms a step, held at 9 by a flood's start; each probe was refuted by a
    closed loop's next request, waiting for the step it arrived in (10 for good). A queue the gateway sent within the
    last step (`aged` False) neither confirms nor refutes; an older one refutes."""
    limit = ConcurrencyLimit(256, cooldown=1)
    assert limit.observe(running=9, waiting=20, in_flight=29, decode_s=5.0, overdue=True) and limit.limit == 9
    assert not limit.observe(running=9, waiting=20, in_flight=29, decode_s=5.0, overdue=True)  # confirmed: learned
    assert limit.observe(running=9, waiting=0, in_flight=9, decode_s=5.0) and limit.limit == 10  # a probe
    assert not limit.observe(running=9, waiting=1, in_flight=10, decode_s=5.0, aged=False) and limit.limit == 10
    assert limit.observe(running=9, waiting=1, in_flight=10, decode_s=5.0, aged=True) and limit.limit == 9


def test_the_pace_of_admissions_keeps_a_bounded_window() -> None:
    """The (time, first tokens) pairs kept for the pace are the last `_ANSWER_SCRAPES` scrapes', however long a queue
    lasts; a scrape without a queue starts the window afresh."""
    limit = ConcurrencyLimit(256)
    _queue(limit, 100, running=64, waiting=2, backlog_s=0.0, decode_s=1.0, answers_each=3)
    assert len(limit._answers) == _ANSWER_SCRAPES
    limit.observe(running=64, waiting=0, in_flight=64, decode_s=1.0, answered=(30.0, 400))
    assert list(limit._answers) == [(30.0, 400)]
