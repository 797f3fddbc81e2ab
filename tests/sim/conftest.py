from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from lockgate.sim import SimConfig, SimServer

# Quick timings so that integration tests stay fast but generation still takes real steps.
QUICK = {"prefill_tps": 1e6, "tpot_ms": 1.0}


@pytest.fixture
async def make_sim() -> AsyncIterator[Callable[..., Awaitable[SimServer]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(**kw: Any) -> SimServer:
            kw.setdefault("models", ("m",))
            for k, v in QUICK.items():
                kw.setdefault(k, v)
            return await stack.enter_async_context(SimServer(SimConfig(**kw)))

        yield make


@pytest.fixture
async def sim(make_sim: Callable[..., Awaitable[SimServer]]) -> SimServer:
    return await make_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
