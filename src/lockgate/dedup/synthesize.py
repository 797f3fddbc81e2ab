"""A stream synthesized from a whole completion (pure, synchronous): the inverse of `assemble()`.

A non-streaming flight keeps the engine's one JSON completion; a streaming client later served from it
(a cache hit, a semantic hit) gets it as stream events, in the order an engine sends them: for each chat choice a
chunk with its role (and an empty content), one with its whole message (content, refusal, reasoning, tool calls with
their `index`, every other field as it is; logprobs), one with its finish reason and the choice's other fields; for
a text completion one chunk per choice; then a `choices: []` chunk with the usage. `assemble(events_of(body))` gives
the body back (up to the response id, which each client gets its own of anyway). The whole answer is already there,
so nothing is lost by sending its message in one piece: this is never used for a generation still in progress.
"""

from __future__ import annotations

from typing import Any

from ..wire import Endpoint


def events_of(endpoint: Endpoint, body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The stream events of the completion `body` (chat or text completion)."""
    chat = endpoint is Endpoint.CHAT
    head: dict[str, Any] = {
        "id": body.get("id") if isinstance(body.get("id"), str) else "",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body.get("created") if isinstance(body.get("created"), int) else 0,
        "model": body.get("model"),
    }
    for key, value in body.items():  # `system_fingerprint`, `service_tier`, llama.cpp's `timings`, ...
        if key not in _BODY_KEYS:
            head[key] = value
    events: list[dict[str, Any]] = []
    for choice in body.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        out: dict[str, Any] = {"index": index}
        if chat:
            # As an engine streams it: the role first, then the message, then the finish reason on its own.
            role, delta = _delta(choice.get("message"))
            opening = {"role": role, "content": ""} if isinstance(delta.get("content"), str) else {"role": role}
            events.append(
                {**head, "choices": [{"index": index, "delta": opening, "logprobs": None, "finish_reason": None}]}
            )
            if delta:
                message = {"index": index, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
                events.append({**head, "choices": [message]})
            out["delta"] = {}
            out["logprobs"] = None
        else:
            out["text"] = choice.get("text") if isinstance(choice.get("text"), str) else ""
            out["logprobs"] = choice.get("logprobs")
        out["finish_reason"] = choice.get("finish_reason")
        for key, value in choice.items():  # `stop_reason`, ...
            if key not in out and key != "message":
                out[key] = value
        events.append({**head, "choices": [out]})
    usage = body.get("usage")
    if isinstance(usage, dict):
        events.append({**head, "choices": [], "usage": usage})
    return tuple(events)


#: The keys of a completion `events_of` rebuilds itself; the others go on every chunk as they are.
_BODY_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage"})


def _delta(message: Any) -> tuple[str, dict[str, Any]]:
    """The message's role, and the rest of it as one delta: every field as it is (`content`, `refusal`, `reasoning`,
    `annotations`, ...), tool calls with their `index`."""
    if not isinstance(message, dict):
        return "assistant", {}
    delta: dict[str, Any] = {}
    for key, value in message.items():
        if key == "tool_calls":
            if isinstance(value, list):
                delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(value) if isinstance(call, dict)]
        elif key != "role":
            delta[key] = value
    return message.get("role") or "assistant", delta
