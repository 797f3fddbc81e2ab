"""Tenants, rate limits (sync, explicit time) and the scheduler's async shell (futures, races)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lockgate.admission.config import SchedulingConfig, TenantConfig
from lockgate.admission.gate import Admission, PoolScheduler, Slot
from lockgate.admission.ratelimit import RateLimiter, RateLimitExceeded, duration
from lockgate.admission.scheduler import ClassSpec, TicketState
from lockgate.admission.tenants import TenantBook, hash_key
from lockgate.config import ConfigError, parse_config
from lockgate.errors import InvalidRequest, ModelNotFound, QueueFull, QueueTimeout, Unauthorized
from lockgate.metrics import GatewayMetrics


def book(*tenants: TenantConfig) -> TenantBook:
    return TenantBook(list(tenants), SchedulingConfig())


def test_open_gateway_without_keys() -> None:
    b = book()
    assert b.open and b.authenticate(None).name == "default"
    assert b.authenticate("Bearer anything").name == "default"


def test_keys_map_to_tenants_and_unknown_or_missing_is_401() -> None:
    b = book(TenantConfig(name="acme", keys=[hash_key("sk-acme")]), TenantConfig(name="zed", keys=[hash_key("k2")]))
    assert b.authenticate("Bearer sk-acme").name == "acme"
    assert b.authenticate("bearer  k2 ").name == "zed"
    for header in (None, "", "Bearer", "Basic sk-acme", "Bearer sk-nope"):
        with pytest.raises(Unauthorized) as err:
            b.authenticate(header)
        assert "sk-" not in err.value.message  # keys never echoed


def test_priority_header_default_and_cap() -> None:
    b = book(TenantConfig(name="batch", keys=[hash_key("b")], max_priority="P2"), TenantConfig(name="vip"))
    batch, vip = b.tenants["batch"], b.tenants["vip"]
    assert b.priority(vip, None) == 1  # the middle class by default
    assert b.priority(vip, "p0") == 0
    assert b.priority(batch, "P0") == 2  # capped by the tenant's maximum
    assert b.priority(batch, None) == 2
    with pytest.raises(InvalidRequest):
        b.priority(vip, "urgent")


def test_allowed_models() -> None:
    b = book(TenantConfig(name="t", keys=[hash_key("x")], models=["a"]))
    b.check_model(b.tenants["t"], "a")
    with pytest.raises(ModelNotFound):
        b.check_model(b.tenants["t"], "b")


def test_config_refuses_plaintext_keys_and_unknown_classes() -> None:
    base = {"models": [{"name": "m", "instances": [{"url": "http://x"}]}]}
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "tenants": [{"name": "t", "keys": ["sk-secret-plain"]}]})
    assert "sk-secret-plain" not in str(err.value)
    with pytest.raises(ConfigError):
        parse_config({**base, "tenants": [{"name": "t", "max_priority": "P9"}]})
    with pytest.raises(ConfigError):
        parse_config(
            {**base, "tenants": [{"name": "a", "keys": [hash_key("k")]}, {"name": "b", "keys": [hash_key("k")]}]}
        )
    config = parse_config({**base, "scheduling": {"classes": [{"name": "hi", "strict": True}, {"name": "lo"}]}})
    assert config.scheduling.default_index == 1


def test_rate_limits_reserve_refund_and_headers() -> None:
    b = book(TenantConfig(name="t", requests_per_minute=2, tokens_per_minute=600, max_concurrent=5))
    tenant = b.tenants["t"]
    limiter = RateLimiter()
    r1 = limiter.admit(tenant, 500, now=0.0)
    headers = limiter.headers(tenant, 0.0)
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-limit-tokens"] == "600" and headers["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 500, now=0.0)
    assert err.value.reason == "tokens" and err.value.http_status == 429
    assert err.value.retry_after is not None
    assert 0 < err.value.retry_after <= 40 and err.value.headers()["x-ratelimit-remaining-tokens"] == "100"
    # Cancelled after 20 tokens: the rest of the reservation comes back.
    r1.settle(20, now=0.0)
    r1.settle(20, now=0.0)  # idempotent
    state = limiter.state(tenant, 0.0)
    assert state.tokens is not None and state.tokens.level == 580 and state.reserved_tokens == 0
    assert state.in_flight == 0
    limiter.admit(tenant, 10, now=0.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 10, now=0.0)
    assert err.value.reason == "requests" and err.value.retry_after == pytest.approx(30.0)
    limiter.admit(tenant, 10, now=30.0)  # refilled one request after 30 s
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 601, now=1000.0)
    assert err.value.code == "tokens_exceed_limit"
    # It can never pass: no time to wait (it said 60 s, and the SDKs slept 60 s twice before failing), and the
    # SDKs are told not to retry it.
    headers = err.value.headers()
    assert "Retry-After" not in headers and headers["x-should-retry"] == "false"


def test_concurrency_limit() -> None:
    b = book(TenantConfig(name="t", max_concurrent=1))
    limiter = RateLimiter()
    held = limiter.admit(b.tenants["t"], 1, 0.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(b.tenants["t"], 1, 0.0)
    assert err.value.reason == "concurrency"
    held.settle(0, 0.0)
    limiter.admit(b.tenants["t"], 1, 0.0)


def test_duration_format() -> None:
    assert duration(0.25) == "250ms" and duration(1.5) == "1.5s" and duration(2.0) == "2s"
    assert duration(360) == "6m0s"


# --- the async shell ------------------------------------------------------------------------------
def shell(capacity: int = 1, **spec: object) -> PoolScheduler:
    classes = (ClassSpec("P0", strict=True, max_queue=4, **spec), ClassSpec("P1", max_queue=2))  # type: ignore[arg-type]
    return PoolScheduler("m", classes, capacity, GatewayMetrics().scheduling)


async def test_waiter_is_woken_on_release_without_polling() -> None:
    s = shell()
    first = s.offer(1)
    second = s.offer(1)
    waiting = asyncio.create_task(s.wait_granted(second))
    await asyncio.sleep(0)
    assert not waiting.done()
    s.release(first)
    async with asyncio.timeout(30):  # bounds a hang only
        await waiting
    assert second.state is TicketState.RUNNING
    s.release(second)
    assert s.statistics()["waiters"] == 0 and s.core.running_total == 0


async def test_queue_full_raises_with_retry_after() -> None:
    s = shell()
    s.offer(1)
    s.offer(1)
    s.offer(1)
    with pytest.raises(QueueFull) as err:
        s.offer(1)
    assert err.value.http_status == 429 and int(err.value.headers()["Retry-After"]) >= 1


async def test_granted_just_as_the_waiter_is_cancelled_returns_the_slot() -> None:
    s = shell()
    first = s.offer(1)
    second = s.offer(1)
    third = s.offer(1)
    waiting = asyncio.create_task(s.wait_granted(second))
    await asyncio.sleep(0)
    # In the same loop iteration: the slot is granted to `second` and its waiter is cancelled.
    s.release(first)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert second.state is TicketState.RUNNING  # it did get the slot...
    s.release(second)  # ... and its owner's release hands it on
    assert third.state is TicketState.RUNNING
    s.release(third)
    assert s.core.running_total == 0 and s.core.queued_total == 0 and s.statistics()["waiters"] == 0


async def test_cancelled_while_queued_leaves_the_queue() -> None:
    s = shell()
    first = s.offer(1)
    second = s.offer(1)
    waiting = asyncio.create_task(s.wait_granted(second))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    s.release(second)
    assert s.core.queued_total == 0
    s.release(first)
    assert s.core.running_total == 0


async def test_a_wait_ended_by_its_other_future_leaves_the_queue() -> None:
    """`wait_granted(ticket, unless)`: False when `unless` is done first (a request queued to lead a flight that
    another request started meanwhile), True when the grant comes first, the other future left as it is."""
    s = shell()
    first = s.offer(1)
    second = s.offer(1)
    third = s.offer(1)
    flight_started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(s.wait_granted(second, flight_started))
    await asyncio.sleep(0)
    flight_started.set_result(None)
    async with asyncio.timeout(30):  # bounds a hang only
        assert await waiting is False
    s.release(second)  # what `Slot.wait` does then
    assert second.state is TicketState.DONE and s.core.queued_total == 1
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(s.wait_granted(third, never))
    await asyncio.sleep(0)
    s.release(first)
    async with asyncio.timeout(30):
        assert await waiting is True
    assert third.state is TicketState.RUNNING and not never.done()
    s.release(third)
    assert s.core.running_total == 0 and s.core.queued_total == 0 and s.statistics()["waiters"] == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Owner:
    """What a `Slot` needs of its exchange: an id, and `hold` (run at the end, as `Exchange._release` does)."""

    def __init__(self, name: str) -> None:
        self.id = name
        self.holds: list[Any] = []

    def hold(self, release: Any) -> None:
        self.holds.append(release)


def clocked(queue_timeout_s: float | None = 10.0) -> tuple[PoolScheduler, _Clock]:
    clock = _Clock()
    classes = (ClassSpec("P0", strict=True, max_queue=4), ClassSpec("P1", max_queue=4, queue_timeout_s=queue_timeout_s))
    return PoolScheduler("m", classes, 1, GatewayMetrics().scheduling, clock=clock), clock


async def test_a_request_that_waited_behind_another_keeps_its_place_by_arrival() -> None:
    """A duplicate waits behind an identical request queued to lead, with no ticket; when that one leaves without
    a slot, the duplicate queues by its own arrival: ahead of a request that arrived after it (it went to the tail,
    behind later arrivals, and was shed for them)."""
    s, clock = clocked()
    running = s.offer(1)
    ahead = s.offer(1)
    clock.now = 1.0
    behind = Slot(s, _Owner("behind"), 1, None)  # type: ignore[arg-type]
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(behind.wait_behind(woken))
    await asyncio.sleep(0)
    clock.now = 2.0
    later = s.offer(1)
    s.release(ahead)  # the request ahead leaves: those behind it look again
    woken.set_result(None)
    async with asyncio.timeout(30):  # bounds a hang only
        await waiting
    assert behind.offer() is False and behind.ticket is not None
    assert behind.ticket.offered_at == 1.0
    s.release(running)
    assert behind.ticket.state is TicketState.RUNNING and later.state is TicketState.QUEUED
    s.release(behind.ticket)
    s.release(later)
    assert s.core.running_total == 0 and s.core.queued_total == 0


async def test_a_queue_deadline_counts_from_when_the_request_began_waiting() -> None:
    """Each duplicate behind the next one got a whole queue deadline of its own after the one ahead timed out: the
    k-th waited (k + 1) times `queue_timeout_ms`. Waiting behind, then queued, a request's deadline is one."""
    s, clock = clocked(queue_timeout_s=10.0)
    running = s.offer(1)
    behind = Slot(s, _Owner("behind"), 1, None)  # type: ignore[arg-type]
    clock.now = 1.0
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(behind.wait_behind(woken))
    await asyncio.sleep(0)
    clock.now = 11.5  # the request ahead timed out (its own deadline), 10.5 s after this one arrived
    woken.set_result(None)
    async with asyncio.timeout(30):
        await waiting
    assert behind.offer() is False
    with pytest.raises(QueueTimeout):
        async with asyncio.timeout(30):  # bounds a hang only: the deadline has passed
            await behind.wait()
    # Behind another for longer than its deadline: it does not wait on.
    late = Slot(s, _Owner("late"), 1, None)  # type: ignore[arg-type]
    late._since = 0.0
    with pytest.raises(QueueTimeout):
        async with asyncio.timeout(30):
            await late.wait_behind(asyncio.get_running_loop().create_future())
    s.release(running)
    assert s.core.running_total == 0 and s.core.queued_total == 0
    # Both counted as the class's queue's refusals (the dashboard's per-class "rejected", as a full queue is).
    assert s.core.statistics()["classes"]["P1"]["rejected"] == 2


