"""Load- and cache-aware policies: `score`, `cache_aware` and `predicted_ttft` (the default).

`predicted_ttft` is a cost model rather than a set of thresholds. For each candidate it predicts

    TTFT = queue wait + uncached prompt tokens / prefill rate + one decode step + eviction cost

    queue wait     = prompt tokens already queued there / prefill rate
                     + (when every batch slot is taken) the share of a request's decode time until a
                       slot frees
    uncached       = prompt tokens - tokens that instance likely has cached (prefix index)
    prefill rate   = that instance's measured rate (EWMA); until it is measured, the mean of the
                     measured candidates (else a configured default)
    decode step    = its measured time per output token (the same fallback)
    eviction cost  = (uncached tokens beyond the room left in its prefix cache) / prefill rate: placing
                     a prompt on an instance whose cache is full evicts other prefixes that will have to
                     be prefilled again; counting that once keeps a working set larger than one cache
                     partitioned over the instances instead of spread (and thrashing) over all of them.
                     Only where the cache size is known (engine-reported or configured).

and picks the minimum. The fallback for unmeasured instances matters: judged by a pessimistic default
next to measured peers, a new instance would never be chosen and so never measured.

A cached prefix makes an instance cheaper only by the prefill it saves; every
request sent there adds to its queue, so a hot prefix or a fresh, idle instance cannot attract
everything (the "death spiral" of threshold-based cache routers): once the queue wait there exceeds
the prefill another instance would need, traffic moves, and that instance caches the prefix too.
"""

from __future__ import annotations

from .config import CacheAwareOptions, PredictedTTFTOptions, ScoreWeights
from .policies import InstanceView, PoolSnapshot, RouteRequest, _Cursor, candidates, lowest


def predict_ttft(
    view: InstanceView, request: RouteRequest, default_prefill_tps: float, default_tpot_s: float = 0.0
) -> float:
    rate = view.prefill_tps or default_prefill_tps
    uncached = max(0, request.prompt_tokens - view.cached_tokens)
    wait = view.queued_prompt_tokens / rate
    over = view.in_flight + 1 - view.max_concurrency
    if over > 0:
        # No free batch slot: on average one frees every decode_s / max_concurrency seconds.
        wait += over * view.decode_s / view.max_concurrency
    if view.cache_room is not None and uncached > view.cache_room:
        uncached += uncached - view.cache_room
    return wait + uncached / rate + (view.tpot_s or default_tpot_s)


def _mean_measured(values: list[float]) -> float:
    measured = [v for v in values if v > 0]
    return sum(measured) / len(measured) if measured else 0.0


class PredictedTTFT:
    name = "predicted_ttft"
    uses_prefix = True

    def __init__(self, options: PredictedTTFTOptions | None = None) -> None:
        self._default_tps = (options or PredictedTTFTOptions()).default_prefill_tps
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        rate = _mean_measured([o.prefill_tps for o in options]) or self._default_tps
        tpot = _mean_measured([o.tpot_s for o in options])
        costs = [predict_ttft(o, request, rate, tpot) for o in options]
        # Equal predictions (an idle fleet, a prompt cached nowhere): the emptier instance, then round-robin.
        best = min(costs)
        tied = [o for o, c in zip(options, costs, strict=True) if c <= best * (1 + 1e-9)]
        return lowest(tied, [t.in_flight for t in tied], self._cursor)


class Score:
    """Weighted sum of queue depth, running batch, KV use and observed TTFT, each scaled to 0..1 by the
    largest value among the candidates (as llm-d's scorers do); the lowest score wins."""

    name = "score"
    uses_prefix = True

    def __init__(self, weights: ScoreWeights | None = None) -> None:
        self._w = weights or ScoreWeights()
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
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
