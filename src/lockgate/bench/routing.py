"""`lockgate bench routing`: every routing policy on a suite of workloads and simulator fleets.

A cell is (workload family, fleet configuration, policy, seed). Each cell starts a fresh fleet of
simulators (so every policy begins with cold caches) and a gateway with the default configuration in
front of it, all in this process; an open-loop client replays the family's trace (`workloads.py`,
streaming) and measures TTFT and end-to-end latency. The prefix-cache hit rate is read from the
simulators' own counters. Time is compressed with the simulators' knobs (fast prefill, short decode
steps) so that a cell takes a few seconds.

Fleet configurations (caches sized against the trace's working set, `workloads.working_set_tokens`):
- `small`: each instance's cache holds a quarter of the working set (the fleet, partitioned, holds it);
- `large`: each instance's cache holds all of it;
- `slow`: `small`, and one instance prefills 3x slower with 3x the time per output token;
- `failing`: `small`, and one instance crashes halfway through (`SimConfig.fail_after_s`): its streams
  break, then it answers 503 until the gateway ejects it.

With `--replicas N` (N >= 2) each cell also runs on the cluster shape (`lockgate.cluster`): a local etcd,
one sidecar per two simulators, N central gateways, the trace's requests alternating between the
centrals; the same trace and fleet, so hit rate and TTFT compare with the single gateway's (the cluster
adds a hop: central -> sidecar -> engine). In that mode every gateway, the single one it is compared
with included, is a process of its own (`topology.py`): the simulators and the client stay here; and
each request's TTFT is split hop by hop from the gateways' usage records and the simulators' own
(`hops.py`), so a gap between the two shapes shows where it is.

With several seeds each row shows the median over seeds of the hit rate and the TTFT percentiles.
`verdicts` checks the issue's targets per row: the default (`predicted_ttft`) within 3 points of the best
hit rate and 10% of the best TTFT p99, and no worse than `round_robin` on either (one gateway); with
replicas, each policy within 5 points of hit rate and 10% of TTFT p99 of its single-gateway row.

Finally the prefix index is filled with a million distinct prompts and its memory measured with
tracemalloc against its configured bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from ..config import parse_config
from ..routing.prefix import PrefixIndex, prompt_blocks
from ..server import GatewayServer, tune_gc
from ..sim import SimConfig, SimServer
from . import hops
from .load import percentile
from .progress import Progress
from .topology import Children
from .workloads import FAMILIES, MAKERS, Shape, TraceRequest, longest_prompt, working_set_tokens

__all__ = [
    "CONFIGS",
    "DEFAULT",
    "FAMILIES",
    "POLICIES",
    "Fleet",
    "Noise",
    "RunResult",
    "Shape",
    "judge",
    "run",
    "verdicts",
]

MODEL = "bench-model"
DEFAULT = "predicted_ttft"
POLICIES = ("round_robin", "least_load", "power_of_two", "consistent_hash", "score", "cache_aware", DEFAULT)
CONFIGS = ("small", "large", "slow", "failing")


@dataclass(frozen=True, slots=True)
class Fleet:
    """The simulated instances, before a configuration varies them."""

    instances: int = 4
    prefill_tps: float = 20000.0
    tpot_ms: float = 2.0
    max_num_seqs: int = 32
    max_tokens: int = 8
    block_size: int = 16
    #: Share of the trace's working set each instance's cache holds in `small`, `slow` and `failing`
    #: (`large`: 1.25 of all of it).
    small_share: float = 0.25


def sim_configs(config: str, fleet: Fleet, trace: list[TraceRequest], duration_s: float) -> list[SimConfig]:
    """The instances of fleet configuration `config` for this trace (see the module docstring)."""
    bs = fleet.block_size
    ws_blocks = working_set_tokens(trace, bs) // bs
    # Never below what a few of the longest prompts in flight at once need (else nothing could run).
    floor = 4 * (longest_prompt(trace) + fleet.max_tokens + 2 * bs) // bs
    blocks = max(floor, ws_blocks * 5 // 4 if config == "large" else int(ws_blocks * fleet.small_share))
    base = SimConfig(
        models=(MODEL,),
        prefill_tps=fleet.prefill_tps,
        tpot_ms=fleet.tpot_ms,
        num_kv_blocks=blocks,
        block_size=bs,
        max_num_seqs=fleet.max_num_seqs,
        max_model_len=blocks * bs,
        requests_seen_limit=len(trace) + 64,  # every request's record, for the TTFT by hop
    )
    sims = [dataclasses.replace(base, seed=n) for n in range(fleet.instances)]
    if config == "slow":
        sims[0] = dataclasses.replace(sims[0], prefill_tps=fleet.prefill_tps / 3, tpot_ms=fleet.tpot_ms * 3)
    elif config == "failing":
        sims[0] = dataclasses.replace(sims[0], fail_after_s=duration_s / 2)
    elif config not in ("small", "large"):
        raise ValueError(f"unknown fleet configuration {config!r}")
    return sims


@dataclass
class RunResult:
    family: str
    config: str
    policy: str
    seed: int
    requests: int
    errors: int = 0
    seconds: float = 0.0
    hit_rate: float = 0.0
    cache_blocks: int = 0
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    #: 1: one gateway in front of the engines; N: N central replicas and sidecars through etcd.
    replicas: int = 1
    #: The second run of the default on the same seed (the bench's own noise).
    repeat: bool = False
    #: Per request that chained through every gateway's records to the engine's, its TTFT by hop
    #: (`hops.segments`, named by `hop_names`); only with the gateways as processes.
    hops: list[tuple[float, ...]] = field(default_factory=list)
    hop_names: tuple[str, ...] = ()
    #: CPU seconds used during the replay, by process kind: `serve` (one gateway, or every central),
    #: `sidecar`, and `bench` (this process: the client and the simulators); only with the gateways as
    #: processes.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.policy}#2" if self.repeat else self.policy

    @property
    def throughput(self) -> float:
        return (self.requests - self.errors) / self.seconds if self.seconds else 0.0


async def run_cell(
    family: str,
    config: str,
    policy: str,
    shape: Shape,
    fleet: Fleet,
    trace: list[TraceRequest] | None = None,
    replicas: int = 1,
    processes: bool = False,
) -> RunResult:
    """`processes`: every gateway in a child process (always with `replicas` > 1)."""
    trace = trace if trace is not None else MAKERS[family](shape)
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(SimServer(c)) for c in sim_configs(config, fleet, trace, shape.duration_s)
        ]
        # Prefill rate until measured: the simulators' (the gateway counts ~4 characters a token, the
        # simulator a word, ~2 of those; it learns the ratio from usage).
        routing = {"policy": policy, "predicted_ttft": {"default_prefill_tps": fleet.prefill_tps * 2}}
        base: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "usage": {"path": ":memory:"},
            "scrape": {"interval_ms": 100},
        }

        def model(members: list[tuple[int, SimServer]]) -> dict[str, Any]:
            instances = [{"url": s.url, "engine": "vllm", "name": f"sim-{n}"} for n, s in members]
            return {"name": MODEL, "routing": routing, "instances": instances}

        single = {**base, "models": [model(list(enumerate(sims)))]}
        children: Children | None = None
        if replicas <= 1 and not processes:
            urls = [(await stack.enter_async_context(GatewayServer(parse_config(single, "bench"), port=0))).url]
        else:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lockgate-bench-")))
            children = stack.enter_context(Children(directory))
            if replicas <= 1:
                urls = [await children.start("serve", single)]
            else:
                urls = await _cluster(stack, children, directory, base, model, routing, list(enumerate(sims)), replicas)
        result = RunResult(family, config, policy, shape.seed, len(trace), cache_blocks=sims[0].config.num_kv_blocks)
        result.replicas = replicas
        client: dict[str, tuple[float, float]] = {}
        commands = ("serve", "sidecar")
        cpu_before = {c: children.cpu(c) for c in commands} if children is not None else {}
        own_before = time.process_time()
        # Collected as `lockgate serve` collects (the gateway may run in this process): what the earlier cells left
        # is freed now, and the rest frozen for the replay, not walked by a full collection in the middle of it (a
        # long run showed p99 spikes on one seed, 188%, that the same row in a fresh process did not).
        thresholds = gc.get_threshold()
        tune_gc()
        try:
            await _replay(urls, trace, shape, fleet, result, client)
        finally:
            gc.unfreeze()  # the next cell's collection frees what this one leaves
            gc.set_threshold(*thresholds)
        if children is not None:
            after = {c: children.cpu(c) for c in commands}
            result.cpu_s = {c: after[c] - cpu_before[c] for c in commands if after[c]}
            result.cpu_s["bench"] = time.process_time() - own_before
        queries = sum(s.stats.prefix_cache_query_tokens for s in sims)
        hits = sum(s.stats.prefix_cache_hit_tokens for s in sims)
        result.hit_rate = hits / queries if queries else 0.0
        if children is not None:
            children.close()  # each gateway flushes its usage records as it stops
            _split_by_hop(result, children, sims, client)
        return result


def _split_by_hop(
    result: RunResult, children: Children, sims: list[SimServer], client: dict[str, tuple[float, float]]
) -> None:
    """`result.hops` from the gateways' usage records (read once they stopped) and the simulators' own."""
    layers = ("central", "sidecar") if result.replicas > 1 else ("gateway",)
    records = [children.records("serve"), *([children.records("sidecar")] if result.replicas > 1 else [])]
    wall = time.time() - time.monotonic()  # the simulators' stamps are this process's monotonic clock
    engine = {
        r.request_id: (r.started_at + wall, r.first_token_at + wall)
        for s in sims
        for r in s.stats.seen
        if r.first_token_at is not None
    }
    result.hops = hops.segments(client, records, engine)
    result.hop_names = hops.names(layers)


async def _cluster(
    stack: contextlib.AsyncExitStack,
    children: Children,
    directory: Path,
    base: dict[str, Any],
    model: Any,
    routing: dict[str, Any],
    sims: list[tuple[int, SimServer]],
    replicas: int,
) -> list[str]:
    """A local etcd, one sidecar per two simulators, `replicas` central gateways (processes); their URLs
    once every central routes to every engine."""
    from ..cluster.etcd_server import LocalEtcd

    etcd = LocalEtcd(directory / "etcd")
    await asyncio.to_thread(etcd.start)
    stack.callback(etcd.stop)
    cluster = {"endpoints": [etcd.url], "name": "bench", "lease_ttl_ms": 2000, "routing": routing}
    for node in range(0, len(sims), 2):
        config = {**base, "models": [model(sims[node : node + 2])], "cluster": {**cluster, "node": f"node-{node // 2}"}}
        await children.start("sidecar", config)
    return [
        await children.start("serve", {**base, "cluster": cluster}, ready_instances=(MODEL, len(sims)))
        for _ in range(replicas)
    ]


async def _replay(
    urls: list[str],
    trace: list[TraceRequest],
    shape: Shape,
    fleet: Fleet,
    result: RunResult,
    client: dict[str, tuple[float, float]],
) -> None:
    """Replay `trace` at its own arrival times; `client` gets each answered request's id (its
    `x-request-id`) -> wall-clock (sent, first bytes)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(request: TraceRequest, start: float, sent: float, url: str, rid: str) -> None:
            """`start` (perf_counter) and `sent` (wall clock): when the trace sends it."""
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": list(request.messages),
                    "max_tokens": fleet.max_tokens,
                    "stream": True,
                    "user": request.user,
                }
            )
            first: float | None = None
            failed = False
            try:
                async with session.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "x-request-id": rid},
                ) as resp:
                    async for chunk in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                            client[rid] = (sent, time.time())
                        failed = failed or b'"error"' in chunk  # a stream that broke ends with an error event
                    failed = failed or resp.status != 200
            except aiohttp.ClientError:
                failed = True
            if failed:
                result.errors += 1
                client.pop(rid, None)
                return
            end = time.perf_counter()
            result.ttfts.append((first or end) - start)
            result.e2es.append(end - start)

        loop = asyncio.get_running_loop()
        began = loop.time()
        started = time.perf_counter()
        async with asyncio.timeout(shape.duration_s + 30.0), asyncio.TaskGroup() as group:
            for n, request in enumerate(trace):
                delay = began + request.at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # the trace's own arrival times
                group.create_task(one(request, time.perf_counter(), time.time(), urls[n % len(urls)], f"bench-{n}"))
        result.seconds = time.perf_counter() - started


