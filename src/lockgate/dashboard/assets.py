"""The dashboard's page and static files, shipped inside the package (`lockgate/dashboard/static/`).

Read once when a gateway is built (never at import). Each file gets an ETag (a hash of its bytes). The page
links its scripts and styles as `/dashboard/static/<name>?v=<etag>`: a versioned URL is cached for a year
(`immutable`), an unversioned one is revalidated (`no-cache` + ETag); the page itself is always revalidated,
so a new release is picked up on the next load. `If-None-Match` gets 304.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from ..edge.server import Request, Response

STATIC_PREFIX = "/dashboard/static/"

_CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".html": "text/html; charset=utf-8",
}
#: `{{asset:app.js}}` in the page becomes that file's versioned URL.
_ASSET_REF = re.compile(rb"\{\{asset:([A-Za-z0-9_.-]+)\}\}")
_PAGE = "index.html"

#: The page runs only its own files: no inline script, nothing from another origin, not framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_IMMUTABLE = "public, max-age=31536000, immutable"


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


class Assets:
    """The page and the static files, in memory."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self._files = {
            name: Asset(body, _CONTENT_TYPES.get(_suffix(name), "application/octet-stream"), _etag(body))
            for name, body in files.items()
            if name != _PAGE
        }
        page = _ASSET_REF.sub(self._versioned_url, files[_PAGE])
        self.page = Asset(page, _CONTENT_TYPES[".html"], _etag(page))

    @classmethod
    def load(cls) -> Assets:
        root = resources.files(__package__).joinpath("static")
        return cls({entry.name: entry.read_bytes() for entry in root.iterdir() if entry.is_file()})

    def names(self) -> list[str]:
        return sorted(self._files)

    def _versioned_url(self, match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        asset = self._files.get(name)
        if asset is None:
            raise ValueError(f"the dashboard page refers to a missing file: {name}")
        return f"{STATIC_PREFIX}{name}?v={asset.etag}".encode()

    def page_response(self, request: Request) -> Response:
        return _respond(request, self.page, "no-cache", PAGE_HEADERS)

    def static_response(self, request: Request, name: str) -> Response | None:
        """The file `name`, or None if there is no such file."""
        asset = self._files.get(name)
        if asset is None:
            return None
        versioned = f"v={asset.etag}" in request.query_string.split("&")
        return _respond(request, asset, _IMMUTABLE if versioned else "no-cache", {"X-Content-Type-Options": "nosniff"})


def _respond(request: Request, asset: Asset, cache_control: str, extra: dict[str, str]) -> Response:
    headers = {"Cache-Control": cache_control, "ETag": f'"{asset.etag}"', **extra}
    match = request.headers.get("if-none-match")
    if match is not None and (match.strip() == "*" or f'"{asset.etag}"' in (t.strip() for t in match.split(","))):
        return Response(status=304, headers=headers)
    return Response(body=asset.body, content_type=asset.content_type, headers=headers)


def _suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:] if dot >= 0 else ""


def _etag(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]
