"""Reloading the configuration file without dropping traffic (SIGHUP, `POST /admin/reload`).

`Reloader.reload()` re-reads the file the gateway was started with, validates it, works out what the
gateway can apply (`config_diff.plan_reload`, `diff_configs`: pure) and hands the result to
`Gateway.reconfigure()`, which swaps it in synchronously. A file that cannot be used raises
`ConfigError` with the reason, is logged, and changes nothing. Reloads run one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from .config import Config, ConfigError, InstanceConfig, load_config
from .config_diff import ConfigDiff, diff_configs, plan_reload

log = logging.getLogger(__name__)


class Reconfigurable(Protocol):
    """What a reload changes (`gateway.Gateway`): the configuration it serves, swapped in synchronously."""

    @property
    def config(self) -> Config: ...

    def reconfigure(self, config: Config, diff: ConfigDiff) -> None: ...


class Reloader:
    def __init__(
        self,
        path: str | Path,
        file_config: Config,
        gateway: Reconfigurable,
        simulated: Mapping[str, list[InstanceConfig]],
    ) -> None:
        self.path = Path(path)
        #: The file as last applied (before simulators and command-line overrides).
        self._file_config = file_config
        self._gateway = gateway
        self._simulated = simulated
        self._lock = asyncio.Lock()

    async def reload(self) -> ConfigDiff:
        """Apply the file as it is now; raises `ConfigError` (nothing changed) if it cannot be used."""
        async with self._lock:
            try:
                new_file = await asyncio.to_thread(load_config, self.path)
                plan = plan_reload(self._file_config, new_file, self._gateway.config, self._simulated)
            except ConfigError as exc:
                log.error("reload rejected; the running configuration stays: %s", exc)
                raise
            diff = diff_configs(self._gateway.config, plan.served, plan.restart_required)
            self._gateway.reconfigure(plan.served, diff)
            self._file_config = plan.applied_file
            log.info("configuration reloaded from %s: %s", self.path, summary(diff))
            if diff.restart_required:
                log.warning("changed but kept until a restart: %s", ", ".join(diff.restart_required))
            return diff


def summary(diff: ConfigDiff) -> str:
    """One line saying what a reload changed, naming the instances (by their names) and models."""
    if diff.applies_nothing:
        return "no change to apply"
    parts = [
        f"{label} {len(names)} ({', '.join(names)})"
        for label, names in (
            ("instances added", diff.shown(diff.added_instances)),
            ("instances removed", diff.shown(diff.removed_instances)),
            ("instances replaced", [f"{old} -> {new}" if old else new for old, new in diff.replaced_names()]),
            ("models added", diff.added_models),
            ("models removed", diff.removed_models),
            ("models changed", diff.changed_models),
        )
        if names
    ]
    if diff.tenants_changed:
        parts.append("tenants changed")
    if diff.admin_changed:
        parts.append("admin keys changed")
    return ", ".join(parts)
