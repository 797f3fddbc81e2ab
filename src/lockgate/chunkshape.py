"""An engine stream's usual token chunk, learned once, so that the next ones are made without parsing.

An engine's stream repeats one chunk: the same id, model, index and nulls around each token's text
(`{"id":"chatcmpl-1",...,"choices":[{"index":0,"delta":{"content":"TEXT"},"logprobs":null,"finish_reason":null}]}`).
Parsing it (`orjson.loads` and the objects it builds, freed after, then `has_content` over them) was ~7.5k instructions
a chunk in the compiled build, almost half of what the gateway spent on a streamed chunk; making it from the learned
one is ~2.5k.

Theory of operation: `learn()` takes a chunk with a token that was parsed, and keeps the bytes before its text and
after it (`prefix`, `suffix`) with the parsed event. `event()` takes a payload that is `prefix + text + suffix` and
returns the learned event with `text` in its place. That is exactly what parsing it would give when `text` holds no
quote, backslash or control character and is valid UTF-8: it is then the whole content of one JSON string whatever
surrounds it, so the payload's tokens are the learned ones but for that string's value. Which value it is, is proven
when the shape is learned: the prefix and suffix around another text must parse to the learned event with that text
in its place (one parse more, once a stream). Anything else is parsed as before (`event()` returns None). Only
scalars may stand beside the text (a `usage` or `logprobs` object, tool calls: not learned), so that the events made
share no mutable object.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

#: A quote and a backslash, as bytes' items (`QUOTE in text` is a `memchr`: see `sse.LF`).
QUOTE: Final = 34
BACKSLASH: Final = 92

#: The keys whose non-empty string is a chunk's token (`assemble.has_content`): a chat delta's, a completion choice's.
_DELTA_TEXTS: Final = ("content", "reasoning_content", "reasoning")
_CHOICE_TEXT: Final = "text"

#: Shapes proven (one parse each) in one stream at most: an engine whose chunks differ by more than their text (a
#: timestamp in each) is parsed chunk by chunk, as before, at the price of this many proofs.
MAX_LEARNED = 3


class ChunkShape:
    """One stream's usual token chunk (see the module docstring). Empty until `learn()` succeeds."""

    __slots__ = ("_choice", "_event", "_holder", "_key", "_learned", "_prefix", "_suffix")

    def __init__(self) -> None:
        self._prefix = b""
        self._suffix = b""
        #: Copies of the learned event, of its one choice and of the dict holding the text (the choice itself for a
        #: completion, its delta for a chat), and the text's key there.
        self._event: dict[str, Any] = {}
        self._choice: dict[str, Any] = {}
        self._holder: dict[str, Any] = {}
        self._key = ""
        self._learned = 0

    def event(self, payload: bytes) -> dict[str, Any] | None:
        """The event `payload` parses to, when it is the learned chunk with another (non-empty) text; else None."""
        prefix, suffix = self._prefix, self._suffix
        if not prefix or not payload.startswith(prefix) or not payload.endswith(suffix):
            return None
        text = payload[len(prefix) : len(payload) - len(suffix)]  # (empty when the two would overlap)
        if not text or QUOTE in text or BACKSLASH in text:
            return None
        try:
            value = text.decode()
        except UnicodeDecodeError:
            return None  # (orjson refuses it: parsed, it raises as before)
        if not value.isprintable():
            return None  # a control character, which a JSON string cannot hold raw (or another unprintable one)
        return self._made(value)

    def learn(self, event: dict[str, Any], payload: bytes) -> None:
        """Take `event`, parsed from `payload`, as the stream's usual chunk when it is one (a token's text beside
        scalars only, its key written without spaces: `"content":"`) and the shape proves out; otherwise keep what
        was learned."""
        if self._learned >= MAX_LEARNED or (
            self._prefix and payload.startswith(self._prefix) and payload.endswith(self._suffix)
        ):
            return  # (the learned shape, with a text `event()` leaves to the parser: a quote, an escape)
        found = _text_of(event)
        if found is None:
            return
        choice, holder, key = found
        marker = b'"' + key.encode() + b'":"'
        start = payload.find(marker)
        if start < 0:
            return
        start += len(marker)
        end = payload.find(b'"', start)
        text = payload[start:end]
        if BACKSLASH in text:
            return  # (its end may be an escaped quote)
        self._learned += 1
        self._prefix = self._suffix = b""
        self._event, self._choice, self._key = event.copy(), choice.copy(), key
        self._holder = self._choice if holder is choice else holder.copy()
        try:
            proven = orjson.loads(payload[:start] + text + b"_" + payload[end:]) == self._made(holder[key] + "_")
        except orjson.JSONDecodeError:
            proven = False
        if proven:
            self._prefix, self._suffix = payload[:start], payload[end:]

    def _made(self, value: str) -> dict[str, Any]:
        """The learned event with `value` as its text: new dicts down to the text, the learned scalars beside it."""
        holder = self._holder.copy()
        holder[self._key] = value
        if self._choice is self._holder:
            choice = holder
        else:
            choice = self._choice.copy()
            choice["delta"] = holder
        event = self._event.copy()
        event["choices"] = [choice]
        return event


def _text_of(event: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """The one choice of a chunk whose only non-scalars are that choice (and its delta), the dict holding its token's
    text (the delta, or the choice itself) and the text's key; None for any other chunk."""
    choices = event.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if type(choice) is not dict or not _scalars(event, "choices"):
        return None
    delta = choice.get("delta")
    if type(delta) is dict:
        if not _scalars(choice, "delta") or not _scalars(delta, ""):
            return None
        for key in _DELTA_TEXTS:
            value = delta.get(key)
            if type(value) is str and value:
                return choice, delta, key
        return None
    value = choice.get(_CHOICE_TEXT)
    if type(value) is str and value and _scalars(choice, ""):
        return choice, choice, _CHOICE_TEXT
    return None


def _scalars(values: dict[str, Any], but: str) -> bool:
    """Whether every value of `values` (but the one under `but`) is a string, a number, a boolean or null."""
    return all(value is None or isinstance(value, (str, int, float)) for key, value in values.items() if key != but)
