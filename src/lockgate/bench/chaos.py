"""`lockgate bench chaos`: the standing guard against leaks and lost records under faults.

A gateway (`lockgate serve`, a child process, so its memory and file descriptors are its own) runs in front of
simulated engines, each behind a `FaultProxy` that resets a fraction of the engine requests at random points and
freezes a few others (a hung engine: the gateway's stall and answer timeouts, short here, end them). Clients (raw
sockets, `chaosclient.py`) send a seeded mix of streaming and non-streaming requests, some of them deterministic
repeats of a few prompts (so they are de-duplicated: coalesced or served from the result cache); a fraction leave
mid-request, a few read slowly. A warm-up without faults comes first; the gateway's RSS and open file descriptors
are measured after it (the baseline) and again at the end.

Checks, each printed PASS/FAIL (the command exits 1 on any failure):
* every answer the clients read to its end is well formed (a stream ends with `[DONE]` or an error event; an
  error carries the OpenAI envelope), no 500, and no 503 (the pool never ran out of instances);
* quiescence within `--quiesce` seconds: no request in flight, no flight, no engine call open, no lease, no
  scheduler slot or queue entry, no tenant reservation, no invariant violation;
* exactly one usage record per accepted request: as many rows as the gateway counted requests, no request id
  twice, and one row for every answer a client read to its end (read from SQLite after a graceful stop);
* RSS within `--rss-slack-mb` of the baseline, and open descriptors (less the gateway's idle connections to
  the engines, counted at the proxies) within `--fd-slack` of the baseline;
* the gateway stopped cleanly (exit status 0) on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..records import read_records
from ..sim import SimConfig, SimServer
from .chaosclient import Manner, Outcome, call
from .faultproxy import FaultProxy
from .overhead import free_port

MODEL = "chaos-model"
#: Prompts the deterministic requests repeat (so they meet in flights and in the result cache).
REPEATED = tuple(f"Repeat after me, variant {i}: the quick brown fox." for i in range(6))
#: Gauges that must read 0 once the gateway is quiescent.
ZERO_GAUGES = (
    "lockgate_client_requests_in_flight",
    "lockgate_upstream_calls_in_flight",
    "lockgate_permits_in_use",
    "lockgate_queue_depth",
    "lockgate_queue_slots_in_use",
    "lockgate_tenant_requests_in_flight",
    "lockgate_tokens_reserved",
    "lockgate_dedup_flights_in_flight",
    "lockgate_invariant_violations_total",
)


#: The gateway's stall timeout and its model's deadline in the run (what a frozen answer costs a client; a frozen
#: non-streaming answer's bound is twice the stall timeout).
STALL_MS = 500
DEADLINE_MS = 3000


@dataclass(frozen=True, slots=True)
class Settings:
    requests: int = 2000
    #: Run for this long instead of a request count (a soak), if set.
    duration_s: float | None = None
    concurrency: int = 32
    engines: int = 2
    #: Share of engine requests the proxies reset.
    reset: float = 0.05
    #: Share of engine requests the proxies freeze (those not reset).
    stall: float = 0.02
    #: Share of clients that leave before their answer is complete, after 0..`leave_within_s`.
    disconnect: float = 0.3
    leave_within_s: float = 0.08
    #: Share of clients that read slowly (of those that stay).
    slow: float = 0.05
    stream_share: float = 0.6
    #: Share of requests that are deterministic repeats of a few prompts.
    repeat_share: float = 0.3
    max_tokens: int = 24
    warmup: int = 64
    seed: int = 1
    tpot_ms: float = 2.0
    quiesce_s: float = 10.0
    rss_slack_mb: float = 48.0
    fd_slack: int = 8


@dataclass
class Usage:
    """A process's resident memory and open descriptors (Linux /proc), and the gateway's idle engine
    connections at that moment (connections open at the proxies)."""

    rss_kb: int
    fds: int
    upstream_connections: int


@dataclass
class Result:
    settings: Settings
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    resets: int = 0
    stalls: int = 0
    engine_requests: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    accepted: float = 0.0
    quiesce_s: float | None = None
    not_quiet: list[str] = field(default_factory=list)
    baseline: Usage | None = None
    after: Usage | None = None
    exit_status: int | None = None
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    #: The end of the gateway's log, kept when a check failed.
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def _usage(pid: int, proxies: list[FaultProxy]) -> Usage | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None  # not Linux: the resource checks are skipped
    return Usage(rss, fds, sum(p.stats.open for p in proxies))


def _config(port: int, proxies: list[FaultProxy], usage_path: str) -> str:
    instances = "".join(f"      - {{url: '{p.url}', engine: vllm, name: e{i}}}\n" for i, p in enumerate(proxies))
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"usage: {{path: '{usage_path}', batch_size: 64}}\n"
        # Generous probe timeouts: the faults under test are on the request path, and a probe that times out
        # on a busy machine would take instances out for reasons the run is not about.
        "health: {interval_ms: 500, timeout_ms: 5000}\n"
        "scrape: {interval_ms: 200}\n"
        "shutdown: {drain_ms: 5000}\n"
        # A frozen stream is given up after STALL_MS, a frozen non-streaming answer after twice that (the model's
        # deadline is a backstop).
        f"upstream: {{stall_timeout_ms: {STALL_MS}, answer_timeout_ms: {2 * STALL_MS}}}\n"
        f"models:\n  - name: {MODEL}\n    retries: 1\n    dedup: deterministic\n    timeout_ms: {DEADLINE_MS}\n"
        f"    instances:\n{instances}"
    )


@contextlib.asynccontextmanager
async def _gateway(config: Path, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """`lockgate serve` as a child; its log goes to a file (a pipe nobody reads could block it)."""
    err = await asyncio.to_thread(open, log, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lockgate", "serve", "--config", str(config), stdout=err, stderr=err
        )
    finally:
        err.close()  # the child has its own copy
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _tail(log: Path, size: int = 3000) -> str:
    text = await asyncio.to_thread(log.read_text, errors="replace")
    return text[-size:]


async def _wait_ready(url: str, proc: asyncio.subprocess.Process, log: Path, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode}: {await _tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway was not ready within {within_s}s: {await _tail(log)}")
            await asyncio.sleep(0.05)  # another process: nothing to wait on but its answer


def _body(rng: random.Random, n: int, settings: Settings, *, stream: bool, slow: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "stream": stream}
    if rng.random() < settings.repeat_share:
        prompt = rng.choice(REPEATED)
        body.update(temperature=0, max_tokens=settings.max_tokens)
    else:
        prompt = f"Request {n}: tell me something new."
        body.update(temperature=1.0, max_tokens=rng.randint(max(1, settings.max_tokens // 4), settings.max_tokens))
    if slow:
        body["max_tokens"] = settings.max_tokens * 8
    body["messages"] = [{"role": "user", "content": prompt}]
    return body


async def _drive(port: int, settings: Settings, rng: random.Random, count: int | None, prefix: str) -> list[Outcome]:
    """Closed loop of `settings.concurrency` clients until `count` requests (or `duration_s`) are done."""
    outcomes: list[Outcome] = []
    issued = 0
    deadline = None if count is not None or settings.duration_s is None else time.monotonic() + settings.duration_s
    chaos = prefix != "warm"

    def next_request() -> tuple[int, dict[str, Any], Manner, float] | None:
        nonlocal issued
        if count is not None and issued >= count:
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        n = issued
        issued += 1
        stream = rng.random() < settings.stream_share
        manner = Manner.READ
        if chaos and rng.random() < settings.disconnect:
            manner = Manner.LEAVE
        elif chaos and rng.random() < settings.slow:
            manner = Manner.SLOW
        body = _body(rng, n, settings, stream=stream, slow=manner is Manner.SLOW)
        return n, body, manner, rng.uniform(0.0, settings.leave_within_s)

    async def client() -> None:
        while (job := next_request()) is not None:
            n, body, manner, leave_after = job
            outcomes.append(await call(port, body, f"{prefix}-{n}", manner, leave_after_s=leave_after))

    await asyncio.gather(*(client() for _ in range(settings.concurrency)))
    return outcomes


async def _not_quiet(http: aiohttp.ClientSession, url: str) -> list[str]:
    """What still holds a resource (empty when the gateway is quiescent)."""
    problems: list[str] = []
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ZERO_GAUGES and sample.value != 0:
                problems.append(f"{sample.name}{sample.labels or ''} = {sample.value:g}")
    async with http.get(url + "/admin/requests") as resp:
        listed = await resp.json()
    requests = listed.get("requests", listed) if isinstance(listed, dict) else listed
    if requests:
        problems.append(f"{len(requests)} request(s) listed in /admin/requests")
    async with http.get(url + "/admin/flights") as resp:
        flights = (await resp.json())["flights"]
    if flights:
        problems.append(f"{len(flights)} flight(s) in /admin/flights")
    return problems


async def _accepted(http: aiohttp.ClientSession, url: str) -> float:
    """Requests the gateway accepted (each ends with a usage record): `lockgate_requests_total` with a model."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "lockgate_requests"
        for s in f.samples
        if s.name == "lockgate_requests_total" and s.labels.get("model")
    )


