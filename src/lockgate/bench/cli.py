"""`lockgate bench …` sub-commands."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ..argtypes import non_negative_float, non_negative_int, positive_float, positive_int, share
from ..runner import run_async
from .progress import Progress

#: The exit status of a bench stopped by SIGTERM (128 + 15, as a shell reports it).
TERMINATED = 143


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """`run_async(main)`, stopped by SIGTERM the way Ctrl-C stops it: the coroutine is cancelled, so that the
    engines, gateways and peers a bench started (`overhead.child`) are stopped on the way out instead of being
    left running (a CI job's timeout, `kill`); exit status 143."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        terminated = False

        def terminate() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await main()
        except asyncio.CancelledError:
            if not terminated:
                raise
            task.uncancel()
            return TERMINATED
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return run_async(guarded)


def _overhead(args: argparse.Namespace) -> int:
    from . import overhead

    settings = overhead.Settings(
        modes=args.modes,
        concurrency=args.concurrency,
        stream_concurrency=args.stream_concurrency,
        max_tokens=args.max_tokens,
        chunks=args.chunks,
        rounds=args.rounds,
        generator=args.generator,
        duration_s=args.duration,
        requests=args.requests,
        client=args.client,
        compare=args.compare,
        tpot_ms=args.tpot_ms,
        sampled=args.sampled,
    )

    async def main() -> int:
        for line in overhead.header(settings):
            print(line, flush=True)
        async with Progress("lockgate bench overhead") as progress:
            rows = await overhead.run(settings, progress)
        print(overhead.report(rows))
        return 0 if all(r.errors == 0 for r in rows) else 1

    return _run(main)


def _routing(args: argparse.Namespace) -> int:
    from . import routing
    from .machine import machine

    shape = routing.Shape(rate=args.rate, duration_s=args.duration, seed=args.seeds[0])
    fleet = routing.Fleet(instances=args.instances, block_size=args.block_size, small_share=args.small_share)

    async def main() -> int:
        replicas = (1, args.replicas) if args.replicas > 1 else (1,)
        print(machine(), flush=True)
        async with Progress("lockgate bench routing") as progress:
            results = await routing.run(
                args.families,
                args.configs,
                args.policies,
                shape,
                fleet,
                args.seeds,
                progress,
                replicas,
                repeat=not args.no_repeat,
            )
        print(routing.report(results))
        checks = routing.verdicts(results)
        if args.index_prompts:
            used, bound, blocks = routing.index_memory_check(args.index_prompts, args.index_bytes)
            print(f"prefix index: {args.index_prompts} distinct prompts -> {blocks} blocks held, {used} bytes measured")
            checks.append((f"prefix index within its {bound} bytes", "PASS" if used <= bound else "MISS"))
        for text, status in checks:
            print(f"{status:<5} {text}")
        print(f"{machine()} (at the end)")
        # Errors are expected only where an instance crashes (its streams in flight break).
        return 0 if all(r.errors == 0 for r in results if r.config != "failing") else 1

    return _run(main)


def _priority(args: argparse.Namespace) -> int:
    from . import priority

    settings = priority.Settings(
        duration_s=args.duration,
        sims=args.sims,
        slots_per_sim=args.slots,
        tpot_ms=args.tpot_ms,
        max_tokens=args.max_tokens,
        p0_max_tokens=args.p0_max_tokens,
        seed=args.seed,
        p0_rate=args.p0_rate,
        p2_factor=args.p2_factor,
        p1_factor=args.p1_factor,
        headroom=args.headroom,
        max_concurrency=args.max_concurrency,
        routing=args.routing,
        preemption=not args.no_preemption,
        preemptible=tuple(c for c in args.preemptible.split(",") if c),
        trace=args.trace,
        deterministic=args.deterministic,
    )

    async def main() -> int:
        async with Progress("lockgate bench priority") as progress:
            phases, info = await priority.run(settings, progress)
        print(priority.report(phases, info, settings))
        if settings.trace:
            print(priority.diagnose(phases))
        return 0

    return _run(main)


def _hol(args: argparse.Namespace) -> int:
    from . import hol

    settings = hol.Settings(
        duration_s=args.duration,
        sims=args.sims,
        prefill_tps=args.prefill_tps,
        max_num_batched_tokens=args.max_batched_tokens,
        short_words=args.short_tokens,
        long_words=args.long_tokens,
        short_rate=args.short_rate,
        long_load=args.long_load,
        policy=args.policy,
        seed=args.seed,
    )

    async def main() -> int:
        async with Progress("lockgate bench hol") as progress:
            phases = await hol.run(settings, progress)
        print(hol.report(phases, settings))
        return 0 if all(p.errors == 0 for p in phases) else 1

    return _run(main)


def _capacity(args: argparse.Namespace) -> int:
    from . import capacity

    settings = capacity.Settings(
        large_seqs=args.large_seqs,
        streams=args.streams,
        max_tokens=args.max_tokens,
        requests=args.requests,
        rounds=args.rounds,
        small_seqs=args.small_seqs,
        settle_s=args.settle,
    )

    async def main() -> int:
        async with Progress("lockgate bench capacity") as progress:
            large = await capacity.run_large(settings, progress) if "large" in args.modes else None
            small = await capacity.run_small(settings, progress) if "small" in args.modes else None
        print(capacity.report(large, small, settings))
        return 0 if capacity.passed(large, small, settings) else 1

    return _run(main)


def _cancel(args: argparse.Namespace) -> int:
    from . import cancel

    async def main() -> int:
        async with Progress("lockgate bench cancel") as progress:
            results = await cancel.run(args.trials, args.tpot_ms, progress)
        print(cancel.report(results, args.target_ms))
        return 0

    return _run(main)


def _inprocess(args: argparse.Namespace) -> int:
    from . import inprocess

    async def main() -> int:
        async with Progress("lockgate bench inprocess") as progress:
            result = await inprocess.run(
                args.requests,
                args.warmup,
                args.concurrency,
                args.target,
                progress,
                stream=args.stream,
                instances=args.instances,
                routing=args.routing,
                paced=args.paced,
                deterministic=args.deterministic,
                tokens=args.tokens,
                usage=args.usage,
            )
        print(inprocess.report(result))
        return 0 if result.ok == result.requests else 1

    return _run(main)


def _dedup(args: argparse.Namespace) -> int:
    from . import dedup

    async def main() -> int:
        async with Progress("lockgate bench dedup") as progress:
            result = await dedup.run(
                windows=args.windows,
                burst=args.burst,
                dup_share=args.dup_share,
                stream_share=args.stream_share,
                max_tokens=args.max_tokens,
                spread_ms=args.spread_ms,
                tpot_ms=args.tpot_ms,
                max_concurrency=args.max_concurrency,
                progress=progress,
            )
        print(dedup.report(result))
        return 0 if result.errors == 0 else 1

    return _run(main)


def _chaos(args: argparse.Namespace) -> int:
    from . import chaos

    settings = chaos.Settings(
        requests=args.requests,
        duration_s=args.duration,
        concurrency=args.concurrency,
        engines=args.engines,
        reset=args.reset,
        stall=args.stall,
        disconnect=args.disconnect,
        slow=args.slow,
        repeat_share=args.repeat,
        max_tokens=args.max_tokens,
        seed=args.seed,
        quiesce_s=args.quiesce,
        rss_slack_mb=args.rss_slack_mb,
        fd_slack=args.fd_slack,
    )

    async def main() -> int:
        result = await chaos.run(settings)
        print(chaos.report(result))
        return 0 if result.ok else 1

    return _run(main)


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _overload(args: argparse.Namespace) -> int:
    from . import overload

    settings = overload.Settings(
        levels=args.levels,
        duration_s=args.duration,
        slots=args.slots,
        tpot_ms=args.tpot_ms,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        scrape=args.scrape,
    )

    async def main() -> int:
        async with Progress("lockgate bench overload") as progress:
            result = await overload.run(settings, progress)
        print(overload.report(result))
        _write(Path(args.svg), overload.svg(result))
        print(f"curve written to {args.svg}")
        return 0 if all(level.failed == 0 for level in result.levels) else 1

    return _run(main)


def _soak(args: argparse.Namespace) -> int:
    from . import soak

    settings = soak.Settings(
        duration_s=args.duration,
        interval_s=args.interval,
        warmup_s=args.warmup,
        concurrency=args.concurrency,
        rss_tolerance_mb=args.rss_tolerance_mb,
        fd_tolerance=args.fd_tolerance,
    )

    async def main() -> int:
        async with Progress("lockgate bench soak") as progress:
            result = await soak.run(settings, progress)
        print(soak.report(result))
        return 0 if result.passed() else 1

    return _run(main)


def peer_spec(text: str) -> str:
    """A `--compare` value: a URL, or a command with a `{port}` placeholder whose program exists (a missing one
    failed later with `FileNotFoundError(2, ...)`, its name nowhere)."""
    from .peer import Peer

    try:
        peer = Peer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not peer.is_url and shutil.which(peer.program) is None:
        raise argparse.ArgumentTypeError(f"no such program: {peer.program!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    over = benches.add_parser(
        "overhead", help="gateway vs direct (and peers): throughput, latency, CPU per request and per chunk"
    )
    over.add_argument("--concurrency", type=positive_int, nargs="+", default=[64], help="connections, non-streaming")
    over.add_argument("--stream-concurrency", type=positive_int, nargs="+", default=[256], help="concurrent streams")
    over.add_argument(
        "--generator",
        choices=["auto", "wrk", "builtin"],
        default="auto",
        help="load generator: wrk (an external process) when installed, else the built-in client",
    )
    over.add_argument(
        "--duration", type=positive_int, default=5, help="seconds per target and round (wrk: whole seconds)"
    )
    over.add_argument(
        "--requests", type=positive_int, default=5000, help="requests per target and round (built-in client)"
    )
    over.add_argument("--rounds", type=positive_int, default=3, help="rounds of direct, gateway, peers per measurement")
    over.add_argument(
        "--client",
        choices=["lean", "aiohttp"],
        default="lean",
        help="the built-in generator's HTTP client: lockgate's lean pool (~40 us/request) or aiohttp's (~90)",
    )
    over.add_argument("--max-tokens", type=positive_int, default=16, help="tokens of a non-streaming answer")
    over.add_argument("--chunks", type=positive_int, default=20, help="token chunks of each stream")
    over.add_argument(
        "--compare",
        type=peer_spec,
        action="append",
        default=[],
        metavar="URL_OR_COMMAND",
        help="a peer router measured in the same rounds: a URL, or a command started per round with {engine} "
        "and {port} replaced (e.g. 'vllm-router --worker-urls {engine} --port {port} --policy round_robin')",
    )
    over.add_argument("--modes", nargs="+", choices=["nonstream", "stream"], default=["nonstream", "stream"])
    over.add_argument(
        "--tpot-ms",
        type=non_negative_float,
        default=None,
        help="the engine writes each token this long after the last, so each chunk is a network read of its own "
        "(as from a real engine); default: sim --fast, a whole stream in one write",
    )
    over.add_argument(
        "--sampled",
        action="store_true",
        help="requests at temperature 1 (the direct path, not eligible for de-duplication); default temperature 0",
    )
    over.set_defaults(func=_overhead)
    inproc = benches.add_parser(
        "inprocess",
        help="client, gateway and a canned engine in one process: CPU per request the gateway adds "
        "(exact under valgrind --tool=callgrind)",
    )
    inproc.add_argument("--requests", type=positive_int, default=10_000)
    inproc.add_argument("--warmup", type=non_negative_int, default=1000)
    inproc.add_argument("--concurrency", type=positive_int, default=64)
    inproc.add_argument(
        "--target", choices=["both", "gateway", "direct"], default="both", help="what to measure (one for callgrind)"
    )
    inproc.add_argument("--stream", action="store_true", help="streamed answers (19 events a request)")
    inproc.add_argument(
        "--tokens",
        type=positive_int,
        default=16,
        help="token chunks of a streamed answer (two sizes give the exact cost of a chunk under callgrind)",
    )
    inproc.add_argument(
        "--no-usage",
        dest="usage",
        action="store_false",
        help="streams do not ask for usage: the engine's chunks pass through unchanged (as bench overhead's do)",
    )
    inproc.add_argument(
        "--paced",
        action="store_true",
        help="with --stream: the engine writes its events one loop iteration apart (a network read each), not at once",
    )
    inproc.add_argument(
        "--instances", type=positive_int, default=1, help="the canned engine listed this many times (routing chooses)"
    )
    inproc.add_argument("--routing", default="least_load", help="the model's routing policy")
    inproc.add_argument(
        "--deterministic",
        action="store_true",
        help="temperature 0, each prompt unique: every request leads a de-duplication flight (default: direct path)",
    )
    inproc.set_defaults(func=_inprocess)
    from .routing import CONFIGS as routing_configs
    from .routing import FAMILIES as routing_families
    from .routing import POLICIES

    route = benches.add_parser(
        "routing", help="each routing policy on workload families x simulator fleets: hit rate, TTFT, verdicts"
    )
    route.add_argument("--families", nargs="+", choices=routing_families, default=list(routing_families))
    route.add_argument("--configs", nargs="+", choices=routing_configs, default=list(routing_configs))
    route.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    route.add_argument(
        "--seeds", type=int, nargs="+", default=[7, 8, 9], help="one run per seed; rows show medians and pooled p99s"
    )
    route.add_argument("--rate", type=positive_float, default=65.0, help="mean requests per second (Poisson)")
    route.add_argument("--duration", type=positive_float, default=5.0, help="seconds of trace per run")
    route.add_argument("--instances", type=positive_int, default=4)
    route.add_argument("--block-size", type=positive_int, default=16, help="the simulators' KV block size (tokens)")
    route.add_argument(
        "--small-share",
        type=positive_float,
        default=0.25,
        help="share of the working set one cache holds in small/slow/failing",
    )
    route.add_argument("--no-repeat", action="store_true", help="do not run the default twice (no noise estimate)")
    route.add_argument(
        "--replicas", type=positive_int, default=1, help="also run N central replicas + sidecars through a local etcd"
    )
    route.add_argument(
        "--index-prompts", type=non_negative_int, default=1_000_000, help="0 skips the index memory check"
    )
    route.add_argument("--index-bytes", type=positive_int, default=8 * 1024 * 1024)
    route.set_defaults(func=_routing)
    prio = benches.add_parser("priority", help="P0 TTFT under a P2 flood, P2 progress, shares, rejections")
    prio.add_argument("--duration", type=positive_float, default=8.0, help="seconds per phase (three phases)")
    prio.add_argument("--sims", type=positive_int, default=2)
    prio.add_argument("--slots", type=positive_int, default=4, help="sequence slots per simulator")
    prio.add_argument("--tpot-ms", type=non_negative_float, default=10.0, help="the simulators' time per output token")
    prio.add_argument(
        "--max-tokens", type=positive_int, default=24, help="answer length (of P0 too unless --p0-max-tokens)"
    )
    prio.add_argument(
        "--p0-max-tokens", type=positive_int, default=None, help="answer length of P0 (default: --max-tokens)"
    )
    prio.add_argument("--seed", type=int, default=1, help="seed of the arrival processes")
    prio.add_argument("--p0-rate", type=positive_float, default=4.0, help="P0 requests per second")
    prio.add_argument(
        "--p2-factor", type=positive_float, default=2.0, help="P2 arrival rate, times the fleet's capacity"
    )
    prio.add_argument(
        "--p1-factor", type=non_negative_float, default=1.0, help="P1 arrival rate, times the fleet's capacity"
    )
    prio.add_argument(
        "--headroom", type=non_negative_float, default=None, help="scheduling.strict_headroom (default: the config's)"
    )
    prio.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="instances' max_concurrency (default: discovered)"
    )
    prio.add_argument(
        "--routing", choices=POLICIES, default=None, help="the model's routing policy (default: the config's default)"
    )
    prio.add_argument("--no-preemption", action="store_true", help="scheduling.preemption.enabled: false")
    prio.add_argument("--preemptible", default="", help="classes to mark preemptible, e.g. P1,P2 (default: P2)")
    prio.add_argument(
        "--trace", action="store_true", help="sample engine queues and limits; explain the slowest P0 requests"
    )
    prio.add_argument(
        "--deterministic",
        action="store_true",
        help="the floods' requests at temperature 0 (each prompt unique): served by de-duplication flights",
    )
    prio.set_defaults(func=_priority)
    hol = benches.add_parser("hol", help="short requests behind long ones in one class: short TTFT, mixed vs alone")
    hol.add_argument("--duration", type=positive_float, default=5.0, help="seconds per phase (three phases)")
    hol.add_argument("--sims", type=positive_int, default=2)
    hol.add_argument("--prefill-tps", type=positive_float, default=8000.0)
    hol.add_argument("--max-batched-tokens", type=positive_int, default=2048, help="the simulators' tokens per step")
    hol.add_argument("--short-tokens", type=positive_int, default=8)
    hol.add_argument("--long-tokens", type=positive_int, default=2000)
    hol.add_argument("--short-rate", type=positive_float, default=20.0, help="short requests per second")
    hol.add_argument(
        "--long-load", type=positive_float, default=0.6, help="long prompts' share of the prefill capacity"
    )
    hol.add_argument("--policy", choices=POLICIES, default="predicted_ttft")
    hol.add_argument("--seed", type=int, default=3)
    hol.set_defaults(func=_hol)
    cap = benches.add_parser(
        "capacity", help="no max_concurrency: 256 streams to an engine of 256 vs direct; the limit an engine of 8 gets"
    )
    cap.add_argument("--modes", nargs="+", choices=["large", "small"], default=["large", "small"])
    cap.add_argument("--large-seqs", type=positive_int, default=256, help="sequences the large engine runs at once")
    cap.add_argument("--streams", type=positive_int, default=256, help="concurrent clients against the large engine")
    cap.add_argument("--max-tokens", type=positive_int, default=20, help="chunks per stream")
    cap.add_argument("--requests", type=positive_int, default=1024, help="streams per round and target")
    cap.add_argument("--rounds", type=positive_int, default=2)
    cap.add_argument("--small-seqs", type=positive_int, default=8, help="sequences the small engine runs at once")
    cap.add_argument("--settle", type=positive_float, default=6.0, help="seconds of load on the small engine")
    cap.set_defaults(func=_capacity)
    dd = benches.add_parser("dedup", help="burst of partly duplicate requests: engine calls, coalescing, latency")
    dd.add_argument("--windows", type=positive_int, default=5)
    dd.add_argument("--burst", type=positive_int, default=200, help="requests per window")
    dd.add_argument("--dup-share", type=share, default=0.8, help="share of requests that repeat another")
    dd.add_argument("--stream-share", type=share, default=0.5)
    dd.add_argument("--max-tokens", type=positive_int, default=32)
    dd.add_argument("--spread-ms", type=non_negative_float, default=200.0, help="arrivals spread over this much time")
    dd.add_argument(
        "--tpot-ms", type=non_negative_float, default=5.0, help="the simulated engine's time per output token"
    )
    dd.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=1024,
        help="the gateway's slots for the engine (fewer than a window's distinct prompts: leaders queue, while "
        "cache hits and joiners take no slot)",
    )
    dd.set_defaults(func=_dedup)
    cancel = benches.add_parser(
        "cancel", help="client disconnect -> engine sees its connection closed, p50/p99 per phase"
    )
    cancel.add_argument("--trials", type=positive_int, default=200, help="trials per phase")
    cancel.add_argument("--tpot-ms", type=positive_float, default=10.0, help="the simulated engine's time per token")
    cancel.add_argument("--target-ms", type=positive_float, default=5.0, help="the p99 target to report against")
    cancel.set_defaults(func=_cancel)
    from .chaos import Settings as ChaosSettings

    d = ChaosSettings()
    ch = benches.add_parser(
        "chaos",
        help="faults (upstream resets, client disconnects, slow readers) then checks: quiescence, one usage record "
        "per accepted request, RSS and fds back near their baseline; exits 1 on a violation",
    )
    ch.add_argument("--requests", type=positive_int, default=d.requests)
    ch.add_argument("--duration", type=positive_float, default=None, help="run this many seconds instead (a soak)")
    ch.add_argument("--concurrency", type=positive_int, default=d.concurrency)
    ch.add_argument("--engines", type=positive_int, default=d.engines)
    ch.add_argument("--reset", type=share, default=d.reset, help="share of engine requests reset by the proxies")
    ch.add_argument("--stall", type=share, default=d.stall, help="share of engine requests frozen by the proxies")
    ch.add_argument("--disconnect", type=share, default=d.disconnect, help="share of clients leaving early")
    ch.add_argument("--slow", type=share, default=d.slow, help="share of (staying) clients reading slowly")
    ch.add_argument("--repeat", type=share, default=d.repeat_share, help="share of deterministic repeats (dedup)")
    ch.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    ch.add_argument("--seed", type=int, default=d.seed)
    ch.add_argument("--quiesce", type=positive_float, default=d.quiesce_s, help="seconds allowed to become quiescent")
    ch.add_argument("--rss-slack-mb", type=non_negative_float, default=d.rss_slack_mb)
    ch.add_argument("--fd-slack", type=non_negative_int, default=d.fd_slack)
    ch.set_defaults(func=_chaos)
    over_load = benches.add_parser(
        "overload", help="offered load swept past the engine's capacity: throughput and p99, drawn as an SVG"
    )
    over_load.add_argument(
        "--levels",
        type=positive_float,
        nargs="+",
        default=[0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5],
        help="x capacity",
    )
    over_load.add_argument("--duration", type=positive_float, default=5.0, help="seconds per level")
    over_load.add_argument(
        "--slots", type=positive_int, default=8, help="the engine's sequence slots (= max_concurrency)"
    )
    over_load.add_argument("--tpot-ms", type=positive_float, default=10.0)
    over_load.add_argument("--max-tokens", type=positive_int, default=8)
    over_load.add_argument("--max-queue", type=non_negative_int, default=0, help="each priority class's max_queue")
    over_load.add_argument("--svg", default="overload.svg", help="where to write the curve")
    over_load.add_argument(
        "--scrape", action="store_true", help="scrape the engine (its concurrency limit discovered, not fixed)"
    )
    over_load.set_defaults(func=_overload)
    soak = benches.add_parser("soak", help="mixed load for a long time: RSS and open fds must stay flat")
    soak.add_argument("--duration", type=positive_float, default=3600.0, help="seconds")
    soak.add_argument("--interval", type=positive_float, default=60.0, help="seconds between samples")
    soak.add_argument(
        "--warmup", type=non_negative_float, default=None, help="seconds (default: min(300, duration / 3))"
    )
    soak.add_argument("--concurrency", type=positive_int, default=16)
    soak.add_argument(
        "--rss-tolerance-mb", type=non_negative_float, default=16.0, help="allowed RSS growth after warm-up"
    )
    soak.add_argument(
        "--fd-tolerance", type=non_negative_int, default=16, help="allowed growth of open fds after warm-up"
    )
    soak.set_defaults(func=_soak)
