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
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seeds sampled answers (temperature > 0, no seed; default %(default)s)"
    )
    parser.add_argument(
        "--prefill-tps",
        type=float,
        default=d.prefill_tps,
        help="prompt tokens prefilled a second (default %(default)s)",
    )
    parser.add_argument(
        "--tpot-ms", type=float, default=d.tpot_ms, help="one decode step, a token each, alone (default %(default)s)"
    )
    parser.add_argument(
        "--batch-growth",
        type=float,
        default=d.batch_growth,
        help="how much longer a step takes for each sequence in the batch (default %(default)s: 2%%)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences run at once (default %(default)s)"
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens a step may take in, prefill chunks included (default %(default)s)",
    )
    parser.add_argument("--kv-blocks", type=int, default=d.num_kv_blocks, help="KV-cache blocks (default %(default)s)")
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens a KV-cache block holds (default %(default)s)"
    )
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=d.default_max_tokens,
        help="an answer's length when the client sets no limit (a natural end; default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="context length, prompt and answer (default %(default)s)",
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
        seed=args.seed,
        prefill_tps=args.prefill_tps,
        tpot_ms=args.tpot_ms,
        batch_growth=args.batch_growth,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        default_max_tokens=args.max_tokens_default,
        max_model_len=args.max_model_len,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        fail_after_s=args.fail_after_s,
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
