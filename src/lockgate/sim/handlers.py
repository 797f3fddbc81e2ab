"""HTTP handlers of the OpenAI-compatible routes and the ``/sim/*`` test hooks.

Each generation request is owned by its handler task: it opens a ``RequestRecord``, runs the request and,
in ``finally``, closes the ``Generation`` (aborting the sequence if unfinished) and the record -- whichever
way it ends. aiohttp runs with ``handler_cancellation=True``, so a client that goes away cancels the handler
at once, queued or streaming, which is how disconnects abort by construction.

Fault-injection request headers:
  ``x-request-id: ID``               record the request under this id (``/sim/stats``, ``/sim/wait``)
  ``x-sim-status: CODE``             answer with this error status and an OpenAI error body
  ``x-sim-hold: 1``                  hold before the first token until ``POST /sim/release`` or disconnect
  ``x-sim-reset-after-tokens: N``    ``transport.abort()`` after N generated tokens
  ``x-sim-delay-ms: MS``             wait MS before entering the engine (like ``delay_first_token_ms``)
``/sim/control`` fields ``hold_next`` and ``reset_after_tokens`` do the same for requests sent by a gateway,
which does not forward client headers.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from .config import SimConfig
from .control import SimControl
from .embeddings import embed_response, parse_embed_request
from .engine import Engine, EngineCrashed, Generation
from .generator import GREEDY_SEED, Token, TokenStream, generate
from .metrics import CONTENT_TYPE, SimMetrics
from .stats import Outcome, RequestRecord, SimStats
from .stored import ResponseStore
from .wire import (
    GenRequest,
    ResponseEventWriter,
    WireError,
    error_body,
    full_response,
    new_response_id,
    parse_body,
    parse_request,
    previous_of,
    response_object,
    usage,
    writer_for,
)

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _error(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> web.Response:
    return web.Response(body=error_body(status, message, type_, param), status=status, content_type=_JSON)


def _int_header(request: web.Request, name: str) -> int | None:
    v = request.headers.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise WireError(400, f"header {name} must be an integer") from None


class _ListTokens:
    """An already generated answer as an async iterator (the ``--fast`` path's stand-in for Generation)."""

    __slots__ = ("_it",)

    def __init__(self, tokens: tuple[Token, ...]) -> None:
        self._it = iter(tokens)

    def __aiter__(self) -> _ListTokens:
        return self

    async def __anext__(self) -> Token:
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None


class Api:
    def __init__(
        self,
        config: SimConfig,
        stats: SimStats,
        metrics: SimMetrics,
        control: SimControl,
        engine: Engine | None,
    ) -> None:
        self.config = config
        self.stats = stats
        self.metrics = metrics
        self.control = control
        self.engine = engine
        self._rng = random.Random(config.seed)
        self.responses = ResponseStore()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/responses", self.create_response)
        self.responses.add_routes(app)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prom)
        app.router.add_get("/sim/stats", self.sim_stats)
        app.router.add_post("/sim/control", self.sim_control)
        app.router.add_get("/sim/control", self.sim_control)
        app.router.add_post("/sim/reset_stats", self.sim_reset_stats)
        app.router.add_post("/sim/release", self.sim_release)
        app.router.add_get("/sim/wait", self.sim_wait)

    # -- read-only routes ------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "lockgate-sim",
                "root": m,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
            for m in self.config.models
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.control.healthy:
            return web.Response(status=200)
        return web.Response(status=503, text="unhealthy")

    async def prom(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def snapshot(self) -> dict[str, Any]:
        snap = self.stats.snapshot()
        if self.engine is not None:
            s = self.engine.scheduler
            snap.update(
                running=s.num_running,
                waiting=s.num_waiting,
                kv_blocks_used=s.kv.blocks_used,
                kv_blocks_total=s.kv.num_blocks,
                kv_usage=s.kv.usage,
            )
        else:
            snap.update(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=self.config.num_kv_blocks, kv_usage=0.0)
        snap["open_count"] = len(snap["open_requests"])
        snap["control"] = self.control.as_dict()
        snap["models"] = list(self.config.models)
        snap["fast"] = self.config.fast
        return snap

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json(self.snapshot())

    async def sim_control(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                body = parse_body(await request.read())
                self.control.update(body)
            except WireError as e:
                return _error(e.status, e.message)
            except ValueError as e:
                return _error(400, str(e))
        return _json(self.control.as_dict())

    async def sim_reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return _json({"ok": True})

    async def sim_release(self, request: web.Request) -> web.Response:
        held = self.stats.held
        self.control.release()
        return _json({"released": held})

    async def sim_wait(self, request: web.Request) -> web.Response:
        """Long-poll until a condition holds: ``held>=N``, ``open==N``, ``running>=N`` and/or
        ``request_id`` ended (optionally with ``outcome``). 408 after ``timeout`` seconds (default 10)."""
        q = request.query
        try:
            timeout = float(q.get("timeout", "10"))
            held = int(q["held"]) if "held" in q else None
            open_ = int(q["open"]) if "open" in q else None
            running = int(q["running"]) if "running" in q else None
        except ValueError:
            return _error(400, "bad /sim/wait query")
        rid = q.get("request_id")
        outcome = q.get("outcome")
        stats, engine = self.stats, self.engine

        def ready() -> bool:
            if held is not None and stats.held < held:
                return False
            if open_ is not None and len(stats.open) != open_:
                return False
            if running is not None and (engine is None or engine.scheduler.num_running < running):
                return False
            if rid is not None:
                rec = stats.find(rid)
                if rec is None or rec.ended_at is None or (outcome is not None and rec.outcome != outcome):
                    return False
            return True

        try:
            async with asyncio.timeout(timeout):
                await stats.wait_until(ready)
        except TimeoutError:
            return _json({"ok": False, "stats": self.snapshot()}, status=408)
        body: dict[str, Any] = {"ok": True}
        if rid is not None:
            rec = stats.find(rid)
            body["request"] = rec.as_dict() if rec else None
        return _json(body)

    # -- generation ----------------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    def _keep(
        self, req: GenRequest, resp_id: str, created: int, text: str, finish_reason: str, usage_: dict[str, Any]
    ) -> None:
        """A finished response goes to the store (`sim/stored.py`), created when its request came, as its answer says
        (an outside run: the stored one said it was created when it ended)."""
        if req.body is not None:
            response = response_object(req.model, resp_id, created, text, finish_reason, usage_, previous_of(req))
            self.responses.keep(response, req.body)

    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's embeddings route (`embeddings.py`). No step loop: the request waits its prefill time
        (prompt tokens at `prefill_tps`; none with `--fast`), then answers. Honours `x-sim-status`,
        `x-sim-hold` / `hold_next` and `x-sim-delay-ms`; a client that leaves ends it as `aborted`."""
        rid = request.headers.get("x-request-id") or secrets.token_hex(8)
        stats = self.stats
        try:
            req = parse_embed_request(parse_body(await request.read()), self.config)
            status = _int_header(request, "x-sim-status") or self.control.fail_status
            hold = self.control.hold or request.headers.get("x-sim-hold", "0") not in ("", "0", "false")
            delay_ms = _int_header(request, "x-sim-delay-ms") or 0
        except WireError as e:
            rec = stats.open_request(rid, "", "embedding", False)
            rec.status = e.status
            stats.close_request(rec, "error")
            return web.Response(body=e.body(), status=e.status, content_type=_JSON)
        rec = stats.open_request(rid, req.model, "embedding", False)
        rec.prompt_tokens = req.prompt_tokens
        if status:
            rec.status = status
            stats.close_request(rec, "error")
            return _error(status, f"injected failure (status {status})", "InternalServerError")
        outcome: Outcome = "aborted"
        try:
            if hold or self.control.take_hold():
                rec.outcome = "held"
                stats.notify()
                await self.control.wait_released()
                rec.outcome = "open"
            delay_s = (delay_ms + self.control.delay_first_token_ms) / 1000
            if not self.config.fast:
                delay_s += req.prompt_tokens / self.config.prefill_tps
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            stats.prompt_tokens += req.prompt_tokens
            self.metrics.prompt_tokens.inc(req.prompt_tokens)
            rec.first_token_at = time.monotonic()
            outcome = "finished"
            return web.Response(body=embed_response(req, "embd-" + secrets.token_hex(12)), content_type=_JSON)
        except asyncio.CancelledError:  # handler cancellation: the client went away
            rec.disconnected_at = time.monotonic()
            raise
        finally:
            if outcome == "aborted":
                rec.aborted_at = time.monotonic()
            stats.close_request(rec, outcome)

    def _seed(self, req: GenRequest) -> int:
        if req.temperature == 0:
            return GREEDY_SEED
        if req.seed is not None:
            return req.seed
        return self._rng.getrandbits(63)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or secrets.token_hex(8)
        try:
            body = parse_body(await request.read())
            if kind == "responses":
                body = self.responses.with_previous(body)
            req = parse_request(kind, body, self.config)
            status = _int_header(request, "x-sim-status") or self.control.fail_status
            hold = self.control.hold or request.headers.get("x-sim-hold", "0") not in ("", "0", "false")
            reset_after = _int_header(request, "x-sim-reset-after-tokens")
            delay_ms = _int_header(request, "x-sim-delay-ms")
        except WireError as e:
            rec = self.stats.open_request(rid, "", kind, False)
            rec.status = e.status
            self.stats.close_request(rec, "error")
            return web.Response(body=e.body(), status=e.status, content_type=_JSON)
        rec = self.stats.open_request(rid, req.model, kind, req.stream)
        rec.prompt_tokens = len(req.prompt_tokens)
        if status:
            rec.status = status
            self.stats.close_request(rec, "error")
            type_ = "InternalServerError" if status >= 500 else "BadRequestError"
            return _error(status, f"injected failure (status {status})", type_)
        hold = hold or self.control.take_hold()
        if reset_after is None:
            reset_after = self.control.reset_after_tokens
        if reset_after is None and self.control.reset_prob and self._rng.random() < self.control.reset_prob:
            reset_after = self._rng.randrange(req.max_tokens)
        if self.config.fast and not (hold or delay_ms or self.control.delay_first_token_ms or reset_after is not None):
            return self._fast(req, rec)
        return await self._run(request, req, rec, hold, reset_after, delay_ms)

    def _fast(self, req: GenRequest, rec: RequestRecord) -> web.Response:
        """Answer at once, without the step loop (``--fast``): the cheapest path that still counts stats."""
        comp = generate(req.prompt_tokens, self._seed(req), req.max_tokens, req.stop, req.natural_end)
        n_prompt, n_gen = len(req.prompt_tokens), len(comp.tokens)
        stats = self.stats
        stats.tokens_generated += n_gen
        stats.prompt_tokens += n_prompt
        stats.prefix_cache_query_tokens += n_prompt
        rec.completion_tokens = n_gen
        rec.finish_reason = comp.finish_reason
        rec.first_token_at = time.monotonic()
        e2e = rec.first_token_at - rec.started_at
        self.metrics.prefix_queries.inc(n_prompt)
        self.metrics.prompt_tokens.inc(n_prompt)
        self.metrics.generation_tokens.inc(n_gen)
        self.metrics.finished(completion_tokens=n_gen, ttft=e2e, e2e=e2e, finish_reason=comp.finish_reason)
        stats.close_request(rec, "finished")
        resp_id = new_response_id(req.kind)
        u = usage(n_prompt, n_gen, 0)
        created = int(time.time())
        self._keep(req, resp_id, created, comp.text, comp.finish_reason, u)
        if not req.stream:
            body = full_response(req, resp_id, created, comp.text, comp.finish_reason, u)
            return web.Response(body=body, content_type=_JSON)
        w = writer_for(req, resp_id)
        parts = [w.role()]
        last = len(comp.tokens) - 1
        for i, t in enumerate(comp.tokens):
            if t.delta or i == last:
                parts.append(w.token(t.delta, t.finish_reason))
        parts.append(w.end(u, req.include_usage))
        return web.Response(body=b"".join(parts), headers=_SSE_HEADERS)

    async def _run(
        self,
        request: web.Request,
        req: GenRequest,
        rec: RequestRecord,
        hold: bool,
        reset_after: int | None,
        delay_ms: int | None,
    ) -> web.StreamResponse:
        stats = self.stats
        outcome: Outcome = "aborted"
        gen: Generation | None = None

        def is_connected() -> bool:
            t = request.transport
            return t is not None and not t.is_closing()

        try:
            if hold:
                rec.outcome = "held"
                stats.notify()
                await self.control.wait_released()
                rec.outcome = "open"
            delay = (delay_ms or 0) + self.control.delay_first_token_ms
            if delay > 0:
                await asyncio.sleep(delay / 1000.0)
            seed = self._seed(req)
            stream = TokenStream(req.prompt_tokens, seed, req.max_tokens, req.stop, req.natural_end)
            tokens: Generation | _ListTokens
            if self.engine is None:  # --fast with a fault injected: precomputed tokens, still no step loop
                comp = generate(req.prompt_tokens, seed, req.max_tokens, req.stop, req.natural_end)
                tokens = _ListTokens(comp.tokens)
                stats.prompt_tokens += len(req.prompt_tokens)
                stats.tokens_generated += len(comp.tokens)
            else:
                try:
                    gen = self.engine.submit(rec, req.prompt_tokens, stream, req.priority, is_connected, req.cache_salt)
                except ValueError as e:
                    rec.status = 400
                    outcome = "error"
                    return _error(400, str(e))
                tokens = gen
            resp_id = new_response_id(req.kind)
            if req.stream:
                resp, outcome = await self._stream(request, req, rec, tokens, resp_id, reset_after)
            else:
                resp, outcome = await self._collect(request, req, rec, tokens, resp_id, reset_after)
            return resp
        except asyncio.CancelledError:  # handler cancellation: the client went away
            if rec.disconnected_at is None:
                rec.disconnected_at = time.monotonic()
            raise
        except EngineCrashed:  # SimServer.fail(): the connection breaks like a dead server's would
            self._reset(request)
            outcome = "reset"
            return web.Response(status=500)
        except ConnectionError:  # a write found the connection gone; nothing more can be sent
            if rec.disconnected_at is None:
                rec.disconnected_at = time.monotonic()
            return web.Response(status=499)
        finally:
            if gen is not None:
                gen.close()
            if outcome == "aborted" and rec.aborted_at is None:
                rec.aborted_at = time.monotonic()
            stats.close_request(rec, outcome)

    def _reset(self, request: web.Request) -> None:
        t = request.transport
        if t is not None:
            t.abort()

    async def _collect(
        self,
        request: web.Request,
        req: GenRequest,
        rec: RequestRecord,
        tokens: Generation | _ListTokens,
        resp_id: str,
        reset_after: int | None,
    ) -> tuple[web.StreamResponse, Outcome]:
        parts: list[str] = []
        finish_reason = "length"
        n = 0
        async for t in tokens:
            n += 1
            parts.append(t.delta)
            if reset_after is not None and n >= reset_after:
                self._reset(request)
                return web.Response(status=500), "reset"
            if t.finish_reason is not None:
                finish_reason = t.finish_reason
        if reset_after is not None:
            self._reset(request)
            return web.Response(status=500), "reset"
        if isinstance(tokens, _ListTokens):
            rec.completion_tokens = n
        rec.finish_reason = finish_reason
        text, u = "".join(parts), usage(len(req.prompt_tokens), n, rec.cached_tokens)
        created = int(time.time() - (time.monotonic() - rec.started_at))  # (when the request came)
        self._keep(req, resp_id, created, text, finish_reason, u)
        body = full_response(req, resp_id, created, text, finish_reason, u)
        return web.Response(body=body, content_type=_JSON), "finished"

    async def _stream(
        self,
        request: web.Request,
        req: GenRequest,
        rec: RequestRecord,
        tokens: Generation | _ListTokens,
        resp_id: str,
        reset_after: int | None,
    ) -> tuple[web.StreamResponse, Outcome]:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        w = writer_for(req, resp_id)
        write: Callable[[bytes], Awaitable[None]] = resp.write
        if reset_after == 0:
            self._reset(request)
            return resp, "reset"
        head = w.role()
        n = 0
        async for t in tokens:
            n += 1
            if t.delta or t.finish_reason is not None:
                await write(head + w.token(t.delta, t.finish_reason))
                head = b""
            if reset_after is not None and n >= reset_after:
                self._reset(request)
                return resp, "reset"
            if t.finish_reason is not None:
                rec.finish_reason = t.finish_reason
        if isinstance(tokens, _ListTokens):
            rec.completion_tokens = n
        u = usage(len(req.prompt_tokens), n, rec.cached_tokens)
        await write(w.end(u, req.include_usage))
        if isinstance(w, ResponseEventWriter):
            self._keep(req, resp_id, w.created, w.text, rec.finish_reason or "stop", u)
        await resp.write_eof()
        return resp, "finished"
