"""Asking an engine how many sequences it runs at once, where its dialect says it tells (one side call,
bounded in time and size, off the hot path; `fleet/capacity.py` `ConcurrencyLimit.declare` uses the answer)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from .bounded import MAX_SIDE_BODY_BYTES, read_bounded

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
        async with asyncio.timeout(timeout_s):
            async with instance.session.get(
                instance.base_url + path, headers=instance.auth_headers(), server_hostname=instance.server_name
            ) as resp:
                body = await read_bounded(resp, MAX_SIDE_BODY_BYTES)
                if resp.status != 200:
                    return None
        return instance.dialect.parallelism(orjson.loads(body))
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        log.info("instance %s: %s did not say its parallelism (%r)", instance.name, path, exc)
        return None
