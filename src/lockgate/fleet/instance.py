"""One engine process (`Instance`: its configuration, connections, health and load state) and a request
attempt's slot on it (`Lease`). The fleet (`pool.py`) creates and owns instances; routing sees one only
through `Instance.view()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp

from ..config import InstanceConfig
from ..credentials import Credentials
from ..engines import DIALECTS, Dialect, dialect_for
from ..http import HttpPool
from ..metrics import GatewayMetrics
from ..routing.policies import InstanceView
from .capacity import ConcurrencyLimit
from .ejection import Ejection
from .state import STEP_TOKENS, Attempt, EngineLoad, Ewma, HitRateGap, OwnAccounting, Published, merge


def part_of(limit: int, index: int, count: int) -> int:
    """Worker `index`'s part of an engine's `limit` among `count` workers: the parts add up to the limit (the first
    workers take what does not divide), each at least one."""
    return max(1, limit // count + (1 if index < limit % count else 0))


class Instance:
    """One engine process. Mutable runtime state; routing sees it only through `view()`."""

    def __init__(
        self,
        config: InstanceConfig,
        session: aiohttp.ClientSession,
        base_url: str,
        ejection: Ejection | None = None,
        http: HttpPool | None = None,
        *,
        max_connections: int = 256,
        key: str | None = None,
        scrapes: HttpPool | None = None,
    ) -> None:
        self.key = key or config.key
        self.name = config.display_name
        self.url = config.url
        self.dialect: Dialect = dialect_for(config.engine)
        #: The concurrency limit: at most the configured ceiling, else discovered from the engine's queue.
        self.concurrency = ConcurrencyLimit(
            config.max_concurrency or max_connections, stated=config.max_concurrency is not None
        )
        #: Under `--workers`: (this worker's index, the workers' count). Each worker reaches an engine that is not
        #: behind a sidecar on its own, so each takes its part of the engine's limit: together they never send it
        #: more than it runs, and a P0 finding its part full preempts its own worker's P2 there (an outside run: with
        #: every worker admitting up to the whole limit, P0 waited behind other workers' P2 streams for a whole
        #: generation, 4.7 s, in the engine's queue).
        self.share: tuple[int, int] | None = None
        self.api_key = config.api_key
        self.basic_authorization = config.basic_authorization
        #: The credentials sent to the engine, scrubbed out of what it says (`credentials.py`).
        self.credentials = Credentials(config.secrets)
        #: Its prefix cache's size in tokens when configured (else learned from the engine's metrics).
        self.cache_tokens = config.cache_tokens
        #: Prompt tokens routed here and those the prefix index predicted cached (`hit_gap` compares
        #: their ratio with the engine's own prefix-cache hit rate, scrape to scrape).
        self.predicted_queries = 0
        self.predicted_hits = 0
        self.hit_gap = HitRateGap()
        #: Engine tokens per token of the gateway's estimate (characters / 4), learned from usage; sizes
        #: its cache in the prefix index's blocks.
        self.token_ratio = Ewma(alpha=0.1)
        #: aiohttp for the rare side calls: health probes, abort calls.
        self.session = session
        #: The lean keep-alive pool that carries generation requests (`upstream.py`).
        self.http = http or HttpPool(config.url)
        #: A lean pool of one connection for the metrics scrapes (several a second per engine: aiohttp cost ~5x
        #: more a scrape), of its own so that a scrape never waits behind generation requests.
        self.scrapes = scrapes or HttpPool(config.url, max_connections=1)
        #: Where aiohttp requests go (for unix sockets the host part is ignored).
        self.base_url = base_url
        #: SNI (and the name checked) for the aiohttp calls when `tls.server_name` overrides the URL's host.
        self.server_name = config.tls.server_name if config.tls is not None else None
        self.healthy = True
        #: Removed (or replaced) by a reload: no new requests; closed once `in_flight` is back to 0.
        self.retired = False
        #: Set by the last lease released while someone waits in `wait_idle()`.
        self.idle: asyncio.Event | None = None
        #: Leases held (routing slots) and engine calls open; exported as gauges when scraped.
        self.in_flight = 0
        #: Of those, the leases of requests of a preemptible class (`Lease.stoppable`), and of these the ones whose
        #: first token has not come back: waiting in the engine, a P0 sent there has them stopped at no cost to the
        #: engine (`preemption.ahead_in_engine`).
        self.stoppable = 0
        self.stoppable_waiting = 0
        #: The most leases held at once since the last scrape judged its limit (`Fleet` sets it back to `in_flight`
        #: then): whether the limit was reached between two scrapes, which the count at a scrape misses when
        #: requests come and go faster than scrapes.
        self.filled_to = 0
        #: Leases held, by the model (pool) they were taken for: once retired, what it still runs of each pool's
        #: requests (`Fleet.apply`: capacity the pool lends until they end).
        self.leased: dict[str, int] = {}
        #: Set once retired: told each time one of its leases ends (the fleet's pools shrink what they lend).
        self.on_vacated: Callable[[], None] | None = None
        #: Retired, the instance a reload put at its URL (the same engine): its leases count there too until they end
        #: (`hand_over`).
        self.successor: Instance | None = None
        self.open_calls = 0
        self.last_probe_at: float | None = None
        #: Its engine was asked how many sequences it runs at once since it last came up (`declared.py`).
        self.parallelism_asked = False
        self.last_error: str | None = None
        #: It answered 404 once (logged once: a model name its engine does not serve, `served_model`).
        self.told_not_found = False
        #: It refused the gateway's credentials once (logged once: its `api_key`).
        self.told_credentials = False
        self.own = OwnAccounting()
        self.engine_load: EngineLoad | None = None
        self.scrape_error: str | None = None
        #: Its engine's load scraped now, or very recently (None: the fleet does not scrape it).
        self.look: Callable[[], Awaitable[EngineLoad | None]] | None = None
        #: Set for an engine behind a sidecar (cluster mode): its state comes from etcd, not from probes.
        self.published: Published | None = None
        self.ejection = ejection or Ejection()
        #: The headers every generation request carries (`upstream_headers` adds the per-request ones).
        self.request_headers = [("Content-Type", "application/json"), *_auth(self).items()]

    @property
    def max_concurrency(self) -> int:
        """How many requests this instance takes at once now (routing and scheduling use it): its engine's limit, or
        under `--workers` this worker's part of it (`share`)."""
        return self._part(self.concurrency.limit)

    def known_slots(self) -> int | None:
        """The slots its engine is known to have (`ConcurrencyLimit.known_slots`; None: not known), or under
        `--workers` this worker's part of them."""
        known = self.concurrency.known_slots()
        return None if known is None else self._part(known)

    def _part(self, slots: int) -> int:
        """This worker's part of the engine's `slots` (`share`; all of them outside `--workers`, or behind a
        sidecar)."""
        share = self.share
        return slots if share is None or self.published is not None else part_of(slots, *share)

    def engine_in_flight(self) -> int:
        """The requests of this gateway at its engine, for judging the engine's limit (`ConcurrencyLimit.observe`):
        under `--workers`, every worker's, reckoned from this one's use of its part (they share the load alike)."""
        part = self.max_concurrency
        if part == self.concurrency.limit:
            return self.in_flight
        return self.in_flight * self.concurrency.limit // part

    @property
    def in_service(self) -> bool:
        """Passes its health checks and is configured: what a panicking pool routes over (ejection aside)."""
        return self.healthy and not self.retired

    @property
    def continues_chat(self) -> bool:
        """Whether its engine continues a final assistant message (`Dialect.continue_final_message`: a preempted or
        broken chat generation resumes from its partial output). Behind a sidecar, the engine's there, which the
        sidecar relays the request to as it is (a central built its discovered instances as OpenAI servers, which
        do not: chat P2 streams that broke there ended in an error, and preempted ones started over)."""
        published = self.published
        if published is None:
            return self.dialect.continue_final_message
        dialect = DIALECTS.get(published.engine)
        return dialect is not None and dialect.continue_final_message

    @property
    def routable(self) -> bool:
        return self.healthy and not self.retired and not self.ejection.ejected

    def hand_over(self, successor: Instance) -> None:
        """A reload replaced this (retired) instance by `successor` at the same URL: the engine is the same, and the
        requests still running here hold its slots. They count there from now until they end (its in-flight gauge,
        `/admin/fleet`, the dashboard, and routing, which sent the engine a full limit more before: an outside run saw
        both instances idle after a reload, their streams still running)."""
        self.successor = successor
        successor.in_flight += self.in_flight
        successor.stoppable += self.stoppable
        successor.stoppable_waiting += self.stoppable_waiting
        for model, count in self.leased.items():
            successor.leased[model] = successor.leased.get(model, 0) + count

    def wake_if_idle(self) -> None:
        """No lease held and no engine call open on its connections: wake `wait_idle` (a retired instance closes)."""
        if self.in_flight <= 0 and self.open_calls <= 0 and self.idle is not None:
            self.idle.set()

    async def wait_idle(self) -> None:
        """Wait until no lease is held on the instance (its requests have ended) and no engine call is open on its
        connections: behind a sidecar that served a call on another engine of its node, the lease moved there while
        the call's connection is still this instance's (closing it would cut that stream)."""
        while self.in_flight > 0 or self.open_calls > 0:
            self.idle = asyncio.Event()
            await self.idle.wait()

    async def aclose(self) -> None:
        """Close its connections: the engine client's, the scrapes' and aiohttp's."""
        await self.http.aclose()
        await self.scrapes.aclose()
        await self.session.close()

    def auth_headers(self) -> dict[str, str]:
        return _auth(self)

    def view(
        self,
        now: float | None = None,
        stale_after: float = 1.0,
        cached_tokens: int = 0,
        cache_room: int | None = None,
        *,
        panic: bool = False,
    ) -> InstanceView:
        """What routing sees; in `panic` an instance that passes its health checks is routable even if ejected."""
        return merge(
            key=self.key,
            name=self.name,
            routable=self.in_service if panic else self.routable,
            in_flight=self.in_flight,
            max_concurrency=self.max_concurrency,
            stoppable=self.stoppable,
            stoppable_waiting=self.stoppable_waiting,
            own=self.own,
            engine=self.engine_load,
            now=time.monotonic() if now is None else now,
            stale_after=stale_after,
            cached_tokens=cached_tokens,
            cache_room=cache_room,
        )


