"""Load- and cache-aware policies: `score`, `cache_aware` and `predicted_ttft` (the default).

`predicted_ttft` is a cost model rather than a set of thresholds. For each candidate it predicts

    TTFT = max(queue wait + eviction cost + lateness, floor) + uncached prompt tokens / prefill rate
           + one decode step

    queue wait     = prompt tokens already queued there / prefill rate (for a P0, without those of the less
                       urgent requests still waiting there: they are stopped before it is sent)
                     + for a P0, when it runs anything, half a decode step (the rest of the step under way)
                     + (when every batch slot is taken) the share of a request's decode time until a
                       slot frees (a P0's: a step, a less urgent request being stopped for it; it takes
                       a full instance only a step sooner than every one with room)
    uncached       = prompt tokens - (tokens that instance likely has cached (prefix index), less one
                     decode step's worth of prefill: see "short shared prefixes" below)
    prefill rate   = that instance's measured rate (EWMA); until it is measured, the mean of the
                     measured candidates (else a configured default); while it takes no new sample
                     it relaxes toward that mean (half-life `measured_half_life_ms`)
    decode step    = its measured time per output token (the same fallback and relaxation)
    eviction cost  = (uncached tokens beyond the room left in its prefix cache) x reuse / prefill rate:
                     placing a prompt on an instance whose cache is full evicts other prefixes that will
                     have to be prefilled again; counting that once keeps a working set larger than one
                     cache partitioned over the instances instead of spread (and thrashing) over all of
                     them. An instance whose cache size is unknown (not reported yet, or never) counts as
                     full, unless no prompt was routed there yet (it holds nothing of ours to evict).
                     `reuse` is the share of recent prompts' tokens the pool found cached somewhere (1 until
                     measured): where nothing is shared (uniform random prompts), evicting costs nothing
                     later, and charging it anyway made the instances' modelled room decide.
    lateness       = how far the oldest request sent there and still without its first token is past
                     the time its prefill and three steps should have taken, counted from the engine's
                     last progress there (a first token, an answer ended) if that came later (an engine
                     that answers others is not hung: a request waiting for a slot, or preempted, does
                     not make it late; the queue terms count that): an engine that stopped
                     answering (hung, its /health still fine) has nothing measured against it, and
                     judged by its peers' rates it looked as fast as they are: it took every other
                     request. Counted only once a step is known (nothing is late before). A request
                     answered as one body shows no first token: it is late past its prefill and four
                     times a whole answer's mean time (its instance's, else its peers': no step needs
                     to be known, a fleet serving whole answers only measures none at first), counted
                     from the engine's last progress there likewise: a busy engine is never late, one
                     that answers nothing soon is.
    floor          = the least of its last 8 first tokens' latencies beyond their prefill and step:
                     an engine slow for reasons of its own (a fixed second, whatever the prompt) is
                     slower than its prefill rate says, and a short prompt would otherwise price it like
                     its peers (a burst of long prompts does not raise it: their prefill is taken out).
                     It fades as it ages (half-life `measured_half_life_ms`, as the rates relax): an
                     instance priced out by a bad spell is tried again, and measured again. Unmeasured:
                     none (a new instance must be tried to be measured).

and picks the minimum. The fallback for unmeasured instances matters: judged by a pessimistic default
next to measured peers, a new instance would never be chosen and so never measured. The relaxation
matters for the same reason: a measurement taken during a stall (the first request on a cold
connection, a paused process) made an instance look 10x slower, it was never chosen again, so never
re-measured, and the fleet ran on one instance fewer for good (seen in `bench routing`: an instance
given 1 of 200 requests). A really slow instance is re-tried about once per half-life and priced out
again by the fresh sample, by a request of a class that is not strict: a P0 (`RouteRequest.urgent`) takes the speeds
as measured (on an idle fleet of a 5 ms and a 40 ms engine, the re-tries were 1 P0 in 10, at ~40 ms against 8); under
load its queue terms still spread it to the slow instance. Its latency floor fades for every class: judged as it
stood, a floor measured at a flood's start sent every P0 to the other engine (`bench priority`: 1.45x, reverted).

A P0 joining a busy batch: an engine that runs anything is mid-step when a request arrives, and takes it in when
that step ends, half a step later on average. Counted for a P0 only: it chooses between a fast engine's full slots and
a slow engine's free one, where steps of 6 and 90 ms differ by more than the rest of the prediction (an outside run:
a 64-slot engine running 60 was priced at its prefill and one step, ~90 ms, and its first tokens came at ~150 ms; 46
of 272 P0s went there while a slot on the fast one freed within ~70 ms). For the other classes the instances' steps
are alike far more often than not, the half step adds the same to each busy one, and the prefix and rotation rules
below were measured without it (`bench routing`).

Short shared prefixes: a prefix cached on an instance saves its prefill there, but a saving smaller than one
engine step (a chat's system prompt of a few dozen tokens: ~3 ms where a step is 10 ms) is not worth a routing
choice: the request's first token comes a step or more after it arrives anyway. Counted whole, it decided where
every new conversation went, so an instance that had not cached it got none of them while the others' caches
overflowed with their histories (`bench routing`, chat on small caches with 8 instances: one instance got 7% of
the requests; TTFT p99 1.64x `cache_aware`'s, hit rate 3.3 points lower). So the first step's worth of a cached
prefix (`tpot x rate` tokens) is discounted on every instance alike: a short prefix then ties and the emptier
instance takes the request, while a longer one (a conversation's history, a document, an agent's system prompt)
still decides, by exactly what it saves beyond that step. Without a measured step there is no discount.

Cached nowhere: a prompt no candidate holds any of (uniform random prompts, a new conversation's first turn) costs
the same prefill everywhere, and only the predicted waits differ. Those come from the gateway's own accounting and are
rough (a first token read late on a busy host keeps an instance "busy" longer), and letting them pick the emptier
instance among near ties sent consecutive arrivals to the same few instances, whose prefills then collided:
`round_robin`'s strict rotation had the lower TTFT p99 (`bench routing`, uniform prompts, 6 seeds: 1.05-1.10x
`round_robin`'s). So such a prompt goes to the instance chosen least recently among those predicted within one step
and half its own prefill of the best: the rotation's even spacing, without the instances whose queue or slowness
the estimates do see (a rotation that ignored them, tried: 1.00x on uniform, 8x `predicted_ttft`'s p99 with one
slow instance; the window of one step alone: 1.03-1.10x).

A reproducible request (temperature 0, or a seed): among near ties, the instances holding its whole prompt go first,
short or not, measured or not. One was sent this very prompt lately: it may have the same request in flight, or its
result, where a sidecar de-duplicates it; a central that did not send it learns where it went from the sidecars'
residency reports. Taking the emptier instead sent the second of two identical requests through two centrals to the
other node (an outside run: 28 of 28 pairs, 150 ms to 1 s apart, made two engine calls; a tie because a prompt within a
step's worth of prefill saves nothing routing weighs).

Ties: predictions within `near_tie` of the best count as equal, and among them the instances holding the most of
the prompt beyond a step's worth go first, then the emptier. A tie means the first token comes as soon either way,
and the holder spends no prefill on it: taking the emptier instead re-prefilled a document its busy holder had
cached (an outside run, a burst of questions per document: the hit rate 2.8 points under `cache_aware`'s at the
same TTFT; 1.4-1.5 points after). Short prefixes (within a step) do not count, as above, nor an instance whose
speed nothing has measured yet: its prediction is a guess, and at a cold start the requests for a hot prefix still
being prefilled there queued behind it on a slow engine (docs/decisions.md, "an instance sent nothing yet").

A cached prefix makes an instance cheaper only by the prefill it saves; every
request sent there adds to its queue, so a hot prefix or a fresh, idle instance cannot attract
everything (the "death spiral" of threshold-based cache routers): once the queue wait there exceeds
the prefill another instance would need, traffic moves, and that instance caches the prefix too.
"""

