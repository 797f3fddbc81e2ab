"""The `lockgate` command: serve, sidecar, sim, bench, slo, check-config, hash-key; `--version`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Literal

from .argtypes import tcp_port
from .runner import run_async


def _serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .embedded import default_config
    from .server import StartupError, serve

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as exc:
        print(f"lockgate: invalid configuration: {exc}", file=sys.stderr)
        return 2
    role: Literal["central", "sidecar"] = "sidecar" if getattr(args, "role", None) == "sidecar" else "central"
    if role == "sidecar" and config.cluster is None:
        print(
            f"lockgate: {args.config}: a sidecar needs a `cluster:` section (etcd endpoints, cluster name)",
            file=sys.stderr,
        )
        return 2
    workers = getattr(args, "workers", 1)
    if workers > 1:
        from .workers import WorkersError, run_workers

        try:
            return run_workers(config, args.config, workers, host=args.host, port=args.port, log_level=args.log_level)
        except WorkersError as exc:
            print(f"lockgate: {exc}", file=sys.stderr)
            return 2
    worker = getattr(args, "worker", None)
    workers = usage_path = None
    if worker is not None:
        from . import workerset
        from .workers import follow_supervisor

        follow_supervisor()
        workers = workerset.WorkerSet.from_env(worker)
        if config.usage.path != ":memory:":
            usage_path = workerset.usage_path(config.usage.path, worker)
    try:
        return run_async(
            lambda: serve(
                config,
                config_path=args.config,
                host=args.host,
                port=args.port,
                announce=lambda text: print(text, flush=True),
                role=role,
                usage_path=usage_path,
                reuse_port=worker is not None,
                workers=workers,
            )
        )
    except StartupError as exc:
        if args.debug:
            raise
        print(f"lockgate: cannot start: {exc}", file=sys.stderr)
        return 1


def _check_config(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .summary import describe_served

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"lockgate: invalid configuration: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: OK; it serves:")
    for line in describe_served(config):
        print(f"  {line}")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    from .admission.tenants import hash_key

    # Read from stdin by default so the key stays out of shell history and process listings.
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("lockgate: no key given (pass it on stdin)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lockgate {_version()}")
    level_help = (
        "logging level (default WARNING; ERROR for bench, whose fleets fail on purpose; DEBUG shows tracebacks)"
    )
    parser.add_argument("--log-level", default=None, help=level_help)
    # Also after the command (`lockgate serve --log-level debug`): absent there, it leaves the value given before.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=level_help)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", parents=[common], help="run the gateway (with no --config: in front of an embedded simulated fleet)"
    )
    serve.add_argument("--config", "-c", help="YAML configuration file")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=tcp_port, help="override listen.port")
    serve.add_argument(
        "--workers", type=int, default=1, help="N processes sharing the port, replicas of the config's cluster"
    )
    serve.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by --workers for each child
    serve.set_defaults(func=_serve)

    sidecar = commands.add_parser(
        "sidecar",
        parents=[common],
        help="run the gateway of one engine node and publish its engines to etcd (`cluster:` section)",
    )
    sidecar.add_argument("--config", "-c", required=True, help="YAML configuration file with a `cluster:` section")
    sidecar.add_argument("--host", help="override listen.host")
    sidecar.add_argument("--port", type=tcp_port, help="override listen.port")
    sidecar.set_defaults(func=_serve, role="sidecar")

    check = commands.add_parser("check-config", parents=[common], help="validate a configuration file and exit")
    check.add_argument("config", help="the YAML configuration file to check (exit 2 and the reasons if it is invalid)")
    check.set_defaults(func=_check_config)

    hashk = commands.add_parser(
        "hash-key",
        parents=[common],
        help="print the sha256 digest of an API key for tenants[].keys (key read from stdin)",
    )
    hashk.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    hashk.set_defaults(func=_hash_key)

    from .sim import cli as sim_cli

    sim = commands.add_parser("sim", parents=[common], help="run an engine simulator that behaves like a vLLM instance")
    sim_cli.add_arguments(sim)
    sim.set_defaults(func=sim_cli.run)

    from .slo import cli as slo_cli

    slo = commands.add_parser(
        "slo",
        parents=[common],
        help="evaluate the SLOs (usage records or a running gateway), or write Prometheus rules for them",
        epilog=f"Exit status: {slo_cli.EXIT_BURNING} while an objective burns, 0 otherwise (met or unknown).",
    )
    slo_cli.add_arguments(slo)

    from .bench import cli as bench_cli

    bench = commands.add_parser(
        "bench", parents=[common], help="benchmarks (ratios against a baseline run in the same process)"
    )
    bench_cli.add_arguments(bench)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lockgate")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
        return "unknown (not installed)"


def log_level(command: str, given: str | None) -> str:
    """The logging level: the one given, else WARNING; ERROR for `bench`, whose in-process gateways would otherwise
    report every failure a bench injects on purpose (the failing fleet's ejections) between its progress lines."""
    if given is not None:
        return given.upper()
    return "ERROR" if command == "bench" else "WARNING"


def main(argv: list[str] | None = None) -> int:
    """Run a command. A failure prints one line naming what failed and why (exit status 1, 2 for a
    configuration error); `--log-level debug` shows the traceback instead."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = log_level(args.command, args.log_level)
    if not isinstance(logging.getLevelName(level), int):
        parser.error(f"--log-level: unknown level {args.log_level!r} (DEBUG, INFO, WARNING, ERROR)")
    args.debug = level == "DEBUG"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"lockgate: {args.command} failed: {exc!r} (--log-level debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
