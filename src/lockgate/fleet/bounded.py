"""The gateway's own side calls to an engine (health check, abort, parallelism, answer probe), bounded in time and
size, and the bound of a metrics page (scraped through the lean pool, `scrape.py`).

The side calls go through aiohttp, off the hot path. A timeout alone does not bound them: on loopback an engine can
send hundreds of megabytes within one. `side_call` reads at most `MAX_SIDE_BODY_BYTES` of an answer (a larger one is
`SideAnswer.body` None, its connection dropped); each caller decides what its status and body mean.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from .instance import Instance

#: A metrics page larger than this is a failed scrape.
MAX_METRICS_BYTES = 4 * 1024 * 1024
#: Health and abort answers are not used beyond their status: more than this is a failed call.
MAX_SIDE_BODY_BYTES = 64 * 1024


class BodyTooLarge(aiohttp.ClientError):
    """An engine's answer was larger than the caller's bound."""


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or `BodyTooLarge` as soon as it is known to exceed `limit` bytes."""
    if response.content_length is not None and response.content_length > limit:
        raise BodyTooLarge(f"the answer ({response.content_length} bytes) is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the answer is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class SideAnswer:
    status: int
    #: The whole body; None when it was larger than `MAX_SIDE_BODY_BYTES` (the connection is dropped).
    body: bytes | None


async def side_call(instance: Instance, method: str, path: str, timeout_s: float, *, json: Any = None) -> SideAnswer:
    """One side call to `instance`'s engine, with its credentials and TLS name: the answer's status and (bounded)
    body. Raises TimeoutError past `timeout_s`, `aiohttp.ClientError` or OSError when the call fails."""
    async with asyncio.timeout(timeout_s):
        async with instance.session.request(
            method,
            instance.base_url + path,
            json=json,
            headers=instance.auth_headers(),
            server_hostname=instance.server_name,
        ) as resp:
            try:
                body: bytes | None = await read_bounded(resp, MAX_SIDE_BODY_BYTES)
            except BodyTooLarge:
                body = None
            return SideAnswer(resp.status, body)
