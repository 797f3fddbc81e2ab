"""Reading an engine's answer to the gateway's own side calls (health, abort) within a size bound, and the
bound of a metrics page (scraped through the lean pool, `scrape.py`).

The side calls go through aiohttp, off the hot path; each already has a timeout, but on loopback an engine can send
hundreds of megabytes within one. `read_bounded` stops at `limit` bytes with `BodyTooLarge`, an
`aiohttp.ClientError`, so callers that already treat client errors as a failed call need no new branch.
"""

from __future__ import annotations

import aiohttp

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
