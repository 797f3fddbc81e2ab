"""`lockgate bench …` sub-commands."""

from __future__ import annotations

import argparse


def _overhead(args: argparse.Namespace) -> int:
    from ..cli import run_async
    from . import overhead

    async def main() -> int:
        rows = await overhead.run(args.concurrency, args.requests, args.max_tokens, args.modes)
        print(overhead.report(rows))
        return 0 if all(r.result.errors == 0 for r in rows) else 1

    return run_async(main)


def _cancel(args: argparse.Namespace) -> int:
    from ..cli import run_async
    from . import cancel

    async def main() -> int:
        results = await cancel.run(args.trials, args.tpot_ms)
        print(cancel.report(results, args.target_ms))
        return 0

    return run_async(main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    over = benches.add_parser("overhead", help="gateway vs direct: throughput, latency, CPU per request")
    over.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    over.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    over.add_argument("--max-tokens", type=int, default=16)
    over.add_argument("--modes", nargs="+", choices=["nonstream", "stream"], default=["nonstream", "stream"])
    over.set_defaults(func=_overhead)
    cancel = benches.add_parser(
        "cancel", help="client disconnect -> engine sees its connection closed, p50/p99 per phase"
    )
    cancel.add_argument("--trials", type=int, default=200, help="trials per phase")
    cancel.add_argument("--tpot-ms", type=float, default=10.0, help="the simulated engine's time per token")
    cancel.add_argument("--target-ms", type=float, default=5.0, help="the p99 target to report against")
    cancel.set_defaults(func=_cancel)
