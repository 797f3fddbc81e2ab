"""Turning one generation's stream events into what a client receives (pure, synchronous).

The gateway often reads an engine as a stream on a client's behalf: a flight shared by several
clients always does, and so does a request to an engine that only aborts streams (llama.cpp).
Streaming clients get each event through a `ClientView` (their own response id, the gateway's model
name, usage only if they asked for it, as one final `choices: []` chunk whatever chunk the engine put
it on); non-streaming clients get the events folded into one completion object by `assemble()`.
"""

from __future__ import annotations

import os
from typing import Any

from .wire import ApiRequest, Endpoint


def new_response_id(endpoint: Endpoint) -> str:
    return ("chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-") + os.urandom(12).hex()


#: A null `usage` as the last key of a compact JSON object.
_NULL_USAGE = b',"usage":null}'


class ClientView:
    """One streaming client's view of a generation's events."""

    __slots__ = ("_include_usage", "_last", "_prompt_tokens", "_response_id", "model", "named", "plain", "usage")

    def __init__(
        self, *, model: str, include_usage: bool, response_id: str | None = None, prompt_tokens: int = 0
    ) -> None:
        """`prompt_tokens`: the gateway's estimate, for the closing usage chunk of an engine that reports none."""
        self.model = model
        self._include_usage = include_usage
        self._prompt_tokens = prompt_tokens
        self._response_id = response_id
        self._last: dict[str, Any] | None = None
        #: The generation's usage, once an event carried it.
        self.usage: dict[str, Any] | None = None
        #: A plain chunk (choices, this client's model name, no `usage` key) reaches this client unchanged and
        #: leaves the view as it was: no response id is imposed and the client did not ask for usage (a writer
        #: may then pass it through without asking `event()`).
        self.plain = response_id is None and not include_usage
        #: Events go out with an `event:` line naming their type, and the stream ends without `[DONE]` (the
        #: Responses API: `responses.ResponseView`).
        self.named = False

    def event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event as this client sees it; None when it gets nothing for it (usage-only chunks). The event
        itself (not a copy) when it needs no change: the gateway's response id is not imposed, the model name is
        already the client's, and `usage` is already what the client gets (absent, or null when it asked for
        usage)."""
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if not event.get("choices"):
            return None
        if (
            self._response_id is None
            and event.get("model") == self.model
            and ("usage" in event and usage is None if self._include_usage else "usage" not in event)
        ):
            # Nothing to change: the event itself (the caller may then send the engine's bytes as they are).
            self._last = event
            return event
        out = {**event, "model": self.model}  # a copy: flights share their events between clients
        if self._response_id is not None:
            out["id"] = self._response_id
        if self._include_usage:
            out["usage"] = None
        else:
            out.pop("usage", None)
        self._last = out
        return out

    def spliced(self, event: dict[str, Any], raw: bytes) -> bytes | None:
        """The payload `event()` would give this client, made from the engine's bytes `raw` (one line) when its
        only change is the `usage` key at the end: `,"usage":null` added for a client that asked for usage
        (OpenAI puts it on every chunk; vLLM and SGLang send none), or a trailing null one removed for a client
        that did not (a gateway in front, OpenAI itself). Bytes in, bytes out: no copy of the event and no
        serialising it again. None when the change is anything else (another model name, an imposed id, no
        choices, a usage object, a layout other than compact JSON): then `event()`."""
        if (
            self._response_id is not None
            or event.get("model") != self.model
            or not event.get("choices")
            or not raw.endswith(b"}")
        ):
            return None
        if self._include_usage:
            if "usage" in event:
                return None  # null already (unchanged: passed through), or an object (`event()` splits it off)
            self._last = event  # what `final()` reads is the same in the copy `event()` would make
            return raw[:-1] + b',"usage":null}'
        if event.get("usage", 0) is None and raw.endswith(_NULL_USAGE):
            return raw[: -len(_NULL_USAGE)] + b"}"
        return None

    def final(self, pieces: int = 0) -> dict[str, Any] | None:
        """The closing usage chunk, if the client asked for usage; `pieces`: the chunks with output the client was
        sent (its completion tokens are no fewer, `_at_least`). From an engine whose stream reports no usage, the
        gateway's estimate (`prompt_tokens`, a token a piece), as a whole answer assembled from it says."""
        if not self._include_usage or self._last is None:
            return None
        usage = self.usage
        if usage is None:
            if not self._prompt_tokens:
                return None
            usage = _estimate(self._prompt_tokens, pieces)
        # The chunk's own fields as this client saw them (id, model, `system_fingerprint`, `service_tier`, ...).
        head = {k: v for k, v in self._last.items() if k != "choices" and k != "usage"}
        return {**head, "choices": [], "usage": _at_least(usage, pieces)}