from __future__ import annotations

from .config import CacheAwareOptions, PredictedTTFTOptions, ScoreWeights
from .policies import InstanceView, PoolSnapshot, RouteRequest, _Cursor, candidates, lowest, with_room


def relaxed(measured: float, peers: float, age_s: float, half_life_s: float) -> float:
    """`measured` (0: none) relaxed toward `peers` as it ages: half way after `half_life_s` (0: never)."""
    if measured <= 0:
        return peers
    if half_life_s <= 0 or peers <= 0 or age_s <= 0:
        return measured
    weight: float = 0.5 ** (age_s / half_life_s)
    return peers + (measured - peers) * weight


def predict_ttft(
    view: InstanceView,
    request: RouteRequest,
    default_prefill_tps: float,
    default_tpot_s: float = 0.0,
    half_life_s: float = 0.0,
    reuse: float = 1.0,
    default_whole_s: float = 0.0,
) -> float:
    """Predicted TTFT of `request` on `view` (see the module docstring); the defaults are its peers'
    means, what an unmeasured (or long unmeasured, with `half_life_s`) instance is judged by. An urgent request
    (`RouteRequest.urgent`) takes the speeds as measured, only the latency floor fading."""
    speeds_half_life_s = 0.0 if request.urgent else half_life_s
    rate = relaxed(view.prefill_tps, default_prefill_tps, view.prefill_age_s, speeds_half_life_s)
    tpot = relaxed(view.tpot_s, default_tpot_s, view.tpot_age_s, speeds_half_life_s)
    if request.urgent and view.tpot_s <= 0 < view.ttft_s and view.whole_s <= 0:
        # No step measured there yet, but first tokens of streams: a step is at most that long. Judged by its peers'
        # step, a slow engine whose first long generations had not yet streamed 8 tokens (`OwnAccounting.decoding`)
        # looked as fast as a fast one, and a flood's first P0s went there (an outside fleet: 0.9-1.4 s, 25-30 ms on
        # its peer). (An engine answering whole bodies never measures a step: its peers' stands.)
        tpot = view.ttft_s
    # A cached prefix saves nothing worth a routing choice until it saves a step: the first step's worth of
    # it is discounted (see the module docstring, "short shared prefixes").
    uncached = max(0, request.prompt_tokens - max(0, view.cached_tokens - round(tpot * rate)))
    queued, pending, in_flight, stoppable = view.queued_prompt_tokens, view.pending, view.in_flight, view.stoppable
    if request.urgent and view.stoppable_waiting and (view.tpot_s > 0 or view.ttft_s > 0):
        # A P0 sent there first has the less urgent requests still waiting in its engine stopped
        # (`PoolScheduler.make_room`: they lose no work), and their queue goes with them (their prompt tokens taken as
        # their share of those waiting there). Priced with them, a fast 4-slot engine a flood had sent 60 of them
        # before its limit was learned looked 0.3-0.8 s away, and every P0 for the next 7 s went to a slow engine next
        # to it (~90-150 ms). Not before a first token there is measured: nothing can be called overdue there yet
        # (`Lease.first_token_due`), and a flood's first P0, sent to a slow engine behind 34 of them, waited 8 s.
        cleared = min(view.stoppable_waiting, pending)
        queued -= queued * cleared // max(1, pending)
        pending -= cleared
        in_flight -= view.stoppable_waiting
        stoppable -= view.stoppable_waiting
    wait = queued / rate
    if request.urgent and (in_flight or view.running):
        # A busy engine is mid-step when the request arrives: it joins the batch when that step ends, half a step
        # later on average (module docstring, "a P0 joining a busy batch").
        wait += tpot / 2
    over = in_flight + 1 - view.max_concurrency
    if over > 0:
        # No free batch slot: on average one frees every decode_s / max_concurrency seconds. For a P0, a request of a
        # preemptible class there is stopped (`PoolScheduler.make_room`): its slot frees at the next step, for as many
        # as there are (an outside run: a fast 2-slot engine full of P0s was priced as a step's wait, and P0s stacked
        # there five deep, each waiting whole generations).
        per_slot = view.decode_s / view.max_concurrency
        quick = min(over, stoppable) if request.urgent and tpot > 0 else 0
        wait += quick * min(tpot, per_slot) + (over - quick) * per_slot
    # An instance whose cache size is not known yet (the first answers teach the engine's token ratio;
    # some engines never say) counts as full: the cold start is when prefixes find their homes, and
    # a copy placed then on a second instance "for free" later crowds out a prefix of its own. An instance sent
    # nothing yet has its room unbounded (`PrefixIndex.room`): it has nothing of ours to evict.
    evicted = max(0, uncached - (view.cache_room or 0)) * reuse
    # What it does to the others: an engine step lasts as long as the prefill it carries, and every
    # request waiting for its first token there (but the one in prefill now) shares a step with this
    # prompt's or waits behind it: a long prompt sent where short ones wait delays each of them.
    delayed = max(0, pending - 1) * uncached
    late = max(0.0, view.oldest_wait_s - view.oldest_work / rate - 3 * tpot) if tpot > 0 else 0.0
    typical = view.whole_s or default_whole_s
    if view.oldest_whole_wait_s and typical > 0:
        late = max(late, view.oldest_whole_wait_s - view.oldest_whole_work / rate - 4 * typical)
    floor = view.latency_floor_s
    if floor and half_life_s > 0 and view.latency_age_s > 0:
        floor *= 0.5 ** (view.latency_age_s / half_life_s)
    return max(wait + (evicted + delayed) / rate + late, floor) + uncached / rate + tpot


