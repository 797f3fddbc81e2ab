"""The embedded default: simulated engines started inside the gateway process.

`lockgate serve` with no configuration runs `default_config()`: two models on a small fleet of
simulators (one of them serves both models), so a new user sees routing and metrics at once with no
engine installed. Any config may add a `simulate:` section; each simulator becomes a `vllm` instance
(named `sim-N`) of every model it serves, after the instances the model lists under `models:`. A model
only simulators serve needs no `models:` entry; one listed there (with or without `instances`) takes
its routing, de-duplication and timeouts from that entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .config import Config, InstanceConfig, ModelConfig, SimFleetEntry, parse_config

if TYPE_CHECKING:
    from .sim import SimConfig


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


def simulator_names(config: Config) -> list[tuple[str, SimFleetEntry]]:
    """Each simulator the config's `simulate:` section starts, with its instance name (pure)."""
    names: list[tuple[str, SimFleetEntry]] = []
    for entry in config.simulate:
        for _ in range(entry.count):
            names.append((f"sim-{len(names) + 1}", entry))
    return names


def simulated_instances(config: Config, urls: Mapping[str, str]) -> dict[str, list[InstanceConfig]]:
    """Model name -> the instances its simulators add (pure), given each simulator's URL by name."""
    extra: dict[str, list[InstanceConfig]] = {}
    for name, entry in simulator_names(config):
        for model in entry.models:
            extra.setdefault(model, []).append(
                InstanceConfig(url=urls[name], engine="vllm", name=name, max_concurrency=entry.max_num_seqs)
            )
    return extra


def with_instances(config: Config, extra: Mapping[str, list[InstanceConfig]]) -> Config:
    """The config as served: simulated instances added to the models they serve (after the listed
    ones), models only simulators serve added with default settings, and `simulate` emptied (pure)."""
    if not config.simulate:
        return config
    models = [m.model_copy(update={"instances": [*m.instances, *extra.get(m.name, [])]}) for m in config.models]
    listed = {m.name for m in config.models}
    models += [ModelConfig(name=name, instances=instances) for name, instances in extra.items() if name not in listed]
    return config.model_copy(update={"models": models, "simulate": []})


async def start_simulators(config: Config, stack: contextlib.AsyncExitStack) -> dict[str, list[InstanceConfig]]:
    """Start the config's simulators (owned by `stack`); returns the instances they add, by model
    (see `with_instances`)."""
    if not config.simulate:
        return {}
    from .sim import SimServer  # the simulator is only imported when used

    urls: dict[str, str] = {}
    for number, (name, entry) in enumerate(simulator_names(config), start=1):
        sim = await stack.enter_async_context(SimServer(_sim_config(entry, seed=number)))
        urls[name] = sim.url
    return simulated_instances(config, urls)


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
