"""The open-loop benches' Poisson arrivals (`bench priority`, `bench overload`): a schedule fixed from the start,
so that a loop woken late still offers the rate asked for, and a rate that would never end is refused."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from lockgate.bench import priority
from lockgate.bench.load import open_loop, poisson_offsets

#: How late every wake-up of the fake clock is (a busy event loop).
LAG = 0.02


class FakeTime:
    """A clock that moves only when slept on, each timed sleep waking `LAG` late (a 0 s sleep: one loop turn)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.real_sleep = asyncio.sleep

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float, *_: Any) -> None:
        if delay > 0:
            self.now += delay + LAG
        await self.real_sleep(0)


async def test_priority_arrivals_follow_the_schedule_despite_late_wake_ups(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench priority` slept each gap after the last wake-up: with every wake-up late its floods offered 50-80% of
    the rate. Every arrival of the seeded schedule must be sent, none before its time, none later than one lag."""
    fake = FakeTime()
    sent_at: list[float] = []

    async def one(*_: Any) -> None:
        return None

    def record(*args: Any) -> Any:
        sent_at.append(fake.now)
        return one()

    monkeypatch.setattr(time, "perf_counter", fake.clock)
    monkeypatch.setattr(asyncio, "sleep", fake.sleep)
    monkeypatch.setattr(priority, "_one", record)
    settings = priority.Settings()
    tasks: list[asyncio.Task[Any]] = []
    start = fake.now
    await priority._arrivals(None, "http://x", "P2", 50.0, 2.0, settings, random.Random(5), tasks)  # type: ignore[arg-type]
    monkeypatch.undo()
    await asyncio.gather(*tasks)

    schedule = list(poisson_offsets(50.0, 2.0, random.Random(5)))
    assert len(schedule) > 60
    assert len(sent_at) == len(schedule)
    for at, sent in zip(schedule, sent_at, strict=True):
        assert at <= sent - start <= at + LAG + 1e-9


async def test_open_loop_sends_what_is_due_at_once_and_awaits_each_time() -> None:
    fake = FakeTime()
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await fake.sleep(delay)

    sent: list[int] = []
    count = await open_loop(200.0, 1.0, random.Random(1), sent.append, clock=fake.clock, sleep=sleep)
    assert sent == list(range(1, count + 1))
    assert count == len(list(poisson_offsets(200.0, 1.0, random.Random(1))))
    assert len(sleeps) == count  # it yields before every arrival, even when late (0 s)
    assert 0.0 in sleeps


@pytest.mark.parametrize("rate", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_rate_that_never_ends_is_refused(rate: float) -> None:
    """`overload --levels -1`: negative gaps, a schedule that never reached its end and never awaited (OOM)."""
    with pytest.raises(ValueError, match="arrival rate"):
        next(poisson_offsets(rate, 1.0, random.Random(1)))
