"""An instance's concurrency limit, discovered from the engine instead of guessed (sync, no I/O).

Theory of operation: the gateway admits at most `limit` requests to an instance at once; the rest wait
in the gateway's priority queues, where they can be reordered (P0 first) and preempted. A limit above
what the engine runs in parallel moves that queue into the engine, where it is first come, first served
and priorities are lost; a limit below it leaves the engine idle. So the limit should sit at the
engine's real parallelism, and that differs per engine (vLLM's `max_num_seqs` or its KV cache, SGLang's
`max_running_requests`, llama.cpp's slots) and may change with the workload (longer prompts fit fewer
sequences in the KV cache).

`ConcurrencyLimit.observe()` is fed each scrape of the engine's own queue signals:
- **saturation**: requests have waited inside the engine in two scrapes in a row while the number it
  runs stayed put (within 10%): the engine is at its parallelism, which is what it runs. The limit drops
  to that number (at once: each scrape interval at a too-high limit costs priority order). The wait must
  be a backlog, not the step a request just arrived in: at least two requests and a quarter of those
  running, or the gateway holding its whole limit there. A busy engine below its parallelism has one
  request waiting for the next step most of the time. The new limit is the most it ran at once in the
  last 25 scrapes, not the count of the moment, which dips whenever a slot has just been freed;
- **headroom**: the gateway holds the limit's worth of requests there and the engine queues none: the
  limit grows, up to the ceiling, so a bigger engine (or a lighter workload) is found again. Held at the scrape
  or at some moment since the last (`filled`): where requests end and are replaced between scrapes the count at a
  scrape is often one short, and a flood's start that held an 8-slot engine at 2 was never probed again (an outside
  run, 20 s). After a
  saturation it first waits `cooldown` scrapes (60 s at the default interval): each probe above the
  engine's parallelism puts a request in the engine's own queue, where a P0 arriving then waits behind
  it. A probe that finds the same limit again doubles the wait before the next (up to ten cooldowns);
- **a probe is a trial**: the first step above a learned limit is one slot, and it is judged by the next
  scrapes alone: the engine running more than before confirms it (the limit then grows by an eighth per
  scrape while it keeps confirming); a request waiting there while the gateway holds more than the old
  limit refutes it at once (one scrape, no backlog rule: the queue is the probe's own), unless all that waits
  there was sent within the last step (`aged` False: it waits for the step it arrived in; on a slow engine a
  closed loop's next request always does, and each probe of a 64-slot engine that a flood's start held at 9 was
  refuted so: 10 for good, in an outside run); neither within
  `_TRIAL_SCRAPES` (the probe slot stayed empty, e.g. kept free by the strict reserve) lets it lapse
  back. Before trials, a probe the shared classes did not fill stayed up while the engine was full, the
  strict reserve's free slot sat on it, and P0 was routed there into the engine's queue
  (`bench priority --duration 60 --trace`: a limit of 5 on a 4-slot engine for 45 s, P0 TTFT p99 5x
  under the P1 + P2 flood, engine-side);
- **a full KV cache** (`kv_full`: the engine's scraped KV use at least `fleet.KV_FULL`): the engine runs what
  fits there, fewer than its slots and a count that moves as sequences grow and are preempted; neither the
  steady-count rule nor the peak rule below applies (a 16-slot engine fitting 8-14 sequences ran 15 at a flood's
  first scrape, then 8-12 with ~38 waiting: read as free slots, the limit stayed at the ceiling for 9-20 s). What
  it sets is what fitted, not the slots: once the cache has room, a probe needs no cooldown;
- no queue signal (the dialect exports none, or scrapes fail): the limit stays where it is;
- **prefill-bound**: requests also wait inside an engine whose slots are free, for its per-step token
  budget, behind long prompts being prefilled (chunked prefill admits at most `max_num_batched_tokens`
  a step). That queue says nothing about the engine's parallelism: cutting the limit to what runs then
  (often 1-2 sequences, one of them a long prefill) would hold every short request in the gateway behind
  the long ones and leave the engine's slots idle (`lockgate bench hol` measured short TTFT p50 x21
  from exactly this). So a queue counts as saturation only if it is not explained by prefill work: the
  gateway's own count of uncached prompt tokens sent there and not yet answered, at the instance's
  measured prefill rate, must stay below half the mean time a request holds its slot decoding (`decode_s`;
  a slot-bound queue waits about that long, a prefill-bound one about the backlog). Before a generation
  ended there, the fleet passes how long the oldest one still running has decoded, or its peers' mean if
  longer (an engine added during a flood), and their prefill rate for its unmeasured one; with none of
  these (`decode_s` 0.0) no queue counts: the first long prompts of a run are exactly when a prefill-bound
  queue looks like saturation. Two more signals say a queue is not a slot limit,
  which that estimate missed (`bench hol`: limits of 9-11 on engines of 16 slots, and short requests queued in
  the gateway): the engine runs clearly fewer than it ran at once in the last few seconds (its slots are free;
  requests arriving during a long prefill step wait for the step, not for a slot), or none of the gateway's own
  requests there is past its first token's due time (`OwnAccounting.overdue`: its prefill, and what was queued
  ahead of it, at the measured rate plus three steps). A request waiting for a slot waits for a generation to
  end, which makes it overdue within a few steps;
- **the pace of admissions**: the backlog estimate also reads many short requests as prefill work: 70 of them (~25
  tokens each) queued in a 4-slot engine made 0.2-1.8 s of it at a rate measured on short prompts (a step's time in
  each), more than half a generation, so the queue never counted and a flood's P2s piled 60-90 deep there for 14 s
  while a 64-slot engine next to it had room (P0 TTFT p99 ~460 ms, nearly every P0 sent to the slow 64-slot one).
  A queue of prefill work drains as fast as the engine prefills; one waiting for slots drains a generation at a
  time. So a queue of at least two, one of the gateway's overdue there, that would take more than three times its
  backlog's time to drain at the pace the engine let requests in lately (first tokens a second over ten scrapes) is
  not prefill-bound (the pace since the queue appeared, over five scrapes at least: before, the engine let in what
  arrived, as fast as it arrived, and over its first steps the pace is a step's luck). Long prompts (3,000 tokens)
  drain at about their backlog's pace. With no first token in that time (a very long prompt in prefill, long
  generations holding every slot) the pace is not known, and the backlog estimate decides as before;

**Discovery**: until a first saturation is learned, a flood reaching a small engine queues inside it for
the two scrapes saturation takes (~0.4 s), first come first served, and a P0 arriving then waits there
(0.4-0.7 s seen on 4-slot engines). So the first scrape showing a backlog already holds the limit at
what the engine runs (the pool shrinks at once: a P0 arriving then stops the excess); the next scrape
confirms the hold (the saturation rule) or undoes it when the engine runs more than that (it was still
taking a burst in); otherwise the first probe judges it (a one-slot trial that a flood refutes within a
scrape; on an engine that runs more, growth by an eighth per scrape). Only a queue at least as long as
the batch holds (a shorter one is more often a step's arrivals at low load), or a backlog (two, and a
quarter of the batch) while a request the gateway sent there is overdue, or a single request waiting that is
both: one of the gateway's there is overdue and the engine's queue holds more than the gateway sent it within
the last step (`aged`: so it waits for a slot, not for the step it arrived in), with the engine at the most it
ran lately: one hold per backlog. Without that last rule an engine fed by P0 traffic alone was never learned:
its queue rarely grows past one, the limit stayed at the ceiling, and routing kept sending P0s into a full
4-slot engine's queue for a whole generation (p99 ~0.4-0.6 s where a 32-slot engine next to it had room).

**Declared**: where the engine says what it runs at once (llama.cpp's `total_slots`, SGLang's
`max_running_requests`, TGI's `max_batch_size`: `Dialect.parallelism`), `declare()` makes that the
ceiling and the learned limit before any traffic, so there is no discovery window: a flood's first
arrivals wait in the gateway's queues from the start. Saturation may still cut below it (a KV cache
that fits fewer sequences than the engine's slots); probes never go above it. vLLM exports no
`max_num_seqs`, so its limit (and the simulator's) is discovered.

Otherwise it starts at the ceiling: the configured `max_concurrency`, or else `upstream.max_connections` (no
more requests can be open to one instance anyway). Starting high costs one scrape interval of engine
queueing on a small engine; starting low would queue every request of a large one in the gateway
while the limit climbs (256 streams to an engine that runs 256 would wait ~1 s for a limit that
doubles per scrape).
"""

