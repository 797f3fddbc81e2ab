"""The async shell around the scheduler: one step loop task, and a token channel per request.

Theory of operation: ``run()`` is the only task; ``SimServer`` owns it. It waits on an event while there
is no work (no polling), then repeatedly takes a ``Scheduler.step()``, sleeps for the step's modelled
duration (against an absolute deadline so that rounding does not accumulate) and then delivers the step's
tokens. A request handler owns its ``Generation``: it must call ``close()`` in ``finally``, which aborts the
sequence at once if it has not finished -- so a disconnect frees the slot and KV blocks without the step
loop having to notice. Tokens the loop produces for a request whose client connection is already gone are
counted (``tokens_after_disconnect``): it measures how well aborting works and should stay near zero.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from .generator import Token, TokenStream
from .metrics import LiveGauges, SimMetrics
from .scheduler import Scheduler, SchedulerConfig, StepResult
from .stats import RequestRecord, SimStats


class EngineCrashed(RuntimeError):
    """The simulated engine crashed (``Engine.crash``): the request's stream breaks."""


class Generation:
    """The token events of one request, in order. An async iterator of ``Token``; ``close()`` aborts."""

    __slots__ = ("_engine", "_error", "_loop", "_tokens", "_waiter", "finish_reason", "is_connected", "record")

    def __init__(self, engine: Engine, record: RequestRecord, is_connected: Callable[[], bool]) -> None:
        self._engine = engine
        # Kept: a token is waited for with a future of this loop, and on Python 3.11 every
        # `asyncio.get_running_loop()` is a getpid() system call (one a token, for every stream).
        self._loop = asyncio.get_running_loop()
        self.record = record
        self.is_connected = is_connected
        self._tokens: deque[Token] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.finish_reason: str | None = None
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self.finish_reason is not None

    def _push(self, token: Token) -> None:
        self._tokens.append(token)
        if token.finish_reason is not None:
            self.finish_reason = token.finish_reason
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self.finish_reason = "error"
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Token:
        while not self._tokens:
            if isinstance(self._error, EngineCrashed):
                raise self._error
            if self._error is not None:
                raise RuntimeError("the simulated engine failed") from self._error
            if self.finish_reason is not None:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._tokens.popleft()

    def close(self) -> None:
        """Abort the sequence unless it has finished. Idempotent, synchronous, safe in ``finally``."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._engine._abort(self)


class Engine:
    def __init__(self, config: SchedulerConfig, stats: SimStats, metrics: SimMetrics) -> None:
        self.scheduler = Scheduler(config)
        self._stats = stats
        self._metrics = metrics
        #: The live generations, each its own sequence id in the scheduler: request ids are the client's and
        #: may repeat (a gateway's retry of a request reuses its id).
        self._gens: dict[object, Generation] = {}
        self._wakeup = asyncio.Event()

    def gauges(self) -> LiveGauges:
        s = self.scheduler
        return LiveGauges(s.num_running, s.num_waiting, s.kv.usage)

    def submit(
        self,
        record: RequestRecord,
        prompt_tokens: Sequence[str],
        stream: TokenStream,
        priority: int = 0,
        is_connected: Callable[[], bool] = lambda: True,
        salt: str | None = None,
    ) -> Generation:
        """Queue a request (`salt`: its prefix-cache salt). Raises ``ValueError`` if it can never fit. The caller must
        ``close()`` it."""
        gen = Generation(self, record, is_connected)
        self.scheduler.add(gen, prompt_tokens, stream, priority, salt)
        self._gens[gen] = gen
        record.prompt_tokens = len(prompt_tokens)
        self._wakeup.set()
        self._stats.notify()
        return gen

    def _abort(self, gen: Generation) -> None:
        if self._gens.pop(gen, None) is not None:
            self.scheduler.abort(gen)
            gen.record.aborted_at = time.monotonic()
            self._metrics.success("abort")
            self._wakeup.set()  # freed blocks may let a waiting request in
            self._stats.notify()

    def crash(self) -> int:
        """Fail every open generation with ``EngineCrashed`` and drop its sequence; returns how many."""
        gens = list(self._gens.values())
        self._gens.clear()
        for gen in gens:
            self.scheduler.abort(gen)
            gen._fail(EngineCrashed("the simulated engine crashed"))
        self._stats.notify()
        return len(gens)

    async def run(self) -> None:
        """The step loop. Runs until cancelled; if it fails, every open generation fails with it."""
        try:
            await self._run()
        except Exception as exc:
            for gen in list(self._gens.values()):
                gen._fail(exc)
            self._gens.clear()
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = loop.time()
            result = self.scheduler.step()
            if result.idle and not result.preempted:
                # Nothing could run (cannot happen with requests that fit); wait for a change, don't spin.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = max(deadline, loop.time()) + result.duration_s
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        stats, metrics = self._stats, self._metrics
        now = time.monotonic()
        for seq in result.admitted:
            if seq.num_preemptions == 0 and seq.seq_id in self._gens:
                rec = self._gens[seq.seq_id].record
                rec.cached_tokens = seq.num_cached
                n = len(seq.prompt_tokens)
                stats.prefix_cache_query_tokens += n
                stats.prefix_cache_hit_tokens += seq.num_cached
                stats.prompt_tokens += n
                metrics.prompt_tokens.inc(n)
                metrics.prefix_queries.inc(n)
                metrics.prefix_hits.inc(seq.num_cached)
        if result.preempted:
            stats.preemptions += len(result.preempted)
            metrics.preemptions.inc(len(result.preempted))
        generated = 0
        for ev in result.events:
            gen = self._gens.get(ev.seq_id)
            if gen is None:
                continue  # aborted while the step ran
            rec = gen.record
            rec.completion_tokens += 1
            stats.tokens_generated += 1
            generated += 1
            if not gen.is_connected():
                rec.tokens_after_disconnect += 1
                stats.tokens_after_disconnect += 1
                if rec.disconnected_at is None:
                    rec.disconnected_at = now
            if ev.first:
                rec.first_token_at = now
                metrics.ttft.observe(now - rec.started_at)
            reason = ev.token.finish_reason
            if reason is not None:
                del self._gens[gen]
                rec.finish_reason = reason
                metrics.finished(
                    completion_tokens=rec.completion_tokens,
                    ttft=0.0 if rec.first_token_at is None else rec.first_token_at - rec.started_at,
                    e2e=now - rec.started_at,
                    finish_reason=reason,
                    observe_ttft=False,
                )
            gen._push(ev.token)
        # As vLLM counts them, per step: an aborted request's tokens too (they were computed).
        metrics.generation_tokens.inc(generated)
        stats.notify()
