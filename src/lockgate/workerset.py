"""Under `--workers`: the other workers of this one, so that an operator's request reaching any worker answers
for all of them.

The kernel hands each connection on the shared port to one worker, so a Prometheus scrape, `GET
/admin/requests` or a cancel by id reached one worker's state at random: a scrape saw one worker's share of the
counters, a cancel of a request held by another worker was answered 404. Each worker therefore also listens
on a unix socket of its own, `worker-<i>.sock` in a directory the supervisor made for this run (0700,
removed when it exits), and the worker that takes an operator request asks the others over those sockets,
with `LOCAL_HEADER` set (answer for yourself) and the client's `Authorization` (each worker checks it as it
would its own). What is gathered:

- `GET /metrics`: every worker's series, each labelled `worker="<i>"` (parsed and written again by
  prometheus-client: families stay whole); sum them by the other labels for the gateway's totals.
- `GET /admin/requests`, `GET /admin/flights`: the lists of every worker, each entry with its `worker`.
- `DELETE /admin/requests/{id}`: this worker first, then the others; the first that holds it answers.

A worker that does not answer within `TIMEOUT_S` (restarting, stuck) is left out and named in the answer
(`workers_unreachable`, or the metric `lockgate_workers_unreachable`). `/admin/slo` needs no asking: it reads every
worker's usage database (`usage_path`). The dashboard and `/admin/fleet` (the same for every replica) are each
worker's own (README, "Cluster").
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from .http import HttpClientError, HttpPool

log = logging.getLogger(__name__)

#: Set by the supervisor in each worker's environment: the directory of the workers' sockets, and their number.
DIRECTORY_ENV = "LOCKGATE_WORKERS_DIR"
COUNT_ENV = "LOCKGATE_WORKERS"
#: On a request between workers: answer for this worker only (no gathering in turn).
LOCAL_HEADER = "x-lockgate-worker-local"
#: How long a worker waits for another's answer before leaving it out.
TIMEOUT_S = 2.0
#: The largest answer taken from another worker (a scrape of a large fleet is a few MB).
MAX_ANSWER_BYTES = 64 * 1024 * 1024


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


def usage_path(path: str, index: int) -> str:
    """Worker `index`'s usage database when the configuration's is `path` (one SQLite writer per file)."""
    return f"{path}.worker-{index}"


@dataclass(frozen=True, slots=True)
class Answer:
    worker: int
    status: int
    body: bytes


class WorkerSet:
    """Worker `index` of `count`, with a connection pool to each other worker's socket."""

    def __init__(self, directory: str, index: int, count: int) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self._pools = {
            n: HttpPool(f"unix://{socket_path(directory, n)}", max_connections=4, connect_timeout_s=TIMEOUT_S)
            for n in range(count)
            if n != index
        }
        #: The `/metrics` gathering in progress, which scrapes arriving meanwhile share.
        self._scrape: asyncio.Future[bytes] | None = None

    @classmethod
    def from_env(cls, index: int) -> WorkerSet | None:
        """This worker's set, from the supervisor's environment (None when not started by one)."""
        directory, count = os.environ.get(DIRECTORY_ENV), os.environ.get(COUNT_ENV)
        if not directory or not count or not count.isdigit():
            return None
        return cls(directory, index, int(count))

    @property
    def socket(self) -> str:
        """Where this worker listens for the others."""
        return socket_path(self.directory, self.index)

    async def ask(
        self, method: str, path: str, authorization: str | None, workers: Iterable[int] | None = None
    ) -> tuple[list[Answer], list[int]]:
        """`method path` asked of the other workers (or of `workers`) at once: their answers, and the workers
        that gave none in time."""
        asked = [n for n in (self._pools if workers is None else workers) if n in self._pools]
        headers = [(LOCAL_HEADER, "1")]
        if authorization:
            headers.append(("Authorization", authorization))
        results = await asyncio.gather(*(self._ask_one(n, method, path, headers) for n in asked))
        answers = [a for a in results if a is not None]
        missing = [n for n, a in zip(asked, results, strict=True) if a is None]
        return answers, missing

    async def _ask_one(self, n: int, method: str, path: str, headers: list[tuple[str, str]]) -> Answer | None:
        try:
            async with asyncio.timeout(TIMEOUT_S):
                response = await self._pools[n].request(method, path, headers=headers)
                try:
                    body = await response.read(MAX_ANSWER_BYTES)
                except BaseException:
                    response.close()
                    raise
                if response.status not in (200, 404):  # e.g. 401: it was restarted on an edited key list
                    log.warning(
                        "worker %d: worker %d answered %d to %s %s", self.index, n, response.status, method, path
                    )
                return Answer(n, response.status, body)
        except (TimeoutError, OSError, HttpClientError, ValueError) as exc:  # ValueError: a path it cannot send
            # (A timeout's text is empty: the log line ended at its colon.)
            reason = f"none within {TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            log.warning("worker %d: no answer from worker %d to %s %s: %s", self.index, n, method, path, reason)
            return None

    async def scrape(self, own: bytes, authorization: str | None) -> bytes:
        """Every worker's `/metrics` merged (`own`: this worker's). Scrapes that arrive while one is being gathered
        share it: each gathering parses every worker's text, and 16 concurrent scrapes of a large fleet gathering
        their own took seconds each, past `TIMEOUT_S` (live workers were left out)."""
        if self._scrape is None or self._scrape.done():
            self._scrape = asyncio.ensure_future(self._gather_metrics(own, authorization))
            self._scrape.add_done_callback(_retrieve)
        return await asyncio.shield(self._scrape)

    async def _gather_metrics(self, own: bytes, authorization: str | None) -> bytes:
        answers, missing = await self.ask("GET", "/metrics", authorization)
        texts = {self.index: own} | {a.worker: a.body for a in answers if a.status == 200}
        missing += [a.worker for a in answers if a.status != 200]
        return await asyncio.to_thread(merge_metrics, texts, missing)

    async def others_json(
        self, path: str, authorization: str | None
    ) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
        """`GET path` of the other workers: (worker, JSON answer) of those that answered 200, and the others."""
        answers, missing = await self.ask("GET", path, authorization)
        bodies = []
        for answer in answers:
            try:
                body = orjson.loads(answer.body) if answer.status == 200 else None
            except orjson.JSONDecodeError:
                body = None
            if isinstance(body, dict):
                bodies.append((answer.worker, body))
            else:
                missing.append(answer.worker)
        return bodies, sorted(missing)

    async def aclose(self) -> None:
        if self._scrape is not None:
            self._scrape.cancel()
        for pool in self._pools.values():
            await pool.aclose()


def _retrieve(future: asyncio.Future[bytes]) -> None:
    """A shared gathering whose scrapers all left: its outcome is nobody's (no "exception never retrieved")."""
    if not future.cancelled():
        future.exception()


def merge_metrics(expositions: dict[int, bytes], unreachable: Iterable[int] = ()) -> bytes:
    """The Prometheus text of several workers' `/metrics` as one, every sample labelled with its worker, plus
    `lockgate_workers_unreachable` (the workers left out). CPU work (parsing): run it off the event loop."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(expositions.items()):
        label = str(worker)
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(
                Sample(s.name, {"worker": label, **s.labels}, s.value, s.timestamp, s.exemplar) for s in family.samples
            )
    missing = Metric(
        "lockgate_workers_unreachable", "Workers that gave no answer to this scrape (under --workers).", "gauge"
    )
    missing.samples.append(Sample("lockgate_workers_unreachable", {}, float(len(list(unreachable)))))
    families[missing.name] = missing
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of given families (what `merge_metrics` writes out)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
