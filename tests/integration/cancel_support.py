"""Shared checks for the cancellation tests: every gauge at zero, no invariant violation, clean engines."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
from prometheus_client import Metric

from lockgate.gateway import Gateway
from lockgate.sim import SimServer

LONG_TOKENS = 5000  # long enough that no request in these tests finishes on its own


def total(metric: Any, suffix: str = "") -> float:
    """Sum of a metric's samples (all label sets); `suffix` picks e.g. `_total` of a counter."""
    families: list[Metric] = list(metric.collect())
    return sum(s.value for f in families for s in f.samples if s.name == f.name + suffix)


def counter(metric: Any, **labels: str) -> float:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def assert_gateway_clean(gateway: Gateway) -> None:
    m = gateway.metrics
    assert len(gateway.registry) == 0, [e.describe() for e in gateway.registry.all()]
    assert total(m.client_requests_in_flight) == 0
    assert total(m.upstream_calls_in_flight) == 0
    assert total(m.permits_in_use) == 0
    assert all(i.in_flight == 0 for i in gateway.fleet.instances.values())
    assert total(m.leaks, "_total") == 0


async def wait_sim_idle(sim: SimServer) -> None:
    """The engine has nothing open, running or waiting (bounded by the caller's timeout)."""
    await sim.wait_until(lambda s: not s.stats.open)
    st = sim.statistics()
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == 0, st


def body(stream: bool, max_tokens: int = LONG_TOKENS) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


class StreamReader:
    """Reads an SSE response event by event, counting the content events (one token each here)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.tokens = 0
        self.events: list[Any] = []
        self.done = False

    async def next(self) -> Any | None:
        """The next event (parsed), `"[DONE]"`, or None at the end of the body."""
        while True:
            line = await self.resp.content.readline()
            if not line:
                return None
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                self.events.append("[DONE]")
                return "[DONE]"
            event = orjson.loads(payload)
            self.events.append(event)
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    self.tokens += 1
            if str(event.get("type")).endswith(".delta"):  # a response's output (the Responses API)
                self.tokens += 1
            return event

    async def read_tokens(self, n: int) -> None:
        while self.tokens < n:
            assert await self.next() is not None, "stream ended early"

    async def read_to_end(self) -> None:
        while await self.next() is not None:
            pass

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
