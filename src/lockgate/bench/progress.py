"""Progress of a long command on stderr: a live line on a terminal, plain periodic lines otherwise.

A benchmark's results go to stdout (scripts and tests parse them); its progress goes to stderr, so it
never mixes with them. A `Progress` knows the current phase (`phase(name, total)`) and how much of it is
done (`advance()`); while it is entered (`async with`), a task it owns redraws it:

- on a terminal, one line rewritten in place every `TTY_INTERVAL_S` (`\\r` + erase), with a bar when the
  phase has a total, and left on screen at the end;
- otherwise (a pipe, a log, CI), one plain line per phase and one every `PLAIN_INTERVAL_S` while a phase
  runs, so that a long step is never silent for more than a couple of seconds.

`Progress.silent()` does nothing (library callers and tests that do not want output).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..tasks import cancel_and_wait

TTY_INTERVAL_S = 0.25
PLAIN_INTERVAL_S = 2.0
BAR_WIDTH = 24


class Progress:
    def __init__(
        self,
        title: str,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
    ) -> None:
        """`stream` defaults to stderr; `tty` defaults to whether the stream is a terminal; `interval_s`
        (how often the line is redrawn) to `TTY_INTERVAL_S` or `PLAIN_INTERVAL_S`."""
        self.title = title
        self._stream = stream if stream is not None else sys.stderr
        self.tty = self._stream.isatty() if tty is None else tty
        self._clock = clock
        self._interval_s = interval_s if interval_s is not None else TTY_INTERVAL_S if self.tty else PLAIN_INTERVAL_S
        self._enabled = True
        self._started = clock()
        self._phase = ""
        self._phase_started = self._started
        self.total: int | None = None
        self.done = 0
        self._task: asyncio.Task[None] | None = None
        self._width = 0  # of the live line last drawn (to erase it)

    @classmethod
    def silent(cls) -> Progress:
        progress = cls("", tty=False)
        progress._enabled = False
        return progress

    # --- what the command reports -----------------------------------------------------------------
    def phase(self, name: str, total: int | None = None) -> None:
        """A new phase begins (`total`: the units it will take, if known)."""
        self._phase, self.total, self.done = name, total, 0
        self._phase_started = self._clock()
        if self._enabled:
            self._draw()

    def advance(self, n: int = 1) -> None:
        """`n` more units of the current phase are done (cheap: drawing happens on the timer)."""
        self.done += n

    # --- rendering (pure) -------------------------------------------------------------------------
    def line(self, now: float | None = None) -> str:
        """The progress as one line."""
        now = self._clock() if now is None else now
        parts = [f"{self.title}:"]
        if self._phase:
            parts.append(self._phase)
        if self.total:
            share = min(1.0, self.done / self.total)
            if self.tty:
                filled = round(share * BAR_WIDTH)
                parts.append("[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]")
            parts.append(f"{self.done}/{self.total} ({share:.0%})")
        elif self.done:
            parts.append(str(self.done))
        parts.append(f"{now - self._started:.0f} s")
        return " ".join(parts)

    # --- the owner of the redraw task ---------------------------------------------------------------
    async def __aenter__(self) -> Progress:
        if self._enabled:
            self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._enabled:
            self._clear()
            self._stream.write(f"{self.title}: finished in {self._clock() - self._started:.0f} s\n")
            self._stream.flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self._draw()

    def _draw(self) -> None:
        text = self.line()
        if self.tty:
            pad = max(0, self._width - len(text))
            self._stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def _clear(self) -> None:
        if self.tty and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._width = 0
