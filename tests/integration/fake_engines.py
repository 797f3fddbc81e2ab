"""What the tests' fake engines send."""

from __future__ import annotations

import orjson


def chat_chunk(content: str) -> bytes:
    """One chat chunk's SSE event carrying `content` (a token)."""
    event = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"