async def _quiesce(http: aiohttp.ClientSession, url: str, within_s: float) -> tuple[float | None, list[str]]:
    started = time.monotonic()
    while True:
        problems = await _not_quiet(http, url)
        waited = time.monotonic() - started
        if not problems:
            return waited, []
        if waited > within_s:
            return None, problems
        await asyncio.sleep(0.05)  # another process: its gauges are read over HTTP


async def run(settings: Settings) -> Result:
    result = Result(settings)
    rng = random.Random(settings.seed)
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                SimServer(
                    SimConfig(
                        models=(MODEL,),
                        prefill_tps=1e6,
                        tpot_ms=settings.tpot_ms,
                        seed=settings.seed + i,
                        requests_seen_limit=64,
                    )
                )
            )
            for i in range(settings.engines)
        ]
        proxies = [
            await stack.enter_async_context(FaultProxy("127.0.0.1", sim.port, seed=settings.seed * 1000 + i))
            for i, sim in enumerate(sims)
        ]
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lockgate-chaos-")))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        usage_path = str(tmp / "usage.sqlite3")
        config = tmp / "gateway.yaml"
        config.write_text(_config(port, proxies, usage_path))
        log = tmp / "gateway.log"
        proc = await stack.enter_async_context(_gateway(config, log))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await _wait_ready(url, proc, log)
        await _drive(port, settings, rng, settings.warmup, "warm")
        await _quiesce(http, url, settings.quiesce_s)
        result.baseline = _usage(proc.pid, proxies)
        for proxy in proxies:
            proxy.reset_fraction, proxy.stall_fraction = settings.reset, settings.stall
        started = time.monotonic()
        count = None if settings.duration_s is not None else settings.requests
        result.outcomes = await _drive(port, settings, rng, count, "c")
        result.seconds = time.monotonic() - started
        for proxy in proxies:
            proxy.reset_fraction = proxy.stall_fraction = 0.0
        result.resets = sum(p.stats.resets for p in proxies)
        result.stalls = sum(p.stats.stalls for p in proxies)
        result.engine_requests = sum(p.stats.requests for p in proxies)
        result.quiesce_s, result.not_quiet = await _quiesce(http, url, settings.quiesce_s)
        result.after = _usage(proc.pid, proxies)
        result.accepted = await _accepted(http, url)
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(settings.quiesce_s + 10):
                result.exit_status = await proc.wait()
        except TimeoutError:
            result.exit_status = None
        if await asyncio.to_thread(os.path.exists, usage_path):
            result.records = await asyncio.to_thread(read_records, usage_path)
        result.checks = verdicts(result)
        if not result.ok:
            result.log_tail = await _tail(log)
    return result