async def run(
    families: list[str],
    configs: list[str],
    policies: list[str],
    shape: Shape,
    fleet: Fleet | None = None,
    seeds: list[int] | None = None,
    progress: Progress | None = None,
    replicas: tuple[int, ...] = (1,),
    repeat: bool = True,
) -> list[RunResult]:
    """Every cell; with `repeat` (and the default among `policies`) the default runs a second time per
    seed, last, on the same trace and fleet: the difference between its two runs is the bench's noise."""
    progress = progress or Progress.silent()
    fleet = fleet or Fleet()
    seeds = seeds or [shape.seed]
    runs = [(p, False) for p in policies] + ([(DEFAULT, True)] if repeat and DEFAULT in policies else [])
    total = len(families) * len(configs) * len(runs) * len(seeds) * len(replicas)
    # Compared with replicas, the single gateway runs as a process too (`topology.py`).
    processes = max(replicas) > 1
    results: list[RunResult] = []
    for family in families:
        for seed in seeds:
            seeded = dataclasses.replace(shape, seed=seed)
            trace = MAKERS[family](seeded)
            for config in configs:
                for policy, again in runs:
                    for count in replicas:
                        if again and count > 1:
                            continue
                        where = f", {count} replicas" if count > 1 else ""
                        name = f"{policy}#2" if again else policy
                        progress.phase(f"{family}/{config} {name}{where} seed {seed} ({len(results) + 1}/{total})")
                        result = await run_cell(
                            family, config, policy, seeded, fleet, trace, count, processes=processes
                        )
                        result.repeat = again
                        results.append(result)
    return results


