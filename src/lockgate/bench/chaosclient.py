"""One client request of `lockgate bench chaos`, over a raw socket, in one of three manners.

* `Manner.READ`: send, read the whole answer (`Connection: close`), check it is well formed: a 200 stream ends
  with `data: [DONE]` or an SSE error event, a 200 JSON answer has `choices`, an error status carries the
  OpenAI error envelope.
* `Manner.LEAVE`: send, then close the socket after `leave_after_s` (before the first byte, mid-stream or
  while a non-streaming answer is generated, whichever that happens to be).
* `Manner.SLOW`: a small receive buffer and a reader that takes `slow_read_bytes` every `slow_read_s`, so the
  gateway's writes toward it wait (backpressure).

The answer is parsed with llhttp (httptools), which also de-chunks it.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import time
from dataclasses import dataclass
from typing import Any

import orjson
from httptools import HttpParserError, HttpResponseParser


class Manner(enum.Enum):
    READ = "read"
    LEAVE = "leave"
    SLOW = "slow"


@dataclass(slots=True)
class Outcome:
    client_id: str
    manner: Manner
    stream: bool
    #: 0 when no status line arrived.
    status: int = 0
    #: The whole answer was received.
    complete: bool = False
    #: The client closed its socket before the answer was complete.
    left: bool = False
    #: What was wrong with a complete answer (or an answer cut short while the client still read), if anything.
    problem: str | None = None
    #: For a 200: whether a stream ended with an error event / a JSON answer was an error.
    upstream_error: bool = False
    seconds: float = 0.0


class _Answer:
    """httptools callbacks: the status and the de-chunked body."""

    def __init__(self) -> None:
        self.parser = HttpResponseParser(self)
        self.status = 0
        self.body = bytearray()
        self.complete = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


def request_bytes(port: int, body: dict[str, Any], client_id: str) -> bytes:
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nx-request-id: {client_id}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


async def call(
    port: int,
    body: dict[str, Any],
    client_id: str,
    manner: Manner,
    *,
    leave_after_s: float = 0.0,
    slow_read_bytes: int = 512,
    slow_read_s: float = 0.005,
) -> Outcome:
    outcome = Outcome(client_id, manner, bool(body.get("stream")))
    started = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if manner is Manner.SLOW:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    answer = _Answer()
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
    except OSError as exc:
        sock.close()
        outcome.problem = f"cannot connect: {exc}"
        return outcome
    try:
        writer.write(request_bytes(port, body, client_id))
        if manner is Manner.LEAVE:
            try:
                async with asyncio.timeout(leave_after_s):
                    await _read(reader, answer, outcome, CHUNK_ALL, 0.0)
            except TimeoutError:
                outcome.left = True
        else:
            size, pause = (slow_read_bytes, slow_read_s) if manner is Manner.SLOW else (CHUNK_ALL, 0.0)
            await _read(reader, answer, outcome, size, pause)
    except OSError as exc:
        outcome.problem = f"connection failed: {exc}"
    finally:
        writer.transport.abort()
        outcome.status = answer.status
        outcome.seconds = time.monotonic() - started
    if answer.complete:
        outcome.complete = True
        _check(answer, outcome)
    elif not outcome.left and outcome.problem is None:
        outcome.problem = "the answer ended before it was complete"
    return outcome


#: Read size of a client that reads as fast as it can.
CHUNK_ALL = 65536


async def _read(reader: asyncio.StreamReader, answer: _Answer, outcome: Outcome, size: int, pause: float) -> None:
    while not answer.complete:
        data = await reader.read(size)
        if not data:
            return
        try:
            answer.parser.feed_data(data)
        except HttpParserError as exc:
            outcome.problem = f"malformed answer: {exc}"
            return
        if pause:
            await asyncio.sleep(pause)  # the slow reader's pace (a client behaviour, not a wait for a state)


def _check(answer: _Answer, outcome: Outcome) -> None:
    body = bytes(answer.body)
    if answer.status != 200:
        try:
            error = orjson.loads(body)["error"]
            if not isinstance(error, dict) or "message" not in error or "type" not in error:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            outcome.problem = f"status {answer.status} without the OpenAI error envelope: {body[:200]!r}"
        return
    if outcome.stream:
        events = [e.strip()[5:].strip() for e in body.split(b"\n\n") if e.strip().startswith(b"data:")]
        if not events:
            outcome.problem = "a stream with no event"
        elif events[-1] == b"[DONE]":
            if b"[DONE]" in events[:-1]:
                outcome.problem = "a stream with two [DONE]"
        elif b'"error"' in events[-1]:
            outcome.upstream_error = True
        else:
            outcome.problem = f"a stream ending with neither [DONE] nor an error event: {events[-1][:200]!r}"
        return
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        outcome.problem = f"a 200 answer that is not JSON: {body[:200]!r}"
        return
    if not isinstance(payload, dict) or not payload.get("choices"):
        outcome.problem = f"a 200 answer without choices: {body[:200]!r}"