from __future__ import annotations

from collections import deque

#: Consecutive scrapes with requests waiting in the engine before it counts as saturated.
_SATURATED_SCRAPES = 2
#: Scrapes over which the most the engine ran at once is remembered (5 s at the default interval).
_PEAK_SCRAPES = 25
#: Scrapes a probe may stay unjudged (neither confirmed nor refuted) before it lapses (1 s by default).
_TRIAL_SCRAPES = 5
#: Scrapes over which the pace of admissions (first tokens a second) is measured (2 s at the default interval).
_ANSWER_SCRAPES = 10
#: Scrapes of a queue before its pace is judged: over the first few the engine has taken a step or two, and a 24-slot
#: engine admitting a flood's prompts 2,048 tokens a step showed a pace that read its queue as slot-bound (held at 9).
_PACE_SCRAPES = 5
#: How many times longer than its prefill backlog explains a queue must take to drain at that pace to wait for slots.
_SLOW_DRAIN = 3


class ConcurrencyLimit:
    __slots__ = (
        "_answers",
        "_calm",
        "_configured",
        "_held",
        "_held_from",
        "_kv_bound",
        "_learned",
        "_prev_running",
        "_recent",
        "_stated",
        "_streak",
        "_trial_from",
        "_trial_scrapes",
        "_wait",
        "adaptive",
        "ceiling",
        "cooldown",
        "declared",
        "limit",
    )

    def __init__(self, ceiling: int, *, adaptive: bool = True, cooldown: int = 300, stated: bool = False) -> None:
        """`stated`: the ceiling is a number given for this engine (`max_concurrency`, a sidecar's publication), taken
        as its slots (`known_slots`) until the engine shows fewer; else it is only a bound (`max_connections`)."""
        if ceiling < 1:
            raise ValueError("ceiling must be >= 1")
        self.ceiling = ceiling
        self._configured = ceiling
        self._stated = stated
        #: What the engine said it runs at once (`declare()`), if it says.
        self.declared: int | None = None
        #: The current limit (1..ceiling).
        self.limit = ceiling
        #: False: the limit is the configured number, whatever the engine says.
        self.adaptive = adaptive
        #: Scrapes without saturation before the limit may grow again.
        self.cooldown = cooldown
        self._streak = 0
        self._prev_running: float | None = None
        self._calm = cooldown  # scrapes since the last saturation (none seen yet: may grow at once)
        #: Scrapes to wait before the next probe: `cooldown`, doubled (up to 10x) each time a probe only found
        #: the limit it started from again, so that a stable engine is probed ever more rarely.
        self._wait = cooldown
        #: The limit the last saturation set (None: none yet), and whether the engine's KV cache was full then.
        self._learned: int | None = None
        self._kv_bound = False
        #: What the engine ran at once in recent scrapes: it can run at least their maximum.
        self._recent: deque[float] = deque(maxlen=_PEAK_SCRAPES)
        #: Discovery (no limit learned yet): the limit a first backlog was held from until the next scrape
        #: judges it, and whether this backlog already had its hold (one per backlog).
        self._held_from: int | None = None
        self._held = False
        #: The limit a probe started from while it is on trial (None: no probe pending).
        self._trial_from: int | None = None
        self._trial_scrapes = 0
        #: (when, first tokens seen so far) at recent scrapes: the pace of admissions (`_admitted_per_s`).
        self._answers: deque[tuple[float, int]] = deque(maxlen=_ANSWER_SCRAPES)

    def observe(
        self,
        running: float | None,
        waiting: float | None,
        in_flight: int,
        prefill_backlog_s: float = 0.0,
        decode_s: float | None = None,
        overdue: bool | None = None,
        kv_full: bool = False,
        aged: bool | None = None,
        answered: tuple[float, int] | None = None,
        filled: bool = False,
    ) -> bool:
        """One scrape's signals and the gateway's requests there now; True if the limit changed.
        `prefill_backlog_s`: the prefill work the gateway has sent there and not seen answered, in seconds
        at its measured rate (0 when the rate is not measured); `decode_s`: the mean time a request holds
        its slot after its first token: 0.0 while not measured (no saturation is judged before the
        instance answered a request), None when the caller has no such signal (the queue alone counts);
        `overdue`: whether a request the gateway sent there waits past its first token's due time
        (`OwnAccounting.overdue`; None: not known). `kv_full`: the engine's KV cache is (nearly) full: it runs what
        fits there, fewer than its slots, and that count moves as sequences grow and are preempted (an outside run:
        a 16-slot engine whose cache fitted 8-14 ran 8-14 with 40 waiting, which read as free slots, and its limit
        stayed at the ceiling for 20 s while P0 waited there behind them). `aged`: the engine's queue holds more than
        the gateway sent it within the last step (`OwnAccounting.queued_beyond`; None: not known). `answered`: when
        (monotonic seconds) and how many first tokens the gateway had seen there so far (`OwnAccounting.answered`):
        how fast the engine lets requests in. `filled`: the gateway held the limit's worth there at some moment since
        the last scrape (`Instance.filled_to`)."""
        if not self.adaptive or running is None or waiting is None:
            self._streak = 0
            return False
        previous = self._prev_running
        self._prev_running = running
        self._recent.append(running)
        if answered is not None:
            if waiting < 1:  # the pace counts while requests wait: before, it is the pace they arrived at
                self._answers.clear()
            self._answers.append(answered)
        unexplained = decode_s is None or (decode_s > 0 and prefill_backlog_s < 0.5 * decode_s)
        if not unexplained and overdue is True and waiting >= 2:
            # A queue of prefill work drains as fast as the engine prefills: at the pace it lets requests in lately,
            # it would be gone within the backlog's time. One that would take several times longer waits for slots
            # (module docstring, "the pace of admissions").
            pace = self._admitted_per_s()
            unexplained = pace is not None and waiting > _SLOW_DRAIN * max(1.0, pace * prefill_backlog_s)
        # An engine at its parallelism runs about the most it ran lately while requests wait; one that runs clearly
        # fewer has free slots, and its queue waits for something else (its step's token budget, behind a long
        # prefill that the gateway's own count may have missed).
        peak = max(self._recent)
        below_peak = running < peak - max(1.0, 0.1 * peak) and not kv_full
        prefill_bound = waiting >= 1 and running >= 1 and (not unexplained or below_peak or overdue is False)
        if self._trial_from is not None:  # a queue prefill explains neither confirms nor refutes a probe
            # (Nor does one the gateway sent within the last step, `aged` False: it waits for the step it arrived in.)
            queued = 0.0 if prefill_bound or aged is False else waiting
            return self._judge(running, queued, in_flight)
        if prefill_bound:
            self._streak = 0
            return False
        backlog = waiting >= max(2.0, 0.25 * running)
        # One request waiting, but for a slot: it is older than a step and one of the gateway's is overdue there.
        lone = self._learned is None and overdue is True and aged is True and in_flight > running
        if waiting >= 1 and running >= 1 and (backlog or in_flight >= self.limit or lone):
            steady = kv_full or (previous is not None and abs(running - previous) <= max(1.0, 0.1 * running))
            self._streak = self._streak + 1 if steady or self._streak == 0 else 1
            held = self._held_from
            if held is not None and running > self.limit:  # the engine was still taking them in: undo
                self._held_from = None
                return self._set(held)
            if self._streak >= _SATURATED_SCRAPES:
                self._held_from = None
                # Never below what it ran at once in the last few seconds: at a full limit a slot freed
                # a moment ago shows as one running fewer and one waiting, and cutting to that ratchets
                # the limit down to nothing (`bench overload --scrape`: 11 of 72 req/s served at 2.5x).
                found = round(max(self._recent))
                if not backlog and self._learned is not None:
                    # One waiting while the gateway holds its whole limit there is also what a slot freed a
                    # moment ago looks like; with the strict reserve keeping a slot free most of the time, the
                    # engine may not show its full count for 25 scrapes (a 4-slot engine's limit fell to 3 under
                    # the P1 + P2 flood). Such weak evidence does not cut below what a saturation learned.
                    found = max(found, self._learned)
                changed = self._saturated(found)
                self._kv_bound = kv_full
                return changed
            if self._learned is None and not self._held and (waiting >= running or (backlog and overdue) or lone):
                # Discovery: a first backlog as long as the batch holds the limit at what the engine runs
                # until a later scrape confirms it (saturation), undoes it (running grew past it) or a probe
                # judges it. A shorter queue is more often a step's arrivals at low load, unless the gateway's
                # own requests there are overdue: then they wait for slots, not for a step (a 16-slot engine
                # needed 16 waiting, ~0.7 s into a flood, while P0 waited there behind them).
                self._held = True
                cut = max(1, round(max(self._recent)))
                if cut < self.limit:
                    self._held_from = self.limit
                    return self._set(cut)
            return False
        self._held = False
        held = self._held_from
        if held is not None and running > self.limit:
            # The engine runs more than the hold: a burst it was still taking in. Undo. Otherwise the hold
            # stays (undoing it on an empty queue, or on the gateway holding one fewer there for a moment,
            # let the flood queue inside the engine again); the probe that follows judges it.
            self._held_from = None
            self._streak = 0
            return self._set(held)
        self._streak = 0
        self._calm += 1
        # A limit a full KV cache set is what fitted there then, not the engine's slots: once the cache has room
        # again, probing needs no cooldown (an outside run: a 64-slot engine's limit, cut to 9 while 20 clients that
        # never read held long streams there, stayed at 9 for 13 minutes of ordinary traffic, probes ever rarer).
        relieved = self._kv_bound and not kv_full
        if waiting < 1 and (in_flight >= self.limit or filled) and (self._calm >= self._wait or relieved):
            # After a saturation the first step is one slot: a refuted probe queues one request, not an eighth.
            step = 1 if self._learned is not None and self.limit <= self._learned else max(1, self.limit // 8)
            before = self.limit
            if self._set(self.limit + step):
                self._held_from = None  # a hold is judged by this probe from here on
                self._trial_from = before
                self._trial_scrapes = 0
                return True
        return False

    def _admitted_per_s(self) -> float | None:
        """First tokens a second over the scrapes remembered (`_ANSWER_SCRAPES`): the pace at which the engine lets
        requests in. None: not known (fewer than `_PACE_SCRAPES` since the queue appeared, or none let in: an engine
        prefilling one very long prompt lets none in for a while, and so does one whose slots hold long
        generations)."""
        answers = self._answers
        if len(answers) < _PACE_SCRAPES:
            return None
        (start, first), (end, last) = answers[0], answers[-1]
        if end <= start or last <= first:
            return None
        return (last - first) / (end - start)

    def known_slots(self) -> int | None:
        """How many requests the engine is known to run at once (None: not known): while a probe above it is on
        trial, the limit it started from; else the limit a saturation set, a first backlog holds, the engine
        declared or the configuration stated. Not a default ceiling nor a limit still growing after a confirmed
        probe: those are guesses."""
        if self._trial_from is not None:
            return self._trial_from
        if self._learned is not None or self._held_from is not None:
            return self.limit
        return self.limit if self._stated and self.limit == self._configured else None

    def declare(self, parallelism: int | None) -> bool:
        """The engine's own count of what it runs at once (None: it says nothing, or no longer does):
        the ceiling and the learned limit from now on, under the configured ceiling. True if the limit
        changed. A fixed (non-adaptive) limit ignores it."""
        if not self.adaptive or parallelism == self.declared:
            return False
        self.declared = parallelism
        self._held_from = None
        self._held = False
        self._trial_from = None
        self._streak = 0
        if parallelism is None:  # back to discovering under the configured ceiling
            self.ceiling = self._configured
            self._learned = None
            return False
        self.ceiling = max(1, min(self._configured, parallelism))
        self._learned = self.ceiling
        self._calm = 0
        self._wait = self.cooldown
        return self._set(self.ceiling)

    def _judge(self, running: float, waiting: float, in_flight: int) -> bool:
        """One scrape during a probe's trial (see the module docstring); True if the limit changed."""
        base = self._trial_from
        assert base is not None
        self._trial_scrapes += 1
        if running > base:  # the engine runs more than before: confirmed, the next scrape may grow again
            self._trial_from = None
            self._learned = None
            self._wait = self.cooldown
            return False
        if waiting >= 1 and in_flight > base:  # its queue is the probe's own: refuted
            self._trial_from = None
            return self._saturated(base, refuted=True)
        if self._trial_scrapes >= _TRIAL_SCRAPES:  # never filled: back, try again after the same wait
            self._trial_from = None
            self._calm = 0
            return self._set(base)
        return False

    def _saturated(self, found: int, *, refuted: bool = False) -> bool:
        """The engine runs `found` at once and queues the rest: that is the limit, probed again later
        (`refuted`: a probe found the same limit again, so the next waits twice as long)."""
        self._streak = 0
        self._calm = 0
        self._kv_bound = False
        found = max(1, min(self.ceiling, found))
        if refuted:
            self._wait = min(self._wait * 2, 10 * self.cooldown)
        elif found != self._learned:
            self._wait = self.cooldown
        self._learned = found
        return self._set(found)

    def _set(self, value: int) -> bool:
        value = max(1, min(self.ceiling, value))
        if value == self.limit:
            return False
        self.limit = value
        return True


def prefill_backlog_s(queued_prompt_tokens: int, measured_tps: float, default_tps: float) -> float:
    """Seconds of prefill the gateway has sent to an instance and not seen answered: at its measured rate,
    or `default_tps` until that is measured (short prompts alone never measure it, and a long prompt sent
    to a fresh instance must count as prefill work from the start)."""
    return max(0, queued_prompt_tokens) / (measured_tps or default_tps)