@dataclass(frozen=True, slots=True)
class Row:
    """One (family, config, policy, replicas) over its seeds: medians of the hit rate and TTFT p50, the
    TTFT p99 of all its seeds' requests pooled, and how much the per-seed figures spread."""

    family: str
    config: str
    policy: str  # `predicted_ttft#2`: the repeat of the default
    replicas: int
    seeds: int
    requests: int
    errors: int
    hit_rate: float
    hit_spread: float  # max - min of the per-seed hit rates (points as a fraction); 0 with one seed
    ttft_p50: float
    ttft_p99: float  # pooled over seeds
    p99_spread: float  # (max - min) / median of the per-seed p99s; 0 with one seed
    e2e_p99: float  # pooled over seeds
    cache_blocks: int


def rows(results: list[RunResult]) -> list[Row]:
    groups: dict[tuple[str, str, str, int], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.family, r.config, r.label, r.replicas), []).append(r)
    out = []
    for (family, config, policy, replicas), rs in groups.items():
        p99s = [percentile(r.ttfts, 99) for r in rs]
        mid = statistics.median(p99s)
        hits = [r.hit_rate for r in rs]
        out.append(
            Row(
                family,
                config,
                policy,
                replicas,
                len(rs),
                sum(r.requests for r in rs),
                sum(r.errors for r in rs),
                statistics.median(hits),
                max(hits) - min(hits),
                statistics.median(percentile(r.ttfts, 50) for r in rs),
                percentile([t for r in rs for t in r.ttfts], 99),
                (max(p99s) - min(p99s)) / mid if mid else 0.0,
                percentile([t for r in rs for t in r.e2es], 99),
                rs[0].cache_blocks,
            )
        )
    return out


