"""A flight stopped for a more urgent request (`Flight.stop`), driven by hand: a fake engine whose reads the test
feeds, so that a stop lands exactly where a race would put it."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from lockgate.admission.preemption import Plan
from lockgate.answer import EngineAnswer
from lockgate.dedup import flight as flight_module
from lockgate.dedup.cache import Result
from lockgate.dedup.fingerprint import fingerprint
from lockgate.dedup.flight import Flight
from lockgate.wire import Endpoint, parse_request

#: The compiled build's `Flight` takes only a real `Lease` and `UpstreamCall` (native classes): these fakes run on the
#: pure build (`make test`); the same rule is tested on both through `Transcript` (test_preemption.py).
pytestmark = pytest.mark.skipif(
    not flight_module.__file__ or not flight_module.__file__.endswith(".py"),
    reason="the compiled Flight takes no fake lease (make test runs this on the pure build)",
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": 50}


class Owner:
    def __init__(self) -> None:
        self.ended: list[str] = []
        self.stopped = 0

    def flight_completed(self, flight: Flight, result: Result | None) -> None:
        self.ended.append("completed")

    def flight_failed(self, flight: Flight) -> None:
        self.ended.append("failed")

    def flight_abandoned(self, flight: Flight, partial: Result | None) -> None:
        self.ended.append("abandoned")

    def flight_closed_to_joiners(self, flight: Flight) -> None:
        pass

    def flight_changed(self, flight: Flight) -> None:
        pass

    def flight_stopped(self, flight: Flight) -> None:
        self.stopped += 1

    def flight_resumed(self, flight: Flight) -> None:
        pass


class Lease:
    answered = True

    def produced(self, now: float) -> int:
        return 0

    def release(self) -> None:
        pass


class Call:
    received = 0
    served_by = "fake"
    finished = False  # (the real call is released at `[DONE]`: this one tells nothing, the transcript must)
    instance = SimpleNamespace(name="fake")

    def abort(self) -> bool:
        return True


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"id": "up", "created": 1, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class Engine:
    """An engine call read through `follow`: each `feed()` is one network read, its events what `take()` returns."""

    def __init__(self, reads: list[list[dict[str, Any]]]) -> None:
        self.reads = reads
        self.ended = self.broken = False
        self.call = Call()
        self.events = self
        self._done: asyncio.Future[bool] | None = None
        self._step: Any = None
        self.following = asyncio.Event()

    async def follow(self, step: Any) -> bool:
        self._step = step
        self._done = asyncio.get_running_loop().create_future()
        self.following.set()
        return await self._done

    def feed(self) -> None:
        assert self._done is not None
        result = self._step()
        if result is not None and not self._done.done():
            self._done.set_result(result)

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
        if not self.reads:
            return []
        events = self.reads.pop(0)
        self.ended = not self.reads  # the last read brings `[DONE]`
        return [(e, orjson.dumps(e), bool(e["choices"][0]["delta"].get("content"))) for e in events]

    def close(self) -> None:
        pass


async def test_a_flight_whose_end_came_is_not_stopped_before_its_task_completes_it() -> None:
    """The engine's last read (finish chunk, `[DONE]`) is taken in the connection's callback; the flight completes at
    its task's next step. A stop landing in between (a P0 arriving in the same loop iteration) was taken as a
    resumption: a continuation of a finished answer, a second ending for the clients and the stored result (a code
    review)."""
    api = parse_request(Endpoint.CHAT, orjson.dumps(BODY))
    engine = Engine([[chunk("", role=True), chunk("Hello")], [chunk(" world", finish="stop")]])

    async def open_engine(flight_id: str, request: Any, hold: Any, drop: Any) -> EngineAnswer:
        hold(Lease(), engine.call)
        return cast(EngineAnswer, engine)

    owner = Owner()
    flight = Flight(
        owner,
        "f",
        fingerprint("t", Endpoint.CHAT, BODY),
        api,
        open_engine,
        cancel_policy="immediate",
        max_response_bytes=1 << 20,
    )
    granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def regranted() -> None:
        await granted

    flight.resumable(regranted, chat_continuation=True)
    flight.subscribe()
    flight.task = asyncio.create_task(flight.run())
    async with asyncio.timeout(5):
        await engine.following.wait()  # the task opened its call and follows it
    engine.feed()
    assert flight.stoppable()  # output, not finished: may be stopped and continued
    engine.feed()  # the finish chunk and `[DONE]`, in the callback: the task has not run yet
    assert not flight.stoppable()
    await flight.task
    assert owner.ended == ["completed"] and owner.stopped == 0


class Producing(Lease):
    """A lease whose engine call had produced 5 tokens when it ended."""

    def produced(self, now: float) -> int:
        return 5


@pytest.mark.parametrize("continues", [True, False], ids=["resumed", "restarted"])
async def test_what_a_restarted_flights_stopped_call_produced_is_not_charged(continues: bool) -> None:
    """A flight started over (its dialect cannot continue a message) makes its stopped call's output again: that output
    is not what its leader's tenant pays for (`Flight.produced`, `leader_tokens`). A continued one keeps it."""
    api = parse_request(Endpoint.CHAT, orjson.dumps(BODY))
    engine = Engine([[chunk("", role=True), chunk("Hello")], [chunk(" world", finish="stop")]])

    async def open_engine(flight_id: str, request: Any, hold: Any, drop: Any) -> EngineAnswer:
        hold(Producing(), engine.call)
        return cast(EngineAnswer, engine)

    key = fingerprint("t", Endpoint.CHAT, BODY)
    flight = Flight(Owner(), "f", key, api, open_engine, cancel_policy="immediate", max_response_bytes=1 << 20)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def regranted() -> None:
        await never

    flight.resumable(regranted, chat_continuation=continues)
    flight.subscribe()  # (it takes nothing: its client has been sent nothing)
    flight.task = asyncio.create_task(flight.run())
    async with asyncio.timeout(5):
        await engine.following.wait()
    engine.feed()
    assert flight.stop() is (Plan.RESUME if continues else Plan.RESTART)
    assert flight.engine_tokens == (5 if continues else 0)
    assert flight.produced() == flight.leader_tokens() == flight.engine_tokens
    flight.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await flight.task
