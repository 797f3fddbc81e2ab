"""`Changes`: a waiter re-checks its predicate on every notification and returns once it holds."""

from __future__ import annotations

import asyncio

from lockgate.changes import Changes


async def test_a_waiter_returns_at_once_when_its_condition_already_holds() -> None:
    await asyncio.wait_for(Changes().wait_until(lambda: True), timeout=1)


async def test_a_waiter_rechecks_on_each_change_and_returns_once_it_holds() -> None:
    changes, state, checks = Changes(), [0], [0]

    def reached() -> bool:
        checks[0] += 1
        return state[0] >= 2

    waiter = asyncio.create_task(changes.wait_until(reached))
    await asyncio.sleep(0)  # the waiter runs up to its first wait
    assert checks[0] == 1 and not waiter.done()
    state[0] = 1
    changes.notify()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert checks[0] == 2 and not waiter.done()
    state[0] = 2
    changes.notify()
    await asyncio.wait_for(waiter, timeout=1)
    assert checks[0] == 3


async def test_every_waiter_wakes_and_a_cancelled_one_leaves_the_others_working() -> None:
    changes, state = Changes(), [False]
    first = asyncio.create_task(changes.wait_until(lambda: state[0]))
    second = asyncio.create_task(changes.wait_until(lambda: state[0]))
    gone = asyncio.create_task(changes.wait_until(lambda: state[0]))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    changes.notify()  # nothing holds yet: every waiter waits on
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    state[0] = True
    changes.notify()
    await asyncio.wait_for(asyncio.gather(first, second), timeout=1)
    # A later waiter is woken as well (the event was renewed, not left set).
    state[0] = False
    late = asyncio.create_task(changes.wait_until(lambda: state[0]))
    await asyncio.sleep(0)
    assert not late.done()
    state[0] = True
    changes.notify()
    await asyncio.wait_for(late, timeout=1)
