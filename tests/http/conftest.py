"""Every test of the HTTP client runs on both event loops: asyncio's and uvloop (the gateway's, in production).

They differ where the client is most delicate: when a closed socket is really closed, how reads are paused,
how large writes are buffered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
