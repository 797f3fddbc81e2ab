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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    over = benches.add_parser("overhead", help="gateway vs direct: throughput, latency, CPU per request")
    over.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    over.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    over.add_argument("--max-tokens", type=int, default=16)
    over.add_argument("--modes", nargs="+", choices=["nonstream", "stream"], default=["nonstream", "stream"])
    over.set_defaults(func=_overhead)
