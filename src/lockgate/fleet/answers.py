"""Asking an engine for a one-token answer: the probe an instance must pass to return after it went silent in a call
while its health check still passed (`Ejection.silent`). One side call, bounded in time and size, off the hot path;
only while the instance is ejected, so it never competes with the traffic it would get."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from .bounded import MAX_SIDE_BODY_BYTES, side_call

if TYPE_CHECKING:
    from .instance import Instance

log = logging.getLogger(__name__)


def probe_body(path: str, served_model: str) -> dict[str, Any]:
    """The smallest generation the dialect's `answer_probe_path` takes: one token of a two-character prompt."""
    body: dict[str, Any] = {"model": served_model, "max_tokens": 1, "temperature": 0, "stream": False}
    if path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


async def answers(instance: Instance, served_model: str, timeout_s: float) -> bool:
    """Whether `instance`'s engine answers a one-token generation of `served_model` within `timeout_s` (HTTP 200 and a
    JSON object with `choices`, or a refusal of the request itself: a 4xx but 408 and 429). An engine whose dialect has
    no probe (`answer_probe_path`) is taken at its health check's word: True."""
    path = instance.dialect.answer_probe_path
    if path is None:
        return True
    try:
        answer = await side_call(instance, "POST", path, timeout_s, json=probe_body(path, served_model))
    except TimeoutError:
        instance.last_error = f"answer probe: no answer to a one-token request within {timeout_s:g} s"
        return False
    except (aiohttp.ClientError, OSError) as exc:
        instance.last_error = f"answer probe failed: {str(exc) or exc.__class__.__name__}"
        return False
    status = answer.status
    if status != 200:
        if 400 <= status < 500 and status not in (408, 429):
            # It answers, and cannot serve this probe (an embedding model, a model name it does not know): a hung
            # generation loop never gets so far, a valid request is queued to it and waits. Back in, rather than out
            # for good (its own requests count against it again if it still fails them).
            return True
        instance.last_error = f"answer probe: HTTP {status} to a one-token request"
        return False
    if answer.body is None:
        instance.last_error = f"answer probe failed: the answer is larger than {MAX_SIDE_BODY_BYTES} bytes"
        return False
    try:
        parsed = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict) or not parsed.get("choices"):
        instance.last_error = "answer probe: the answer to a one-token request has no choices"
        return False
    return True
