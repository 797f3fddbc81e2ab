"""Asking an engine how many sequences it runs at once, where its dialect says it tells (one side call,
bounded in time and size, off the hot path; `fleet/capacity.py` `ConcurrencyLimit.declare` uses the answer)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from .bounded import side_call

if TYPE_CHECKING:
    from .instance import Instance

log = logging.getLogger(__name__)


async def ask_parallelism(instance: Instance, timeout_s: float) -> int | None:
    """What `instance`'s engine says it runs at once; None when its dialect has no such call, the call
    fails or the answer does not carry a usable number (the limit is then discovered from its queue)."""
    path = instance.dialect.parallelism_path
    if path is None:
        return None
    try:
        answer = await side_call(instance, "GET", path, timeout_s)
        if answer.status != 200 or answer.body is None:
            return None
        return instance.dialect.parallelism(orjson.loads(answer.body))
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        log.info("instance %s: %s did not say its parallelism (%r)", instance.name, path, exc)
        return None