def usage_of(events: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> dict[str, Any] | None:
    """The generation's usage: the last event's that carries one (a response's, in its terminal event's response,
    named as `usage_tokens` names it)."""
    for event in reversed(events):
        usage = event.get("usage")
        if isinstance(usage, dict):
            return usage
        response = event.get("response")
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            return usage_tokens(response["usage"])
    return None


#: The largest token count taken from an engine (larger: an engine's bug, read as unknown; a record could not
#: store it, SQLite's integers end at 2**63).
MAX_COUNT = 1 << 53


def count_of(value: Any) -> int:
    """A count an engine reported (tokens): an integer in [0, `MAX_COUNT`], else 0 (not reported, or not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else 0


#: The keys of a whole answer's choice (or response item) whose strings are output the engine generated.
_OUTPUT_KEYS = frozenset({"content", "text", "arguments", "reasoning_content", "reasoning", "refusal"})


def estimated_output_tokens(body: dict[str, Any]) -> int:
    """A whole answer's output tokens, for an engine that reports none: its generated text at ~4 characters a token,
    at least one for each choice (or response output item) that has any."""
    total = 0
    for part in (*(body.get("choices") or ()), *(body.get("output") or ())):
        chars = _output_chars(part, 0)
        if chars:
            total += max(1, chars // 4)
    return total


def _output_chars(value: Any, depth: int) -> int:
    """Characters of the strings under `_OUTPUT_KEYS` in `value` (a choice, its message, parts: a few levels)."""
    if depth > 6:
        return 0
    if isinstance(value, list):
        return sum(_output_chars(item, depth + 1) for item in value)
    if not isinstance(value, dict):
        return 0
    chars = 0
    for key, item in value.items():
        if isinstance(item, str):
            chars += len(item) if key in _OUTPUT_KEYS else 0
        elif isinstance(item, (dict, list)) and key not in ("logprobs", "annotations"):
            chars += _output_chars(item, depth + 1)
    return chars


def usage_tokens(usage: dict[str, Any]) -> dict[str, Any]:
    """A response's usage (`input_tokens`, `output_tokens`: the Responses API) under the names the gateway's records
    read (`prompt_tokens`, `completion_tokens`); a completion's usage as it is."""
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return usage
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}


