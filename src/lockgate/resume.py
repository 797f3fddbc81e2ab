"""The request path of preemptible requests: one generation over several engine calls.

Theory of operation: a request of a preemptible class is admitted with a `Resumable` as its ticket's
tag (`preemption.Preemptee`). Its generation is the async iterator `Resumable.events()`, which the
shared client writers consume (`respond.stream_events`, or folded by `assemble` for non-streaming
clients). While an engine call is running the request may be stopped: a strict-class arrival on a
full pool calls `preempt()` synchronously (from the scheduler, in the arriving request's task), which
aborts the engine call at once (`Exchange.detach()`: connection closed, lease released), marks the
request `queued` and — if this request's task is awaiting the engine — cancels that await. The
scheduler then re-queues the ticket. `events()` absorbs exactly that cancellation (counted with
`Task.uncancel()`; any other cancellation — client gone, deadline, admin — still propagates), waits
for its ticket to be granted again, and opens the continuation (`preemption.continuation`) or, for
requests that cannot be continued and have sent nothing yet, the original request again.

An engine call that breaks after it opened (the engine died, hung past the stall timeout, or sent an error event
that another instance may not) is taken over the same way (`_fails_over`): detached, and the generation continued —
or restarted while its client has nothing — on an instance the failure did not rule out, within the model's
`retries` over the whole generation; with nowhere else to go, the engine's error stands.

The `Exchange` stays the single owner of everything: the ticket is released by its hold, the engine
call and lease by `detach()`, and `events()` holds nothing across a preemption. A request stopped
while its client write is in progress is not cancelled (the write finishes, then `events()` sees the
flag before touching the engine again): a cancellation there would look like a client disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import TYPE_CHECKING, Any

from .admission.preemption import Plan, Stopped, StopSignal, Transcript, blocker, continuation, fresh, plan
from .attempt import Failover, Opened
from .edge.server import Reply, Request
from .errors import UpstreamError
from .exchange import Exchange, Phase
from .fleet.instance import mark_stoppable
from .relay import in_time, open_engine
from .respond import stream_events, whole_body
from .responses import whole_answer
from .upstream import UpstreamEvents, too_large
from .wire import ApiRequest

if TYPE_CHECKING:
    from .admission.gate import Admission, PoolScheduler
    from .admission.scheduler import Ticket
    from .fleet.fleet import Fleet
    from .fleet.instance import Lease
    from .fleet.pool import HeaderLookup


class Resumable:
    """One preemptible request's generation, across the engine calls it takes."""

    def __init__(
        self,
        ex: Exchange,
        fleet: Fleet,
        scheduler: PoolScheduler,
        max_preemptions: int,
        request_headers: HeaderLookup,
    ) -> None:
        self.ex = ex
        self._fleet = fleet
        self._request_headers = request_headers
        self.ticket: Ticket | None = None
        # Only a non-streaming client needs the events kept (to assemble its answer at the end).
        # Its text is kept for a continuation up to the most of an answer the gateway holds.
        self.transcript = Transcript(
            ex.api.endpoint, keep_events=not ex.api.stream, max_chars=fleet.upstream.max_response_bytes
        )
        #: Bytes of event payloads read from the engine, over every attempt (bounds a non-streaming answer).
        self.received = 0
        self.preemptions = 0
        #: Response headers, completed when the first engine call opens (read when the client's
        #: response starts).
        self.headers: dict[str, str] = {
            "x-request-id": ex.record.client_request_id or ex.id,
            **ex.response_headers,
            "x-lockgate-cache": "bypass",
        }
        self._scheduler = scheduler
        self._max = max_preemptions
        self._task = asyncio.current_task()
        chat_continuation = all(i.continues_chat for i in ex.pool.instances)
        self._blocker = blocker(ex.api, chat_continuation=chat_continuation)
        self._active = False  # an engine call of this request is running
        self._preempted = False  # stopped; waiting to be granted again
        self._restart = False  # the next attempt starts from scratch
        self._signal = StopSignal()
        #: Engine calls that broke midway and were taken over elsewhere (`_fails_over`).
        self._failover = Failover(ex.pool)

    # --- Preemptee (synchronous, called by the scheduler) --------------------------------------
    def preemptible(self) -> bool:
        return self._active and self.preemptions < self._max and self._plan() is not None

    def preempt(self) -> Plan:
        how = self._plan()
        if not self._active or how is None:
            raise RuntimeError("preempt() on a request that is not preemptible")
        ex = self.ex
        self.preemptions += 1
        ex.record.preemptions += 1
        if how is Plan.RESTART:
            ex.record.restarts += 1
            self._restart = True
        self._active = False
        self._preempted = True
        self._detach(how)  # the engine sees the abort now
        ex.phase = Phase.QUEUED
        self._signal.stop(self._task)
        return how

    def redo_tokens(self) -> int:
        # Started over: its output is produced again, not prefilled.
        return self.ex.api.estimated_prompt_tokens() + (0 if self._restart else self.transcript.tokens)

    def placed(self) -> Lease | None:
        return self.ex.lease

    def _plan(self) -> Plan | None:
        return plan(self._blocker, self.transcript, self.ex.api.max_tokens, sent=self.ex.response is not None)

    # --- the generation ------------------------------------------------------------------------
    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        ex = self.ex
        attempt = 0
        while True:
            if self._preempted:
                await self._wait_regranted()
            api = self._next_request()
            upstream_id = ex.id if attempt == 0 else f"{ex.id}-p{attempt}"
            attempt += 1
            self.transcript.start_attempt()
            self._active = True
            opened: Opened | None = None
            upstream: UpstreamEvents | None = None
            received_before = self.received
            try:
                opened = await self._signal.engine(self._open(api, upstream_id))
                ex.served_by(opened.call.served_by)
                if ex.response is None:  # (the client's headers are not out yet: the instance that answers it)
                    self.headers["x-lockgate-instance"] = opened.call.served_by
                upstream = opened.events
                assert upstream is not None  # a resumable generation is read as a stream
                while True:
                    if self._preempted:
                        raise Stopped
                    try:
                        event = await self._signal.engine(anext(upstream))
                    except StopAsyncIteration:
                        break
                    self.received = received_before + opened.call.received
                    out = self.transcript.take(event)
                    if out is None:
                        continue
                    if ex.response is not None and ex.phase is not Phase.STREAMING:
                        ex.phase = Phase.STREAMING
                    yield out
            except Stopped:
                continue
            except UpstreamError as exc:
                if opened is None or not self._fails_over(exc, opened):
                    raise
                continue
            finally:
                self._active = False
                if upstream is not None:
                    upstream.close()
                if opened is not None:
                    opened.close()
            return

    def _open(self, api: ApiRequest, upstream_id: str) -> Awaitable[Opened]:
        """Route and open one engine call for `api` (`relay.open_engine`). `upstream_id` is per attempt (`<id>-p<n>`)
        so that an engine never sees two requests with one id (SGLang aborts by id). After a failover, not where the
        generation broke (and if nowhere else can take it, that engine's error stands)."""
        failover = self._failover
        return open_engine(
            self.ex,
            self._fleet,
            api,
            self._request_headers,
            upstream_id,
            mark_stoppable,
            exclude=failover.excluded,
            after=failover.error(),
            resent=self.preemptions > 0 and self.transcript.tokens == 0,
        )

    def _fails_over(self, exc: UpstreamError, opened: Opened) -> bool:
        """An engine call that broke after it opened (its engine died, hung or failed midway): whether the generation
        goes on elsewhere, as after a preemption (continued from what it produced, or restarted while nothing reached
        the client), within the model's `retries` over the whole generation and the deadline. False: the error
        stands, as it does for a request that cannot be continued once its client has output."""
        ex = self.ex
        how = self._plan()
        if how is None or not in_time(ex) or not self._failover.take(exc, opened.lease.instance):
            return False
        self._detach(how)
        if how is Plan.RESTART:
            ex.record.restarts += 1
            self.transcript.reset()
        return True

    def _detach(self, how: Plan) -> None:
        """End the engine call under way (`Exchange.detach`). What a call started over (`Plan.RESTART`) produced is
        thrown away and produced again by the next: not charged to the tenant's rate limit (`Exchange.engine_tokens`).
        A P2 request restarted for a P0 was charged ~115 tokens for an answer of 71 (an outside run), where a resumed
        one is charged what it delivered."""
        ex = self.ex
        charged = ex.engine_tokens
        ex.detach()
        if how is Plan.RESTART:
            ex.engine_tokens = charged

    async def _wait_regranted(self) -> None:
        self._preempted = False
        if self._restart:
            self._restart = False
            self.transcript.reset()
        assert self.ticket is not None
        await self._scheduler.wait_granted(self.ticket)

    def _next_request(self) -> ApiRequest:
        t = self.transcript
        if t.tokens == 0:
            return fresh(self.ex.api)
        return continuation(self.ex.api, t.text, t.tokens)


async def relay_resumable(
    ex: Exchange,
    http_request: Request,
    klass: int,
    admission: Admission,
    fleet: Fleet,
) -> Reply:
    """The request path of a request of a preemptible class, once its tenant's allowance is taken (and it is not
    de-duplicated): its slot, then its generation over as many engine calls as preemptions make it take."""
    run = Resumable(ex, fleet, admission.schedulers[ex.api.model], admission.max_preemptions, http_request.headers)
    slot = admission.slot(ex, klass, tag=run)
    await slot.take()
    run.ticket = slot.ticket
    events = run.events()
    try:
        if ex.api.stream:
            return await stream_events(ex, http_request, events, run.headers)
        limit = fleet.upstream.max_response_bytes
        async for _ in events:
            if run.received > limit:
                raise too_large(run.headers.get("x-lockgate-instance", "?"), limit)
        return whole_body(ex, whole_answer(ex.api, run.transcript.events), run.headers)
    finally:
        await events.aclose()
        # The ticket's tag is the run: without this, the two would wait for a full garbage collection, the request's
        # body and answer with them (the exchange's hold still releases the ticket).
        run.ticket = None
