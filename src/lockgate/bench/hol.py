"""`lockgate bench hol`: head-of-line blocking of short requests behind long ones within one class.

A fleet of simulators (chunked prefill, `max_num_batched_tokens` tokens a step) and a gateway with the
default configuration run in this process. Two phases replay the same Poisson stream of short requests
(`short_words` prompt tokens): alone, then mixed with long ones (`long_words` prompt tokens, a share
`long_load` of the fleet's prefill capacity), all in one priority class. The figure is the short
requests' TTFT in the mixed phase against alone; `engine` splits it into the engine's part (the sim's
own record, arrival to first token), so what is left is the gateway's queue.

A short request cannot avoid waiting for the forward step it joins, and a step that carries a long
prefill chunk lasts `chunk / prefill_tps`; what it should never do is wait for long prefills that
arrived before it while another instance or slot could serve it sooner. A third phase replays the mixed
stream with long prompts' turns on (`routing.long_prefill_ms`, off by default: at most one long prefill
outstanding per instance), beside the default in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from ..config import parse_config
from ..server import GatewayServer
from ..sim import SimConfig, SimServer
from .load import percentile
from .progress import Progress

MODEL = "bench-model"
#: The third phase's `routing.long_prefill_ms` (long prompts' turns).
LONG_PREFILL_MS = 100
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]


@dataclass(frozen=True, slots=True)
class Settings:
    duration_s: float = 5.0
    sims: int = 2
    prefill_tps: float = 8000.0
    tpot_ms: float = 10.0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    short_words: int = 8
    long_words: int = 2000
    short_rate: float = 20.0
    long_load: float = 0.6  # long prompt tokens per second, as a share of the fleet's prefill capacity
    short_max_tokens: int = 8
    long_max_tokens: int = 16
    policy: str = "predicted_ttft"
    seed: int = 3

    @property
    def long_rate(self) -> float:
        return self.long_load * self.sims * self.prefill_tps / self.long_words


@dataclass
class Sample:
    kind: str  # "short" | "long"
    ttft: float
    engine_ttft: float | None = None


@dataclass
class PhaseResult:
    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    #: Each instance's concurrency limit (discovered) at the end of the phase.
    limits: list[int] = field(default_factory=list)

    def ttfts(self, kind: str) -> list[float]:
        return [s.ttft for s in self.samples if s.kind == kind]

    def engine_ttfts(self, kind: str) -> list[float]:
        return [s.engine_ttft for s in self.samples if s.kind == kind and s.engine_ttft is not None]


def _arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration_s
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _prompt(rng: random.Random, words: int, n: int) -> str:
    return f"{n} " + " ".join(rng.choice(_WORDS) for _ in range(words - 1))


async def _phase(
    name: str, settings: Settings, with_long: bool, progress: Progress, *, turns: bool = False
) -> PhaseResult:
    rng = random.Random(settings.seed)
    shorts = [(t, "short") for t in _arrivals(settings.short_rate, settings.duration_s, rng)]
    longs = [(t, "long") for t in _arrivals(settings.long_rate, settings.duration_s, rng)] if with_long else []
    schedule = sorted(shorts + longs)
    result = PhaseResult(name)
    progress.phase(name, total=len(schedule))
    async with contextlib.AsyncExitStack() as stack:
        base = SimConfig(
            models=(MODEL,),
            prefill_tps=settings.prefill_tps,
            tpot_ms=settings.tpot_ms,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )
        sims = [
            await stack.enter_async_context(SimServer(dataclasses.replace(base, seed=n))) for n in range(settings.sims)
        ]
        config = parse_config(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "usage": {"path": ":memory:"},
                "scrape": {"interval_ms": 100},
                "models": [
                    {
                        "name": MODEL,
                        "routing": {
                            "policy": settings.policy,
                            "predicted_ttft": {"default_prefill_tps": settings.prefill_tps * 2},
                            **({"long_prefill_ms": LONG_PREFILL_MS} if turns else {}),
                        },
                        "instances": [{"url": s.url, "engine": "vllm", "name": f"sim-{n}"} for n, s in enumerate(sims)],
                    }
                ],
            },
            "bench",
        )
        server = await stack.enter_async_context(GatewayServer(config, port=0))
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))

        async def one(n: int, kind: str) -> None:
            words, max_tokens = (
                (settings.short_words, settings.short_max_tokens)
                if kind == "short"
                else (settings.long_words, settings.long_max_tokens)
            )
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": _prompt(rng, words, n)}],
                    "max_tokens": max_tokens,
                    "stream": True,
                }
            )
            start = time.perf_counter()
            first: float | None = None
            try:
                async with session.post(server.url + "/v1/chat/completions", data=body) as resp:
                    rid = resp.headers.get("x-request-id")
                    async for _ in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - start
                    ok = resp.status == 200 and first is not None
            except aiohttp.ClientError:
                ok = False
            progress.advance()
            if not ok or first is None:
                result.errors += 1
                return
            engine: float | None = None
            for sim in sims:
                rec = sim.stats.find(rid) if rid else None
                if rec is not None and rec.first_token_at is not None:
                    engine = rec.first_token_at - rec.started_at
            result.samples.append(Sample(kind, first, engine))

        loop = asyncio.get_running_loop()
        began = loop.time()
        async with asyncio.timeout(settings.duration_s + 60.0), asyncio.TaskGroup() as group:
            for n, (at, kind) in enumerate(schedule):
                delay = began + at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # the open-loop arrival times
                group.create_task(one(n, kind))
        async with session.get(server.url + "/admin/fleet") as resp:
            result.limits = [int(i["max_concurrency"]) for i in (await resp.json())["instances"]]
    return result


async def run(settings: Settings, progress: Progress | None = None) -> list[PhaseResult]:
    progress = progress or Progress.silent()
    return [
        await _phase("short alone", settings, False, progress),
        await _phase("short + long", settings, True, progress),
        await _phase("turns on", settings, True, progress, turns=True),
    ]


def report(phases: list[PhaseResult], settings: Settings) -> str:
    lines = [
        f"{settings.sims} simulators, {settings.prefill_tps:.0f} prefill tokens/s, {settings.max_num_batched_tokens}"
        f" tokens a step; short: {settings.short_words} tokens at {settings.short_rate:.0f}/s, long:"
        f" {settings.long_words} tokens at {settings.long_rate:.1f}/s ({settings.long_load:.0%} of prefill capacity);"
        f" policy {settings.policy}",
        f"{'phase':<14}{'kind':<7}{'n':>6}{'err':>5}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
        f"{'engine p50':>12}{'engine p99':>12}",
    ]
    for p in phases:
        for kind in ("short", "long"):
            t, e = p.ttfts(kind), p.engine_ttfts(kind)
            if not t:
                continue
            lines.append(
                f"{p.name:<14}{kind:<7}{len(t):>6}{p.errors:>5}{percentile(t, 50) * 1000:>13.1f}"
                f"{percentile(t, 99) * 1000:>13.1f}{percentile(e, 50) * 1000:>12.1f}{percentile(e, 99) * 1000:>12.1f}"
            )
    limits = "; ".join(f"{p.name}: {', '.join(map(str, p.limits))}" for p in phases)
    lines.append(f"instances' concurrency limits at the end (engines run {settings.max_num_seqs}): {limits}")
    alone, mixed, turns = (p.ttfts("short") for p in phases)
    if alone and mixed:
        step = settings.max_num_batched_tokens / settings.prefill_tps
        lines.append(
            f"short TTFT with long requests vs alone: p50 {percentile(mixed, 50) / percentile(alone, 50):.2f}x,"
            f" p99 {percentile(mixed, 99) / percentile(alone, 99):.2f}x (one full prefill step: {step * 1000:.0f} ms)"
        )
    if alone and turns:
        lines.append(
            f"the same with long prompts' turns (routing.long_prefill_ms: {LONG_PREFILL_MS}): p50"
            f" {percentile(turns, 50) / percentile(alone, 50):.2f}x,"
            f" p99 {percentile(turns, 99) / percentile(alone, 99):.2f}x"
        )
    long_off, long_on = phases[1].ttfts("long"), phases[2].ttfts("long")
    if long_on and long_off:
        lines.append(
            f"long TTFT with turns vs without: p50 {percentile(long_on, 50) / percentile(long_off, 50):.2f}x,"
            f" p99 {percentile(long_on, 99) / percentile(long_off, 99):.2f}x"
        )
    return "\n".join(lines)
