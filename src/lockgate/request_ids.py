"""Request ids: the gateway's own for each request, and the client's `x-request-id` when it sent a usable one."""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .edge.server import Request

_ID_PREFIX = "lg-" + os.urandom(6).hex() + "-"
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """Unique per process run (a random prefix and a counter): no syscall on the hot path. The counter
    is zero-padded so that ids sort in creation order: the usage table's key index then grows at its
    end instead of splitting pages at random places."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):010x}"


def client_request_id(request: Request) -> str | None:
    """The client's own `x-request-id`, if it sent a usable one (printable ASCII, at most 200 characters: echoed back,
    kept in the record)."""
    client_id = request.headers.get("x-request-id")
    if client_id is not None and (len(client_id) > 200 or not client_id.isascii() or not client_id.isprintable()):
        return None
    return client_id


def echoed_request_id(request: Request) -> str:
    """The id an answer that is no request's own carries: the client's, else a new one."""
    return client_request_id(request) or new_request_id()
