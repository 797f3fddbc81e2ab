"""Live statistics of a sim, for tests and benchmarks (``GET /sim/stats``).

The request handler owns each request's ``RequestRecord``: it opens it on arrival and closes it exactly
once, in ``finally``, with the outcome. The engine only adds token counts and timestamps.
``wait_until`` lets tests wait for a condition without polling or sleeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..changes import Changes

Outcome = Literal["open", "held", "finished", "aborted", "error", "reset"]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    model: str
    kind: str  # "chat" or "completion"
    stream: bool
    started_at: float  # time.monotonic()
    outcome: Outcome = "open"
    finish_reason: str | None = None
    status: int | None = None  # HTTP status of an error answer
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    tokens_after_disconnect: int = 0
    first_token_at: float | None = None
    disconnected_at: float | None = None  # when a lost client connection was first noticed
    aborted_at: float | None = None  # when the sequence left the scheduler because of it
    ended_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SimStats:
    def __init__(self, seen_limit: int = 1000) -> None:
        self._seen_limit = seen_limit
        self._changes = Changes()
        self.open: dict[str, RequestRecord] = {}
        self.reset()

    def reset(self) -> None:
        """Zero the counters and forget finished requests (open requests stay open)."""
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_failed = 0
        self.requests_reset = 0
        self.tokens_generated = 0
        self.tokens_after_disconnect = 0
        self.prompt_tokens = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.preemptions = 0
        self.seen: deque[RequestRecord] = deque(maxlen=self._seen_limit)
        self.abort_latencies_s: deque[float] = deque(maxlen=10_000)
        self.notify()

    # -- change notification ------------------------------------------------------------------------------
    def notify(self) -> None:
        self._changes.notify()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checking on every change (bound it with ``asyncio.timeout``)."""
        await self._changes.wait_until(predicate)

    # -- request lifecycle --------------------------------------------------------------------------------
    def open_request(self, request_id: str, model: str, kind: str, stream: bool) -> RequestRecord:
        rid = request_id
        n = 1
        while rid in self.open:  # ids are client-chosen; keep concurrent duplicates apart
            n += 1
            rid = f"{request_id}#{n}"
        rec = RequestRecord(rid, model, kind, stream, time.monotonic())
        self.open[rid] = rec
        self.requests_started += 1
        self.notify()
        return rec

    def close_request(self, rec: RequestRecord, outcome: Outcome) -> None:
        """Close a request exactly once (later calls are ignored)."""
        if rec.ended_at is not None:
            return
        rec.ended_at = time.monotonic()
        rec.outcome = outcome
        self.open.pop(rec.request_id, None)
        if outcome == "finished":
            self.requests_finished += 1
        elif outcome == "aborted":
            self.requests_aborted += 1
            if rec.disconnected_at is not None and rec.aborted_at is not None:
                self.abort_latencies_s.append(max(0.0, rec.aborted_at - rec.disconnected_at))
        elif outcome == "reset":
            self.requests_reset += 1
        else:
            self.requests_failed += 1
        self.seen.append(rec)
        self.notify()

    def find(self, request_id: str) -> RequestRecord | None:
        """The open record, else the most recent finished one, with this id."""
        rec = self.open.get(request_id)
        if rec is not None:
            return rec
        for rec in reversed(self.seen):
            if rec.request_id == request_id:
                return rec
        return None

    @property
    def held(self) -> int:
        return sum(1 for r in self.open.values() if r.outcome == "held")

    def snapshot(self) -> dict[str, Any]:
        lat = sorted(self.abort_latencies_s)
        summary: dict[str, Any] = {"count": len(lat)}
        if lat:
            summary.update(
                max_ms=lat[-1] * 1000,
                mean_ms=sum(lat) / len(lat) * 1000,
                p50_ms=lat[len(lat) // 2] * 1000,
                p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
            )
        return {
            "requests_started": self.requests_started,
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
            "requests_failed": self.requests_failed,
            "requests_reset": self.requests_reset,
            "tokens_generated": self.tokens_generated,
            "tokens_after_disconnect": self.tokens_after_disconnect,
            "prompt_tokens": self.prompt_tokens,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "preemptions": self.preemptions,
            "held": self.held,
            "open_requests": list(self.open),
            "abort_latencies_ms": summary,
            "requests_seen": [r.as_dict() for r in self.seen],
        }
