"""`cancel_and_wait`: the stopped task's cancellation is absorbed, the caller's own is not."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.tasks import cancel_and_wait


async def test_a_cancelled_task_is_awaited_and_its_cancellation_absorbed() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(forever())
    await started.wait()
    await cancel_and_wait(task, None)
    assert task.cancelled()


async def test_every_task_is_cancelled_before_any_is_awaited() -> None:
    ready = asyncio.Event()
    seen_by_first: list[int] = []
    tasks: list[asyncio.Task[None]] = []

    async def first() -> None:
        ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            seen_by_first.append(tasks[1].cancelling())  # the second was asked to stop already

    async def second() -> None:
        await asyncio.Event().wait()

    tasks.extend([asyncio.create_task(first()), asyncio.create_task(second())])
    await ready.wait()
    await cancel_and_wait(*tasks)
    assert all(task.cancelled() for task in tasks)
    assert seen_by_first == [1]


async def test_the_callers_own_cancellation_is_not_swallowed() -> None:
    """The idiom `cancel(); with suppress(CancelledError): await task` loses this cancellation."""
    stopping = asyncio.Event()
    release = asyncio.Event()

    async def slow_cleanup() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()  # cleanup that takes a while
            raise

    background = asyncio.create_task(slow_cleanup())
    await asyncio.sleep(0)  # let it start waiting
    after_stop: list[str] = []

    async def owner() -> None:
        await cancel_and_wait(background)
        after_stop.append("carried on")  # must not run: the owner itself was cancelled

    owner_task = asyncio.create_task(owner())
    await stopping.wait()
    owner_task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await owner_task
    assert after_stop == []
    assert background.cancelled()


async def test_a_task_failing_as_it_stops_propagates_its_error() -> None:
    started = asyncio.Event()

    async def fails_on_cancel() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await started.wait()
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(task)
