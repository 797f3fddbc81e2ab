"""The request owner.

Theory of operation: every accepted client request gets exactly one `Exchange`. It is the single
owner of everything that request holds — its registry entry (admin listing, shutdown), its instance
lease, its upstream call, its deadline, its usage record, and whatever else it was handed with
`hold()` (its queue ticket, its rate-limit reservation) — and releases each exactly once in
`_release()`, which runs in the `finally` of `run()` whichever way the request ends: completed,
upstream error, client disconnect, deadline, admin cancel or shutdown. Release is synchronous (no
`await`), so it cannot be interrupted by a second cancellation; the usage record is then handed to
the background writer (two-phase cleanup: resources now, the durable record right after).

How a request ends is decided in one place, `run()`:
- the client disconnects (or stops reading for `limits.write_timeout_ms`): the edge
  server cancels the handler task, or a write fails with a connection error; either way the upstream
  call is closed at once;
- the deadline passes: `asyncio.timeout` cancels the work; 504, or a final SSE error event;
- an admin or the shutdown drain calls `cancel(reason)`: the task is cancelled with the reason noted,
  the cancellation is absorbed and the client gets an error saying why.

A whole (non-streaming) answer is written by the edge server after `run()` has returned it, so its usage
record waits for the edge's word (`Response.on_sent` -> `body_sent`): taken by the client, the request
completed; not taken (the client left, or stopped reading for `limits.write_timeout_ms`), it was cancelled
(`client_disconnect`) with no completion token delivered. Everything else is released at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from . import sse
from .edge.server import Reply, Response, StreamResponse
from .errors import Cancelled, DeadlineExceeded, GatewayError, drop_tracebacks
from .records import CLIENT_ENDED, UsageRecord
from .response_ids import ResponseNaming
from .wire import ApiRequest, Endpoint

log = logging.getLogger(__name__)

#: The priority class a request was served at (response header).
PRIORITY_SERVED_HEADER = "x-lockgate-priority"

if TYPE_CHECKING:
    from .admission.ratelimit import Allowance
    from .fleet.instance import Instance, Lease
    from .fleet.pool import Pool
    from .metrics import GatewayMetrics
    from .observe.otel import Tracer
    from .records import RecordWriter
    from .response_ids import ResponseIds
    from .upstream import UpstreamCall


class Phase(StrEnum):
    QUEUED = "queued"
    CONNECTING = "connecting"  # waiting for the engine's first byte (prefill)
    #: (Shown only, never set) the engine streams tokens that the client gets as one answer at the end (an engine
    #: read as a stream for a non-streaming client: llama.cpp, a resumable class).
    GENERATING = "generating"
    STREAMING = "streaming"
    FINISHING = "finishing"


class ClientGone(Exception):
    """Writing to the client failed: it has disconnected."""


class Subscription(Protocol):
    """A share of an upstream call owned by someone else (a flight). `close()` is idempotent and
    returns True if closing it aborted that upstream call; `instance()` names the instance that call went to (the
    engine serving it once it opened); `attempts()` counts the engine calls the flight started; `tokens()` the tokens
    its engine call has sent so far; `requeued()` whether the flight was stopped by a preemption and waits for its
    slot again."""

    def close(self) -> bool: ...

    def instance(self) -> str | None: ...

    def attempts(self) -> int: ...

    def tokens(self) -> int: ...

    def requeued(self) -> bool: ...


class Host(Protocol):
    """What an exchange needs of the gateway that owns it (the `Gateway`): where its metrics, record and
    trace span go, the registry of live requests, and the error envelope."""

    metrics: GatewayMetrics
    records: RecordWriter
    registry: Registry
    tracer: Tracer | None
    log_prompts: bool
    #: The running loop (set when the gateway starts, `Gateway.__aenter__`: requests come only after).
    loop: asyncio.AbstractEventLoop

    def count_dedup(self, outcome: str) -> None: ...

    def error_response(
        self,
        error: GatewayError,
        request_id: str,
        instance: str | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> Response: ...


class Exchange:
    def __init__(
        self,
        host: Host,
        request_id: str,
        api: ApiRequest,
        pool: Pool,
        *,
        deadline_s: float | None,
        tenant: str = "default",
        priority: str | None = None,
        scope: str | None = None,
        response_ids: ResponseIds | None = None,
        previous_response: tuple[str, str] | None = None,
    ) -> None:
        """`response_ids`, `previous_response`: a response's (`response_ids.ResponseNaming`)."""
        self.host = host
        #: Whose results it may share (`Tenant.cache_scope`): its tenant's name unless that says otherwise.
        self.scope = tenant if scope is None else scope
        self.id = request_id
        self.api = api
        self.pool = pool
        self.deadline_s = deadline_s
        self.phase = Phase.QUEUED
        self.started = time.perf_counter()
        self.record = UsageRecord(
            request_id=request_id,
            tenant=tenant,
            model=api.model,
            endpoint=api.endpoint.value,
            stream=api.stream,
            priority=priority,
            started_at=time.time(),
        )
        #: How de-duplication served it (`lockgate_dedup_total`'s outcome, set by the coalescer), counted when the
        #: request ends unless it was rejected: the metric counts the requests the usage records count.
        self.dedup_outcome: str | None = None
        #: A semantic hit's prompt tokens beyond the answered question's (estimated from their texts): its record counts
        #: its own prompt, not the other's.
        self.prompt_tokens_delta = 0
        self.response: StreamResponse | None = None
        #: Set once the complete answer is on the wire (a stream's end: `[DONE]`, or a response's terminal event): the
        #: request can only complete.
        self.answered = False
        self._ending = False  # how the request ends has been decided (`_set_end` ran)
        self.cancel_reason: str | None = None
        self._task: asyncio.Task[Any] | None = None
        self._lease: Lease | None = None
        self._call: UpstreamCall | None = None
        self._subscription: Subscription | None = None
        self._released = False
        #: The whole answer built by `whole_response()`, and whether `run()` returned it (its record then
        #: waits for `body_sent`).
        self._whole: Response | None = None
        self._record_waits = False
        self._cancel_detected_at: float | None = None
        #: Release callbacks of resources handed over with `hold()`, run once by `_release()`.
        self._holds: list[Callable[[], None]] = []
        #: Headers added to the response (x-ratelimit-*; the priority class it was served at, which a tenant's
        #: `max_priority` may have lowered from the one asked for).
        self.response_headers: dict[str, str] = {PRIORITY_SERVED_HEADER: priority} if priority else {}
        #: The tenant's rate-limit reservation for it (`Admission.allow`), shared with a flight it leads.
        self.allowance: Allowance | None = None
        #: Tokens its engine calls produced (`Lease.produced`: read, or estimated for whole answers cut short), which
        #: its tenant is charged for even when none was delivered (`Admission._settle`).
        self.engine_tokens = 0
        #: A response's ids and event numbering as its client sees them (None: not a response).
        self.naming = (
            ResponseNaming(pool, tenant, _weakly(self.serving), response_ids, previous_response)
            if api.endpoint is Endpoint.RESPONSES
            else None
        )
        #: Served from a stored result (de-duplication): the name of the instance that made it.
        self.served_from: str | None = None
        #: Priority for engines whose dialect accepts one (lower = more urgent); None: not sent.
        self.engine_priority: int | None = None
        #: Admitted at a strict class (P0): routed by instances' speeds as measured (`RouteRequest.urgent`).
        self.urgent = False
        #: Admitted at a class that is not strict (P1, P2): not sent where a strict request waits for its first
        #: token (`RouteRequest.yields`).
        self.yields = False
        #: The request's OpenTelemetry span, when tracing is on (ended in `_release()`).
        self.span: Any = None
        #: The running deadline (`asyncio.Timeout`) while `run()` is active, if the request has one:
        #: inspect or reschedule it.
        self.timeout: asyncio.Timeout | None = None

    # --- resources -----------------------------------------------------------------------------
    @property
    def instance(self) -> Instance | None:
        return self._lease.instance if self._lease is not None else None

    @property
    def lease(self) -> Lease | None:
        """The current attempt's lease (None between attempts)."""
        return self._lease

    def attach(self, lease: Lease, call: UpstreamCall) -> None:
        """Hold a lease and its upstream call (one attempt). A previous attempt must be detached."""
        if self._lease is not None or self._call is not None:
            self.host.metrics.leaks.labels("attach_over_live_attempt").inc()
            self.detach()
        self._lease = lease
        self._call = call
        self.record.instance = lease.instance.name
        self.record.attempts += 1

    def served_by(self, name: str) -> None:
        """The engine that produced the answer, once known (behind a sidecar, the engine it chose; a flight's, for its
        clients): what the record names (`attach` and `detach` name the instance an attempt went to before)."""
        self.record.instance = name

    def serving(self) -> Instance | None:
        """The instance serving this request: its own call's; a flight's client's, the flight's; a stored result's, the
        one that made it."""
        instance = self.instance
        if instance is not None:
            return instance
        name = self._subscription.instance() if self._subscription is not None else self.served_from
        return self.pool.named(name) if name is not None else None

    def engine_failed(self, message: str) -> None:
        """The engine answered that it failed the request (a response's `status: failed`), within a well-formed
        answer the client gets as it is: recorded as the service's failure, not as completed."""
        self.record.status = "error"
        self.record.error = message[:500]

    def subscribe(self, subscription: Subscription) -> None:
        """Hold a subscription to a shared flight; it is closed with the attempt (`detach`)."""
        if self._subscription is not None:
            self.host.metrics.leaks.labels("subscription_over_live_one").inc()
            self._subscription.close()
        self._subscription = subscription

    def detach(self) -> None:
        """End the current attempt: close its upstream call (if open) or its subscription, and
        release its lease."""
        call, self._call = self._call, None
        lease, self._lease = self._lease, None
        subscription, self._subscription = self._subscription, None
        # `call.aborted` also counts an abort done while the cancellation unwound through `open()`.
        aborted = call is not None and (call.abort() or call.aborted)
        if subscription is not None:
            if self.record.instance is None:
                # The flight's instance, known from its first attempt (a streamed answer's head may have gone out
                # before it was set here; a flight that failed still names the instance it tried).
                self.record.instance = subscription.instance()
            if self.record.served_by == "miss":  # this request led the flight: its engine calls are its own
                self.record.attempts = subscription.attempts()
            if subscription.close():
                aborted = True
        if aborted and self._cancel_detected_at is not None:
            self.host.metrics.abort_latency.observe(time.perf_counter() - self._cancel_detected_at)
        if lease is not None:
            self.engine_tokens += lease.produced(time.monotonic())
            lease.release(self.record.prompt_tokens)

    def hold(self, release: Callable[[], None]) -> None:
        """Own one more resource until the request ends: `release` (synchronous, idempotent) runs
        exactly once in `_release()`, in reverse order of `hold()` calls. Call it before the next
        `await` after acquiring the resource."""
        self._holds.append(release)

    def _release(self) -> None:
        if self._released:
            self.host.metrics.leaks.labels("double_release").inc()
            return
        self._released = True
        self.detach()
        holds, self._holds = self._holds, []
        for release in reversed(holds):
            try:
                release()
            except Exception:
                log.exception("releasing a resource of request %s failed", self.id)
                self.host.metrics.leaks.labels("release_failed").inc()
        self.host.registry.remove(self)
        if self._record_waits:
            return  # the record is finished by `body_sent`, once the edge has written the answer
        if self._whole is not None:
            self._whole.on_sent = None  # built, but not the answer: it will never be written
        self._finish_record()

    def whole_response(self, body: bytes, headers: dict[str, str]) -> Response:
        """The whole (non-streaming) answer; the usage record learns from the edge whether the client
        took it (`body_sent`)."""
        self._whole = Response(body=body, content_type="application/json", headers=headers, on_sent=self.body_sent)
        return self._whole

    def body_sent(self, delivered: bool) -> None:
        """The edge server wrote the whole answer (`delivered`: the client took it) or could not."""
        if not self._record_waits:
            return
        self._record_waits = False
        if not delivered and self.record.status == "completed":
            self.record.status = "cancelled"
            self.record.cancel_reason = "client_disconnect"
            self.record.completion_tokens = 0  # as for streams: delivered = taken by the client's connection
        self._finish_record()

    def prompt_processed(self) -> bool:
        """Whether an engine processed this request's prompt: it produced or delivered tokens, or the client left (or
        its deadline passed) once the prompt was sent. Its tenant is charged that prompt (`Admission._settle`) and
        its usage record counts it."""
        record = self.record
        if record.completion_tokens > 0 or self.engine_tokens > 0:
            return True
        return record.status == "cancelled" and record.cancel_reason in CLIENT_ENDED and record.attempts > 0

    def _finish_record(self) -> None:
        record = self.record
        record.finished_at = time.time()
        if not record.prompt_tokens and self.prompt_processed():
            # The engine processed the prompt but never said how long it was (a stream stopped before its usage
            # chunk: the client left, in the prefill too, a deadline; an engine that reports no usage): the gateway's
            # estimate, as the tenant's rate limit is charged, rather than a prompt of 0 tokens (an outside run: a
            # 12,000-token prompt left in its prefill was charged, its record said 0). (The lease was released with
            # the engine's count already: the estimate never teaches the token ratio.)
            record.prompt_tokens = self.api.estimated_prompt_tokens()
        metrics = self.host.metrics
        priority = record.priority or ""
        reason = record.cancel_reason
        status = reason or record.status
        elapsed = time.perf_counter() - self.started
        metrics.requests.labels(record.model, priority, status).inc()
        metrics.request_duration.labels(record.model, priority, status).observe(elapsed)
        if (
            record.first_token_at is None
            and record.status != "rejected"
            and self.api.endpoint is not Endpoint.EMBEDDINGS
        ):
            # Waited and got nothing: a stuck engine whose clients give up must not look fast (the TTFT objective).
            metrics.unanswered.labels(record.model, priority, "true" if self.api.stream else "false").observe(elapsed)
        metrics.endpoint_requests.labels(record.endpoint, status).inc()
        if self.dedup_outcome is not None and record.status != "rejected":
            self.host.count_dedup(self.dedup_outcome)
        if reason:
            metrics.cancellations.labels(record.model, priority, reason).inc()
        if self.host.log_prompts:
            body = self.api.body
            record.log_prompt = body.get("messages", body.get("prompt", body.get("input")))
        counters = metrics.tokens
        tokens = counters.children.get((record.model, record.tenant)) or counters.child(record.model, record.tenant)
        tokens.prompt += record.prompt_tokens
        tokens.completion += record.completion_tokens
        if self.response is not None:
            metrics.backpressure.labels(record.model).observe(self.response.backpressure_s)
        if self.span is not None and self.host.tracer is not None:
            self.host.tracer.end(self.span, record)
        self.host.records.submit(record)

    # --- control -------------------------------------------------------------------------------
    def cancel(self, reason: str) -> bool:
        """Ask the request to end (admin, shutdown). Returns False if it is already ending."""
        if self._task is None or self._task.done() or self.cancel_reason is not None or self._ending:
            return False
        self.cancel_reason = reason
        self._task.cancel(f"lockgate: {reason}")
        return True

    def stop_now(self) -> None:
        """Cut the request off without a goodbye (shutdown, after `cancel()` had its grace period): the
        task is cancelled even while it writes its final error; `_release()` still runs."""
        if self._task is not None and not self._task.done():
            self._task.cancel("lockgate: stopped")

    def first_token(self) -> None:
        if self.record.first_token_at is None:
            self.record.first_token_at = time.time()
            if self.api.endpoint is Endpoint.EMBEDDINGS:
                return  # no tokens: its answer time would pull the whole answers' TTFT down
            self.host.metrics.ttft.labels(
                self.api.model, self.record.priority or "", "true" if self.api.stream else "false"
            ).observe(time.perf_counter() - self.started)

    def describe(self) -> dict[str, Any]:
        # (a request on a flight learns its instance from the flight: named in the record when it ends)
        subscription = self._subscription
        phase, tokens = self.phase, self.record.completion_tokens
        lease = self._lease
        if lease is not None and not lease.released and lease.answered:
            # Read from the engine before anything reaches the client (an answer assembled from a stream).
            tokens = max(tokens, lease.completion_tokens)
            if phase is Phase.CONNECTING:
                phase = Phase.GENERATING
        elif subscription is not None and subscription.requeued():
            # Its flight was stopped for a more urgent request and waits for its slot again (it read "streaming",
            # frozen, while the queue gauges counted it: an outside run).
            phase = Phase.QUEUED
        elif subscription is not None and (shared := subscription.tokens()):
            # A client of a flight that another request leads: the shared call's tokens (a non-streaming client is
            # sent nothing until the end, and stayed "connecting" for the whole generation: an outside run).
            tokens = max(tokens, shared)
            if phase is Phase.CONNECTING:
                phase = Phase.GENERATING
        return {
            "id": self.id,
            # The client's own `x-request-id`, if it sent one: how an operator finds a client's request.
            "client_request_id": self.record.client_request_id,
            "model": self.api.model,
            "tenant": self.record.tenant,
            "instance": self.record.instance or (subscription.instance() if subscription is not None else None),
            "priority": self.record.priority,
            "phase": phase.value,
            "stream": self.api.stream,
            "age_ms": round((time.perf_counter() - self.started) * 1000, 1),
            "completion_tokens": tokens,
        }

    # --- the one place where a request's fate is decided ---------------------------------------
    async def run(self, work: Callable[[Exchange], Awaitable[Reply]]) -> Reply:
        """Run `work(self)` as this request's work and decide how the request ends."""
        self._task = asyncio.current_task(self.host.loop)
        self.host.registry.add(self)
        try:
            try:
                if self.deadline_s is None:
                    reply = await work(self)
                else:
                    async with asyncio.timeout(self.deadline_s) as deadline:
                        self.timeout = deadline
                        reply = await work(self)
                # Returned to the edge server at once (no await in between): it will write this answer.
                self._record_waits = reply is self._whole
                return reply
            except TimeoutError:
                if self.timeout is None or not self.timeout.expired():
                    raise
                self._cancel_detected_at = time.perf_counter()
                self.detach()
                return await self._end_with(
                    "cancelled", DeadlineExceeded("The request exceeded its deadline."), reason="timeout"
                )
        except asyncio.CancelledError:
            self._cancel_detected_at = time.perf_counter()
            self.detach()
            reason = self.cancel_reason
            if reason is None:
                self._set_end("cancelled", reason="client_disconnect")
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            message = {
                "admin": "The request was cancelled by an administrator.",
                "shutdown": "The gateway is shutting down; the request was stopped.",
            }.get(reason, f"The request was cancelled ({reason}).")
            # A request stopped by shutdown may be retried at once on another replica; one an operator cancelled must
            # not be sent again by the client's SDK (it retries a 503 twice by default).
            error = Cancelled(message, retry_after=1 if reason == "shutdown" else None, final=reason == "admin")
            return await self._end_with("cancelled", error, reason=reason)
        except ClientGone:
            self._cancel_detected_at = time.perf_counter()
            self.detach()
            self._set_end("cancelled", reason="client_disconnect")
            return self.response or Response(status=499)
        except GatewayError as exc:
            self.detach()
            drop_tracebacks(exc)
            # An engine's error naming the response followed up: as the client knows it.
            shown = self.naming.in_error(exc) if self.naming is not None else exc
            reason = shown.reason if isinstance(shown, Cancelled) else None
            if reason is not None:  # (an operator cancelled the flight this request shares)
                return await self._end_with("cancelled", shown, reason=reason)
            return await self._end_with("rejected" if shown.rejected else "error", shown)
        except Exception as exc:
            # A bug, not a request's fate: still end it truthfully (500 / a final SSE error event and an
            # `error` record), never as "completed".
            log.exception("request %s failed inside the gateway", self.id)
            self.detach()
            drop_tracebacks(exc)
            return await self._end_with("error", GatewayError("The gateway failed to serve the request."))
        finally:
            self._release()

    def _set_end(self, status: str, *, reason: str | None = None, error: GatewayError | None = None) -> None:
        record = self.record
        if self.answered or self._ending:
            # The whole answer (up to `[DONE]`) was already written: whatever ends the request now, the
            # client has it all. It completed; nothing may be appended after `[DONE]`. Or the request is
            # already ending (e.g. writing its timeout error) when a second cause arrives: the first wins.
            return
        self._ending = True
        record.status = status
        record.cancel_reason = reason
        if error is not None:
            record.error = error.message[:500]
            if not self._stream_started():
                record.http_status = error.http_status

    def _echo_id(self) -> str:
        """The `x-request-id` a response carries: the client's own if it sent one."""
        return self.record.client_request_id or self.id

    def _stream_started(self) -> bool:
        """Whether the status line may be on the wire. A response whose `prepare()` was interrupted
        before it began has sent nothing: the client must get the error status, not an empty 200."""
        return self.response is not None and self.response.prepared

    async def _end_with(self, status: str, error: GatewayError, *, reason: str | None = None) -> Reply:
        if self._ending or self.answered:
            # Already ending (a second cause arrived while the first was being written) or complete.
            return self.response or self.host.error_response(error, self._echo_id(), self.record.instance)
        self._set_end(status, reason=reason, error=error)
        if self.response is None or not self._stream_started():
            # (`response_headers`: the tenant's `x-ratelimit-*` as of its admission, as its answers carry them)
            return self.host.error_response(error, self._echo_id(), self.record.instance, self.response_headers)
        # The stream has started (status 200 is on the wire): end it with an error event, never [DONE].
        try:
            sequence = self.naming.sequence_sent + 1 if self.naming is not None else None
            await self.response.write(sse.encode_error(error.body(), sequence_number=sequence))
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return self.response


