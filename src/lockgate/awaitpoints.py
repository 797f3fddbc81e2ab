"""A hook at the awaits of the engine client and the edge server, for tests that cancel or hold the request
path at each of them.

`http.Response` and `edge.StreamResponse` are native classes in the compiled build (setup.py: native attribute
access is ~10% of a streamed chunk's cost), and a native class's methods cannot be patched. So each of their
awaits that the request path goes through (and `HttpPool.request`) first awaits `hook(name, data)` when a hook is
installed: `name` is the method (`"StreamResponse.write"`), `data` what it was given (the bytes of a write, else
None). Tests install one with `installed()`; nothing else does, and then the cost is one attribute read per await.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator

Hook = Callable[[str, object], Awaitable[None]]

#: Awaited at each of those awaits when set (tests only).
hook: Hook | None = None


@contextlib.contextmanager
def installed(new: Hook) -> Iterator[None]:
    """Install `new` for the duration of the block."""
    global hook
    previous, hook = hook, new
    try:
        yield
    finally:
        hook = previous
