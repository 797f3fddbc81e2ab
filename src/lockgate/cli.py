"""The `lockgate` command: serve, sim, bench, check-config, hash-key."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a coroutine on uvloop where available."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


def _serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .embedded import default_config
    from .server import serve

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.port is not None or args.host is not None:
        listen = config.listen.model_copy(
            update={k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None}
        )
        config = config.model_copy(update={"listen": listen})
    return run_async(lambda: serve(config, announce=lambda text: print(text, flush=True)))


def _check_config(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{args.config}: OK ({len(config.models)} model(s))")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    from .admission.tenants import hash_key

    # Read from stdin by default so the key stays out of shell history and process listings.
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("no key given (pass it on stdin)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockgate", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the gateway (with no --config: in front of an embedded simulated fleet)"
    )
    serve.add_argument("--config", "-c", help="YAML configuration file")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("config")
    check.set_defaults(func=_check_config)

    hashk = commands.add_parser(
        "hash-key", help="print the sha256 digest of an API key for tenants[].keys (key read from stdin)"
    )
    hashk.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    hashk.set_defaults(func=_hash_key)

    from .sim import cli as sim_cli

    sim = commands.add_parser("sim", help="run an engine simulator that behaves like a vLLM instance")
    sim_cli.add_arguments(sim)
    sim.set_defaults(func=sim_cli.run)

    from .bench import cli as bench_cli

    bench = commands.add_parser("bench", help="benchmarks (ratios against a baseline run in the same process)")
    bench_cli.add_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
