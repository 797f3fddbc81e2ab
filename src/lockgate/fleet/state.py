"""What the gateway knows about one instance's load, from two sources, each with its age.

- `OwnAccounting`: what the gateway itself sent and saw — requests in flight (kept on `Instance`),
  prompt tokens queued (sent, first token not back yet), TTFT / TPOT / decode time and the prefill rate
  as EWMAs, errors. Always current for the gateway's own traffic.
- `EngineLoad`: the engine's own metrics, scraped on an interval (`scrape.py`). It also sees other
  clients' traffic, but it is late by up to an interval, and after a failure or a mass cancellation it
  can be stale (vLLM #29928); past `stale_after` it is not trusted at all.
- `Published`: for an engine behind a sidecar (cluster mode), what that sidecar published through etcd;
  its load numbers (which count every replica's traffic) arrive as the instance's `EngineLoad`.

`merge()` is the one place the two are combined into the `InstanceView` a policy sees. Own accounting is
never replaced by the scrape, only raised by it (max): a burst sent since the last scrape still counts,
so policies do not herd onto an instance whose metrics are 200 ms old. Health checks never touch these
counters (vllm-router #197).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from ..routing.config import PredictedTTFTOptions
from ..routing.policies import InstanceView


class Ewma:
    """Exponentially weighted moving average; `value` is 0.0 until the first sample."""

    __slots__ = ("alpha", "samples", "updated_at", "value")

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value = 0.0
        self.samples = 0
        self.updated_at: float | None = None

    def add(self, sample: float, now: float) -> None:
        self.value = sample if self.samples == 0 else self.value + self.alpha * (sample - self.value)
        self.samples += 1
        self.updated_at = now


class Moments:
    """Exponentially weighted first and second moments of (x, y) pairs, for a running linear fit."""

    __slots__ = ("alpha", "mx", "my", "samples", "sxx", "sxy")

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.samples = 0
        self.mx = self.my = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        if self.samples == 0:
            self.mx, self.my = x, y
        else:
            a = self.alpha
            dx, dy = x - self.mx, y - self.my
            self.mx += a * dx
            self.my += a * dy
            # West's exponentially weighted (co)variance update.
            self.sxx = (1 - a) * (self.sxx + a * dx * dx)
            self.sxy = (1 - a) * (self.sxy + a * dx * dy)
        self.samples += 1

    def slope(self) -> float:
        """dy/dx of the fit; 0.0 until x has varied enough (a spread of about one token) to tell."""
        if self.samples < 4 or self.sxx < 1.0:
            return 0.0
        return max(0.0, self.sxy / self.sxx)


class Attempt:
    """One request attempt's contribution to its instance's accounting (held by its `Lease`)."""

    __slots__ = ("backlog", "first_at", "holding", "long", "sent_at", "tokens", "whole")

    def __init__(self, tokens: int, backlog: int, sent_at: float, long: bool = False, whole: bool = False) -> None:
        self.tokens = tokens  # uncached prompt tokens it queued
        self.backlog = backlog  # prompt tokens queued ahead of it when sent
        self.sent_at = sent_at
        self.first_at: float | None = None
        self.long = long  # a long prompt (`routing.long_prefill_ms`) whose first token has not come back
        #: The engine answers it with one body: its first token is never seen, only its end (it stays "unanswered"
        #: while it generates).
        self.whole = whole
        #: A strict class's request whose first token has not come back: it holds the instance (`OwnAccounting.held`).
        self.holding = False


#: Prefill-rate samples need enough tokens to be meaningful next to one step's fixed cost.
_MIN_RATE_TOKENS = 256
#: Prefill-rate samples after which one sample moves the rate by at most `_RATE_SWING` times (`_measure_first_token`).
_RATE_SETTLED = 3
_RATE_SWING = 4.0
#: Prefill rate assumed until an instance's own is measured (the routing default's), tokens/s.
_DEFAULT_PREFILL_TPS = PredictedTTFTOptions().default_prefill_tps
#: At most this many times slower than estimated is read from prompts past their estimate (`backlog_tokens`).
_MAX_SLOWDOWN = 20.0
#: Samples an instance's latency floor is the least of (`OwnAccounting.latency_floor`).
_FLOOR_SAMPLES = 8
#: A stream's output tokens at which its time per token so far is a sample of the engine's step (`decoding`).
STEP_TOKENS = 8
#: How long after it was sent a strict request still waiting for its first token holds its instance (`held`): an
#: engine that answers nothing that long is not made to wait on by the less urgent requests sent there.
HOLD_MAX_S = 2.0


class OwnAccounting:
    def __init__(self) -> None:
        self.queued_prompt_tokens = 0
        self.ttft = Ewma()
        self.tpot = Ewma()
        #: Time per output token of streams still decoding, taken once from each at its `STEP_TOKENS`th token: the
        #: step before any stream ended here (`step_s`).
        self.live_tpot = Ewma()
        self.decode = Ewma()
        self.prefill_tps = Ewma()
        self.prompt_tokens = Ewma()
        #: Whole (non-streamed) answers: (tokens, seconds) moments for the TPOT fit, and their times.
        self.whole = Moments()
        self.whole_time = Ewma()
        self.errors = 0
        self.updated_at: float | None = None
        #: When the prompt tokens sent here should all be prefilled, at the measured rate (monotonic), and
        #: when the run of prompts that estimate covers began (the last time nothing was pending here).
        self.prefill_until = 0.0
        self.busy_since = 0.0
        #: The rate assumed until measured: the routing's `predicted_ttft.default_prefill_tps` (its pool sets
        #: it), so that this estimate and the routing's prediction agree about an unmeasured instance.
        self.default_tps = _DEFAULT_PREFILL_TPS
        #: Long prompts sent here whose first token has not come back (`routing.long_prefill_ms`); and what to
        #: call when one of them, or a strict request holding the instance (`held`), is answered or ends: the fleet
        #: wakes the requests waiting for their turn.
        self.long_pending = 0
        self.on_turn: Callable[[], None] | None = None
        #: Strict requests sent here whose first token has not come back (`hold`), and when the latest was sent.
        self.urgent_pending = 0
        self.urgent_sent_at = 0.0
        #: The attempts sent here whose first token has not come back (queued or in prefill there), oldest first: the
        #: streamed ones, and those answered as one body (their first token is never seen; they stay until their end).
        self._unanswered: dict[Attempt, None] = {}
        self._unanswered_whole: dict[Attempt, None] = {}
        #: The streamed attempts answered here and not ended (they hold a sequence slot, decoding), oldest first.
        self._decoding: dict[Attempt, None] = {}
        #: When the engine last showed progress here: a first token, or an answer that ended with tokens.
        self.progress_at = 0.0
        #: First tokens seen here so far: how fast the engine lets requests in (`ConcurrencyLimit.observe`).
        self.answered = 0
        #: Attempts that ended here before their first token so far (stopped, left, failed): those waiting at a scrape
        #: that ended since are not someone else's (`EngineLoad.own_left`, `merge`).
        self.left_unanswered = 0
        #: The last `_FLOOR_SAMPLES` latencies (`latency_floor`), and when the last was taken.
        self._latencies: collections.deque[float] = collections.deque(maxlen=_FLOOR_SAMPLES)
        self.latency_at: float | None = None

    @property
    def latency_floor(self) -> float:
        """The least of the recent first tokens' latencies here: what a first token took beyond the prefill and the
        step the estimates account for (0.0: none measured yet). An engine slow for reasons of its own (a fixed second
        whatever the prompt) has a floor the prefill rate does not show; a burst of long prompts does not raise it."""
        return min(self._latencies) if self._latencies else 0.0

    def _measure_first_token(self, ttft: float, work: int, step: float, now: float) -> None:
        """A first token after `work` tokens of prefill (this prompt and what was queued ahead of it) and a step: a
        sample of the latency floor, and of the prefill rate when the work is enough to tell."""
        self._latencies.append(max(0.0, ttft - work / self.rate - step))
        self.latency_at = now
        busy = ttft - step
        if work >= _MIN_RATE_TOKENS and busy > 0:
            sample, measured = work / busy, self.prefill_tps
            if measured.samples >= _RATE_SETTLED:
                # One sample moves a settled rate by at most `_RATE_SWING` times: a P0 sent behind 45,000 tokens of
                # queued P2 prompts had them stopped (`PoolScheduler.make_room`) and its first token came in 20 ms, a
                # sample of millions of tokens a second that took the rate 100x up, and the queue left there read as
                # no prefill work at all (an 8-slot engine's limit held at 3 by it, in an outside run's fleet).
                sample = min(max(sample, measured.value / _RATE_SWING), measured.value * _RATE_SWING)
            measured.add(sample, now)

    def waiting_since(self, attempt: Attempt) -> float:
        """Since when `attempt` (unanswered) has waited with nothing to show: its sending, or the engine's last progress
        here if that came later (an engine that answers others is working, whatever keeps this one waiting)."""
        return max(attempt.sent_at, self.progress_at)

    def oldest_unanswered(self) -> tuple[Attempt | None, Attempt | None]:
        """The streamed attempt sent here the longest ago whose first token has not come back, and the oldest whole
        one (still generating, or waiting: its first token is never seen)."""
        return next(iter(self._unanswered), None), next(iter(self._unanswered_whole), None)

    def _waiting(self, attempt: Attempt) -> dict[Attempt, None]:
        return self._unanswered_whole if attempt.whole else self._unanswered

    @property
    def pending(self) -> int:
        """Attempts sent here whose first token has not come back (they are queued or in prefill there)."""
        return len(self._unanswered) + len(self._unanswered_whole)

    @property
    def rate(self) -> float:
        """Its measured prefill rate, or the default until measured (tokens/s)."""
        return self.prefill_tps.value or self.default_tps

    def remaining_prompt_tokens(self, now: float) -> int:
        """Of the prompt tokens queued here (sent, first token not back), those not prefilled yet by
        the estimate: an instance that has been prefilling a long prompt for a while is closer to done
        than one just sent it, and a short request routed now waits only for the rest. Once the
        estimate has run out (the engine is slower than measured) nothing more is assumed: the next
        first token re-measures the rate."""
        queued = self.queued_prompt_tokens
        if queued <= 0:
            return 0
        return min(queued, max(0, round((self.prefill_until - now) * self.rate)))

    def backlog_tokens(self, now: float) -> int:
        """The prompt work routing counts as queued here, in tokens at the estimated rate: what
        `remaining_prompt_tokens` estimates while the estimate runs. Once the estimate (and one decode step
        after it) has run out with prompts still unanswered, the engine is slower than estimated: by at
        least the time this run of prompts has taken over the time it should have, and every unanswered
        prompt token counts, scaled by that (at most `_MAX_SLOWDOWN`). Before, nothing was assumed queued
        then: a slow instance looked idle exactly while it was overdue, and took every arrival until its
        first answer (`bench routing`, bursty/slow: 22 requests sent to the slow engine in its first 0.16 s,
        engine-side TTFT 170-320 ms)."""
        queued = self.queued_prompt_tokens
        due = self.prefill_until + self.tpot.value
        if queued <= 0 or self.pending <= 0 or now <= due:
            return self.remaining_prompt_tokens(now)
        expected = due - self.busy_since
        slowdown = _MAX_SLOWDOWN if expected <= 0 else min(_MAX_SLOWDOWN, (now - self.busy_since) / expected)
        return round(queued * max(1.0, slowdown))

    def start(self, uncached_tokens: int, now: float, long: bool = False, whole: bool = False) -> Attempt:
        attempt = Attempt(uncached_tokens, self.remaining_prompt_tokens(now), now, long, whole)
        if long:
            self.long_pending += 1
        if self.pending > 0:
            # Queued behind what is unanswered here: after it, even when that is overdue (counting from now
            # would hide how far behind the estimate the engine is).
            self.prefill_until += uncached_tokens / self.rate
        else:
            if self.prefill_until <= now:
                self.busy_since = now
            self.prefill_until = max(now, self.prefill_until) + uncached_tokens / self.rate
        self.queued_prompt_tokens += uncached_tokens
        self._waiting(attempt)[attempt] = None
        self.prompt_tokens.add(uncached_tokens, now)
        self.updated_at = now
        return attempt

    def decode_s(self, now: float) -> float:
        """How long a request holds its slot here after its first token: the mean measured at their ends; before
        any ended here (a fresh instance, a flood's first generation), how long the oldest stream still running here
        has held its slot so far, a lower bound that grows as it decodes (0.0: none is decoding here yet)."""
        if self.decode.samples:
            return self.decode.value
        oldest = next(iter(self._decoding), None)
        return 0.0 if oldest is None or oldest.first_at is None else max(0.0, now - oldest.first_at)

    def exceeds_step(self, tokens: int) -> bool:
        """Whether `tokens` of prompt take the engine longer to prefill than a step, at the measured rate and step (in
        the same step as a strict request's first token, they delay it by more than a step: `held`,
        `Lease.prefill_exceeds_step`). False while no step is measured (the TTFT that `step_s` falls back on
        includes queueing and prefill): nothing is stopped or held on a guess."""
        step = self.measured_step()
        return step is not None and tokens / self.rate > step

    def step_s(self) -> float | None:
        """The engine's step here: the measured TPOT; before any stream ended here (a fresh gateway, a flood's
        first seconds), that of the streams decoding here (`decoding`), else the measured TTFT, which holds at least
        a step (an upper bound: a due time later than it could be, never earlier); None while none is measured. Long
        generations end late: a flood of them with long prompts had a 60 ms engine's step read as its P2s' TTFT for
        its first seconds, ~4 s, and a P0 sent there due only after 17 s, which is when it is given a slot (an outside
        fleet: 2.8-3.7 s)."""
        step = self.measured_step()
        if step is not None:
            return step
        return self.ttft.value if self.ttft.samples else None

    def measured_step(self) -> float | None:
        """The engine's step as its streams measure it: their TPOT, before any ended here that of those decoding
        (`decoding`); None while neither is measured."""
        tpot = self.tpot if self.tpot.samples else self.live_tpot
        return tpot.value if tpot.samples else None

    def decoding(self, attempt: Attempt, tokens: int, now: float) -> None:
        """`attempt`, streaming, has produced `tokens` (at least `STEP_TOKENS`) by `now`: a sample of the step."""
        first = attempt.first_at
        if first is not None and now > first:
            self.live_tpot.add((now - first) / (tokens - 1), now)

    def first_token_due(self, attempt: Attempt, slack_steps: int = 1) -> float | None:
        """The latest `attempt` (sent here, unanswered) should have had its first token if the engine took it
        in at once: its prefill and what was queued ahead of it, at the measured rate, plus two steps (the
        rest of the step it arrived in, and its own) and `slack_steps` more for a loaded host. Past that it
        waits in the engine's own queue for a sequence slot. None once answered, or while no step is known
        (`step_s`: before it, a P0 sent behind a fresh gateway's flood waited a whole generation there)."""
        step = self.step_s()
        if attempt.first_at is not None or attempt.whole or step is None:
            return None
        steps = 2 + slack_steps
        return attempt.sent_at + (attempt.backlog + attempt.tokens) / self.rate + steps * step

    def overdue(self, now: float) -> bool | None:
        """Whether an attempt sent here is past its `first_token_due`: it waits in the engine's own queue for a
        sequence slot. None while the step time is not measured (nothing can be called overdue)."""
        if not self.tpot.samples:
            return None
        for attempt in self._unanswered:
            due = self.first_token_due(attempt)
            if due is not None and now > due:
                return True
        return False

    def queued_beyond(self, waiting: float, at: float) -> bool | None:
        """Whether an engine that had `waiting` requests in its queue at `at` (a scrape) holds more there than the
        gateway sent it within the step before (`tpot`): those may only wait for the step they arrived in, but an
        engine with a free slot takes every older request in at its next step. More waiting: older requests wait
        for a slot, the engine is full, and a request sent there waits behind them. Other clients of the engine
        count as older (an engine shared with other gateways is called full sooner). None while no step is known
        (`step_s`)."""
        step = self.step_s()
        if step is None:
            return None
        since = at - step
        young = 0
        for sent in (self._unanswered, self._unanswered_whole):
            for attempt in reversed(sent):  # newest first
                if attempt.sent_at <= since:
                    break
                young += 1
        return waiting > young

    def adopt(self, attempt: Attempt, now: float) -> Attempt:
        """An attempt routed to another instance and served here (a sidecar chose this engine of its
        node): queued here from now, timed from when it was sent. The other instance `end`s its own (first:
        `Lease.move`), which gives back a long prompt's turn there; none is taken here, as an instance behind a
        sidecar never holds one (`Pool.is_long`)."""
        moved = self.start(attempt.tokens, now, whole=attempt.whole)
        moved.sent_at = attempt.sent_at
        return moved

    def first_token(self, attempt: Attempt, now: float, measure: bool = True) -> None:
        """The attempt's first token came back. `measure`: its time measures the prefill rate and the latency
        floor; not when it may have waited for a sequence slot (`engine_queues`), which no prefill explains."""
        if attempt.first_at is not None:
            return
        attempt.first_at = now
        self.progress_at = now
        self.answered += 1
        self.queued_prompt_tokens -= attempt.tokens
        self._waiting(attempt).pop(attempt, None)
        self._decoding[attempt] = None
        if attempt.long:
            self._long_done(attempt)
        if attempt.holding:
            self._urgent_done(attempt)
        ttft = now - attempt.sent_at
        self.ttft.add(ttft, now)
        # The instance prefilled what was queued ahead plus this prompt before answering.
        if measure:
            self._measure_first_token(ttft, attempt.backlog + attempt.tokens, self.tpot.value, now)
        if now > self.prefill_until:
            # It was overdue: what is still queued is estimated afresh from here, at the rate just measured.
            self.busy_since = now
            self.prefill_until = now + max(0, self.queued_prompt_tokens) / self.rate
        self.updated_at = now

    def end(
        self,
        attempt: Attempt,
        now: float,
        completion_tokens: int,
        *,
        whole: bool = False,
        engine_tpot: float = 0.0,
        measure: bool = True,
    ) -> None:
        """The attempt is over (whichever way). Idempotence is the lease's job.

        `whole`: a non-streamed answer of `completion_tokens` tokens arrived complete (no first-token
        time was seen): its time is split into TTFT and decode by `_split_whole`."""
        if completion_tokens > 0:
            self.progress_at = now
        if attempt.first_at is None:
            self.left_unanswered += 1
            self.queued_prompt_tokens -= attempt.tokens
            self._waiting(attempt).pop(attempt, None)
            if attempt.long:
                self._long_done(attempt)
            if attempt.holding:
                self._urgent_done(attempt)
            if whole and completion_tokens >= 1:
                self.whole_time.add(now - attempt.sent_at, now)
                self._split_whole(attempt, now, completion_tokens, engine_tpot, measure)
        else:
            self._decoding.pop(attempt, None)
            decode = now - attempt.first_at
            self.decode.add(decode, now)
            if completion_tokens > 1:
                self.tpot.add(decode / (completion_tokens - 1), now)
        self.updated_at = now

    def _long_done(self, attempt: Attempt) -> None:
        attempt.long = False
        self.long_pending -= 1
        if self.on_turn is not None:
            self.on_turn()

    def hold(self, attempt: Attempt, now: float) -> None:
        """`attempt` (streamed, unanswered) is a strict request's, about to be sent: until its first token comes back
        (or it ends, or `HOLD_MAX_S` pass) the instance is `held`. Its backlog is what is still queued ahead of it: the
        less urgent prompts stopped for it since it was counted (`PoolScheduler.make_room`) are not, and its due time
        (`first_token_due`) does not wait for them (an outside fleet: a P0's first token came after 2.8 s on a
        24-slot engine full of P2 generations; its due time, which frees a slot, counted 8,000 tokens of P2 prompts
        stopped for it)."""
        if attempt.holding or attempt.first_at is not None or attempt.whole:
            return
        attempt.backlog = min(attempt.backlog, max(0, self.remaining_prompt_tokens(now) - attempt.tokens))
        attempt.holding = True
        self.urgent_pending += 1
        self.urgent_sent_at = max(self.urgent_sent_at, attempt.sent_at)

    def held(self, now: float) -> float:
        """How much longer less urgent prompts that take longer than a step to prefill (`exceeds_step`) are not sent
        here (0.0: they may be): while a strict request sent here waits for its first token, at most `HOLD_MAX_S` from
        the latest one's sending. The engine takes in what is sent to it at its next step first come, first served,
        whatever the gateway's priorities, and the step lasts as long as the prefill it carries: a long prompt sent
        there after a P0 went into the P0's first step with it (an outside fleet's P0 first tokens at 0.5-1 s, a step
        with 2,048 tokens of prefill). A shorter one delays it by less than a step, and is sent."""
        if not self.urgent_pending:
            return 0.0
        return max(0.0, self.urgent_sent_at + HOLD_MAX_S - now)

    def _urgent_done(self, attempt: Attempt) -> None:
        attempt.holding = False
        self.urgent_pending -= 1
        if self.on_turn is not None:
            self.on_turn()

    def _split_whole(self, attempt: Attempt, now: float, tokens: int, engine_tpot: float, measure: bool) -> None:
        """A non-streamed answer's total time L = TTFT + (tokens - 1) * TPOT, with TPOT from this
        instance's streams if it has any, else from a least-squares fit of L against the token count
        over recent whole answers (exponentially weighted moments; needs answers of different
        lengths), else the engine's own reported mean TPOT (scraped), else unknown (no sample)."""
        total = now - attempt.sent_at
        whole = self.whole
        whole.add(float(tokens), total)
        tpot = self.tpot.value if self.tpot.samples else whole.slope() or engine_tpot
        if tpot <= 0:
            return
        ttft = max(0.0, total - (tokens - 1) * tpot)
        attempt.first_at = attempt.sent_at + ttft
        self.ttft.add(ttft, now)
        if measure:
            self._measure_first_token(ttft, attempt.backlog + attempt.tokens, tpot, now)
        self.decode.add(total - ttft, now)

    def error(self, now: float) -> None:
        self.errors += 1
        self.updated_at = now


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's metrics (None: the engine does not export that signal)."""

    scraped_at: float
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    tpot_seconds: float | None = None
    tpot_tokens: float | None = None
    #: Its KV cache's size in tokens, as the engine reports it (vLLM: num_gpu_blocks x block_size).
    cache_tokens: int | None = None
    prefix_hit_rate: float | None = None
    #: Published by a sidecar (cluster mode): requests other gateway replicas have there (its accounting
    #: minus this replica's own when received).
    foreign_in_flight: int = 0
    #: How many of the gateway's requests there had ended before their first token when the scrape landed
    #: (`OwnAccounting.left_unanswered`; None: not recorded): those ending since may be in its `waiting` (`merge`).
    own_left: int | None = None

    def age(self, now: float) -> float:
        return now - self.scraped_at

    @property
    def tpot_s(self) -> float | None:
        """The engine's own mean time per output token since it started (None: not exported yet)."""
        if self.tpot_seconds is None or not self.tpot_tokens:
            return None
        return self.tpot_seconds / self.tpot_tokens


class HitRateGap:
    """How far the prefix index's predicted hit rate runs above the engine's own (positive: the index
    believes more is cached than the engine has: it does not see all of the engine's evictions, or the
    engine serves other clients). Computed between scrapes over the prompt tokens of that interval, as an
    EWMA; 0.0 until both sides have seen prompt tokens."""

    __slots__ = ("_engine", "_predicted", "ewma")

    def __init__(self) -> None:
        self.ewma = Ewma(alpha=0.2)
        self._predicted: tuple[int, int] | None = None
        self._engine: tuple[float, float] | None = None

    @property
    def value(self) -> float:
        return self.ewma.value

    def observe(self, predicted_hits: int, predicted_queries: int, load: EngineLoad) -> None:
        if load.prefix_hits is None or load.prefix_queries is None:
            return
        previous, engine_before = self._predicted, self._engine
        self._predicted = (predicted_hits, predicted_queries)
        self._engine = (load.prefix_hits, load.prefix_queries)
        if previous is None or engine_before is None:
            return
        queries = predicted_queries - previous[1]
        engine_queries = load.prefix_queries - engine_before[1]
        if queries <= 0 or engine_queries <= 0:
            return
        predicted = (predicted_hits - previous[0]) / queries
        engine = (load.prefix_hits - engine_before[0]) / engine_queries
        self.ewma.add(predicted - engine, load.scraped_at)


@dataclass(frozen=True, slots=True)
class Published:
    """The third source: what the sidecar in front of a remote engine published about it through etcd
    (`lockgate.cluster`), received at `received_at` (this process's monotonic clock: ages never depend
    on another host's clock). Its load numbers reach routing as the instance's `EngineLoad`."""

    node: str
    #: The engine's key at its sidecar (sent back in `x-lockgate-engine`).
    engine_id: str
    seq: int
    received_at: float
    in_flight: int = 0
    queued_prompt_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prefill_tps: float = 0.0
    #: The engine's dialect at its sidecar (`engine:` there): what it can do, which this replica, speaking to the
    #: sidecar as to any OpenAI server, cannot tell from its own dialect (`Instance.continues_chat`).
    engine: str = "openai"

    def age(self, now: float) -> float:
        return now - self.received_at


def merge(
    *,
    key: str,
    name: str,
    routable: bool,
    in_flight: int,
    max_concurrency: int,
    own: OwnAccounting,
    engine: EngineLoad | None,
    now: float,
    stale_after: float,
    cached_tokens: int = 0,
    cache_room: int | None = None,
    stoppable: int = 0,
    stoppable_waiting: int = 0,
) -> InstanceView:
    queued = own.backlog_tokens(now)
    fresh = engine is not None and engine.age(now) <= stale_after
    if fresh and engine is not None:
        # Behind a sidecar: the slots the other replicas' requests take there are taken for this one too.
        in_flight += engine.foreign_in_flight
    own_running = min(in_flight, max_concurrency)
    own_waiting = max(0, in_flight - max_concurrency)
    running, waiting, kv = float(own_running), float(own_waiting), 0.0
    if fresh and engine is not None:
        if engine.running is not None:
            running = max(running, engine.running)
        if engine.waiting is not None:
            # Requests waiting there beyond those the gateway sent and has not heard back from are someone else's:
            # their prompt tokens are unknown; assume this gateway's mean. Its own that ended unanswered since the
            # scrape (stopped for a P0, left) were among them: counted as someone else's, 27 P2 requests stopped for a
            # P0 priced a 6-slot engine 9 s away for the scrape's age, and the next P0 went to a slow engine, 10-15 s.
            left = own.left_unanswered - engine.own_left if engine.own_left is not None else 0
            foreign = engine.waiting - own.pending - left
            if foreign > 0:
                queued += int(foreign * own.prompt_tokens.value)
            waiting = max(waiting, engine.waiting)
        if engine.kv_usage is not None:
            kv = engine.kv_usage
    # Before any stream ended here, the TPOT of those decoding (`OwnAccounting.decoding`): a slow engine's first long
    # generations are its only measure of its step for seconds.
    prefill, tpot = own.prefill_tps, own.tpot if own.tpot.samples else own.live_tpot
    oldest, oldest_whole = own.oldest_unanswered()
    return InstanceView(
        key=key,
        name=name,
        healthy=routable,
        in_flight=in_flight,
        max_concurrency=max_concurrency,
        queued_prompt_tokens=queued,
        pending=own.pending,
        waiting=int(waiting),
        running=int(running),
        kv_usage=kv,
        ttft_s=own.ttft.value,
        tpot_s=tpot.value,
        decode_s=own.decode.value,
        prefill_tps=prefill.value,
        prefill_age_s=0.0 if prefill.updated_at is None else now - prefill.updated_at,
        tpot_age_s=0.0 if tpot.updated_at is None else now - tpot.updated_at,
        cached_tokens=cached_tokens,
        cache_room=cache_room,
        # (Both counted from the engine's last progress here if that came later: an engine that answers others is
        # not hung, whatever keeps this one waiting: a slot, its priority, a preemption.)
        oldest_wait_s=0.0 if oldest is None else now - own.waiting_since(oldest),
        oldest_work=0 if oldest is None else oldest.backlog + oldest.tokens,
        oldest_whole_wait_s=0.0 if oldest_whole is None else now - own.waiting_since(oldest_whole),
        oldest_whole_work=0 if oldest_whole is None else oldest_whole.backlog + oldest_whole.tokens,
        whole_s=own.whole_time.value,
        latency_floor_s=own.latency_floor,
        latency_age_s=0.0 if own.latency_at is None else now - own.latency_at,
        stoppable=stoppable,
        stoppable_waiting=stoppable_waiting,
    )