async def test_a_preempted_request_queued_again_has_no_queue_deadline() -> None:
    """The class's queue deadline bounds a request's first wait; one preempted and queued again always completes
    (it got 503 `queue_timeout` after its output so far was thrown away)."""
    s, _ = clocked(queue_timeout_s=0.0)
    running = s.offer(1)
    s.core.set_capacity(0, 0.0)
    s.core.requeue(running, 0.0)  # preempted: queued again at the head, no slot free now
    s._waiters[running] = asyncio.get_running_loop().create_future()  # as `_stop` does
    waiting = asyncio.create_task(s.wait_granted(running))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiting.done()
    s.resize(1, 0)
    async with asyncio.timeout(30):
        assert await waiting is True
    s.release(running)
    assert s.core.running_total == 0 and s.core.queued_total == 0


async def test_queue_deadline() -> None:
    s = shell(queue_timeout_s=0.01)
    first = s.offer(0)
    second = s.offer(0)
    with pytest.raises(QueueTimeout) as err:
        async with asyncio.timeout(30):  # bounds a hang only: the queue deadline (10 ms) ends the wait
            await s.wait_granted(second)
    assert err.value.http_status == 503 and err.value.code == "queue_timeout"
    assert second.state is TicketState.DONE and s.core.queued_total == 0
    s.release(second)
    s.release(first)
    assert s.core.running_total == 0