class Registry:
    """The exchanges in flight, for the admin API and the shutdown drain."""

    def __init__(self) -> None:
        self._live: dict[str, Exchange] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def add(self, exchange: Exchange) -> None:
        if not self._live:
            self._empty.clear()
        self._live[exchange.id] = exchange

    def remove(self, exchange: Exchange) -> None:
        if self._live.get(exchange.id) is exchange:
            del self._live[exchange.id]
        if not self._live:
            self._empty.set()

    def get(self, request_id: str) -> Exchange | None:
        return self._live.get(request_id)

    def __len__(self) -> int:
        return len(self._live)

    def all(self) -> list[Exchange]:
        return list(self._live.values())

    async def wait_empty(self) -> None:
        await self._empty.wait()


def _weakly(method: Callable[[], Instance | None]) -> Callable[[], Instance | None]:
    """`method` of an object, called through a weak reference (None once the object is gone): a callable that the
    object's own parts hold makes no reference cycle. (`ResponseNaming` holding `Exchange.serving` did: every response
    request's exchange, with its request body, waited for a full garbage collection, which the server's tuned
    collector runs rarely: RSS grew by the bodies' size, a megabyte a request with 1 MB bodies.)"""
    ref = weakref.WeakMethod(method)

    def call() -> Instance | None:
        bound = ref()
        return bound() if bound is not None else None

    return call
