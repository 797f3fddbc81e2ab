"""Server-sent events, sans-IO: a decoder fed with bytes, and encoders for what the gateway sends.

Only the `data:` field matters for the OpenAI protocol; other fields (`event:`, `id:`, comments) are
skipped. Multi-line data is joined with newlines, per the SSE specification.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
#: A line feed and a carriage return, as bytes' items: `LF in data` is a `memchr`. (Searched for as bytes, `b"\n" in
#: data` first fails as an integer on Python 3.11, an exception raised and cleared, and `data.find(b"\n")` parses its
#: arguments from a tuple: ~850 instructions a call in the compiled build, against ~60.)
LF: Final = 10
CR: Final = 13


class EventTooLarge(ValueError):
    """An event (or a line) is larger than the decoder's bound."""


class SSEDecoder:
    """Accumulates bytes and returns the data payloads of every complete event.

    Bounded: an event's data, whole or still incomplete between feeds (the data lines of one event together), may
    not exceed `max_event_bytes`; beyond it `feed` raises `EventTooLarge` (for an event that arrived whole in one
    read too: an engine's read can hold more than the bound)."""

    __slots__ = ("_buffer", "_data", "_data_bytes", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._data_bytes = 0
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._buffer and not self._data and chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"):
            # An engine's usual read: one whole `data:` event, one line, nothing pending (larger: refused below).
            payload = chunk[6:-2]
            if LF not in payload and CR not in payload and len(payload) <= self.max_event_bytes:
                return [payload]
        buffer = self._buffer + chunk if self._buffer else chunk
        if self._data or CR in buffer:
            events = self._feed_lines(buffer)
        else:
            # What engines send: `data: <json>` events ending in a blank line, LF line ends. Whole events are
            # split off at once; any other shape of event (comments, several fields) goes line by line.
            blocks = buffer.split(b"\n\n")
            rest = blocks.pop()  # the incomplete event after the last blank line, kept whole
            events = []
            for block in blocks:
                if block.startswith(b"data: ") and LF not in block:
                    events.append(block[6:])
                elif block:
                    events += self._feed_lines(block + b"\n\n")
            self._buffer = rest
        if len(self._buffer) + self._data_bytes > self.max_event_bytes:
            # The complete lines of the event still open: comments (keep-alives) and fields other than `data` take no
            # room (an outside run: a megabyte of comment lines, no blank line between them, ended a stream).
            events += self._feed_lines(self._buffer)
        if len(self._buffer) + self._data_bytes > self.max_event_bytes or any(
            len(event) > self.max_event_bytes for event in events
        ):
            raise EventTooLarge(f"an event is larger than {self.max_event_bytes} bytes")
        return events

    def _feed_lines(self, buffer: bytes) -> list[bytes]:
        events: list[bytes] = []
        held = b""
        if CR in buffer:
            # A lone CR ends a line too (the SSE specification; an outside run's engine used them): as LF, but a CR
            # ending this piece waits for the next, whose LF may make it a CRLF.
            if buffer.endswith(b"\r"):
                buffer, held = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = buffer[start:end]
            start = end + 1
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                    self._data_bytes = 0
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self._data.append(value)
                self._data_bytes += len(value) + 1
        self._buffer = buffer[start:] + held
        return events

    def close(self) -> list[bytes]:
        """End of stream: a final event without its blank line still counts."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        self._buffer = b""
        self._data = []
        self._data_bytes = 0
        return events


def encode(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def encode_error(error_body: dict[str, Any], *, sequence_number: int | None = None) -> bytes:
    """A final error event for a stream that has already started (status 200 was sent). `sequence_number`: a
    response's stream (the Responses API), whose error event is `{"type": "error", "code", "message", "param",
    "sequence_number"}` (the envelope's `error` kept beside them: a client reading either finds it)."""
    if sequence_number is None:
        return b"data: " + orjson.dumps(error_body) + b"\n\n"
    error = error_body.get("error")
    fields = error if isinstance(error, dict) else {}
    event = {
        "type": "error",
        "code": fields.get("code"),
        "message": fields.get("message"),
        "param": fields.get("param"),
        "sequence_number": sequence_number,
        **error_body,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