def _mean_measured(values: list[float]) -> float:
    measured = [v for v in values if v > 0]
    return sum(measured) / len(measured) if measured else 0.0


class PredictedTTFT:
    name = "predicted_ttft"
    uses_prefix = True

    def __init__(self, options: PredictedTTFTOptions | None = None) -> None:
        options = options or PredictedTTFTOptions()
        self._default_tps = options.default_prefill_tps
        self._half_life_s = options.measured_half_life_ms / 1000
        self._near = 1 + options.near_tie
        self._near_s = options.near_tie_ms / 1000
        self._cursor = _Cursor()
        #: The choice count when each instance was last chosen (`_least_recent`).
        self._chosen: dict[str, int] = {}
        self._choices = 0

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        chosen = self._choose(request, snapshot)
        if chosen is not None:
            self._choices += 1
            self._chosen[chosen.key] = self._choices
            if len(self._chosen) > 2 * len(snapshot.instances):  # instances gone: forget them
                current = {i.key for i in snapshot.instances}
                self._chosen = {k: n for k, n in self._chosen.items() if k in current}
        return chosen

    def _choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        rate = _mean_measured([o.prefill_tps for o in options]) or self._default_tps
        tpot = _mean_measured([o.tpot_s for o in options])
        whole = _mean_measured([o.whole_s for o in options])
        # The limit is a ceiling (`with_room`): a cached prefix made waiting there look cheaper than a cold prefill
        # next door, and an instance of 2 ran 4 while its neighbour ran none. A P0 (`RouteRequest.urgent`) may take a
        # full instance clearly sooner than every one with room (`_sooner_full`).
        reuse = snapshot.reuse

        def cost(view: InstanceView) -> float:
            return predict_ttft(view, request, rate, tpot, self._half_life_s, reuse, whole)

        roomy = with_room(options)
        costs = [cost(o) for o in roomy]
        # A P0's step is the fastest measured one's: the peers' mean, widened by a slow engine's own step, kept P0s
        # off a fast engine (a full one, or near the best) whose first token was clearly sooner (see below).
        step = min((o.tpot_s for o in options if o.tpot_s > 0), default=tpot) if request.urgent else tpot
        if request.urgent and len(roomy) < len(options):
            free = set(map(id, roomy))
            full = [o for o in options if id(o) not in free]
            options, costs = self._sooner_full(full, [cost(o) for o in full], roomy, costs, step)
        else:
            options = roomy
        # Equal predictions (an idle fleet), or as good as equal (`near_tie`): the holder of the most of the prompt,
        # then the emptier instance, then round-robin.
        cutoff = min(costs) * self._near + self._near_s
        if not any(o.cached_tokens for o in options):
            # Cached nowhere: only the waits differ, and the least recently chosen instance among those within a
            # step and half this prompt's prefill of the best wins (module docstring, "cached nowhere"). With the
            # peers' mean step, a fleet of two taking P0s alone went on sending half of them to one slowed midway (an
            # outside run).
            window = max(cutoff, min(costs) + step + 0.5 * request.prompt_tokens / rate)
            return min((o for o, c in zip(options, costs, strict=True) if c <= window), key=self._least_recent)
        tied = [o for o, c in zip(options, costs, strict=True) if c <= cutoff]
        # (Module docstring, "ties" and "a reproducible request".)
        whole = request.repeat_tokens
        holders = [t for t in tied if t.cached_tokens >= whole] if whole else []
        if holders:
            tied = holders
        else:
            held = [max(0.0, t.cached_tokens - tpot * rate) if t.prefill_tps else 0.0 for t in tied]
            most = max(held)
            if most > 0:
                tied = [t for t, h in zip(tied, held, strict=True) if h == most]
        return lowest(tied, [t.in_flight for t in tied], self._cursor)

    def _sooner_full(
        self,
        full: list[InstanceView],
        full_costs: list[float],
        roomy: list[InstanceView],
        roomy_costs: list[float],
        tpot: float,
    ) -> tuple[list[InstanceView], list[float]]:
        """A P0's candidates (and their predictions) when some are full: the full ones its first token is predicted to
        come from a step sooner than from any with room (before it is sent there the scheduler stops a less urgent
        request for it, `PoolScheduler.make_room`: its wait is a step, `predict_ttft`), else those with room. Kept to
        instances with room, every P0 of a flood went to the slow engine of a fast and a slow one, the only one with
        room (~90 ms against ~10 on the fast one idle); free to take any full one, it stopped requests where a free
        slot was as soon."""
        best = min(roomy_costs) - max(tpot, self._near_s)
        sooner = [(o, c) for o, c in zip(full, full_costs, strict=True) if c * self._near < best]
        if not sooner:
            return roomy, roomy_costs
        return [o for o, _ in sooner], [c for _, c in sooner]

    def _least_recent(self, view: InstanceView) -> int:
        return self._chosen.get(view.key, 0)


