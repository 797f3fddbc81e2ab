"""HTTP/1.1 header lines, rendered for the wire by both halves of the gateway (the edge server's responses, the
engine client's requests), with the one check both need: no CR or LF inside a name or a value (header
injection, response splitting)."""

from __future__ import annotations

from collections.abc import Collection


def render(headers: Collection[tuple[str, str]]) -> str:
    """`name: value` lines, each ending in CRLF. ValueError naming the header if a name or value holds CR or LF."""
    block = "".join([f"{name}: {value}\r\n" for name, value in headers])
    # Every line ends in one CRLF: any other CR or LF came from a name or a value (one count for all of them).
    if block.count("\r") != len(headers) or block.count("\n") != len(headers):
        bad = next(name for name, value in headers if has_crlf(f"{name}{value}"))
        raise ValueError(f"CR or LF in header {bad!r}")
    return block


def has_crlf(text: str) -> bool:
    return "\r" in text or "\n" in text
