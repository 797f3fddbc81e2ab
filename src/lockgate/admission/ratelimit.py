"""Per-tenant rate limits: requests/min, tokens/min and concurrent requests. Synchronous core.

Theory of operation: each limit per minute is a token bucket holding at most one minute's allowance
and refilling continuously. Admission takes one request and a *reservation* of tokens (estimated
prompt + `max_tokens`) at once, or takes nothing and raises `RateLimitExceeded` with the wait until
enough would be back (`Retry-After`) and the limit headers clients expect. When the request ends —
completed, failed or cancelled — its owner settles the reservation with the tokens actually used;
the unused part flows back, so a cancelled request costs only what was delivered or its engine produced
(`Admission._settle`). Settling is
idempotent. Time is passed in (`now`, monotonic seconds); nothing here awaits.

In a cluster each central replica holds a *share* of every tenant's per-minute limits (`set_share`,
kept current by `lockgate.cluster`): its buckets hold and refill `share` of the allowance, so the
replicas together admit the tenant's limit. Concurrency limits stay per replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import RateLimited
from .tenants import Tenant


def duration(seconds: float) -> str:
    """OpenAI-style reset duration: `250ms`, `1.5s`, `6m0s`."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.1f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass(slots=True)
class Bucket:
    capacity: float
    level: float
    stamp: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def give_back(self, amount: float, now: float) -> None:
        """Return `amount` (negative: take more, a debt refilled later), never above the capacity."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is); call after `refill`."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def reset_s(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


def _resized(bucket: Bucket | None, capacity: float | None, now: float) -> Bucket | None:
    if capacity is None:
        return None
    if bucket is None:
        return Bucket(capacity, capacity, now)
    bucket.refill(now)
    bucket.capacity = capacity
    bucket.level = min(bucket.level, capacity)
    return bucket


#: Weight of the latest request in a tenant's mean hold time.
_HOLD_EWMA = 0.2


class RateLimitExceeded(RateLimited):
    """429 with `Retry-After` and the `x-ratelimit-*` headers."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        code: str,
        retry_after: float | None,
        limit_headers: dict[str, str],
    ) -> None:
        # No time to wait: the request can never pass (it asks for more than the limit allows at all).
        super().__init__(message, code=code, retry_after=retry_after, final=retry_after is None)
        #: Which limit: "requests", "tokens" or "concurrency".
        self.reason = reason
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.limit_headers}


@dataclass(slots=True)
class TenantState:
    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int = 0
    reserved_tokens: int = 0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    #: How long the tenant's requests hold their place (EWMA, seconds): when one in flight is likely to end.
    mean_hold_s: float = 1.0


class Reservation:
    """What one admitted request holds: a request slot, a concurrency slot and reserved tokens."""

    __slots__ = ("_limiter", "admitted_at", "reserved", "settled", "tenant", "used")

    def __init__(self, limiter: RateLimiter, tenant: Tenant, reserved: int, admitted_at: float) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self.reserved = reserved
        self.admitted_at = admitted_at
        self.settled = False
        self.used: int | None = None

    def settle(self, used_tokens: int, now: float, *, refund_request: bool = False) -> None:
        """Give back what the request did not use (`refund_request`: the request itself too). Idempotent."""
        if self.settled:
            return
        self.settled = True
        self.used = used_tokens
        self._limiter._settle(self, used_tokens, now, refund_request)


class Allowance:
    """A request's rate-limit reservation, settled once every holder is done with it: the request itself, and the
    flight it leads (`share`), which may run on after every client left (`cancel_policy: finish_and_cache`). The
    flight's engine work is the tenant's: until it ends it counts against the tenant's `max_concurrent`, and the
    tokens it produced while no client followed it are charged on top of what the request was (else a client could
    start generations and leave at once, free); what its other clients received, their own tenants are charged."""

    __slots__ = ("_clock", "_holders", "_reached", "_unattended", "_used", "reservation")

    def __init__(self, reservation: Reservation, clock: Callable[[], float]) -> None:
        self.reservation = reservation
        self._clock = clock
        self._holders = 1
        self._used = 0
        self._unattended = 0
        self._reached = False

    def share(self) -> Callable[[int, bool, int], None]:
        """One more holder (a flight): it calls what this returns, once, when it ends (see `done`)."""
        self._holders += 1
        return self.done

    def done(self, used: int, reached_engine: bool, unattended: int = 0) -> None:
        """A holder is done: `used` tokens (prompt + completion, 0 if nothing was produced), whether it reached an
        engine, and (a flight) the tokens it produced that no client received, charged on top of the most `used` any
        holder reports. The last one settles: a request that reached none is refunded (see `Admission._settle`)."""
        self._used = max(self._used, used)
        self._unattended += unattended
        self._reached = self._reached or reached_engine
        self._holders -= 1
        if self._holders == 0:
            used = self._used + self._unattended
            self.reservation.settle(used, self._clock(), refund_request=not used and not self._reached)


