"""Helpers of the cluster tests: configs for a sidecar and a central gateway, and a bounded wait."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lockgate.sim import SimServer


def cluster_section(etcd_url: str, name: str, **extra: Any) -> dict[str, Any]:
    return {"endpoints": [etcd_url], "name": name, "lease_ttl_ms": 1000, "publish_interval_ms": 50, **extra}


def unique_cluster(prefix: str) -> str:
    return f"{prefix}-{os.urandom(4).hex()}"


def sidecar_config(
    etcd_url: str, cluster: str, sims: list[SimServer], usage: str, node: str, model: str = "m", **extra: Any
) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_ms": 60000},
        "usage": {"path": usage},
        "models": [
            {
                "name": model,
                "instances": [{"url": s.url, "engine": "vllm", "name": f"engine-{i}"} for i, s in enumerate(sims)],
            }
        ],
        "cluster": cluster_section(etcd_url, cluster, node=node),
        **extra,
    }


def central_config(etcd_url: str, cluster: str, usage: str, **cluster_extra: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "health": {"interval_ms": 60000},
        "usage": {"path": usage},
        "cluster": cluster_section(etcd_url, cluster, **cluster_extra),
    }


async def eventually(predicate: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    """Bounded polling of state that has no event to wait on (another process's view, etcd's clock)."""

    async def check() -> bool:
        return predicate()

    await poll_until(check, timeout_s, what)


async def poll_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, what: str = "condition") -> None:
    """`eventually` for a check that asks another process (an admin endpoint) over HTTP."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