class ChoiceUsages:
    """An engine's usage reported per choice, merged as OpenAI counts it: every choice's completion tokens, each
    prompt's tokens once (`per_prompt` choices each: `n`). llama.cpp reports a completion's usage on each choice's
    finish chunk and a chat's on a usage-only chunk per choice, each for that choice alone: the last one read was the
    answer's usage (an outside run: a completion of two prompts reported one prompt's tokens). `merge` rewrites each
    event carrying a usage to the totals so far, so that the last one carries them all."""

    __slots__ = ("_next", "_per_prompt", "_seen")

    def __init__(self, per_prompt: int) -> None:
        self._per_prompt = max(1, per_prompt)
        #: Choice index -> its prompt tokens, completion tokens and cached prompt tokens (None: not reported).
        self._seen: dict[int, tuple[int, int, int | None]] = {}
        #: The index given to the next usage that names no choice (a chat's usage-only chunks come in order).
        self._next = 0

    def merge(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if not isinstance(usage, dict):
            return
        index: int | None = None
        choices = event.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            found = choices[0].get("index")
            index = found if type(found) is int and found >= 0 else None
        if index is None:
            index, self._next = self._next, self._next + 1
        details = usage.get("prompt_tokens_details")
        cached = count_of(details.get("cached_tokens")) if isinstance(details, dict) else None
        self._seen[index] = (count_of(usage.get("prompt_tokens")), count_of(usage.get("completion_tokens")), cached)
        if len(self._seen) == 1:
            return  # one choice so far: its usage is the answer's
        prompts: dict[int, tuple[int, int | None]] = {}
        completion = 0
        for choice, (prompt, generated, hits) in self._seen.items():
            completion += generated
            prompts.setdefault(choice // self._per_prompt, (prompt, hits))
        prompt = sum(tokens for tokens, _ in prompts.values())
        merged = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if isinstance(details, dict):
            merged["prompt_tokens_details"] = {**details, "cached_tokens": sum(h or 0 for _, h in prompts.values())}
        event["usage"] = merged


def has_content(event: dict[str, Any]) -> bool:
    """Whether a chunk (or a response's event) carries output: a token at least."""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or _delta_output(choice.get("delta")):
            return True
    # A response's `*.delta` event: text, reasoning, a tool call's arguments (`responses.py`).
    kind = event.get("type")
    return isinstance(kind, str) and kind.endswith(".delta")


def _delta_output(delta: Any) -> bool:
    """Whether a chat chunk's delta carries output (text, reasoning, a tool or function call's piece): a token at
    least."""
    return isinstance(delta, dict) and bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning")
        or delta.get("reasoning_content")
        or delta.get("function_call")
    )


#: Keys `assemble` builds itself: of an event, and of one of its choices.
_EVENT_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage"})
_CHOICE_KEYS = frozenset({"index", "delta", "text", "logprobs", "finish_reason", "message"})


def assemble(
    endpoint: Endpoint,
    events: tuple[dict[str, Any], ...] | list[dict[str, Any]],
    *,
    model: str,
    response_id: str | None = None,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    """The non-streaming response a client would have received for this generation. Fields the gateway does not know
    are kept as the engine sent them (`system_fingerprint`, `service_tier`, llama.cpp's `timings`; a choice's
    `stop_reason`; a message's `reasoning` and any other text folded piece by piece). `prompt_tokens`: the gateway's
    estimate, for an engine whose stream reports no usage (then the usage is estimated: that prompt, and a token
    for each chunk with output)."""
    chat = endpoint is Endpoint.CHAT
    choices: dict[int, dict[str, Any]] = {}
    created = None
    extra: dict[str, Any] = {}
    pieces = 0  # choices' chunks that carried output: at least one token each
    for event in events:
        if created is None and isinstance(event.get("created"), int):
            created = event["created"]
        for key, value in event.items():
            if key not in _EVENT_KEYS:
                _keep(extra, key, value)
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            if not isinstance(index, int):
                index = 0
            acc = choices.get(index)
            if acc is None:
                acc = choices[index] = _new_choice(index, chat)
            if chat:
                delta = choice.get("delta")
                _fold_delta(acc["message"], delta)
                pieces += _delta_output(delta)
            elif isinstance(choice.get("text"), str):
                acc["text"] += choice["text"]
                pieces += bool(choice["text"])
            _fold_logprobs(acc, choice.get("logprobs"))
            if choice.get("finish_reason") is not None:
                acc["finish_reason"] = choice["finish_reason"]
            for key, value in choice.items():
                if key not in _CHOICE_KEYS:
                    _keep(acc, key, value)
    if chat:
        for acc in choices.values():
            message = acc["message"]
            if message.get("tool_calls") or message.get("function_call"):
                if message["content"] == "":
                    message["content"] = None  # beside tool calls, as engines and OpenAI answer whole
            elif message["content"] is None and message.get("refusal") is None:
                # No text came (llama.cpp holds back a trailing piece of a UTF-8 character while it streams: an answer
                # of one or two tokens may have none): an empty string, as the engine answers whole, not null, which
                # OpenAI sends only beside tool calls or a refusal (a client that appends the message to its history
                # and sends it on was refused "content is required").
                message["content"] = ""
    if response_id is None:
        # The default is made only when needed (`next()`'s default argument would make one for every call).
        response_id = next((e["id"] for e in events if isinstance(e.get("id"), str)), None) or new_response_id(endpoint)
    usage = usage_of(events)
    if usage is None and prompt_tokens:
        usage = _estimate(prompt_tokens, pieces)
    body: dict[str, Any] = {
        "id": response_id,
        "object": endpoint.object_name,
        "created": created or 0,
        "model": model,
        "choices": [choices[i] for i in sorted(choices)],
        "usage": _at_least(usage, pieces),
    }
    body.update(extra)
    return body


def assemble_for(
    api: ApiRequest, events: tuple[dict[str, Any], ...] | list[dict[str, Any]], response_id: str | None = None
) -> dict[str, Any]:
    """`assemble` for the client request `api`: its endpoint, its model, its prompt's estimate."""
    return assemble(
        api.endpoint, events, model=api.model, response_id=response_id, prompt_tokens=api.estimated_prompt_tokens()
    )


def _estimate(prompt_tokens: int, pieces: int) -> dict[str, Any]:
    """The gateway's usage for an engine that reported none: its prompt estimate, a token for each chunk with output."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": pieces, "total_tokens": prompt_tokens + pieces}


def _keep(target: dict[str, Any], key: str, value: Any) -> None:
    """A field assembled as the engine last sent it (a null does not replace a value sent before)."""
    if value is not None or key not in target:
        target[key] = value


def _at_least(usage: dict[str, Any] | None, pieces: int) -> dict[str, Any] | None:
    """The engine's usage, with no fewer completion tokens than the chunks that carried output: OpenAI counts the
    tokens of every choice, and llama.cpp reports one choice's for `n` > 1 (a client's answer of two 5-token
    choices said 5)."""
    if usage is None:
        return None
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int) or isinstance(completion, bool) or completion >= pieces:
        return usage
    prompt = usage.get("prompt_tokens")
    fixed = {**usage, "completion_tokens": pieces}
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        fixed["total_tokens"] = prompt + pieces
    return fixed


def _new_choice(index: int, chat: bool) -> dict[str, Any]:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": None},
            "logprobs": None,
            "finish_reason": None,
        }
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}


#: A message's text fields, streamed piece by piece.
_TEXT_FIELDS = frozenset({"content", "refusal", "reasoning", "reasoning_content"})


def _fold_delta(message: dict[str, Any], delta: Any) -> None:
    """Text fields (`_TEXT_FIELDS`) are joined piece by piece; tool calls by their index, a legacy `function_call` by
    its name and arguments; a list (`annotations`) extended; anything else kept as last sent."""
    if not isinstance(delta, dict):
        return
    for key, value in delta.items():
        if key == "tool_calls":
            _fold_tool_calls(message, value)
        elif key == "function_call":
            if isinstance(value, dict):
                _fold_function(message.setdefault("function_call", {"name": "", "arguments": ""}), value)
        elif key == "role":
            if isinstance(value, str):
                message["role"] = value
        elif key in _TEXT_FIELDS and isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        elif isinstance(value, list):
            existing = message.get(key)
            message[key] = existing + value if isinstance(existing, list) else list(value)
        else:
            _keep(message, key, value)


def _fold_tool_calls(message: dict[str, Any], pieces: Any) -> None:
    if not isinstance(pieces, list):
        return
    calls: list[dict[str, Any]] = message.setdefault("tool_calls", [])
    for call in pieces:
        if not isinstance(call, dict):
            continue
        index = call.get("index", len(calls))
        if not isinstance(index, int) or index < 0:
            index = len(calls)
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        target = calls[index]
        if call.get("id"):
            target["id"] = call["id"]
        if call.get("type"):
            target["type"] = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            _fold_function(target["function"], function)


def _fold_function(target: dict[str, Any], piece: dict[str, Any]) -> None:
    """A function call's name and arguments, joined piece by piece."""
    for key in ("name", "arguments"):
        if isinstance(piece.get(key), str):
            target[key] = (target.get(key) or "") + piece[key]


def _fold_logprobs(acc: dict[str, Any], logprobs: Any) -> None:
    """Lists (`content`, `refusal`, a completion's `tokens`, ...) are joined across chunks; a null one (a role chunk's
    `{"content": null}`) holds nothing yet; other fields are kept as first sent."""
    if not isinstance(logprobs, dict):
        return
    if acc["logprobs"] is None:
        acc["logprobs"] = {}
    target = acc["logprobs"]
    for key, value in logprobs.items():
        existing = target.get(key)
        if isinstance(value, list):
            if isinstance(existing, list):
                existing.extend(value)
            else:
                target[key] = list(value)
        elif key not in target:
            target[key] = value
