"""An opened engine call as its holders read it — the direct path (`relay.py`) and a flight (`dedup/flight.py`) —
and reading its whole answer for a non-streaming client (`read_whole`).

Protocols rather than `attempt.Opened`, `upstream.UpstreamCall` and `upstream.UpstreamEvents` themselves, so that a
flight can be driven by a fake engine in tests, compiled or not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .assemble import usage_tokens
from .errors import UpstreamProtocolError
from .responses import whole_answer
from .upstream import too_large
from .wire import Endpoint

if TYPE_CHECKING:
    from .fleet.instance import Instance, Lease
    from .wire import ApiRequest

T = TypeVar("T")


class EngineCall(Protocol):
    """What a holder reads of its engine call (`upstream.UpstreamCall`)."""

    @property
    def received(self) -> int: ...

    @property
    def served_by(self) -> str: ...

    @property
    def instance(self) -> Instance: ...

    def abort(self) -> bool: ...

    async def read_json_bytes(self) -> tuple[dict[str, Any], bytes]: ...


class EngineReads(Protocol):
    """What a reader following the engine call's stream takes at each read."""

    @property
    def ended(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]: ...


class EngineEvents(EngineReads, Protocol):
    """What a holder reads of its engine call's stream (`upstream.UpstreamEvents`)."""

    def follow(self, step: Callable[[], T | None]) -> Awaitable[T]: ...

    def close(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...


class EngineAnswer(Protocol):
    """An opened engine call, its lease, and for a stream its events (`attempt.Opened`)."""

    @property
    def call(self) -> EngineCall: ...

    @property
    def lease(self) -> Lease: ...

    @property
    def events(self) -> EngineEvents | None: ...

    @property
    def whole(self) -> tuple[dict[str, Any], bytes | None] | None: ...

    def close(self) -> None: ...


async def read_whole(opened: EngineAnswer, api: ApiRequest, limit: int) -> tuple[dict[str, Any], bytes | None]:
    """The whole answer for a non-streaming client: the engine's body and its bytes (its completion tokens counted on
    the lease), or, from an engine read as a stream whatever was asked (llama.cpp: `stream_upstream_always`), its
    events assembled (no bytes), held until the end within `limit` (`upstream.max_response_bytes`, counted in event
    payload bytes; beyond it the call is aborted and `upstream_response_too_large` raised)."""
    call = opened.call
    events = opened.events
    if events is None:
        body, raw = await call.read_json_bytes()
        field = _ANSWER_FIELDS[api.endpoint]
        if not isinstance(body.get(field), list):
            # A 200 that is not an answer (`{}`, a proxy's JSON page): served, it was a success without one.
            raise UpstreamProtocolError(f"Instance {call.served_by} answered without `{field}`.")
        usage = body.get("usage")
        tokens = usage_tokens(usage).get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int):
            opened.lease.whole(tokens)
        return body, raw
    held: list[dict[str, Any]] = []
    async for event in events:
        held.append(event)
        if call.received > limit:
            call.abort()
            raise too_large(call.served_by, limit)
    return whole_answer(api, held, source=f"Instance {call.served_by}"), None


#: Where a whole answer holds its output, by endpoint (a 200 without it is not an answer).
_ANSWER_FIELDS = {
    Endpoint.CHAT: "choices",
    Endpoint.COMPLETIONS: "choices",
    Endpoint.EMBEDDINGS: "data",
    Endpoint.RESPONSES: "output",
}
