"""Tenant rate limits that hold cluster-wide: each central replica enforces a share of every limit.

Every replica publishes, in its replica record, the demand it sees per rate-limited tenant (requests
offered per second, admitted or refused, an average over ~`TAU_S`); every replica reads all the records
(the central role's watch) and computes the same shares from them:

    share(me) = EQUAL_PART / n + (1 - EQUAL_PART) * (count(me) + PRIOR_REQUESTS) / (total + n * PRIOR_REQUESTS)

where `count` is a replica's requests in the window (demand x `TAU_S`), so the shares of the live replicas add up
to one: together they admit the tenant's limit, wherever its clients connect. A few requests move the shares a
little (`PRIOR_REQUESTS`: the ratio of a handful is noise), many move them to their ratio, and demand never counts
entirely (`EQUAL_PART`), so that a replica with no traffic for a tenant can take its first requests: a client whose
every request reaches one replica of two gets up to 0.9 of its limit. A replica that joins or leaves (its lease
expires) changes `n` and the shares at once; shares move only by more than `HYSTERESIS` (each move resizes the
buckets, `RateLimiter.set_share`: the part a share gains comes at the fill the others last said they held, the
departed one's included, if lower than its own).

A replica that joins a running cluster (a new one, a restart, a `--workers` worker started again) starts each
tenant's buckets at the mean fraction the other replicas' records say they still hold (`fill`), not full: a
tenant that used its limit does not get a fresh share at every restart (a restarted central admitted 10-12 more
of a spent 60-a-minute limit each time), and one that is idle finds the joiner full. Alone (a cold start) it
starts full, as a single gateway does.
While etcd is unreachable the last shares stay (a replica that died meanwhile keeps its share until
etcd returns: conservative). `share_of` is pure; `ClusterLimits` applies it to the rate limiter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from ..admission.ratelimit import RateLimiter
from ..admission.tenants import Tenant
from .keys import ReplicaRecord, encode_replica

EQUAL_PART = 0.2
#: Time constant of the demand average (seconds).
TAU_S = 10.0
#: Requests counted for every replica beyond its own in the window (`share_of`): a handful of requests would make
#: the demand ratio noise, and each move of a share resizes the buckets. (A fixed 200 requests in the window before
#: the ratio counted in full left a tenant of 60 a minute, all of whose traffic reached one replica of two, about
#: half its limit: an outside run.)
PRIOR_REQUESTS = 5.0
#: Smallest share change applied.
HYSTERESIS = 0.02


def share_of(me: str, demand: Mapping[str, float]) -> float:
    """This replica's share of one tenant's limits, from every live replica's demand for it (requests
    per second; `me` included; a replica absent from `demand` counts as none): `EQUAL_PART` split equally, the rest
    by each replica's part of the requests in the window, counted with `PRIOR_REQUESTS` more for every replica, so
    that a few requests move the shares a little and many move them to their ratio."""
    replicas = set(demand) | {me}
    n = len(replicas)
    counts = {r: max(0.0, demand.get(r, 0.0)) * TAU_S for r in replicas}
    total = sum(counts.values())
    if total <= 0:
        return 1.0 / n
    ratio = (counts[me] + PRIOR_REQUESTS) / (total + n * PRIOR_REQUESTS)
    return EQUAL_PART / n + (1 - EQUAL_PART) * ratio


class ClusterLimits:
    def __init__(self, replica: str, limiter: RateLimiter, tenants: Callable[[], Mapping[str, Tenant]]) -> None:
        """`tenants()`: the current tenants by name (a reload may change them)."""
        self.replica = replica
        self.started_at = time.time()
        self._limiter = limiter
        self._tenants_now = tenants
        self._offered: dict[str, int] = {}
        self._rate: dict[str, float] = {}
        self._sampled_at: float | None = None
        #: Replica id -> its demand per tenant, as last read from etcd.
        self.replicas: dict[str, dict[str, float]] = {}
        #: Per tenant: the number of replicas its share was last computed for (a change applies at once).
        self._count: dict[str, int] = {}
        #: Replica id -> the fraction of each tenant's allowance it said it still holds.
        self._fills: dict[str, dict[str, float]] = {}
        limiter.start_fill = self.start_fill

    def start_fill(self, tenant: str) -> float:
        """Where this replica's buckets for `tenant` start: the mean of what the other replicas hold (1.0 alone)."""
        fills = [fill.get(tenant, 1.0) for rid, fill in self._fills.items() if rid != self.replica]
        return sum(fills) / len(fills) if fills else 1.0

    @property
    def _tenants(self) -> dict[str, Tenant]:
        """Only tenants with a per-minute limit take part."""
        return {
            name: t
            for name, t in self._tenants_now().items()
            if t.requests_per_minute is not None or t.tokens_per_minute is not None
        }

    def record(self) -> bytes:
        """This replica's record, with its demand measured since the previous one."""
        now = time.monotonic()
        states = self._limiter.tenants()
        elapsed = None if self._sampled_at is None else now - self._sampled_at
        self._sampled_at = now
        for name in self._tenants:
            state = states.get(name)
            offered = 0 if state is None else state.admitted + sum(state.rejected.values())
            previous = self._offered.get(name, offered)
            self._offered[name] = offered
            if elapsed:
                # An exponential average in time: each sample weighs by how long it covers.
                alpha = 1.0 - math.exp(-elapsed / TAU_S)
                old = self._rate.get(name, 0.0)
                self._rate[name] = old + alpha * ((offered - previous) / elapsed - old)
        demand = tuple(sorted((name, round(rate, 3)) for name, rate in self._rate.items()))
        fill = tuple(sorted((name, round(self._limiter.fill(name, now), 3)) for name in self._tenants))
        return encode_replica(ReplicaRecord(self.replica, self.started_at, demand, fill))

    def apply(self, replicas: Mapping[str, ReplicaRecord]) -> None:
        """The live replicas changed (or their demand did): recompute and apply this replica's shares."""
        self.replicas = {r.id: dict(r.demand) for r in replicas.values()}
        # What the others said they hold, the ones that left included (their last word): a share that grows takes
        # its added part at that fill, not at this replica's own (`RateLimiter.set_share`).
        before = {rid: fill for rid, fill in self._fills.items() if rid != self.replica}
        self._fills = {r.id: dict(r.fill) for r in replicas.values()}
        others = before | {rid: fill for rid, fill in self._fills.items() if rid != self.replica}
        now = time.monotonic()
        for name, tenant in self._tenants.items():
            demand = {rid: d.get(name, 0.0) for rid, d in self.replicas.items()}
            share = share_of(self.replica, demand)
            current = self._limiter.share(name)
            if abs(share - current) > HYSTERESIS or (share != current and len(demand) != self._count.get(name)):
                self._count[name] = len(demand)
                fills = [fill[name] for fill in others.values() if name in fill]
                given = sum(fills) / len(fills) if fills else None
                self._limiter.set_share(tenant, share, now, given)

    def shares(self) -> dict[str, float]:
        return {name: round(self._limiter.share(name), 4) for name in self._tenants}
