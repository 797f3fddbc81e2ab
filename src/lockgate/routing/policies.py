"""Routing: which instance serves a request.

A policy's `choose(request, snapshot)` is synchronous and sees only an immutable snapshot of the pool,
so it can be unit-tested on crafted snapshots. Policies may keep their own small state (a round-robin
cursor, a seeded random generator, a cached hash ring) but never touch the pool.

The snapshot is built per request (`Pool.snapshot`): each `InstanceView` already merges the instance's
sources (the gateway's own accounting, and scraped engine metrics when they are fresh) and carries
`cached_tokens`, how much of *this* request's prompt that instance likely has in its prefix cache.

The policies, by module: `round_robin`, `least_load`, `power_of_two` here; `consistent_hash` in
`affinity.py`; `score`, `cache_aware` and `predicted_ttft` (the default) in `cost.py`; `make_policy` in
`factory.py`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


# The value types below are built for every request (a view per instance): not `frozen`, whose
# `__init__` costs ~5x more (1.5 us for a view). Never mutate one after construction.
@dataclass(slots=True)
class InstanceView:
    key: str
    name: str
    #: Routable: passes health checks and is not ejected.
    healthy: bool
    #: Requests the gateway has in flight there (own accounting, always current).
    in_flight: int
    max_concurrency: int
    #: Prompt tokens sent there not prefilled yet (first token not back, by the measured rate): work ahead.
    queued_prompt_tokens: int = 0
    #: Requests the gateway sent there whose first token has not come back.
    pending: int = 0
    #: Requests waiting for a batch slot / in the running batch (engine metrics when fresh, merged
    #: with own accounting so that what was sent since the last scrape counts).
    waiting: int = 0
    running: int = 0
    #: KV-cache use 0..1 (0 when unknown).
    kv_usage: float = 0.0
    #: Observed EWMAs (0.0: not measured yet).
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    #: Mean time a request keeps its batch slot after its first token.
    decode_s: float = 0.0
    #: Measured prefill rate, prompt tokens per second (0.0: not measured yet).
    prefill_tps: float = 0.0
    #: Seconds since `prefill_tps` / `tpot_s` last took a sample (how far to trust them).
    prefill_age_s: float = 0.0
    tpot_age_s: float = 0.0
    #: Tokens of this request's prompt the instance likely has cached (from the prefix index).
    cached_tokens: int = 0
    #: Tokens its prefix cache takes before it must evict (None: its cache size is unknown).
    cache_room: int | None = None
    #: The oldest streamed request sent there still without its first token: how long it has waited (counted from the
    #: engine's last progress there if that came later), and the prompt work (tokens: its own uncached ones and those
    #: queued ahead of it when sent) it was to wait for.
    oldest_wait_s: float = 0.0
    oldest_work: int = 0
    #: The same for the oldest request answered as one body (its first token never seen: it is out there until its
    #: end).
    oldest_whole_wait_s: float = 0.0
    oldest_whole_work: int = 0
    #: The mean time of a whole (non-streamed) answer there (0.0: none measured).
    whole_s: float = 0.0
    #: The least of its recent first tokens' latencies beyond their prefill and step (0.0: none measured), and the age
    #: of the last (`OwnAccounting.latency_floor`): what a first token takes there at the least, whatever the prompt.
    latency_floor_s: float = 0.0
    latency_age_s: float = 0.0
    #: Requests of a preemptible class in flight there (`Lease.stoppable`): a P0 sent there when it is full has one
    #: stopped for it (`Admission.make_room`), at most this many.
    stoppable: int = 0
    #: Of those, the ones whose first token has not come back: waiting in the engine, they are stopped before a P0 is
    #: sent there (`preemption.ahead_in_engine`), all at once, and take their queue with them.
    stoppable_waiting: int = 0

    @property
    def load(self) -> float:
        return self.in_flight / self.max_concurrency


@dataclass(slots=True)
class PoolSnapshot:
    model: str
    instances: tuple[InstanceView, ...]
    #: The share of recent prompts' tokens found cached somewhere in the pool (1.0 until measured): how
    #: much what a cache holds gets reused, so what evicting it costs (`cost.predict_ttft`).
    reuse: float = 1.0


@dataclass(slots=True)
class RouteRequest:
    model: str
    prompt: str = ""
    #: Instances already tried for this request (retries go elsewhere).
    exclude: frozenset[str] = field(default_factory=frozenset)
    #: Estimated prompt tokens (~4 characters a token).
    prompt_tokens: int = 0
    #: Session key for affinity (a header or the body's `user`).
    affinity_key: str | None = None
    #: Hash chain of the prompt's blocks (see `prefix.py`).
    blocks: tuple[int, ...] = ()
    #: At a sidecar: the engine a central gateway chose (taken when it can serve the request); a follow-up
    #: (`previous_response_id`): the engine that made the response it continues.
    pin: str | None = None
    #: The pinned engine alone can serve it (a follow-up: no other engine holds the response it continues): while
    #: that member cannot take it, 503 rather than another engine's 404.
    pin_only: bool = False
    #: A reproducible request (temperature 0, or a seed): the tokens its prompt's blocks cover (0: not reproducible).
    #: An instance holding that much of it was sent this very prompt lately, and may hold the same request in
    #: flight or its result (a sidecar de-duplicates), so among near ties it goes there (`cost.PredictedTTFT`).
    repeat_tokens: int = 0
    #: A streamed answer: only those take long prompts' turns (`Pool.is_long`; a whole answer's first token is
    #: not seen, so it could not give its turn back at the end of its prefill).
    stream: bool = False
    #: A strict class's request (P0): `predicted_ttft` judges instances' speeds (prefill rate, step) as measured, not
    #: relaxed toward their peers', so that it is never the request that re-tries an instance priced out as slow (an
    #: outside run: 1 P0 in 10 went to an engine 8x slower than its peer on an idle fleet, ~40 ms against 8). Their
    #: latency floors still fade: a P0 judging them as they stood sent every P0 to one engine at a flood's start. Nor
    #: is it kept to instances with room: it may go where less urgent work fills the slots (see `PredictedTTFT`).
    urgent: bool = False
    #: A request of a class that is not strict (P1, P2): it is not sent where a strict request waits for its first
    #: token (`Held`).
    yields: bool = False
    #: Sent again after it was stopped before its first token: the prefix index took its prompt where it went first,
    #: which the engine may have prefilled only in part (its prefill is judged whole where a strict request holds).
    resent: bool = False


class Policy(Protocol):
    name: str
    #: Whether `choose` looks at `InstanceView.cached_tokens`: only then does the pool hash the prompt
    #: and keep the prefix index (work every request would otherwise pay for nothing).
    uses_prefix: bool

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None: ...


def candidates(request: RouteRequest, snapshot: PoolSnapshot) -> list[InstanceView]:
    """Healthy instances not yet tried; if every untried one is unhealthy, none."""
    return [i for i in snapshot.instances if i.healthy and i.key not in request.exclude]


def with_room(options: list[InstanceView]) -> list[InstanceView]:
    """The candidates below their concurrency limit, or all of them when none is. An instance's limit (configured,
    or the engine's discovered slots) is a ceiling: past it a request queues inside the engine, out of reach of the
    gateway's priorities, while another instance may have a free slot. Over it only when every candidate is (the
    pool's admission keeps that rare)."""
    return [o for o in options if o.in_flight < o.max_concurrency] or options


