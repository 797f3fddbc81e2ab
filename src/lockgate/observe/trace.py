"""W3C trace context (https://www.w3.org/TR/trace-context/): a client's `traceparent` and `tracestate`.

A valid `traceparent` is forwarded to the engine unchanged (with its `tracestate`) and recorded in the
usage record; an invalid one is dropped with its `tracestate`, as the specification asks of a
participant that cannot parse it (it is not an error for the client). Pure functions, no I/O.
"""

from __future__ import annotations

import re

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: version-traceid-parentid-flags, lower-case hex; a later version may append fields after a `-`.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16
#: The specification lets a participant drop a tracestate longer than this (and 32 list members at most).
MAX_TRACESTATE = 512
_TRACESTATE_MEMBERS = 32


def parse_traceparent(value: str) -> tuple[str, str, str] | None:
    """(trace id, parent id, flags) of a valid `traceparent`, else None."""
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return None
    return trace_id, parent_id, flags


def _valid_tracestate(value: str) -> bool:
    return (
        len(value) <= MAX_TRACESTATE
        and value.isascii()
        and value.isprintable()
        and value.count(",") < _TRACESTATE_MEMBERS
    )


def trace_headers(traceparent: str, tracestate: str | None) -> tuple[tuple[str, str], ...]:
    """The trace-context headers to forward to the engine for a client's headers (empty if the
    `traceparent` is invalid; an invalid `tracestate` alone is dropped)."""
    if parse_traceparent(traceparent) is None:
        return ()
    parent = (TRACEPARENT, traceparent.strip())
    state = tracestate.strip() if tracestate is not None else ""
    if state and _valid_tracestate(state):
        return (parent, (TRACESTATE, state))
    return (parent,)
