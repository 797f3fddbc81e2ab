"""Whether an http(s) URL names something a client can connect to: a host, and a port that is a number in 1-65535.

Config validators call it (an instance's URL, a sidecar's `advertise_url`), so that a URL that passes `check-config`
does not fail later, at `serve` or at every central that reads it."""

from __future__ import annotations

import urllib.parse


def http_url_problem(url: str) -> str | None:
    """What is wrong with the http(s) URL `url` (its scheme already checked), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port that is not a number in 0-65535
    except ValueError as exc:
        if "@" in url:
            # The parser's message quotes what it took for the port: part of a password, when the password has a
            # character that ends the host part.
            return (
                "is not a usable URL: its port is not a number (a user name or password with `/`, `?`, `#` or `@` "
                "must be percent-encoded)"
            )
        return f"is not a usable URL: {exc}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query or fragment (the API's paths are appended to it)"
    if not parts.hostname:
        return "needs a host, e.g. http://127.0.0.1:8000"
    if port == 0:
        return "needs a port in 1-65535 (or none: 80 for http, 443 for https)"
    if parts.path.rstrip("/").endswith("/v1"):
        # An OpenAI client's base URL: the gateway appends `/v1/chat/completions` (and `/health`, `/metrics`) itself.
        return "must be the engine's base URL without `/v1` (the API's paths, `/v1/...`, are appended to it)"
    return None
