"""Admission: tenant rate limits, then a slot from the model pool's scheduler. The async shell.

Theory of operation: admission runs at the start of a request's work, inside `Exchange.run()`, in two
steps with de-duplication between them (`Gateway._admit_then_serve`). Each resource taken is handed to the
exchange (`Exchange.hold`) *before* the next `await`, so the exchange's `_release()` returns it exactly
once however the request ends — including while it is still queued:

1. `Admission.allow`: the tenant's rate-limit `Reservation` (one request, prompt + max_tokens tokens for
   each choice, a concurrency slot), for every request; settled on release with the tokens actually delivered;
2. `Slot.take`, only for a request about to call an engine (not for a cached result or a flight's joiner):
   a `Ticket` from the model's `PoolScheduler`: granted at once, queued, or refused (429 QueueFull); a
   queued ticket waits on a future that the scheduler resolves when the sync core grants it (or, for a
   request waiting to lead a flight, until something serves it without a slot: `Slot.wait(unless)`,
   `dedup/waiting.py`). A flight's leader hands its slot over to the flight (`Slot.hand_over`).

Nothing polls and no state is read before an `await` and written after it: every decision is one
synchronous call into `SchedulerCore` / `RateLimiter`. The race "granted just as the waiter is
cancelled" needs no special case: the core, not the future, says whether the ticket holds a slot,
and `release()` returns the slot (granting the next waiter) or leaves the queue accordingly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..changes import Changes
from ..errors import ModelNotFound, QueueFull, QueueTimeout
from ..fleet.instance import mark_stoppable
from ..metrics import SchedulingMetrics
from .preemption import (
    Placement,
    Preemptee,
    ahead_in_engine,
    choose_victim,
    holding_up,
    sent_ahead,
    waits_in_engine,
)
from .ratelimit import Allowance, Bucket, RateLimiter, RateLimitExceeded, Reservation, TenantState
from .scheduler import ClassSpec, SchedulerCore, Ticket, TicketState
from .tenants import Tenant, TenantBook

if TYPE_CHECKING:
    from ..config import Config
    from ..exchange import Exchange
    from ..fleet.instance import Lease
    from ..fleet.pool import Pool

Clock = Callable[[], float]


class PoolScheduler:
    """One model pool's queue: tickets are futures granted by the sync core on release."""

    def __init__(
        self,
        model: str,
        classes: Sequence[ClassSpec],
        capacity: int,
        metrics: SchedulingMetrics,
        *,
        reserve: int = 0,
        strict_window_s: float | None = None,
        clock: Clock = time.monotonic,
        preemptible: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.core = SchedulerCore(classes, capacity, reserve=reserve, strict_window_s=strict_window_s)
        #: The capacity of the pool's members, and the slots lent on top of it (see `resize`).
        self._members = capacity
        self.lent = 0
        #: Classes whose running requests a strict-class arrival may stop (see `preemption.py`).
        self.preemptible = preemptible
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        #: Stopped tickets waiting for their slot again, with the tokens their engine prefills again when they get it
        #: (`_stop`, `_wake`); gone when granted or released.
        self._stopped: dict[Ticket, int] = {}
        #: The error of a pool a reload removed (`withdraw`): what a request waiting for its slot again gets.
        self._withdrawn: Callable[[], Exception] | None = None
        #: Strict requests' looks at their engine's queue under way (`_look`), each gone within a scrape's timeout.
        self._looks: set[asyncio.Task[None]] = set()
        #: Tests and drains wait on it; free while nobody does.
        self._changes = Changes()
        self._export()
        core = self.core
        #: Per class: its admissions counter and queue-wait histogram (looked up once, not per grant).
        self._granted_metrics = [
            (metrics.admissions.labels(model, spec.name), metrics.queue_wait.labels(model, spec.name))
            for spec in core.classes
        ]

    def _export(self) -> None:
        """Its queue and slot gauges, per class (read when scraped)."""
        core, metrics = self.core, self._metrics
        for index, spec in enumerate(core.classes):
            metrics.queue_depth.labels(self.model, spec.name).set_function(functools.partial(core.queued, index))
            metrics.slots_in_use.labels(self.model, spec.name).set_function(functools.partial(core.running, index))

    def _unexport(self) -> None:
        """A withdrawn pool's gauges go once nothing runs there (an outside run: a removed model's queue gauges stayed
        exported at 0 for as long as it was not configured)."""
        core, metrics = self.core, self._metrics
        if core.running_total or core.queued_total:
            return
        for spec in core.classes:
            for family in (metrics.queue_depth, metrics.slots_in_use):
                with contextlib.suppress(KeyError):  # (removed already)
                    family.remove(self.model, spec.name)

    def resize(self, capacity: int, reserve: int, lent: int = 0) -> None:
        """The pool grew or shrank (instances ejected, unhealthy or back): grant what now fits. `lent`: its requests
        still running on instances a reload retired (`Pool.lent`), counted on top: they hold no slot of the members'.
        One of them ending takes its lent slot along with its own (the lease ends before the ticket): the excess of
        that moment is not shed."""
        core = self.core
        shrank = capacity < self._members
        self._members = capacity
        self.lent = lent
        if capacity + lent == core.capacity and reserve == core.reserve:
            return
        core.reserve = reserve
        self._wake(core.set_capacity(capacity + lent, self._clock()))
        if shrank:
            self._shed_excess()
        self._changes.notify()

    def offer(self, klass: int, tag: object = None, arrived: float | None = None) -> Ticket:
        """Ask for a slot: the ticket comes back granted or queued; a full queue raises QueueFull. `arrived`: see
        `SchedulerCore.offer` (this scheduler's clock). A withdrawn pool (`withdraw`) raises its error: an identical
        request that waited behind one of its queued requests looks for its own place once that one was told, and
        queued anew here until its queue deadline (an outside run)."""
        if self._withdrawn is not None:
            raise self._withdrawn()
        ticket = Ticket(klass, tag)
        now = self._clock()
        if self.core.grant_at_once(ticket, now):
            self._granted(ticket, now)
            self._changes.notify()
            return ticket
        offer = self.core.offer(ticket, now, arrived)
        if ticket.state is TicketState.QUEUED:
            # Only a queued ticket needs a future (the common, uncontended path skips it).
            self._waiters[ticket] = asyncio.get_running_loop().create_future()
        self._wake(offer.granted)
        if offer.queued and self.preemptible:
            self._preempt_for(ticket)
        self._changes.notify()
        if offer.rejected:
            spec = self.core.classes[klass]
            self._metrics.rejections.labels("queue_full", spec.name).inc()
            raise QueueFull(
                f"The {spec.name} queue for model '{self.model}' is full ({spec.max_queue} waiting); "
                "retry later or at another priority.",
                retry_after=offer.retry_after_s,
            )
        return ticket

    def _preempt_for(self, ticket: Ticket) -> None:
        """A ticket was queued: if it may, stop running requests so that it gets its slot now — one
        normally; more only when the pool holds more than its capacity (it just shrank: an instance
        left, or its discovered limit fell), so that a P0 never waits for the excess to drain."""
        self._preempt(ticket.klass, self.core.running_total - self.core.capacity + 1, until=ticket)

    def _shed_excess(self) -> None:
        """The pool shrank below what runs in it (an engine's discovered limit fell: the excess waits in
        that engine's own queue, first come, first served). If a strict-class request runs now, it may be
        waiting there behind that excess: stop the excess at once (the newest of the least urgent
        preemptible classes, the requests sent last, queued there, not generating yet) rather than at
        the next strict arrival. Without strict work running, the excess simply drains."""
        core = self.core
        if not self.preemptible or core.running_total <= core.capacity:
            return
        strict = next((k for k, spec in enumerate(core.classes) if spec.strict and core.running(k)), None)
        if strict is not None:
            self._preempt(strict, core.running_total - core.capacity)

    def _preempt(self, klass: int, count: int, until: Ticket | None = None) -> None:
        """Stop up to `count` running requests in favour of class `klass` (`preemption.choose_victim`), or
        fewer once `until` is no longer queued. Each victim's owner aborts its work synchronously; its
        ticket goes back to the queue head."""
        core = self.core
        for _ in range(count):
            victim = choose_victim(core, klass, self.preemptible, _stops_so_far)
            if victim is None:
                return
            self._stop(victim)
            if until is not None and until.state is not TicketState.QUEUED:
                return

    def make_room(self, klass: int, lease: Placement, watch: bool) -> None:
        """A request of class `klass` is about to be sent with `lease`: if it is strict, stop the less urgent requests
        it would wait behind in that engine's own queue (`preemption.ahead_in_engine`). With `watch` (the engine
        streams: the lease sees its first token), hold the instance until that token (`Lease.hold`: less urgent
        requests are not sent there meanwhile) and look again when it is due (`_rescue`)."""
        if not self.preemptible:
            return
        # Lease times are `time.monotonic()` (the scheduler's clock may be a test's).
        now = time.monotonic()
        # While the engine's slots are not known (a flood's first moments: what the gateway sent beyond them waits
        # in its queue) a request counts as overdue a step earlier, and so does the strict request's own first token:
        # a stop wrongly made then costs little (the waiting lose no work), a missed one a generation's wait. Once
        # they are known, the step of slack keeps a loaded host's late steps from stopping requests that were not
        # waiting (without it, `bench priority`: 1,916 tokens re-prefilled in a 60 s flood instead of ~200).
        known = lease.slots_known()
        slack = 1 if known else 0
        full = lease.engine_full()
        victims = ahead_in_engine(
            self.core,
            klass,
            self.preemptible,
            lease.instance,
            now,
            _stops_so_far,
            full,
            slack,
            prefills=lease.limit_found(),
        )
        for victim in victims:
            self._stop(victim)
        if not watch or not self.core.classes[klass].strict:
            return
        lease.hold()
        loop = asyncio.get_running_loop()
        due = lease.first_token_due(slack)
        if due is not None:
            # Bounded: one timer per strict engine call in flight, gone when it fires (within a few steps).
            loop.call_later(max(0.0, due - now), self._rescue, klass, lease)
            if (
                not known
                and not victims
                and sent_ahead(self.core, klass, self.preemptible, lease.instance, lease.sent_at)
            ):
                # Slots unknown and requests sent there before it still unanswered: too young to be called overdue,
                # but if the engine is full they are queued, and the strict request waits behind them until its
                # due time (a flood's first moments on a 16-slot engine: P0 TTFT 97-137 ms where 54 ms is its p99
                # alone). A look at the engine's queue tells at once, and a second one half way to the due time.
                look = loop.create_task(self._look(klass, lease, now + (due - now) / 2), name="lockgate-look")
                self._looks.add(look)
                look.add_done_callback(self._looks.discard)

    async def _look(self, klass: int, lease: Placement, again_at: float) -> None:
        """A strict request was sent to an engine whose slots are not known: if the engine's queue holds more than
        arrived within the last step (`Placement.queue_ahead`), it is full and the request waits there: stop what
        holds it up now (`_rescue`) instead of at its due time. If not, look again at `again_at` (monotonic, half way
        to the due time), unless its first token came: an engine exactly full when it was sent shows then, the
        request itself now older than a step and still waiting."""
        if await lease.queue_ahead():
            self._rescue(klass, lease)
            return
        await asyncio.sleep(max(0.0, again_at - time.monotonic()))
        if not lease.answered and not lease.released and await lease.queue_ahead():
            self._rescue(klass, lease)

    def _rescue(self, klass: int, lease: Placement) -> None:
        """A strict request's first token is due: if it has not come, stop what holds it up in the engine
        (`preemption.holding_up`)."""
        if lease.answered or lease.released:
            return
        for victim in holding_up(self.core, klass, self.preemptible, lease.instance, lease.sent_at, _stops_so_far):
            self._stop(victim)

    def _stop(self, victim: Ticket) -> None:
        """Preempt one running ticket: its owner aborts its work synchronously; the ticket goes back to the
        head of its queue. A request the engine had not started yet costs no prefill again."""
        tag = victim.tag
        assert isinstance(tag, Preemptee)
        waited = waits_in_engine(tag)
        outcome = tag.preempt()
        # Counted once it is sent again (`_wake`): a request whose client leaves meanwhile is prefilled no more, and
        # one started over prefills its prompt, not its output (an outside run: 200 tokens counted, none prefilled).
        self._stopped[victim] = 0 if waited else tag.redo_tokens()
        self._waiters[victim] = asyncio.get_running_loop().create_future()
        self._wake(self.core.requeue(victim, self._clock()))
        victim_class = self.core.classes[victim.klass].name
        self._metrics.preemptions.labels(self.model, victim_class, outcome.value).inc()
        self._metrics.cancellations.labels(self.model, victim_class, "preempted").inc()

    def now(self) -> float:
        """The scheduler's clock (what tickets' `offered_at` are on)."""
        return self._clock()

    async def wait_granted(self, ticket: Ticket, unless: asyncio.Future[None] | None = None) -> bool:
        """Wait until the ticket holds a slot (True), or until `unless` is done while it does not (False);
        QueueTimeout after its class's queue deadline. On any exit the ticket stays owned by the caller, who
        must `release()` it."""
        if ticket.state is TicketState.RUNNING:
            return True
        waiter = self._waiters.get(ticket)
        if waiter is None or ticket.state is not TicketState.QUEUED:
            if self._withdrawn is not None:
                raise self._withdrawn()
            raise RuntimeError(f"{ticket!r} is not waiting")
        # A request preempted and queued again (`resumed`) always completes: no deadline but its own.
        limit = None if ticket.resumed else self.queue_time_left(ticket.klass, ticket.offered_at)
        try:
            async with asyncio.timeout(limit):
                if unless is None:
                    await waiter
                else:
                    # Futures, not coroutines: `asyncio.wait` makes no task and cancels neither.
                    await asyncio.wait((waiter, unless), return_when=asyncio.FIRST_COMPLETED)
                    if waiter.done() and not waiter.cancelled():
                        waiter.result()  # raises what `withdraw` set
            return ticket.running  # the core, not the futures, says whether it holds a slot
        except TimeoutError:
            if ticket.running:  # granted in the same loop iteration
                return True
            self.release(ticket)
            raise self.queue_timeout(ticket.klass) from None

    def withdraw(self, error: Callable[[], Exception]) -> None:
        """The pool is gone (a reload removed its model): every queued request fails now with `error()` instead of
        waiting for a slot that leads nowhere, and so does any stopped one that comes to wait for its slot again (it
        may not be waiting yet). Running ones go on."""
        self._withdrawn = error
        for ticket, waiter in list(self._waiters.items()):
            if ticket.state is TicketState.QUEUED and not waiter.done():
                waiter.set_exception(error())
                waiter.add_done_callback(_retrieved)  # (its request may never await it: no "never retrieved" log)
                self.release(ticket)
        self._unexport()

    def reinstate(self) -> None:
        """A reload added the withdrawn pool's model again: it takes requests again."""
        self._withdrawn = None
        self._export()

    def queue_time_left(self, klass: int, since: float) -> float | None:
        """Seconds left of class `klass`'s queue deadline for a request that began waiting at `since` (this
        scheduler's clock; in the queue or behind an identical request): it bounds a request's first wait as a
        whole. None: the class has none."""
        limit = self.core.classes[klass].queue_timeout_s
        return None if limit is None else max(0.0, limit - (self._clock() - since))

    def queue_timeout(self, klass: int) -> QueueTimeout:
        """The error of a request of class `klass` that waited its class's whole queue deadline (counted)."""
        spec = self.core.classes[klass]
        self._metrics.rejections.labels("queue_timeout", spec.name).inc()
        self.core.rejected_total[klass] += 1  # refused by its class's queue, as a full one refuses
        return QueueTimeout(
            f"The request waited {spec.queue_timeout_s:g} s in the {spec.name} queue for model "
            f"'{self.model}' without getting a slot.",
            retry_after=self.core.retry_after(klass),
        )

    def release(self, ticket: Ticket) -> None:
        """The owner is done with the ticket (queued or running). Idempotent; never awaits."""
        waiter = self._waiters.pop(ticket, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        self._stopped.pop(ticket, None)
        granted = self.core.release(ticket, self._clock())
        if granted:
            self._wake(granted)
        if self._withdrawn is not None:
            self._unexport()
        self._changes.notify()

    async def wait_until(self, predicate: Callable[[SchedulerCore], bool]) -> None:
        """Wait until `predicate(core)` holds, re-checked on every change (tests, drains; no polling).
        Bound it with `asyncio.timeout`."""
        core = self.core
        await self._changes.wait_until(lambda: predicate(core))

    def _wake(self, granted: Sequence[Ticket]) -> None:
        if not granted:
            return
        now = self._clock()
        stopped = self._stopped
        for ticket in granted:
            redo = stopped.pop(ticket, None) if stopped else None
            if redo is None:
                self._granted(ticket, now)
            elif redo:
                # Granted again after a stop: not a new admission; what its engine prefills again is the price.
                self._metrics.reprefill_tokens.labels(self.model).inc(redo)
            waiter = self._waiters.get(ticket)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _granted(self, ticket: Ticket, now: float) -> None:
        admissions, queue_wait = self._granted_metrics[ticket.klass]
        admissions.inc()
        queue_wait.observe(max(0.0, now - ticket.offered_at))

    def statistics(self) -> dict[str, object]:
        return {**self.core.statistics(), "lent": self.lent, "waiters": len(self._waiters)}


class Slot:
    """A request's slot at its pool's scheduler, taken only once it is about to call an engine (a request served
    from the result cache or joining a flight takes none). The ticket is owned by the exchange from the moment it
    is offered (`Exchange.hold`), so it is released however the request ends — unless it is handed over to the
    flight it then leads (`hand_over`), which outlives its leader when others follow it."""

    __slots__ = ("_ex", "_held", "_scheduler", "_since", "_tag", "klass", "ticket")

    def __init__(self, scheduler: PoolScheduler, ex: Exchange, klass: int, tag: object) -> None:
        self._scheduler = scheduler
        self._ex = ex
        #: The class (lower: more urgent).
        self.klass = klass
        self._tag = ex.id if tag is None else tag
        self.ticket: Ticket | None = None
        #: The exchange holds a release of this slot (from the first `offer`), and still owns it.
        self._held = False
        #: When the request began waiting (the scheduler's clock): its queue deadline counts from then.
        self._since: float | None = None

    def offer(self) -> bool:
        """Ask for the slot; True if it was granted at once (the uncontended case), else the ticket is queued
        (`wait`). Raises QueueFull (429)."""
        self.ticket = self._scheduler.offer(self.klass, self._tag, self._since)
        if self._since is None:
            self._since = self.ticket.offered_at
        if not self._held:
            self._held = True
            self._ex.hold(self._release_held)
        return self.ticket.state is TicketState.RUNNING

    async def wait(self, unless: asyncio.Future[None] | None = None) -> bool:
        """Wait for the offered ticket's grant (True), or until `unless` is done first (False: the ticket has
        left the queue; `offer` again to queue anew). QueueTimeout (503) after the class's queue deadline."""
        assert self.ticket is not None
        granted = await self._scheduler.wait_granted(self.ticket, unless)
        if not granted:
            self.give_back()
        return granted

    async def wait_behind(self, woken: asyncio.Future[None]) -> None:
        """Wait without a ticket (behind an identical request queued to lead) until `woken` is done, within this
        request's own queue deadline, counted from when it began waiting: QueueTimeout (503) after it."""
        scheduler = self._scheduler
        if self._since is None:
            self._since = scheduler.now()
        try:
            async with asyncio.timeout(scheduler.queue_time_left(self.klass, self._since)):
                await woken
        except TimeoutError:
            raise scheduler.queue_timeout(self.klass) from None

    async def take(self) -> None:
        """`offer`, then `wait` if the ticket was queued."""
        if not self.offer():
            await self.wait()

    def give_back(self) -> None:
        """Release the ticket now (idempotent: the exchange's release at the end finds it released)."""
        if self.ticket is not None:
            self._scheduler.release(self.ticket)

    def hand_over(self) -> Callable[[], None]:
        """The granted slot's release, for whoever holds the engine call from now on (a flight: it runs on for its
        other clients after its leader left, and the engine call it makes must go on counting against the pool's
        capacity). The exchange no longer releases it."""
        assert self.ticket is not None and self.ticket.running
        self._held = False
        return functools.partial(self._scheduler.release, self.ticket)

    def regranted(self) -> Callable[[], Awaitable[bool]]:
        """How the work the slot was handed over to (a flight: `dedup.stoppable`) waits, after a stop for a more urgent
        request, until the ticket is granted again (no deadline: a stopped request always completes). It holds the
        scheduler and the ticket, not the request (a flight may outlive its leader)."""
        assert self.ticket is not None
        return functools.partial(self._scheduler.wait_granted, self.ticket)

    def _release_held(self) -> None:
        if self._held:
            self.give_back()


def _retrieved(future: asyncio.Future[None]) -> None:
    future.exception()


def _stops_so_far(ticket: Ticket) -> int | None:
    """How often the ticket's request was stopped already; None when it may not be stopped now."""
    tag = ticket.tag
    if isinstance(tag, Preemptee) and tag.preemptible():
        return tag.preemptions
    return None


def class_specs(config: Config) -> tuple[ClassSpec, ...]:
    return tuple(
        ClassSpec(
            name=c.name,
            weight=c.weight,
            strict=c.strict,
            max_queue=c.max_queue,
            max_running=c.max_running,
            queue_timeout_s=None if c.queue_timeout_ms is None else c.queue_timeout_ms / 1000,
        )
        for c in config.scheduling.classes
    )


class Admission:
    """The gateway's admission control: tenants, rate limits and one scheduler per model pool.

    Pool capacity is the sum of the concurrency limits of the model's routable instances (healthy and
    not ejected; an instance shared by several models counts fully in each; each limit discovered from
    its engine below the configured ceiling, `fleet/capacity.py`), kept current by `resize()`;
    `scheduling.strict_headroom` of it is kept for strict classes."""

    def __init__(self, config: Config, metrics: SchedulingMetrics, *, clock: Clock = time.monotonic) -> None:
        self.book = TenantBook(config.tenants, config.scheduling)
        self.limiter = RateLimiter()
        self.classes = class_specs(config)
        self.engine_priority = config.scheduling.engine_priority
        #: Classes whose running requests may be preempted, and how often one request may be.
        self.preemptible = config.scheduling.preemptible_classes()
        self.max_preemptions = config.scheduling.preemption.max_per_request
        self._metrics = metrics
        self._clock = clock
        self._headroom = config.scheduling.strict_headroom
        window_ms = config.scheduling.strict_reserve_window_ms
        self._strict_window_s = window_ms / 1000 if window_ms else None
        self.schedulers: dict[str, PoolScheduler] = {}
        self._add_schedulers(config)
        #: Tenants whose gauges are exported: every configured one from the start, others from their first request.
        self._watched: set[str] = set()
        self._export_tenants()

    def _add_schedulers(self, config: Config) -> None:
        for m in config.models:
            if m.name in self.schedulers:
                self.schedulers[m.name].reinstate()  # (a model removed by a reload, then added again)
                continue
            capacity = sum(i.concurrency_ceiling(config.upstream) for i in m.instances)
            self.schedulers[m.name] = PoolScheduler(
                m.name,
                self.classes,
                capacity,
                self._metrics,
                reserve=self._reserve(capacity),
                strict_window_s=self._strict_window_s,
                clock=self._clock,
                preemptible=self.preemptible,
            )

    def reconfigure(self, config: Config) -> None:
        """A reload: new tenants, keys and limits for requests that start from now on (synchronous);
        a scheduler for each new model. A removed model's scheduler stays (a request that arrived just
        before the reload still takes its slot there; a model added again reuses it). The `scheduling:`
        section is the running one (a change there needs a restart). Requests in flight keep the tenant,
        the reservation and the ticket they hold; a tenant's buckets keep their level within the new limits."""
        self.book = TenantBook(config.tenants, config.scheduling)
        self.limiter.reconfigure([*self.book.tenants.values(), self.book.default], self._clock())
        self._export_tenants()
        self._add_schedulers(config)

    def _export_tenants(self) -> None:
        """Export the gauges of every configured tenant now (before its first request) with its current limits, and
        drop the series of tenants no longer configured (a reload removed them) and of limits a reload removed."""
        m = self._metrics
        families = (m.ratelimit_remaining_requests, m.ratelimit_remaining_tokens, m.tenant_in_flight, m.tokens_reserved)
        for name in self._watched - self.book.tenants.keys():
            for family in families:
                family.remove(name)
        self._watched.clear()
        for tenant in self.book.tenants.values():
            self._watch(tenant)

    def _reserve(self, capacity: int) -> int:
        headroom = self._headroom
        return min(max(0, capacity - 1), math.ceil(capacity * headroom)) if headroom else 0

    def resize(self, pools: Mapping[str, Pool]) -> None:
        """Follow the fleet: each pool's capacity is what its routable instances take. With none
        routable the configured capacity stays, so requests fail fast (503) instead of queueing."""
        for name, pool in pools.items():
            live = sum(i.max_concurrency for i in pool.instances if i.routable)
            capacity = live or sum(i.max_concurrency for i in pool.instances)
            lent = pool.lent() if pool.lenders else 0
            scheduler = self.schedulers.get(name)
            if scheduler is None:  # a model discovered at run time (cluster mode)
                self.schedulers[name] = PoolScheduler(
                    name,
                    self.classes,
                    max(1, capacity),
                    self._metrics,
                    reserve=self._reserve(max(1, capacity)),
                    clock=self._clock,
                    preemptible=self.preemptible,
                )
                continue
            scheduler.resize(capacity, self._reserve(capacity), lent)

    def withdraw(self, models: Sequence[str]) -> None:
        """A reload removed `models`: their queued requests are told so now (404; the running ones go on)."""
        for model in models:
            scheduler = self.schedulers.get(model)
            if scheduler is not None:
                scheduler.withdraw(
                    functools.partial(
                        ModelNotFound,
                        f"The model '{model}' is no longer served: a configuration reload removed it.",
                        param="model",
                    )
                )

    def class_name(self, klass: int) -> str:
        return self.classes[klass].name

    def room_for(self, model: str, klass: int) -> Callable[[Lease, bool], None] | None:
        """What a request of `model` and class `klass` calls with each engine call's lease just before it is sent: a
        strict class makes room there (`PoolScheduler.make_room`) when a less urgent one is preemptible; a preemptible
        class marks its lease (`Lease.stoppable`: routing prices a P0 at that full instance as a step's wait); else
        None."""
        if klass in self.preemptible:
            return mark_stoppable
        if not self.classes[klass].strict or not any(k > klass for k in self.preemptible):
            return None
        return functools.partial(self.schedulers[model].make_room, klass)

    def allow(self, ex: Exchange, tenant: Tenant, klass: int) -> None:
        """Take the tenant's allowance for `ex` (owned by `ex` from now on): every request passes here first,
        those served from the result cache or a flight included. Raises RateLimitExceeded (429)."""
        api = ex.api
        max_tokens = api.max_tokens if api.max_tokens is not None else tenant.assumed_max_tokens
        # `max_tokens` bounds each of the `n` choices: eight of them may use eight times as much.
        output = max_tokens * api.sequences()
        reserve = api.estimated_prompt_tokens() + output
        if tenant.name not in self._watched:
            self._watch(tenant)
        now = self._clock()
        try:
            reservation = self.limiter.admit(tenant, reserve, now, api.least_prompt_tokens() + output, output)
        except RateLimitExceeded as exc:
            self._metrics.rejections.labels(f"rate_limit_{exc.reason}", self.class_name(klass)).inc()
            raise
        allowance = ex.allowance = Allowance(reservation, self._clock)
        ex.hold(lambda: self._settle(ex, allowance))
        limit_headers = self.limiter.headers(tenant, now)
        if limit_headers:
            ex.response_headers.update(limit_headers)
        if self.engine_priority:
            ex.engine_priority = klass

    def allow_plain(self, tenant: Tenant) -> Reservation:
        """The tenant's allowance for a request that generates nothing (a stored response's route): one request and its
        place among the tenant's `max_concurrent`, no tokens. The caller settles it when the request ends. Raises
        RateLimitExceeded (429)."""
        if tenant.name not in self._watched:
            self._watch(tenant)
        try:
            return self.limiter.admit(tenant, 0, self._clock())
        except RateLimitExceeded as exc:
            self._metrics.rejections.labels(f"rate_limit_{exc.reason}", "").inc()
            raise

    def settle_plain(self, reservation: Reservation) -> None:
        reservation.settle(0, self._clock())

    def slot(self, ex: Exchange, klass: int, *, tag: object = None) -> Slot:
        """`ex`'s place at its model's scheduler, to be taken (`Slot.take`) by a request about to call an engine."""
        return Slot(self.schedulers[ex.api.model], ex, klass, tag)

    @staticmethod
    def _settle(ex: Exchange, allowance: Allowance) -> None:
        """A request whose engines produced nothing and that delivered nothing costs no tokens; otherwise its prompt and
        the more of the tokens delivered and produced (`Exchange.engine_tokens`, at most its `max_tokens`): a client
        that left before its whole answer came, or whose deadline passed, had the engine generate it, and leaving was a
        way around the token limit (an outside run: six requests abandoned at 2.7 s, ~1,380 tokens generated, none
        charged). One that also reached no engine (refused by the scheduler's queue, no healthy instance, cancelled
        while queued) does not count as a request either: retried by its SDK, a full queue's 429 used up the tenant's
        requests per minute."""
        record = ex.record
        produced = ex.api.generable(ex.engine_tokens)
        used = 0
        # A client that left (or whose deadline passed) once its prompt was sent had the engine prefill it: its
        # prompt is charged even before any token came (`Exchange.prompt_processed`; an outside run: 20 streamed
        # requests of 2,400-token prompts, each dropped in its prefill, ~19,000 prompt tokens a second under a limit of
        # 50, none charged).
        if record.status == "completed" or ex.prompt_processed():  # (tokens produced: its prompt was processed)
            used = max(record.completion_tokens, produced) + (record.prompt_tokens or ex.api.estimated_prompt_tokens())
        allowance.done(used, record.attempts > 0)

    def _watch(self, tenant: Tenant) -> None:
        """Export the tenant's rate-limit state (computed when scraped), once per tenant."""
        self._watched.add(tenant.name)
        m, limiter, clock = self._metrics, self.limiter, self._clock

        def state() -> TenantState:
            return limiter.state(tenant, clock())

        def remaining(bucket: Bucket | None) -> float:
            return 0.0 if bucket is None else max(0.0, bucket.level)

        if tenant.requests_per_minute is not None:
            m.ratelimit_remaining_requests.labels(tenant.name).set_function(lambda: remaining(state().requests))
        else:
            m.ratelimit_remaining_requests.remove(tenant.name)  # (a reload removed the limit)
        if tenant.tokens_per_minute is not None:
            m.ratelimit_remaining_tokens.labels(tenant.name).set_function(lambda: remaining(state().tokens))
        else:
            m.ratelimit_remaining_tokens.remove(tenant.name)
        m.tenant_in_flight.labels(tenant.name).set_function(lambda: state().in_flight)
        m.tokens_reserved.labels(tenant.name).set_function(lambda: state().reserved_tokens)

    def statistics(self) -> dict[str, object]:
        return {
            "pools": {name: s.statistics() for name, s in self.schedulers.items()},
            "tenants": {
                name: {"in_flight": st.in_flight, "reserved_tokens": st.reserved_tokens, "admitted": st.admitted}
                for name, st in self.limiter.tenants().items()
            },
        }
