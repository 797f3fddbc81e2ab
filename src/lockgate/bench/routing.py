"""`lockgate bench routing`: every routing policy on the same traces, against a simulator fleet.

Each run starts a fresh fleet (so every policy begins with cold caches) of simulators with prefix
caching and a deliberately small KV cache, and a gateway in front of it, all in this process; an
open-loop client replays the trace (Poisson arrivals, streaming) and measures TTFT and end-to-end
latency. The prefix-cache hit rate is read from the simulators' own counters. Time is compressed with
the simulators' knobs (fast prefill, short decode steps) so that a run takes a few seconds.

Traces (seeded, identical for every policy):
- `agent`: a handful of long shared system prompts, many users, each a multi-turn conversation whose
  prompt extends the previous turn's.
- `skewed`: one system prompt takes 80% of the traffic; single-turn questions.

With `--replicas N` (N >= 2) each policy also runs on the cluster shape (`lockgate.cluster`): a local
etcd, one sidecar per two simulators, N central gateways, the trace's requests alternating between the
centrals; the same trace and fleet, so hit rate and TTFT compare with the single gateway's (the cluster
adds a hop: central -> sidecar -> engine, all in this one process).

Finally the prefix index is filled with a million distinct prompts and its memory measured with
tracemalloc against its configured bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
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
from ..server import GatewayServer
from ..sim import SimConfig, SimServer
from .load import percentile
from .progress import Progress

MODEL = "bench-model"
POLICIES = ("round_robin", "least_load", "power_of_two", "consistent_hash", "score", "cache_aware", "predicted_ttft")
_WORDS = [
    "account",
    "billing",
    "refund",
    "policy",
    "customer",
    "order",
    "shipping",
    "warranty",
    "invoice",
    "support",
    "ticket",
    "escalate",
    "product",
    "service",
    "contract",
    "renewal",
    "discount",
    "payment",
    "method",
    "address",
    "delivery",
    "return",
    "exchange",
    "status",
]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float
    user: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True, slots=True)
class Shape:
    """The fleet and the load; the defaults keep one run to a few seconds."""

    instances: int = 4
    prefill_tps: float = 20000.0
    tpot_ms: float = 2.0
    kv_blocks: int = 320  # x 16 tokens: room for ~3 of the 8 system prompts (~1200 tokens) per instance
    max_num_seqs: int = 32
    system_words: int = 1200
    prefixes: int = 8
    users: int = 64
    turns: int = 5
    rate: float = 65.0  # requests per second
    duration_s: float = 4.0
    max_tokens: int = 8
    seed: int = 7


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _systems(shape: Shape, rng: random.Random) -> list[str]:
    return [f"System prompt {p}. " + _text(rng, shape.system_words) for p in range(shape.prefixes)]


def _arrivals(shape: Shape, rng: random.Random) -> list[float]:
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(shape.rate)
        if t >= shape.duration_s:
            return times
        times.append(t)


def agent_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed)
    systems = _systems(shape, rng)
    history: dict[int, list[dict[str, str]]] = {}
    out = []
    for at in _arrivals(shape, rng):
        user = rng.randrange(shape.users)
        convo = history.get(user)
        if convo is None or len(convo) >= 1 + 2 * shape.turns:  # a new conversation
            convo = history[user] = [{"role": "system", "content": systems[user % shape.prefixes]}]
        elif len(convo) > 1:
            convo.append({"role": "assistant", "content": _text(rng, 20)})
        convo.append({"role": "user", "content": f"User {user}: " + _text(rng, 30)})
        out.append(TraceRequest(at, f"user-{user}", tuple(convo)))
    return out


def skewed_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed + 1)
    systems = _systems(shape, rng)
    out = []
    for n, at in enumerate(_arrivals(shape, rng)):
        prefix = 0 if rng.random() < 0.8 else rng.randrange(1, shape.prefixes)
        messages = (
            {"role": "system", "content": systems[prefix]},
            {"role": "user", "content": f"Question {n}: " + _text(rng, 30)},
        )
        out.append(TraceRequest(at, f"user-{rng.randrange(shape.users)}", messages))
    return out


@dataclass
class RunResult:
    trace: str
    policy: str
    requests: int
    errors: int
    seconds: float
    hit_rate: float
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    #: 1: one gateway in front of the engines; N: N central replicas and sidecars through etcd.
    replicas: int = 1

    @property
    def throughput(self) -> float:
        return (self.requests - self.errors) / self.seconds if self.seconds else 0.0


async def run_policy(
    trace_name: str, trace: list[TraceRequest], policy: str, shape: Shape, replicas: int = 1
) -> RunResult:
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                SimServer(
                    SimConfig(
                        models=(MODEL,),
                        seed=n,
                        prefill_tps=shape.prefill_tps,
                        tpot_ms=shape.tpot_ms,
                        num_kv_blocks=shape.kv_blocks,
                        max_num_seqs=shape.max_num_seqs,
                        max_model_len=shape.kv_blocks * 16,
                    )
                )
            )
            for n in range(shape.instances)
        ]
        # The gateway counts ~4 characters a token, the simulator a word (~2 of those).
        routing = {"policy": policy, "predicted_ttft": {"default_prefill_tps": shape.prefill_tps * 2}}
        base: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "usage": {"path": ":memory:"},
            "scrape": {"interval_ms": 100},
        }

        def model(members: list[tuple[int, SimServer]]) -> dict[str, Any]:
            instances = [
                {"url": s.url, "engine": "vllm", "name": f"sim-{n}", "max_concurrency": shape.max_num_seqs}
                for n, s in members
            ]
            return {"name": MODEL, "routing": routing, "instances": instances}

        if replicas <= 1:
            config = parse_config({**base, "models": [model(list(enumerate(sims)))]}, "bench")
            urls = [(await stack.enter_async_context(GatewayServer(config, port=0))).url]
        else:
            urls = await _cluster(stack, base, model, routing, list(enumerate(sims)), replicas)
        result = await _replay(urls, trace, shape)
        queries = sum(s.stats.prefix_cache_query_tokens for s in sims)
        hits = sum(s.stats.prefix_cache_hit_tokens for s in sims)
        result.trace, result.policy, result.replicas = trace_name, policy, replicas
        result.hit_rate = hits / queries if queries else 0.0
        return result


async def _cluster(
    stack: contextlib.AsyncExitStack,
    base: dict[str, Any],
    model: Any,
    routing: dict[str, Any],
    sims: list[tuple[int, SimServer]],
    replicas: int,
) -> list[str]:
    """A local etcd, one sidecar per two simulators, `replicas` central gateways; their URLs once every
    central routes to every engine."""
    from ..cluster.etcd_server import LocalEtcd

    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lockgate-bench-etcd-")))
    etcd = LocalEtcd(directory / "data")
    await asyncio.to_thread(etcd.start)
    stack.callback(etcd.stop)
    cluster = {"endpoints": [etcd.url], "name": "bench", "lease_ttl_ms": 2000, "routing": routing}
    for node in range(0, len(sims), 2):
        config = {**base, "models": [model(sims[node : node + 2])], "cluster": {**cluster, "node": f"node-{node // 2}"}}
        await stack.enter_async_context(GatewayServer(parse_config(config, "bench sidecar"), port=0, role="sidecar"))
    urls = []
    for _ in range(replicas):
        server = await stack.enter_async_context(GatewayServer(parse_config({**base, "cluster": cluster}), port=0))
        assert server.gateway is not None
        async with asyncio.timeout(30):
            await server.gateway.fleet.wait_until(
                lambda f: MODEL in f.pools and sum(i.routable for i in f.pools[MODEL].instances) == len(sims)
            )
        urls.append(server.url)
    return urls


async def _replay(urls: list[str], trace: list[TraceRequest], shape: Shape) -> RunResult:
    result = RunResult("", "", len(trace), 0, 0.0, 0.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(request: TraceRequest, start: float, url: str) -> None:
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": list(request.messages),
                    "max_tokens": shape.max_tokens,
                    "stream": True,
                    "user": request.user,
                }
            )
            first: float | None = None
            try:
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    async for _ in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                    if resp.status != 200:
                        result.errors += 1
                        return
            except aiohttp.ClientError:
                result.errors += 1
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
                    await asyncio.sleep(delay)  # the trace's own (Poisson) arrival times
                group.create_task(one(request, time.perf_counter(), urls[n % len(urls)]))
        result.seconds = time.perf_counter() - started
    return result


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


async def run(
    traces: list[str],
    policies: list[str],
    shape: Shape,
    progress: Progress | None = None,
    replicas: tuple[int, ...] = (1,),
) -> list[RunResult]:
    progress = progress or Progress.silent()
    makers = {"agent": agent_trace, "skewed": skewed_trace}
    results: list[RunResult] = []
    for name in traces:
        trace = makers[name](shape)
        for policy in policies:
            for count in replicas:
                where = f", {count} replicas" if count > 1 else ""
                progress.phase(
                    f"{name} trace, {policy}{where} ({len(results) + 1}/{len(traces) * len(policies) * len(replicas)})"
                )
                results.append(await run_policy(name, trace, policy, shape, count))
    return results


def report(results: list[RunResult]) -> str:
    lines = [
        f"{'trace':<8}{'policy':<17}{'repl':>5}{'reqs':>6}{'err':>5}{'hit rate':>10}{'TTFT p50 ms':>13}"
        f"{'TTFT p99 ms':>13}{'e2e p99 ms':>12}{'req/s':>8}"
    ]
    for r in results:
        lines.append(
            f"{r.trace:<8}{r.policy:<17}{r.replicas:>5}{r.requests:>6}{r.errors:>5}{r.hit_rate:>10.1%}"
            f"{percentile(r.ttfts, 50) * 1000:>13.1f}{percentile(r.ttfts, 99) * 1000:>13.1f}"
            f"{percentile(r.e2es, 99) * 1000:>12.1f}{r.throughput:>8.1f}"
        )
    return "\n".join(lines)


def verdicts(results: list[RunResult]) -> list[tuple[str, bool]]:
    """The issue's targets, for the runs that were made."""
    by = {(r.trace, r.policy): r for r in results if r.replicas == 1}
    out: list[tuple[str, bool]] = []
    for many in results:
        single = by.get((many.trace, many.policy))
        if many.replicas > 1 and single is not None:
            label = f"{many.trace}: {many.policy} with {many.replicas} replicas"
            out.append(
                (
                    f"{label}: hit rate within 5 points of one gateway's",
                    abs(many.hit_rate - single.hit_rate) <= 0.05,
                )
            )
            out.append(
                (
                    f"{label}: TTFT p99 within 10% of one gateway's",
                    percentile(many.ttfts, 99) <= 1.1 * percentile(single.ttfts, 99),
                )
            )
    rr = by.get(("agent", "round_robin"))
    for policy in ("predicted_ttft", "cache_aware"):
        r = by.get(("agent", policy))
        if rr is None or r is None:
            continue
        out.append((f"agent: {policy} hit rate >= 2x round_robin's", r.hit_rate >= 2 * rr.hit_rate))
        out.append(
            (
                f"agent: {policy} TTFT p99 <= 0.5x round_robin's",
                percentile(r.ttfts, 99) <= 0.5 * percentile(rr.ttfts, 99),
            )
        )
    least, pred = by.get(("skewed", "least_load")), by.get(("skewed", "predicted_ttft"))
    if least is not None and pred is not None:
        out.append(
            (
                "skewed: predicted_ttft TTFT p99 <= least_load's",
                percentile(pred.ttfts, 99) <= percentile(least.ttfts, 99),
            )
        )
    return out
