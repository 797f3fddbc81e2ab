"""The client's errors, by how far the exchange got (callers decide on retries from the class alone).

    HttpClientError
    ├── ConnectError        could not connect (refused, unreachable, timeout) or the pool is closed:
    │                       nothing was sent
    ├── DisconnectedError   the server closed the connection before any byte of a response: the request
    │                       may or may not have been processed
    └── ProtocolError       the response was malformed, or the connection broke (or was closed by us)
        │                   after its head arrived
        ├── ResponseTooLarge  the body is larger than the reader's bound (the connection is closed)
        └── StalledError      the server sent nothing for the pool's stall timeout while a response was awaited
                              (the connection is closed)

OS errors and httptools' `HttpParserError` are translated into these where they enter (`connection.py`,
`pool.py`).
"""

from __future__ import annotations


class HttpClientError(Exception):
    """Base of the client's errors."""


class ConnectError(HttpClientError):
    """No connection could be made (or the pool is closed); nothing was sent. The message names the address;
    `reason` says what happened without it (what a client of the gateway may be told)."""

    def __init__(self, message: str, reason: str = "the connection failed") -> None:
        super().__init__(message)
        self.reason = reason


class DisconnectedError(HttpClientError):
    """The server closed the connection before sending any byte of a response."""


class ProtocolError(HttpClientError):
    """The response was malformed, or the connection broke after the response started."""


class ResponseTooLarge(ProtocolError):
    """The response body is larger than the reader accepts; the connection was closed."""


class StalledError(ProtocolError):
    """The server sent nothing for the pool's `stall_timeout_s` while the response (its head, or the rest of its
    body) was awaited on a watched request, or it began its head and did not finish it within as long (`trickled`: a
    byte at a time keeps the reads moving); the connection was closed."""

    def __init__(self, timeout_s: float, *, trickled: bool = False) -> None:
        #: What the server did, in the words of the message (`upstream.stalled` names the engine with them).
        self.what = "did not finish its response head within" if trickled else "sent nothing for"
        super().__init__(f"the server {self.what} {timeout_s:g}s")
        self.timeout_s = timeout_s