class _Cursor:
    """Round-robin among ties, so an idle fleet spreads instead of piling onto the first instance."""

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, tied: Sequence[InstanceView]) -> InstanceView:
        chosen = tied[self._cursor % len(tied)]
        self._cursor += 1
        return chosen


def lowest(options: Sequence[InstanceView], cost: Sequence[float], cursor: _Cursor) -> InstanceView:
    best = min(cost)
    # Costs within a relative 1e-9 are ties (floating-point noise must not decide).
    tied = [o for o, c in zip(options, cost, strict=True) if c <= best + abs(best) * 1e-9]
    return cursor.pick(tied)


class RoundRobin:
    name = "round_robin"
    uses_prefix = False

    def __init__(self) -> None:
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = with_room(candidates(request, snapshot))
        return self._cursor.pick(options) if options else None


class LeastLoad:
    """Fewest requests in flight relative to capacity; ties go round-robin so idle fleets spread."""

    name = "least_load"
    uses_prefix = False

    def __init__(self) -> None:
        self._cursor = _Cursor()

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        return lowest(options, [i.load for i in options], self._cursor)


class PowerOfTwo:
    """Two random candidates, the less loaded wins: near least-load balance without herding on one."""

    name = "power_of_two"
    uses_prefix = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = with_room(candidates(request, snapshot))
        if len(options) <= 1:
            return options[0] if options else None
        a, b = self._rng.sample(options, 2)
        return a if occupancy(a) <= occupancy(b) else b


def occupancy(view: InstanceView) -> float:
    """Requests there (in the batch or waiting for it) relative to capacity."""
    return max(view.in_flight, view.running + view.waiting) / view.max_concurrency