def report(results: list[RunResult]) -> str:
    lines = [
        f"{'family':<8}{'config':<9}{'policy':<17}{'repl':>5}{'reqs':>6}{'err':>5}{'hit rate':>10}{'±hit':>6}"
        f"{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'±p99':>7}{'e2e p99 ms':>12}{'cache blk':>10}"
    ]
    for r in rows(results):
        lines.append(
            f"{r.family:<8}{r.config:<9}{r.policy:<17}{r.replicas:>5}{r.requests:>6}{r.errors:>5}{r.hit_rate:>10.1%}"
            f"{r.hit_spread * 100:>6.1f}{r.ttft_p50 * 1000:>13.1f}{r.ttft_p99 * 1000:>13.1f}{r.p99_spread:>7.0%}"
            f"{r.e2e_p99 * 1000:>12.1f}{r.cache_blocks:>10}"
        )
    legend = (
        "hit rate and TTFT p50: medians over seeds (±hit: their max - min, in points); TTFT and e2e p99: all seeds'"
        " requests pooled (±p99: max - min of the per-seed p99s over their median)"
    )
    if any(run.repeat for run in results):
        legend += f"; {DEFAULT}#2: the default run again on the same seeds (the bench's own noise)"
    lines.append(legend)
    by_row: dict[tuple[str, str, str, int], list[RunResult]] = {}
    for run in results:
        if run.hop_names:
            by_row.setdefault((run.family, run.config, run.label, run.replicas), []).append(run)
    for (family, config, policy, replicas), runs in by_row.items():
        label = f"{family}/{config} {policy}, {f'{replicas} replicas' if replicas > 1 else 'one gateway'}"
        pooled = [h for run in runs for h in run.hops]
        requests = sum(run.requests for run in runs)
        lines.append(hops.table(label, runs[0].hop_names, pooled, requests))
        cpu = {kind: sum(run.cpu_s.get(kind, 0.0) for run in runs) for kind in ("serve", "sidecar", "bench")}
        kinds = {"serve": "centrals" if replicas > 1 else "gateway", "sidecar": "sidecars", "bench": "client+sims"}
        parts = [f"{kinds[kind]} {seconds / requests * 1000:.2f}" for kind, seconds in cpu.items() if seconds]
        if parts and requests:
            lines.append(
                f"  CPU per request during the replay (ms, every process of a kind together): {', '.join(parts)}"
            )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Noise:
    """How far the default's two identical runs of a row differed: hit rate (points as a fraction) and
    TTFT p99 (relative)."""

    hit: float = 0.0
    p99: float = 0.0

    @classmethod
    def between(cls, a: Row | None, b: Row | None) -> Noise | None:
        """None when the row was not run twice (`--no-repeat`): its noise is not known."""
        if a is None or b is None:
            return None
        if not a.ttft_p99 or not b.ttft_p99:
            return cls(abs(a.hit_rate - b.hit_rate))
        return cls(abs(a.hit_rate - b.hit_rate), max(a.ttft_p99, b.ttft_p99) / min(a.ttft_p99, b.ttft_p99) - 1)


