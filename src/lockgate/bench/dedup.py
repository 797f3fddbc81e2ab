"""`lockgate bench dedup`: a burst workload where a share of the requests duplicate each other.

One simulator (real batching and token timing) and one gateway run in this process. Each window sends
a burst of `burst` requests whose arrivals are spread over `spread_ms`; `dup_share` of them repeat one
of the window's distinct prompts (windows never share prompts, so each window starts cold). Every request
is reproducible (temperature 0), so each duplicate should be coalesced with the flight of its prompt
(or, arriving after it finished, served from the completed-result cache).

Reported: engine calls vs requests vs distinct fingerprints, outcomes (miss / coalesced / hit), latency
of leaders (miss), followers (coalesced) and cache hits, and the engine tokens generated vs requested.
The target: engine calls == distinct fingerprints in every window. With mixed clients the first window
may miss it by a few calls: a streaming duplicate that arrives while only a non-streaming (JSON) flight
runs leads a streaming flight of its own rather than wait for the whole answer; after that the model's
flights stream for a while, whatever their leader asked (docs/decisions.md, issue 17).

`--max-concurrency` below a window's distinct prompts saturates the gateway's slots: the leaders queue for them,
while a duplicate joins its flight (or takes its cached result) without one.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson

from ..config import parse_config
from ..server import GatewayServer
from ..sim import SimConfig, SimServer
from .load import percentile
from .progress import Progress

MODEL = "bench-model"


@dataclass
class DedupResult:
    requests: int = 0
    distinct: int = 0
    engine_calls: int = 0
    errors: int = 0
    engine_tokens: int = 0
    requested_tokens: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)
    windows_on_target: int = 0
    windows: int = 0
    seconds: float = 0.0


async def run(
    *,
    windows: int,
    burst: int,
    dup_share: float,
    stream_share: float,
    max_tokens: int,
    spread_ms: float,
    tpot_ms: float,
    seed: int = 1,
    max_concurrency: int = 1024,
    progress: Progress | None = None,
) -> DedupResult:
    progress = progress or Progress.silent()
    rng = random.Random(seed)
    result = DedupResult()
    sim_config = SimConfig(models=(MODEL,), tpot_ms=tpot_ms, max_num_seqs=256, requests_seen_limit=10)
    with tempfile.TemporaryDirectory() as tmp:
        async with SimServer(sim_config) as sim:
            config = parse_config(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "usage": {"path": f"{tmp}/usage.sqlite3"},
                    "models": [
                        {
                            "name": MODEL,
                            "instances": [{"url": sim.url, "engine": "vllm", "max_concurrency": max_concurrency}],
                        }
                    ],
                },
                "bench",
            )
            connector = aiohttp.TCPConnector(limit=0)
            async with GatewayServer(config, port=0) as gw, aiohttp.ClientSession(connector=connector) as http:
                url = gw.url + "/v1/chat/completions"
                started = time.perf_counter()
                for window in range(windows):
                    progress.phase(f"window {window + 1}/{windows} ({burst} requests)")
                    await _window(
                        http, url, sim, rng, window, burst, dup_share, stream_share, max_tokens, spread_ms, result
                    )
                result.seconds = time.perf_counter() - started
    return result


async def _window(
    http: aiohttp.ClientSession,
    url: str,
    sim: SimServer,
    rng: random.Random,
    window: int,
    burst: int,
    dup_share: float,
    stream_share: float,
    max_tokens: int,
    spread_ms: float,
    result: DedupResult,
) -> None:
    distinct = max(1, round(burst * (1 - dup_share)))
    prompts = [f"window {window} document {i}: summarise it" for i in range(distinct)]
    plan = prompts + [rng.choice(prompts) for _ in range(burst - distinct)]
    rng.shuffle(plan)
    before = sim.statistics()

    async def one(prompt: str) -> None:
        delay = rng.random() * spread_ms / 1000
        stream = rng.random() < stream_share
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        await asyncio.sleep(delay)  # open-loop arrival time, not a wait for a condition
        t0 = time.perf_counter()
        first: float | None = None
        try:
            async with http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                outcome = resp.headers.get("x-lockgate-cache", "?")
                if resp.status != 200:
                    result.errors += 1
        except aiohttp.ClientError:
            result.errors += 1
            return
        end = time.perf_counter()
        result.outcomes[outcome] += 1
        result.latency.setdefault(outcome, []).append(end - t0)
        if stream and first is not None:
            result.ttft.setdefault(outcome, []).append(first - t0)

    await asyncio.gather(*(one(p) for p in plan))
    after = sim.statistics()
    calls = after["requests_started"] - before["requests_started"]
    result.windows += 1
    result.requests += burst
    result.distinct += distinct
    result.engine_calls += calls
    result.engine_tokens += after["tokens_generated"] - before["tokens_generated"]
    result.requested_tokens += burst * max_tokens
    if calls == distinct:
        result.windows_on_target += 1


def report(r: DedupResult) -> str:
    lines = [
        f"windows {r.windows}  requests {r.requests}  distinct fingerprints {r.distinct}  "
        f"engine calls {r.engine_calls}  errors {r.errors}  ({r.seconds:.1f}s)",
        f"engine calls / distinct: {r.engine_calls / max(1, r.distinct):.3f}  "
        f"(windows on target: {r.windows_on_target}/{r.windows})",
        f"coalescable duplicates: {r.requests - r.distinct}  served without an engine call: "
        f"{r.outcomes['coalesced'] + r.outcomes['hit']}",
        f"engine tokens generated {r.engine_tokens} for {r.requested_tokens} requested "
        f"({r.engine_tokens / max(1, r.requested_tokens):.1%})",
        f"{'outcome':<10}{'count':>7}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>10}",
    ]
    for outcome in ("miss", "coalesced", "hit", "bypass"):
        lat = r.latency.get(outcome, [])
        if not lat:
            continue
        ttft = r.ttft.get(outcome, [])
        lines.append(
            f"{outcome:<10}{len(lat):>7}{percentile(lat, 50) * 1000:>9.1f}{percentile(lat, 99) * 1000:>9.1f}"
            f"{(percentile(ttft, 50) * 1000 if ttft else float('nan')):>10.1f}"
        )
    return "\n".join(lines)