class Score:
    """Weighted sum of queue depth, running batch, KV use and observed TTFT, each scaled to 0..1 by the
    largest value among the candidates (as llm-d's scorers do); the lowest score wins."""

    name = "score"
    uses_prefix = True

    def __init__(self, weights: ScoreWeights | None = None) -> None:
        self._w = weights or ScoreWeights()
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = with_room(candidates(request, snapshot))
        if not options:
            return None
        w = self._w
        queue = _scaled([o.waiting + o.queued_prompt_tokens / 1000 for o in options])
        running = _scaled([max(o.running, o.in_flight) / o.max_concurrency for o in options])
        kv = _scaled([o.kv_usage for o in options])
        ttft = _scaled([o.ttft_s for o in options])
        scores = [
            w.queue * q + w.running * r + w.kv * k + w.ttft * t
            for q, r, k, t in zip(queue, running, kv, ttft, strict=True)
        ]
        return lowest(options, scores, self._cursor)


def _scaled(values: list[float]) -> list[float]:
    top = max(values)
    return [v / top for v in values] if top > 0 else [0.0] * len(values)


class CacheAware:
    """SGLang-style: the instance with the longest cached prefix, unless the fleet is imbalanced or that
    instance is full; then the least loaded. Misses go to the least loaded instance (never to the
    "emptiest cache", which is what makes a fresh instance attract everything)."""

    name = "cache_aware"
    uses_prefix = True

    def __init__(self, options: CacheAwareOptions | None = None) -> None:
        self._o = options or CacheAwareOptions()
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        least = lowest(options, [o.load for o in options], self._cursor)
        loads = [o.in_flight for o in options]
        high, low = max(loads), min(loads)
        if high - low > self._o.balance_abs and high > self._o.balance_rel * low:
            return least
        best = max(options, key=lambda o: o.cached_tokens)
        if (
            request.prompt_tokens
            and best.cached_tokens >= self._o.min_match * request.prompt_tokens
            and best.in_flight < best.max_concurrency
        ):
            # Ties on the cached prefix go to the less loaded of them.
            tied = [o for o in options if o.cached_tokens == best.cached_tokens]
            return min(tied, key=lambda o: o.load)
        return least