class Lease:
    """A routing slot on one instance, held by one request attempt. `release()` is idempotent."""

    __slots__ = (
        "_attempt",
        "_estimate",
        "_metrics",
        "_released",
        "_stoppable",
        "_waiting_stop",
        "_whole",
        "completion_tokens",
        "instance",
        "model",
    )

    def __init__(
        self,
        instance: Instance,
        metrics: GatewayMetrics,
        uncached_tokens: int = 0,
        prompt_tokens: int = 0,
        long: bool = False,
        model: str = "",
        *,
        whole: bool = False,
    ) -> None:
        """`long`: a long streamed prompt, holding the instance's turn for one (`Pool.is_long`) until its first
        token or its end. `model`: the pool it was taken for. `whole`: the engine answers with one body."""
        self.instance = instance
        self.model = model
        #: The gateway's estimate of the prompt's tokens (characters / 4).
        self._estimate = prompt_tokens
        self._metrics = metrics
        self._released = False
        self._stoppable = False
        #: Counted in `Instance.stoppable_waiting`: stoppable, its first token not back.
        self._waiting_stop = False
        #: Tokens received so far (for the instance's TPOT), kept current by the relay.
        self.completion_tokens = 0
        self._whole = False
        instance.in_flight += 1
        if instance.in_flight > instance.filled_to:
            instance.filled_to = instance.in_flight
        leased = instance.leased
        leased[model] = leased.get(model, 0) + 1
        self._attempt: Attempt = instance.own.start(uncached_tokens, time.monotonic(), long, whole)

    def first_token(self) -> None:
        """The engine's first event arrived: this attempt's prompt is no longer queued there."""
        if not self._released:
            self.instance.own.first_token(self._attempt, time.monotonic(), not engine_queues(self.instance))
            if self._waiting_stop:
                self._waiting_stop = False
                self._count_stops(0, -1)

    @property
    def sent_at(self) -> float:
        """When the attempt was sent (`time.monotonic()`)."""
        return self._attempt.sent_at

    @property
    def answered(self) -> bool:
        """Its first token has come back."""
        return self._attempt.first_at is not None

    def waiting_since(self) -> float | None:
        """Since when it has waited with nothing to show (`OwnAccounting.waiting_since`); None once answered or
        released."""
        if self._released or self._attempt.first_at is not None:
            return None
        return self.instance.own.waiting_since(self._attempt)

    @property
    def released(self) -> bool:
        """The attempt has ended (`release()`)."""
        return self._released

    def engine_full(self) -> bool:
        """Whether every slot the engine is known to have (`ConcurrencyLimit.known_slots`) is taken by a request
        already generating there (its first token back): this attempt then waits for one of them to end. A whole
        (non-streamed) answer never shows its first token and does not count: the answer errs towards "not full"."""
        instance = self.instance
        known = instance.known_slots()
        return known is not None and instance.in_flight - instance.own.pending >= known

    def slots_known(self) -> bool:
        """Whether the engine's parallelism is known (`ConcurrencyLimit.known_slots`): else the gateway may have
        sent it more than it runs (a flood's first moments), and the excess waits in its queue."""
        return self.instance.concurrency.known_slots() is not None

    async def queue_ahead(self) -> bool | None:
        """A look at the engine's queue now (`Instance.look`, a scrape): whether it holds requests sent before the
        last step, so that this attempt waits behind them for a slot (`OwnAccounting.queued_beyond`). None: it
        cannot be told (not scraped here, no queue signal, the step time not measured)."""
        instance = self.instance
        look = instance.look
        if look is None or instance.published is not None:
            return None
        load = await look()
        if load is None or load.waiting is None:
            return None
        return instance.own.queued_beyond(load.waiting, load.scraped_at)

    def limit_found(self) -> bool:
        """Whether the instance's limit is the engine's (`slots_known`) or one its discovery set below the ceiling:
        else, a flood's first moments, the gateway may have sent the engine more than it runs."""
        concurrency = self.instance.concurrency
        return concurrency.known_slots() is not None or concurrency.limit < concurrency.ceiling

    def prefill_exceeds_step(self) -> bool:
        """Whether this attempt's prompt (its uncached part) takes the engine longer to prefill than a step, at the
        instance's measured rate and step (`OwnAccounting.exceeds_step`: none while no step is measured)."""
        return self.instance.own.exceeds_step(self._attempt.tokens)

    def first_token_due(self, slack_steps: int = 1) -> float | None:
        """When an unanswered attempt's first token is overdue (`OwnAccounting.first_token_due`): past it, the
        attempt waits in the engine's own queue. None once answered or while the instance's step time is
        not measured."""
        return self.instance.own.first_token_due(self._attempt, slack_steps)

    def produced(self, now: float) -> int:
        """Tokens the engine has produced for this attempt: those read from its stream, or its whole answer's; for a
        whole answer not come yet (its client left, its deadline passed), an estimate: the time since it was sent, less
        its own prefill (what was queued ahead of it and its prompt, at the instance's measured rate) and a step, at
        the measured time per token (its streams', else its whole answers' fit, else the engine's own), 0 while none
        is measured. Work its tenant is charged for (`Admission._settle`): a client that left before its whole answers
        came had the engine generate them for free. (Less the instance's mean first-token time instead, a request left
        in the prefill of its 30,000-token prompt was charged 33 tokens, and one after a long prompt's 35 of its 73.)"""
        attempt = self._attempt
        if self.completion_tokens or self._whole or not attempt.whole:
            return self.completion_tokens
        own, load = self.instance.own, self.instance.engine_load
        tpot = own.tpot.value or own.whole.slope() or (load.tpot_s if load is not None and load.tpot_s else 0.0)
        if tpot <= 0:
            return 0
        first = attempt.sent_at + (attempt.backlog + attempt.tokens) / own.rate + tpot
        return max(0, int((now - first) / tpot))

    def produced_tokens(self, tokens: int) -> None:
        """The engine streamed `tokens` more tokens for this attempt; at `STEP_TOKENS` of them its pace is a sample of
        the engine's step (`OwnAccounting.decoding`)."""
        before = self.completion_tokens
        self.completion_tokens = after = before + tokens
        if before < STEP_TOKENS <= after and not self._released:
            self.instance.own.decoding(self._attempt, after, time.monotonic())

    def whole(self, completion_tokens: int) -> None:
        """A non-streamed answer arrived complete: its timing still feeds the instance's TTFT/TPOT."""
        self.completion_tokens = completion_tokens
        self._whole = True

    def hold(self) -> None:
        """The request is of a strict class and streamed: until its first token the less urgent requests are not sent
        to its instance (`OwnAccounting.held`)."""
        if not self._released:
            self.instance.own.hold(self._attempt, time.monotonic())

    def stoppable(self) -> None:
        """The request is of a preemptible class: a P0 routed to its full instance has it stopped (`Instance.stoppable`,
        `predict_ttft`). Counted until the lease ends (and where it moves)."""
        if not self._released and not self._stoppable:
            self._stoppable = True
            self._waiting_stop = self._attempt.first_at is None
            self._count_stops(1, self._waiting_stop)

    def _count_stops(self, stoppable: int, waiting: int) -> None:
        """Add to the stoppable leases counted at its instance and at those that replaced it at its URL
        (`Instance.hand_over`), and to those of them waiting for their first token."""
        at: Instance | None = self.instance
        while at is not None:
            at.stoppable += stoppable
            at.stoppable_waiting += waiting
            at = at.successor

    def move(self, to: Instance) -> None:
        """The engine serving this attempt is `to`, not the instance it was routed to (a sidecar picks
        among its node's engines): its slot, queued prompt and TTFT/TPOT samples count there from now,
        so this replica's view of both engines stays exact between the sidecar's publications."""
        if self._released or to is self.instance:
            return
        now = time.monotonic()
        before = self.instance
        before.own.end(self._attempt, now, 0)  # no first token yet: no sample, only the queue undone
        self._attempt = to.own.adopt(self._attempt, now)
        to.in_flight += 1
        to.stoppable += self._stoppable
        to.stoppable_waiting += self._waiting_stop
        to.leased[self.model] = to.leased.get(self.model, 0) + 1
        self.instance = to
        self._vacate(before)

    def release(self, engine_prompt_tokens: int = 0) -> None:
        """End the attempt; `engine_prompt_tokens`: the prompt's size as the engine counted it (usage),
        which teaches the instance how its tokens relate to the gateway's estimate."""
        if self._released:
            return
        self._released = True
        instance = self.instance
        if engine_prompt_tokens > 0 and self._estimate > 0:
            instance.token_ratio.add(engine_prompt_tokens / self._estimate, time.monotonic())
        engine = instance.engine_load
        instance.own.end(
            self._attempt,
            time.monotonic(),
            self.completion_tokens,
            whole=self._whole,
            engine_tpot=engine.tpot_s if engine is not None and engine.tpot_s is not None else 0.0,
            measure=not engine_queues(instance),
        )
        self._vacate(instance)

    def _vacate(self, instance: Instance) -> None:
        at: Instance | None = instance
        while at is not None:  # (and at the instances that replaced it at its URL, `Instance.hand_over`)
            at.in_flight -= 1
            at.stoppable -= self._stoppable
            at.stoppable_waiting -= self._waiting_stop
            leased = at.leased
            left = leased.get(self.model, 0) - 1
            if left > 0:
                leased[self.model] = left
            else:
                leased.pop(self.model, None)
            if at.in_flight < 0:
                self._metrics.leaks.labels("negative_in_flight").inc()
            if at.on_vacated is not None:
                at.on_vacated()
            at.wake_if_idle()
            at = at.successor


