"""``lockgate sim``: run one simulated engine until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from ..argtypes import tcp_port
from ..runner import run_async
from .config import SimConfig
from .server import SimServer

#: The engine's numeric knobs: option, `SimConfig` field (its default is the option's), type, what it sets.
_KNOBS: tuple[tuple[str, str, type[int] | type[float], str], ...] = (
    ("--seed", "seed", int, "seeds sampled answers (temperature > 0, no seed)"),
    ("--prefill-tps", "prefill_tps", float, "prompt tokens prefilled a second"),
    ("--tpot-ms", "tpot_ms", float, "one decode step, a token each, alone"),
    ("--batch-growth", "batch_growth", float, "how much longer a step takes for each sequence in the batch"),
    ("--max-num-seqs", "max_num_seqs", int, "sequences run at once"),
    ("--max-batched-tokens", "max_num_batched_tokens", int, "tokens a step may take in, prefill chunks included"),
    ("--kv-blocks", "num_kv_blocks", int, "KV-cache blocks"),
    ("--block-size", "block_size", int, "tokens a KV-cache block holds"),
    ("--max-tokens-default", "default_max_tokens", int, "an answer's length when the client sets no limit"),
    ("--max-model-len", "max_model_len", int, "context length, prompt and answer"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=tcp_port, default=8000, help="TCP port (default %(default)s; 0 picks a free one)"
    )
    parser.add_argument("--uds", default=None, help="serve on this unix socket path instead of TCP")
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="served model name (repeatable; default sim-model: name the gateway's model, or set its `served_model`)",
    )
    parser.add_argument("--fast", action="store_true", help="answer at once: no step loop, no delays")
    for flag, field, kind, what in _KNOBS:
        metavar = flag[2:].upper().replace("-", "_")
        parser.add_argument(
            flag,
            dest=field,
            metavar=metavar,
            type=kind,
            default=getattr(d, field),
            help=f"{what} (default %(default)s)",
        )
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate (chain)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's key, if not in --tls-cert")
    parser.add_argument(
        "--fail-after-s",
        type=float,
        default=None,
        help="crash this many seconds after start: streams in flight break, then 503 to everything",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        models=tuple(args.models or ("sim-model",)),
        host=args.host,
        port=args.port,
        uds=args.uds,
        fast=args.fast,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        fail_after_s=args.fail_after_s,
        **{field: getattr(args, field) for _, field, _, _ in _KNOBS},
    )


async def serve(config: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with SimServer(config) as sim:
            where = f"unix:{sim.uds}" if sim.uds else sim.url
            print(f"lockgate sim serving {', '.join(config.models)} on {where}", flush=True)
            await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    run_async(lambda: serve(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lockgate sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
