"""Stopping a background task: cancel it and wait until it has finished.

`task.cancel()` followed by `with suppress(CancelledError): await task` is the usual idiom, and it has a hole:
if the task that is waiting is itself cancelled while it waits, `suppress` swallows that cancellation too, and
the caller carries on as if nobody had asked it to stop. `cancel_and_wait` tells the two apart with
`Task.cancelling()` (Python 3.11): the stopped task's `CancelledError` is absorbed, the caller's own is re-raised.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel every given task (None is skipped), then wait for each to finish.

    Error handling: a stopped task's `CancelledError` is absorbed; any other exception a task ends with
    propagates, as awaiting it would. A cancellation of the *calling* task propagates too (after every task has
    been asked to stop), instead of being mistaken for the stopped task's.
    """
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    current = asyncio.current_task()
    for task in pending:
        try:
            await task
        except asyncio.CancelledError:
            if current is not None and current.cancelling():
                raise