#: A verdict: its text and `PASS`, `MISS`, or `NOISE` (missed by less than the row's own noise).
Verdict = tuple[str, str]


def judge(
    default: Row, others: list[Row], noise: Noise | None, hit_points: float = 0.03, p99_ratio: float = 1.10
) -> Verdict:
    """The issue's targets on one (family, config): the default within `hit_points` of the best hit rate
    and `p99_ratio` of the best TTFT p99 among `others` (itself included), and no worse than round_robin
    on either. `NOISE` when it misses only by less than `noise` (None: not measured, never `NOISE`)."""
    measured = noise
    noise = noise or Noise()
    best_hit = max(others, key=lambda r: r.hit_rate)
    best_p99 = min(others, key=lambda r: r.ttft_p99)
    hit_gap = best_hit.hit_rate - default.hit_rate
    ratio = default.ttft_p99 / best_p99.ttft_p99 if best_p99.ttft_p99 else 1.0
    strict = [hit_gap <= hit_points, ratio <= p99_ratio]
    loose = [hit_gap <= hit_points + noise.hit, ratio <= p99_ratio + noise.p99]
    text = (
        f"{default.family}/{default.config}: {default.policy} hit {default.hit_rate:.1%} (best"
        f" {best_hit.hit_rate:.1%} {best_hit.policy}), TTFT p99 {default.ttft_p99 * 1000:.1f} ms ="
        f" {ratio:.2f}x best ({best_p99.policy})"
    )
    rr = next((r for r in others if r.policy == "round_robin"), None)
    if rr is not None:
        strict.append(default.hit_rate >= rr.hit_rate and default.ttft_p99 <= rr.ttft_p99)
        loose.append(default.hit_rate >= rr.hit_rate - noise.hit and default.ttft_p99 <= rr.ttft_p99 * (1 + noise.p99))
        text += f"; round_robin {rr.hit_rate:.1%}, {rr.ttft_p99 * 1000:.1f} ms"
    if measured is None:
        text += "; noise not measured (the default ran once)"
    else:
        text += f"; noise (default run twice): hit {noise.hit * 100:.1f} points, p99 {noise.p99:.0%}"
    return text, "PASS" if all(strict) else "NOISE" if all(loose) else "MISS"


