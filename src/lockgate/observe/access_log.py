"""The access log: one JSON line per finished request, built from its usage record.

Theory of operation: the usage writer (`records.RecordWriter`) already moves every finished request's
record off the event loop in batches, in a worker thread; after a batch is stored it hands the batch
to `AccessLog.write()`, in that same thread. So the request path pays nothing (not even the sampling
decision), the log needs no queue or thread of its own, and its lines follow the records' durability:
a record that spilled to disk under overload is logged when it is imported.

What a line holds: ids, tenant, model, endpoint, instance, priority, status, cancel reason, HTTP status,
error message, tokens, TTFT and duration (ms), the cache outcome, attempts, preemptions and the client's
`traceparent`. Never a key (records hold none); the prompt only with `include_prompts`.
`sample` (0..1) logs that fraction of requests, chosen at random per request.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

import orjson

from .config import AccessLogConfig

if TYPE_CHECKING:
    from ..records import UsageRecord

log = logging.getLogger(__name__)

STDOUT = "-"


class AccessLogUnavailable(Exception):
    """The access-log file cannot be opened (at start); the message names it and says why."""


def entry(record: UsageRecord, *, include_prompts: bool = False) -> dict[str, Any]:
    """The access-log entry of one finished request (pure)."""
    finished = record.finished_at if record.finished_at is not None else record.started_at
    first = record.first_token_at
    line: dict[str, Any] = {
        "ts": round(finished, 6),
        "request_id": record.request_id,
        "client_request_id": record.client_request_id,
        "tenant": record.tenant,
        "model": record.model,
        "endpoint": record.endpoint,
        "stream": record.stream,
        "instance": record.instance,
        "priority": record.priority,
        "status": record.status,
        "cancel_reason": record.cancel_reason,
        "http_status": record.http_status,
        "error": record.error,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_ms": None if first is None else round((first - record.started_at) * 1000, 3),
        "duration_ms": round((finished - record.started_at) * 1000, 3),
        "cache": record.served_by,
        "attempts": record.attempts,
        "preemptions": record.preemptions,
        "traceparent": record.traceparent,
    }
    if include_prompts:
        line["prompt"] = record.log_prompt
    return line


class AccessLog:
    """Writes sampled access-log lines to standard output or a file. `open()`, `write()` and `close()` run
    in the usage writer's thread (they do blocking I/O); `write()` never raises."""

    def __init__(self, config: AccessLogConfig, *, rng: random.Random | None = None) -> None:
        self._path = config.path
        self._sample = config.sample
        self._include_prompts = config.include_prompts
        self._rng = rng or random.Random()
        self._out: IO[str] | None = None
        self._failed = False
        #: Lines written (for tests and statistics).
        self.lines = 0

    @property
    def include_prompts(self) -> bool:
        return self._include_prompts

    def open(self) -> None:
        """Open the file (appending); `AccessLogUnavailable` if that is impossible."""
        if self._path != STDOUT and self._out is None:
            try:
                self._out = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise AccessLogUnavailable(f"cannot open the access log {self._path!r}: {reason}") from exc

    def write(self, records: Iterable[UsageRecord]) -> None:
        sample, rng = self._sample, self._rng
        chosen = [r for r in records if sample >= 1.0 or rng.random() < sample]
        if not chosen:
            return
        text = "".join(
            orjson.dumps(entry(r, include_prompts=self._include_prompts), default=str).decode() + "\n" for r in chosen
        )
        out = self._out if self._out is not None else sys.stdout
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError) as exc:
            if not self._failed:  # once: a full disk must not flood the error log too
                log.error("access log: cannot write to %s (%s); lines are dropped until it works", self._path, exc)
            self._failed = True
            return
        self._failed = False
        self.lines += len(chosen)

    def close(self) -> None:
        out, self._out = self._out, None
        if out is not None:
            out.close()