def _auth(instance: Instance) -> dict[str, str]:
    """The gateway's own credential for an engine: its `api_key` as a Bearer token, else the Basic
    credential of its URL's userinfo, else none."""
    if instance.api_key:
        return {"Authorization": f"Bearer {instance.api_key}"}
    if instance.basic_authorization:
        return {"Authorization": instance.basic_authorization}
    return {}


def upstream_headers(
    instance: Instance, request_id: str, *, stream: bool, extra: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    headers = [("X-Request-Id", request_id), *instance.request_headers]
    if stream and instance.dialect.close_after_stream:
        headers.append(("Connection", "close"))
    if extra:
        headers.extend(extra)
    return headers


def engine_queues(instance: Instance) -> bool:
    """Whether the engine's last scrape showed a queue at least as long as what it runs: a first token then may have
    waited for a sequence slot, which no prefill explains. Measured as prefill, such waits took an 8-slot engine's
    rate from thousands of tokens a second to a few hundred under a flood; every queue then read as prefill work,
    and its concurrency limit stayed at the ceiling with 240 requests waiting inside it (an outside run)."""
    load = instance.engine_load
    if load is None or load.waiting is None or load.running is None:
        return False
    return load.waiting >= max(1.0, load.running)


def mark_stoppable(lease: Lease, watch: bool) -> None:
    """A preemptible class's engine calls' hook before they are sent (`Admission.room_for`, `resume.Resumable`): the
    lease counts as one a P0 may have stopped (`Lease.stoppable`)."""
    lease.stoppable()