class RateLimiter:
    def __init__(self) -> None:
        self._states: dict[str, TenantState] = {}
        #: Tenant -> this gateway's fraction of its per-minute limits (absent: all of them).
        self._shares: dict[str, float] = {}
        #: The fraction of its allowance a tenant's buckets start with when its first request here creates them
        #: (None: full). A replica joining a running cluster starts where the others stand (`cluster/limits.py`):
        #: started full, every restart minted a fresh share of a tenant's limit.
        self.start_fill: Callable[[str], float] | None = None

    def share(self, tenant: str) -> float:
        return self._shares.get(tenant, 1.0)

    def fill(self, tenant: str, now: float) -> float:
        """The fraction of the tenant's allowance here still available (the lower of its two buckets'; 1.0 before
        its first request)."""
        state = self._states.get(tenant)
        fill = 1.0
        if state is not None:
            for bucket in (state.requests, state.tokens):
                if bucket is not None and bucket.capacity > 0:
                    bucket.refill(now)
                    fill = min(fill, max(0.0, bucket.level) / bucket.capacity)
        return fill

    def set_share(self, tenant: Tenant, share: float, now: float, given_fill: float | None = None) -> None:
        """This gateway's fraction (0..1] of the tenant's per-minute limits; the rest belongs to other replicas of
        the cluster. A bucket that shrinks keeps the fraction it holds (what it gives up goes with its share); one
        that grows takes the added part at `given_fill`, the fraction the replicas it comes from said they held, if
        lower than its own (None: its own), so that shares moving between replicas do not mint allowance (an
        outside run: a replica killed after spending its share left the survivor's full half to grow into the
        whole limit, full, and the tenant was admitted 1.7x its limit)."""
        share = min(1.0, max(1e-6, share))
        self._shares[tenant.name] = share
        state = self._states.get(tenant.name)
        if state is None:
            return
        for bucket, limit in ((state.requests, tenant.requests_per_minute), (state.tokens, tenant.tokens_per_minute)):
            if bucket is not None and limit is not None:
                bucket.refill(now)
                capacity = limit * share
                if bucket.capacity <= 0:
                    bucket.level = capacity
                elif capacity <= bucket.capacity or given_fill is None:
                    bucket.level = bucket.level * capacity / bucket.capacity
                else:
                    # (Never above its own fraction: the others' word is up to a record old, and they spent since.)
                    fill = min(max(0.0, bucket.level) / bucket.capacity, given_fill)
                    bucket.level = min(capacity, bucket.level + (capacity - bucket.capacity) * fill)
                bucket.capacity = capacity

    def state(self, tenant: Tenant, now: float) -> TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            share = self._shares.get(tenant.name, 1.0)
            fill = 1.0 if self.start_fill is None else min(1.0, max(0.0, self.start_fill(tenant.name)))
            rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
            state = TenantState(
                requests=None if rpm is None else Bucket(rpm * share, rpm * share * fill, now),
                tokens=None if tpm is None else Bucket(tpm * share, tpm * share * fill, now),
            )
            self._states[tenant.name] = state
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        return state

    def admit(self, tenant: Tenant, tokens: int, now: float, least: int | None = None, output: int = 1) -> Reservation:
        """Take one request and reserve `tokens`, or raise `RateLimitExceeded` taking nothing. `least`: the fewest
        the request can use (`tokens` unless given): refused for good only when that is over the tenant's limit (a
        reservation between the two waits for a full bucket); `output`: the output limit in `tokens` (0: an input
        alone, an embedding's)."""
        state = self.state(tenant, now)
        if tenant.max_concurrent is not None and state.in_flight >= tenant.max_concurrent:
            raise self._refusal(
                tenant,
                state,
                now,
                "concurrency",
                f"Tenant '{tenant.name}' already has {state.in_flight} requests in flight "
                f"(limit {tenant.max_concurrent}).",
                code="concurrency_limit_exceeded",
                # Not a fixed second: an SDK's two quick retries would fail behind requests that take longer.
                retry_after=max(1.0, state.mean_hold_s),
            )
        if state.tokens is not None and (tokens if least is None else least) > (tenant.tokens_per_minute or 0):
            # First: whatever else is short, this request can never pass (and its client must not retry).
            uses, advice = (
                ("prompt + its output limit for each choice", "lower max_tokens (max_output_tokens for a response)")
                if output
                else ("its input", "send its inputs in smaller requests")
            )
            raise self._refusal(
                tenant,
                state,
                now,
                "tokens",
                f"This request uses at least {tokens if least is None else least} tokens ({uses}), more than tenant "
                f"'{tenant.name}' may use per minute ({tenant.tokens_per_minute}); {advice}.",
                code="tokens_exceed_limit",
                retry_after=None,
            )
        requests_wait = state.requests.wait_for(1) if state.requests is not None else 0.0
        # A reservation larger than this replica's share of the limit (a cluster's: it is under the limit) waits for
        # a full bucket and leaves a debt: it could never pass otherwise, and Retry-After would promise it would.
        tokens_wait = state.tokens.wait_for(min(tokens, state.tokens.capacity)) if state.tokens is not None else 0.0
        if requests_wait > 0 or tokens_wait > 0:
            # Retry-After is when both are back: a retry once the requests are would still find the tokens short.
            wait = max(requests_wait, tokens_wait)
            if requests_wait >= tokens_wait:
                reason = "requests"
                message = f"{tenant.requests_per_minute} requests per minute"
            else:
                reason = "tokens"
                message = (
                    f"{tenant.tokens_per_minute} tokens per minute; this request reserves {tokens} "
                    f"({'prompt + its output limit for each choice' if output else 'its input'})"
                )
            raise self._refusal(
                tenant,
                state,
                now,
                reason,
                f"Rate limit reached for tenant '{tenant.name}': {message}.",
                code="rate_limit_exceeded",
                retry_after=wait,
            )
        if state.requests is not None:
            state.requests.level -= 1
        if state.tokens is not None:
            state.tokens.level -= tokens
        state.in_flight += 1
        state.reserved_tokens += tokens
        state.admitted += 1
        return Reservation(self, tenant, tokens, now)

    def _refusal(
        self,
        tenant: Tenant,
        state: TenantState,
        now: float,
        reason: str,
        message: str,
        *,
        code: str,
        retry_after: float | None,
    ) -> RateLimitExceeded:
        """Count a refusal for `reason` and return the error to raise (with the limit headers as they stand)."""
        state.rejected[reason] = state.rejected.get(reason, 0) + 1
        return RateLimitExceeded(
            reason, message, code=code, retry_after=retry_after, limit_headers=self.headers(tenant, now)
        )

    def _settle(self, reservation: Reservation, used: int, now: float, refund_request: bool) -> None:
        state = self._states[reservation.tenant.name]  # created by `admit`
        state.in_flight -= 1
        state.reserved_tokens -= reservation.reserved
        state.mean_hold_s += _HOLD_EWMA * (max(0.0, now - reservation.admitted_at) - state.mean_hold_s)
        if refund_request and state.requests is not None:
            state.requests.give_back(1, now)
        if state.tokens is not None:
            # Refund the unused part; charge the excess if the estimate was low (a debt, refilled later).
            state.tokens.give_back(reservation.reserved - used, now)

    def reconfigure(self, tenants: Iterable[Tenant], now: float) -> None:
        """New limits for the tenants named: each bucket keeps its level (capped by its new capacity);
        a limit that appears starts full, one that disappears is dropped. In-flight counts are kept."""
        for tenant in tenants:
            state = self._states.get(tenant.name)
            if state is not None:
                share = self._shares.get(tenant.name, 1.0)  # this replica's part (cluster mode)
                rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
                state.requests = _resized(state.requests, None if rpm is None else rpm * share, now)
                state.tokens = _resized(state.tokens, None if tpm is None else tpm * share, now)

    def headers(self, tenant: Tenant, now: float) -> dict[str, str]:
        out: dict[str, str] = {}
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return out  # no per-minute limit to report
        state = self.state(tenant, now)
        if state.requests is not None:
            out["x-ratelimit-limit-requests"] = str(tenant.requests_per_minute)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(state.requests.level)))
            out["x-ratelimit-reset-requests"] = duration(state.requests.reset_s())
        if state.tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(tenant.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(state.tokens.level)))
            out["x-ratelimit-reset-tokens"] = duration(state.tokens.reset_s())
        return out

    def tenants(self) -> dict[str, TenantState]:
        return dict(self._states)
