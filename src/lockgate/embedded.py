"""The embedded default: simulated engines started inside the gateway process.

`lockgate serve` with no configuration runs `default_config()`: two models on a small fleet of
simulators (one of them serves both models), so a new user sees routing and metrics at once with no
engine installed. Any config may add a `simulate:` section; each simulator becomes a `vllm` instance
of every model it serves.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .config import Config, InstanceConfig, ModelConfig, SimFleetEntry, parse_config

if TYPE_CHECKING:
    from .sim import SimConfig

DEFAULT_MODELS = ("demo-model", "demo-model-large")


def default_config(port: int = 8080) -> Config:
    return parse_config(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "usage": {"path": "lockgate-usage.sqlite3"},
            "scheduling": {"engine_priority": True},
            "simulate": [
                {"models": ["demo-model"], "count": 2},
                {"models": ["demo-model", "demo-model-large"], "count": 1},
                {"models": ["demo-model-large"], "count": 1, "prefill_tps": 4000, "tpot_ms": 20},
            ],
        },
        "embedded default",
    )


async def start_simulators(config: Config, stack: contextlib.AsyncExitStack) -> Config:
    """Start the config's simulators (owned by `stack`) and return the config with their instances."""
    if not config.simulate:
        return config
    from .sim import SimServer  # the simulator is only imported when used

    extra: dict[str, list[InstanceConfig]] = {}
    number = 0
    for entry in config.simulate:
        for _ in range(entry.count):
            number += 1
            sim = await stack.enter_async_context(SimServer(_sim_config(entry, seed=number)))
            for model in entry.models:
                extra.setdefault(model, []).append(
                    InstanceConfig(
                        url=sim.url,
                        engine="vllm",
                        name=f"sim-{number}",
                        max_concurrency=entry.max_num_seqs,
                    )
                )
    models = [m.model_copy(update={"instances": [*m.instances, *extra.pop(m.name, [])]}) for m in config.models]
    models += [ModelConfig(name=name, instances=instances) for name, instances in extra.items()]
    return config.model_copy(update={"models": models, "simulate": []})


def _sim_config(entry: SimFleetEntry, *, seed: int) -> SimConfig:
    from .sim import SimConfig

    return SimConfig(
        models=tuple(entry.models),
        port=0,
        fast=entry.fast,
        seed=seed,
        prefill_tps=entry.prefill_tps,
        tpot_ms=entry.tpot_ms,
        max_num_seqs=entry.max_num_seqs,
        num_kv_blocks=entry.kv_blocks,
    )