def test_hash_key_cli_reads_stdin(monkeypatch, capsys) -> None:
    import io

    from lockgate.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("sk-test\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("sk-test")


def test_every_configured_tenants_gauges_are_exported_from_the_start_and_follow_reloads() -> None:
    """An outside run: the per-tenant limit gauges appeared only at a tenant's first request, and a tenant a reload
    removed kept its series (its remaining requests refilling forever)."""

    def config(*tenants: dict[str, Any]) -> Any:
        model = {"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}
        return parse_config({"models": [model], "tenants": [{"keys": [hash_key(t["name"])], **t} for t in tenants]})

    metrics = GatewayMetrics()

    def series() -> set[str]:
        text = metrics.render().decode()
        names = ("lockgate_ratelimit_remaining", "lockgate_tenant_requests_in_flight", "lockgate_tokens_reserved")
        return {line.split(" ")[0] for line in text.splitlines() if line.startswith(names)}

    admission = Admission(
        config({"name": "acme", "requests_per_minute": 60, "tokens_per_minute": 6000}, {"name": "beta"}),
        metrics.scheduling,
    )
    assert series() == {
        'lockgate_ratelimit_remaining_requests{tenant="acme"}',
        'lockgate_ratelimit_remaining_tokens{tenant="acme"}',
        'lockgate_tenant_requests_in_flight{tenant="acme"}',
        'lockgate_tenant_requests_in_flight{tenant="beta"}',
        'lockgate_tokens_reserved{tenant="acme"}',
        'lockgate_tokens_reserved{tenant="beta"}',
    }
    assert 'lockgate_ratelimit_remaining_requests{tenant="acme"} 60.0' in metrics.render().decode()
    admission.reconfigure(config({"name": "acme", "tokens_per_minute": 6000}))  # beta removed, acme's rpm too
    assert series() == {
        'lockgate_ratelimit_remaining_tokens{tenant="acme"}',
        'lockgate_tenant_requests_in_flight{tenant="acme"}',
        'lockgate_tokens_reserved{tenant="acme"}',
    }


def test_retry_after_waits_for_every_short_limit() -> None:
    """Both per-minute limits short: Retry-After is when both are back (it said the requests' wait, and the retry
    then found the tokens short)."""
    b = book(TenantConfig(name="t", requests_per_minute=2, tokens_per_minute=600))
    tenant = b.tenants["t"]
    limiter = RateLimiter()
    limiter.admit(tenant, 290, now=0.0).settle(290, now=0.0)
    limiter.admit(tenant, 290, now=0.0).settle(290, now=0.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 580, now=0.0)  # one request back in 30 s, 580 tokens in 56 s (20 left)
    assert err.value.reason == "tokens" and err.value.retry_after == pytest.approx(56.0)
    assert "this request reserves 580" in err.value.message
    with pytest.raises(RateLimitExceeded):
        limiter.admit(tenant, 580, now=30.0)
    limiter.admit(tenant, 580, now=56.0)
    # The requests' wait the longer: it is the reason given.
    limiter2 = RateLimiter()
    limiter2.admit(tenant, 1, now=0.0).settle(1, now=0.0)
    limiter2.admit(tenant, 1, now=0.0).settle(1, now=0.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter2.admit(tenant, 10, now=0.0)
    assert err.value.reason == "requests" and err.value.retry_after == pytest.approx(30.0)


def test_a_request_that_can_never_pass_is_told_so_whatever_else_is_short() -> None:
    b = book(TenantConfig(name="t", requests_per_minute=1, tokens_per_minute=600))
    tenant = b.tenants["t"]
    limiter = RateLimiter()
    limiter.admit(tenant, 1, now=0.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 601, now=0.0)  # it said "retry in 60 s", then refused it for good
    assert err.value.code == "tokens_exceed_limit" and err.value.retry_after is None


def test_a_full_concurrency_limit_says_how_long_requests_hold_it() -> None:
    """Retry-After of `max_concurrent`'s 429 follows how long the tenant's requests take (it was always 1 s: an
    SDK's two retries failed behind 3-second requests)."""
    b = book(TenantConfig(name="t", max_concurrent=1))
    tenant = b.tenants["t"]
    limiter = RateLimiter()
    for start in range(20):
        limiter.admit(tenant, 1, float(start * 10)).settle(1, float(start * 10 + 3))
    limiter.admit(tenant, 1, 500.0)
    with pytest.raises(RateLimitExceeded) as err:
        limiter.admit(tenant, 1, 500.5)
    assert err.value.reason == "concurrency" and err.value.retry_after == pytest.approx(3.0, abs=0.1)
    assert err.value.headers()["Retry-After"] == "3"
