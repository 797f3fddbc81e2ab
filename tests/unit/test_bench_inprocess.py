"""`bench inprocess`'s load: no connection is refused at once (`--concurrency 0` waited forever)."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.bench.inprocess import _drive


async def test_no_connection_is_refused_not_a_hang() -> None:
    # The timeout only bounds the test if it regresses; the call must fail at once.
    with pytest.raises(ValueError, match="at least one connection"):
        await asyncio.wait_for(_drive(1, 10, 0), 5)
