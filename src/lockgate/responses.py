"""The Responses API's stream (`POST /v1/responses`), as the gateway relays it (pure, synchronous).

A response streams typed events rather than chat chunks: `response.created` and `response.in_progress` (the
response object, no output yet), then an output item's events (`response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` a token, `... .done`), and one terminal event
carrying the whole response with its usage (`response.completed`, `response.incomplete` at `max_output_tokens`,
`response.failed`). Every `*.delta` event carries output (text, reasoning, a tool call's arguments): a token at
least (`assemble.has_content`). Engines end the body after the terminal event, with or without `[DONE]`
(llama.cpp: without).

The gateway relays the events as they come: each client's view only restores the model name it asked for inside
the response objects and learns the usage from the terminal event; the events go out with an `event:` line naming
their type, as OpenAI sends them. A non-streaming client gets the terminal event's response (`whole_answer`) when
the engine was read as a stream. Responses are never continued from partial output (`Endpoint.chunked`): a
preempted one is restarted while nothing was sent; identical ones share a streamed flight, every client getting the
engine's events (its response id too: the one the engine may have stored).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .assemble import ClientView, assemble_for, usage_tokens
from .errors import UpstreamProtocolError

if TYPE_CHECKING:
    from .wire import ApiRequest

#: The events that end a response's stream, each carrying the whole response (its usage, its output).
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def is_terminal(event: dict[str, Any]) -> bool:
    return event.get("type") in TERMINAL


def show_ids(response: dict[str, Any], show: Callable[[str], str]) -> None:
    """Name a response object's ids (its own, the one it follows up: OpenAI and vLLM echo it) as its client sees them
    (`show`: `response_ids.py`), in place."""
    for key in ("id", "previous_response_id"):
        value = response.get(key)
        if isinstance(value, str):
            response[key] = show(value)


def failure_of(response: dict[str, Any]) -> str | None:
    """Why the engine failed a response (`status: failed`, its `error`), else None."""
    if response.get("status") != "failed":
        return None
    error = response.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else "The engine reported the response as failed."


def whole_answer(
    api: ApiRequest,
    events: tuple[dict[str, Any], ...] | list[dict[str, Any]],
    response_id: str | None = None,
    *,
    source: str = "The engine",
    finished_at: float | None = None,
) -> dict[str, Any]:
    """The whole answer a non-streaming client gets for a generation's events, its own dict (the caller may change
    it): a completion assembled (`assemble_for`, with `response_id`), or a response as its stream's terminal event
    carries it (the engine's id kept), given a `completed_at` if the engine's stream had none (llama.cpp's; its whole
    answer has one): when the generation ended (`finished_at`, wall clock: one time for every answer of a shared or
    cached one), else now. `source` names who sent a response's stream that ended without it
    (`UpstreamProtocolError`)."""
    if api.endpoint.chunked:
        return assemble_for(api, events, response_id)
    # (An index, not `reversed()`: mypyc 1.x fails to compile a loop over `reversed()` of these events.)
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        response = event.get("response")
        if is_terminal(event) and isinstance(response, dict):
            out = dict(response)  # (the events may be a flight's, shared by its clients)
            if out.get("status") == "completed" and "completed_at" not in out:
                out["completed_at"] = int(time.time() if finished_at is None else finished_at)
            return out
    raise UpstreamProtocolError(f"{source} ended a response's stream without the response.")


class ResponseView(ClientView):
    """One streaming client's view of a response's events (see the module docstring): the events themselves,
    each response object naming the client's model; `usage` (as `usage_tokens` names it) once the terminal event
    came. Nothing is added at the end (no usage chunk, no `[DONE]`)."""

    __slots__ = ("_made", "_shown", "_shown_ids", "failure")

    def __init__(
        self,
        *,
        model: str,
        made: Callable[[str], object] | None = None,
        shown: Callable[[str], str] | None = None,
    ) -> None:
        """`made`: told the response's id once an event shows it (where its follow-ups should go); `shown`: the id
        the client sees for the engine's (`response_ids.py`; None: the engine's)."""
        super().__init__(model=model, include_usage=False)
        self.plain = False
        self.named = True
        self._made = made
        self._shown = shown
        #: The client's ids for the engine's, once computed (every response object of a stream names the same ones).
        self._shown_ids: dict[str, str] = {}
        #: Why the engine failed the response (`response.failed`), once its terminal event said so.
        self.failure: str | None = None

    def event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        response = event.get("response")
        if not isinstance(response, dict):
            return event
        engine_id = response.get("id")
        made = self._made
        if made is not None and isinstance(engine_id, str):
            self._made = None
            made(engine_id)
        usage = response.get("usage")
        if isinstance(usage, dict):
            self.usage = usage_tokens(usage)
        if is_terminal(event):
            self.failure = failure_of(response)
        if self._shown is None:
            if response.get("model") == self.model:
                return event
            return {**event, "response": {**response, "model": self.model}}
        out = {**response, "model": self.model}
        show_ids(out, self._show)
        return {**event, "response": out}

    def _show(self, engine_id: str) -> str:
        shown = self._shown_ids.get(engine_id)
        if shown is None:
            assert self._shown is not None
            shown = self._shown_ids[engine_id] = self._shown(engine_id)
        return shown

    def spliced(self, event: dict[str, Any], raw: bytes) -> bytes | None:
        # The engine's bytes for every event without a response object (the deltas): nothing in them to change.
        return None if "response" in event else raw

    def final(self, pieces: int = 0) -> dict[str, Any] | None:
        return None