def verdicts(result: Result) -> list[tuple[str, bool, str]]:
    """The checks: (what, passed, detail)."""
    s = result.settings
    checks: list[tuple[str, bool, str]] = []
    answered = [o for o in result.outcomes if o.complete]
    problems = [o for o in result.outcomes if o.problem is not None]
    checks.append(
        (
            "every answer read to its end is well formed",
            not problems,
            "; ".join(f"{o.client_id}: {o.problem}" for o in problems[:5]),
        )
    )
    bad = Counter(o.status for o in answered if o.status >= 500 and o.status not in (502, 504))
    checks.append(("no 500 and no 503 (the pool never ran dry)", not bad, str(dict(bad))))
    checks.append(
        (
            "quiescent (no request, flight, call, lease, slot, reservation, violation)",
            result.quiesce_s is not None,
            f"after {result.quiesce_s:.2f}s" if result.quiesce_s is not None else "; ".join(result.not_quiet),
        )
    )
    rows = result.records
    ids = Counter(r["request_id"] for r in rows)
    by_client = Counter(r["client_request_id"] for r in rows)
    twice = [i for i, n in ids.items() if n > 1] + [c for c, n in by_client.items() if n > 1]
    missing = [o.client_id for o in answered if by_client[o.client_id] != 1]
    checks.append(
        (
            "one usage record per accepted request",
            len(rows) == result.accepted and not twice and not missing,
            f"{len(rows)} rows, {result.accepted:g} accepted (the {s.warmup} warm-up requests included); "
            f"twice: {twice[:5]}; answered without a row: "
            f"{missing[:5]}",
        )
    )
    if result.baseline is not None and result.after is not None:
        grown_mb = (result.after.rss_kb - result.baseline.rss_kb) / 1024
        checks.append(
            (
                f"RSS within {s.rss_slack_mb:g} MiB of its baseline",
                grown_mb <= s.rss_slack_mb,
                f"{result.baseline.rss_kb / 1024:.1f} -> {result.after.rss_kb / 1024:.1f} MiB ({grown_mb:+.1f})",
            )
        )
        base = result.baseline.fds - result.baseline.upstream_connections
        after = result.after.fds - result.after.upstream_connections
        checks.append(
            (
                f"open descriptors within {s.fd_slack} of the baseline (idle engine connections aside)",
                after - base <= s.fd_slack,
                f"{result.baseline.fds} ({result.baseline.upstream_connections} upstream) -> {result.after.fds} "
                f"({result.after.upstream_connections} upstream)",
            )
        )
    checks.append(("stopped cleanly on SIGTERM", result.exit_status == 0, f"exit status {result.exit_status}"))
    return checks


