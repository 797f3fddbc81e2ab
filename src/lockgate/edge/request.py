"""A request as the handler sees it: method, target, headers and the whole body, already read."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator
from typing import TYPE_CHECKING, Any, overload
from urllib.parse import unquote

import httptools

if TYPE_CHECKING:
    from .protocol import Connection

__all__ = ["Headers", "Request"]


class Headers:
    """Request headers: case-insensitive lookup; iterating yields (name, value) with lower-case names."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, str] | None = None) -> None:
        self._items = items if items is not None else {}  # keys are lower-case

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        return self._items.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._items.items())

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> ItemsView[str, str]:
        return self._items.items()

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


class Request:
    """One complete request: the server has read the whole body before the handler sees it."""

    __slots__ = (
        "body",
        "connection",
        "content_length",
        "headers",
        "held",
        "keep_alive",
        "method",
        "path",
        "query_string",
        "raw_path",
        "remote",
        "version",
    )

    def __init__(
        self,
        conn: Connection,
        method: str,
        raw_path: str,
        path: str,
        query_string: str,
        headers: Headers,
        version: str,
        keep_alive: bool,
        content_length: int | None,
    ) -> None:
        #: The connection it came on (a response to it writes there: `StreamResponse.prepare`).
        self.connection = conn
        self.method = method
        self.raw_path = raw_path  # as sent, without the query, not percent-decoded
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.version = version  # "1.1" or "1.0"
        self.keep_alive = keep_alive  # what the client asked for (HTTP version and Connection header)
        self.content_length = content_length
        self.remote = conn.remote
        self.body = b""
        #: What it counts in the server's held bodies (`max_held_body_bytes`) until answered: its body's bytes and the
        #: weight of what parsing it makes (`protocol.parsed_weight`).
        self.held = 0

    async def read(self) -> bytes:
        """The body (already read; for code written against aiohttp)."""
        return self.body

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path}>"


def split_target(url: bytes) -> tuple[str, str, str]:
    """(raw path, decoded path, query string) of a request target."""
    if not url.startswith(b"/"):
        if url == b"*":
            return "*", "*", ""
        # Absolute-form; raises HttpParserInvalidURLError. A part the URL lacks is None where the stubs say bytes
        # (typed as the stubs say, a compiled build would reject the None).
        parsed: Any = httptools.parse_url(url)
        url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
    if url.find(b"#") >= 0:  # not `in`: on Python 3.11 that raises (and clears) a TypeError first
        url = url.partition(b"#")[0]
    raw, _, query = url.partition(b"?")
    raw_path = raw.decode("utf-8", "replace")
    path = unquote(raw_path) if "%" in raw_path else raw_path
    return raw_path, path, query.decode("utf-8", "replace")