def verdicts(results: list[RunResult], hit_points: float = 0.03, p99_ratio: float = 1.10) -> list[Verdict]:
    """Per (family, config) with the default among the policies run: `judge`; with replicas, each
    policy within 5 points and 10% of TTFT p99 of its single-gateway row."""
    table: dict[tuple[str, str], dict[str, Row]] = {}
    many: list[Row] = []
    for row in rows(results):
        if row.replicas == 1:
            table.setdefault((row.family, row.config), {})[row.policy] = row
        else:
            many.append(row)
    out: list[Verdict] = []
    for m in many:
        single = table.get((m.family, m.config), {}).get(m.policy)
        if single is None:
            continue
        label = f"{m.family}/{m.config}: {m.policy} with {m.replicas} replicas"
        hits, p99s = _paired(results, m)
        out.append(
            (
                f"{label}: hit rate within 5 points of one gateway's (per seed: median "
                f"{_points(statistics.median(hits))}, {_points(min(hits))} to {_points(max(hits))} points)",
                _status(abs(statistics.median(hits)) <= 0.05),
            )
        )
        out.append(
            (
                f"{label}: TTFT p99 within 10% of one gateway's (per seed: median {statistics.median(p99s):.2f}x, "
                f"{min(p99s):.2f}x to {max(p99s):.2f}x)",
                _status(statistics.median(p99s) <= 1.1),
            )
        )
    for by in table.values():
        d = by.get(DEFAULT)
        others = [r for name, r in by.items() if not name.endswith("#2")]
        if d is None or len(others) < 2:
            continue
        out.append(judge(d, others, Noise.between(d, by.get(f"{DEFAULT}#2")), hit_points, p99_ratio))
    return out


def _status(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _points(difference: float) -> str:
    """A difference of two hit rates in percentage points (`+2.0`, not `+2.0%`: 2% of a 50% rate is 1 point)."""
    return f"{difference * 100:+.1f}"


def _paired(results: list[RunResult], row: Row) -> tuple[list[float], list[float]]:
    """Per seed run both ways, the replicas' hit rate minus one gateway's and their TTFT p99 ratio: the same
    trace, run one after the other, so that a loaded machine's drift between seeds cancels out."""
    runs: dict[tuple[int, int], RunResult] = {
        (r.seed, r.replicas): r
        for r in results
        if not r.repeat and (r.family, r.config, r.policy) == (row.family, row.config, row.policy)
    }
    hits, p99s = [], []
    for (seed, replicas), many in runs.items():
        one = runs.get((seed, 1))
        if replicas != row.replicas or one is None:
            continue
        hits.append(many.hit_rate - one.hit_rate)
        single = percentile(one.ttfts, 99)
        p99s.append(percentile(many.ttfts, 99) / single if single else 1.0)
    return hits, p99s


def index_memory_check(prompts: int, max_bytes: int, block_chars: int = 64) -> tuple[int, int, int]:
    """Fill an index with `prompts` distinct prompts; return (bytes measured, bound, blocks held)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(max_bytes, block_chars)
        for n in range(prompts):
            index.insert(f"i{n % 4}", prompt_blocks(f"prompt {n:09d} " * 9, block_chars))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used, max_bytes, len(index)