def report(result: Result) -> str:
    s = result.settings
    outcomes = result.outcomes
    by_manner = Counter(o.manner.value for o in outcomes)
    statuses = Counter(o.status for o in outcomes if o.complete)
    left = sum(o.left for o in outcomes)
    upstream_errors = sum(o.upstream_error for o in outcomes)
    records = Counter(f"{r['status']}/{r['cancel_reason'] or '-'}" for r in result.records)
    lines = [
        f"chaos: {len(outcomes)} requests in {result.seconds:.1f}s at concurrency {s.concurrency}, "
        f"{s.engines} engines, seed {s.seed}",
        f"clients: {dict(by_manner)}; left before the end: {left}; statuses read: {dict(sorted(statuses.items()))}; "
        f"streams/answers ending in an upstream error: {upstream_errors}",
        f"engine requests through the fault proxies: {result.engine_requests}, reset: {result.resets} "
        f"({result.resets / max(1, result.engine_requests):.1%}), frozen: {result.stalls}",
        f"usage records: {len(result.records)} ({dict(sorted(records.items()))})",
    ]
    for what, ok, detail in result.checks:
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}" + (f": {detail}" if detail else ""))
    if result.log_tail:
        lines.append("gateway log (end):\n" + result.log_tail)
    lines.append("chaos: OK" if result.ok else "chaos: VIOLATIONS")
    return "\n".join(lines)
