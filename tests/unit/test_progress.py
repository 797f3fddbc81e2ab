"""Progress output of long commands (benchmarks): a live line on a terminal, periodic plain lines otherwise."""

from __future__ import annotations

import asyncio
import io

from lockgate.bench.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(io.StringIO):
    """A stream that lets a test wait for the n-th line (no sleeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def write(self, s: str) -> int:
        self.changed.set()
        return super().write(s)

    async def wait_lines(self, n: int) -> list[str]:
        while self.getvalue().count("\n") < n:
            self.changed.clear()
            await self.changed.wait()
        return self.getvalue().splitlines()


def test_line_shows_phase_count_share_and_elapsed_time() -> None:
    clock = Clock()
    plain = Progress("bench x", stream=io.StringIO(), tty=False, clock=clock)
    plain.phase("round 1/3 direct", total=200)
    plain.advance(50)
    clock.now += 12.4
    assert plain.line() == "bench x: round 1/3 direct 50/200 (25%) 12 s"
    tty = Progress("bench x", stream=io.StringIO(), tty=True, clock=clock)
    tty.phase("warm-up", total=4)
    tty.advance(4)
    assert tty.line() == "bench x: warm-up [########################] 4/4 (100%) 0 s"
    tty.phase("no total")
    assert tty.line() == "bench x: no total 0 s"


async def test_plain_output_prints_each_phase_and_a_line_per_interval_until_finished() -> None:
    out = Lines()
    async with Progress("bench x", stream=out, tty=False, interval_s=0.001) as progress:
        progress.phase("phase one", total=10)
        progress.advance(3)
        lines = await out.wait_lines(3)  # the phase's own line, then at least two periodic ones
    assert lines[0].startswith("bench x: phase one 0/10")
    assert all(line.startswith("bench x: phase one 3/10 (30%)") for line in lines[1:3])
    assert out.getvalue().splitlines()[-1].startswith("bench x: finished in")
    assert "\r" not in out.getvalue()


async def test_tty_output_rewrites_one_line_and_clears_it_at_the_end() -> None:
    out = io.StringIO()
    async with Progress("bench x", stream=out, tty=True) as progress:
        progress.phase("a long phase name", total=2)
        progress.phase("short")
    text = out.getvalue()
    assert text.startswith("\rbench x: a long phase name")
    assert "\rbench x: short" in text and text.endswith("bench x: finished in 0 s\n")
    assert text.count("\n") == 1


async def test_silent_writes_nothing() -> None:
    async with Progress.silent() as progress:
        progress.phase("p", total=1)
        progress.advance()
    assert progress.done == 1
