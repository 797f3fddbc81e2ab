"""Memory bounds of de-duplication: a flight's backpressure and history, the result cache's per-entry
cap and its eager expiry. The engine is a fake (`Opened`-like) stream; time is a controlled clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from lockgate.answer import EngineAnswer
from lockgate.config import parse_config
from lockgate.dedup.cache import Result, ResultCache
from lockgate.dedup.coalescer import Coalescer
from lockgate.dedup.fingerprint import fingerprint
from lockgate.dedup.flight import Flight, FlightState
from lockgate.fleet.fleet import Fleet
from lockgate.metrics import GatewayMetrics
from lockgate.wire import ApiRequest, Endpoint, parse_request

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def key(n: int):
    return fingerprint("t", Endpoint.CHAT, {**BASE, "max_tokens": n})


def result(nbytes: int) -> Result:
    return Result(events=({"choices": [{"index": 0, "text": "x"}]},), nbytes=nbytes)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the result cache ---------------------------------------------------------------------------------


def test_a_result_larger_than_the_entry_cap_is_not_cached():
    cache = ResultCache(max_entries=10, max_bytes=10_000, ttl_ms=5000, max_entry_bytes=1000, clock=Clock())
    assert not cache.put(key(1), result(1001))
    assert cache.get(key(1)) is None and len(cache) == 0 and cache.nbytes == 0
    assert cache.statistics()["too_large"] == 1
    assert cache.put(key(2), result(1000))  # at the cap: stored
    assert cache.get(key(2)) is not None


def test_expired_entries_are_dropped_without_a_lookup():
    clock = Clock()
    cache = ResultCache(max_entries=10, max_bytes=10_000, ttl_ms=5000, clock=clock)
    cache.put(key(1), result(10))
    clock.now += 1
    cache.put(key(2), result(10))
    cache.get(key(1))  # a hit does not extend the TTL, nor change the expiry order
    clock.now += 4.5  # key(1) expired, key(2) not
    assert cache.put(key(3), result(10))  # an insert sweeps
    assert len(cache) == 2 and cache.nbytes == 20 and cache.statistics()["expirations"] == 1
    assert cache.next_expiry() == 101 + 5
    clock.now += 10
    assert cache.sweep() == 2  # the timer's sweep: nothing is looked up
    assert len(cache) == 0 and cache.nbytes == 0 and cache.next_expiry() is None


def test_replacing_an_entry_moves_it_to_the_end_of_the_expiry_order():
    clock = Clock()
    cache = ResultCache(max_entries=10, max_bytes=10_000, ttl_ms=5000, clock=clock)
    cache.put(key(1), result(10))
    clock.now += 1
    cache.put(key(2), result(10))
    clock.now += 1
    cache.put(key(1), result(20))  # stored again: expires 5 s from now
    clock.now += 4.5  # key(2) expired (at 106), key(1) not (107)
    assert cache.sweep() == 1
    assert cache.get(key(1)) is not None and cache.get(key(2)) is None


async def test_the_coalescers_timer_drops_expired_results():
    clock = Clock()
    config = parse_config(
        {"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:9"}]}], "result_cache": {"ttl_ms": 50}}
    )
    metrics = GatewayMetrics()
    coalescer = Coalescer(config, metrics, Fleet(config, metrics), clock=clock)  # a fleet never started
    try:
        coalescer.cache.put(key(1), result(10))
        timer = coalescer._sweep_timer
        assert timer is not None  # armed for the entry's expiry
        assert timer.when() - asyncio.get_running_loop().time() == pytest.approx(0.05, abs=0.04)
        clock.now += 0.05
        coalescer.sweep()  # what the timer runs when it fires
        assert len(coalescer.cache) == 0 and coalescer._sweep_timer is None
        # Fired for real: the entry is dropped when it expires, with no lookup. (Awaited through a callback the loop
        # runs just after the coalescer's timer: the cache's methods cannot be patched, it is compiled.)
        coalescer.cache.put(key(2), result(10))
        clock.now += 0.05
        loop = asyncio.get_running_loop()
        timer = coalescer._sweep_timer
        assert timer is not None and len(coalescer.cache) == 1
        after_timer = loop.create_future()
        loop.call_at(timer.when() + 0.001, after_timer.set_result, None)
        async with asyncio.timeout(5):
            await after_timer
        assert coalescer._sweep_timer is None
        assert len(coalescer.cache) == 0
        assert coalescer.cache.statistics()["expirations"] == 2
    finally:
        await coalescer.aclose()
    assert coalescer._sweep_timer is None


# --- a flight's backpressure and history -----------------------------------------------------------------


class Owner:
    def __init__(self) -> None:
        self.ended: list[tuple[str, Result | None]] = []
        self.closed: list[Flight] = []
        self.changed = asyncio.Event()

    def flight_completed(self, flight: Flight, result: Result | None) -> None:
        self.ended.append(("completed", result))

    def flight_failed(self, flight: Flight) -> None:
        self.ended.append(("failed", None))

    def flight_abandoned(self, flight: Flight, partial: Result | None) -> None:
        self.ended.append(("abandoned", partial))

    def flight_closed_to_joiners(self, flight: Flight) -> None:
        self.closed.append(flight)

    def flight_changed(self, flight: Flight) -> None:
        self.changed.set()

    def flight_stopped(self, flight: Flight) -> None:
        self.closed.append(flight)

    def flight_resumed(self, flight: Flight) -> None:
        pass

    async def wait_until(self, predicate: Any) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


def event(n: int) -> dict[str, Any]:
    return {"id": "up", "choices": [{"index": 0, "delta": {"content": f"token {n} " + "x" * 100}}]}


def stream_request() -> ApiRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
    return parse_request(Endpoint.CHAT, orjson.dumps(body))


class FakeEngine:
    """What `open_attempts` returns: a stream of `count` events, one a step, as fast as they are taken, and its
    call counting the payload bytes received (what the flight sizes its buffer by)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.produced = 0
        self.call = SimpleNamespace(received=0, served_by="fake")
        self.broken = False
        self.events = self  # the opened call and its stream in one

    async def follow(self, step: Callable[[], Any]) -> Any:
        while True:
            result = step()
            if result is not None:
                return result
            await asyncio.sleep(0)  # a loop iteration: the next "read" (subscribers run in between)

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
        if self.produced >= self.count:
            return []
        self.produced += 1
        raw = orjson.dumps(event(self.produced - 1))
        self.call.received += len(raw)
        return [(event(self.produced - 1), raw, True)]

    @property
    def ended(self) -> bool:
        return self.produced >= self.count

    def close(self) -> None:
        pass


def start_flight(owner: Owner, engine: FakeEngine, *, lag: int, history: int, policy: str) -> Flight:
    async def open_engine(flight_id: str, request: Any, hold: Any, drop: Any) -> EngineAnswer:
        return cast(EngineAnswer, engine)

    return Flight(
        owner,
        "f",
        key(1),
        stream_request(),
        open_engine,
        cancel_policy=policy,
        max_response_bytes=1 << 20,
        max_lag_bytes=lag,
        max_history_bytes=history,
    )


async def test_a_flight_waits_for_its_slowest_subscriber_and_keeps_within_its_bounds():
    owner = Owner()
    engine = FakeEngine(20_000)
    flight = start_flight(owner, engine, lag=8 * 1024, history=32 * 1024, policy="immediate")
    fast, slow = flight.subscribe(), flight.subscribe()
    task = asyncio.create_task(flight.run())
    try:
        assert await anext(slow) == event(0)  # ... and then it stops reading

        async def read_fast() -> int:
            n = 0
            async for _ in fast:
                n += 1
            return n

        reader = asyncio.create_task(read_fast())
        await owner.wait_until(lambda: flight.waiting_for_readers or flight.done)
        stats = flight.statistics()
        assert stats["waiting_for_readers"], stats
        # Held back by `slow` (1 event read) while the history still holds everything: within the lag bound.
        assert stats["lag_bytes"] <= 8 * 1024 + 1024 and stats["bytes_total"] <= 8 * 1024 + 1024, stats
        assert engine.produced < 100
        # The slow one reads on: the flight follows, past its history bound it closes to joiners and keeps only
        # what is unread.
        for _ in range(400):
            await anext(slow)
        await owner.wait_until(lambda: flight.waiting_for_readers and not flight.joinable)
        stats = flight.statistics()
        assert owner.closed == [flight] and stats["events_total"] > 400
        assert stats["buffered_bytes"] <= 8 * 1024 + 1024 and stats["events_buffered"] < 60, stats
        with pytest.raises(RuntimeError):
            flight.subscribe()
        # The slow subscriber leaves: nothing holds the flight back any more.
        slow.close()
        async with asyncio.timeout(30):
            assert await reader == 20_000
        await task
    finally:
        task.cancel()
    assert flight.state is FlightState.COMPLETED
    assert owner.ended == [("completed", None)]  # part of the history is gone: no result to cache
    assert flight.statistics()["buffered_bytes"] <= 8 * 1024 + 1024
    # What is kept beside each event (its bytes, its byte end, its token flag) is dropped with it.
    assert len(flight._ends) == len(flight._contents) == len(flight._payloads) == len(flight.events) < 60


async def test_a_detached_flight_keeps_no_more_than_its_history():
    """`finish_and_cache` with every client gone: the flight finishes with nobody reading; its buffer
    stays within the history bound (and then holds nothing unread)."""
    owner = Owner()
    engine = FakeEngine(2000)
    flight = start_flight(owner, engine, lag=4 * 1024, history=16 * 1024, policy="finish_and_cache")
    flight.subscribe().close()
    peak = 0

    async with asyncio.timeout(30):
        task = asyncio.create_task(flight.run())
        while not task.done():
            peak = max(peak, flight.statistics()["buffered_bytes"])
            await asyncio.sleep(0)
    assert engine.produced == 2000 and flight.state is FlightState.COMPLETED
    assert peak <= 16 * 1024 + 1024
    assert owner.ended == [("completed", None)]


async def test_a_small_flight_is_replayed_to_late_joiners_and_yields_its_result():
    owner = Owner()
    engine = FakeEngine(20)
    flight = start_flight(owner, engine, lag=1024 * 1024, history=1024 * 1024, policy="immediate")
    first = flight.subscribe()
    await flight.run()
    late = flight.subscribe()  # still joinable: replayed from the start
    assert [e async for e in late] == [event(n) for n in range(20)]
    assert await first.wait_done() == [event(n) for n in range(20)]
    [(how, res)] = owner.ended
    assert how == "completed" and res is not None and len(res.events) == 20


# --- following a flight (streaming subscribers, `respond.pump`) ---------------------------------------------


async def test_a_following_subscriber_takes_each_event_in_the_step_that_brought_it():
    """A streaming subscriber caught up with its flight is handed each event in the flight's own step (the
    engine connection's callback), not by waking its task per event: its task waits in `follow` once."""
    owner = Owner()
    engine = FakeEngine(30)
    flight = start_flight(owner, engine, lag=1024 * 1024, history=1024 * 1024, policy="immediate")
    leader, other = flight.subscribe(), flight.subscribe()
    taken: dict[str, list[tuple[dict[str, Any], bytes | None, bool]]] = {"leader": [], "other": []}
    lags: list[tuple[int, int, int]] = []
    original = engine.follow

    async def checked(step: Callable[[], Any]) -> Any:
        def stepped() -> Any:
            result = step()  # the flight's step: keeps the event and notifies its followers
            lags.append((engine.produced, len(taken["leader"]), len(taken["other"])))
            return result

        return await original(stepped)

    engine.follow = checked  # type: ignore[method-assign]

    following = {"leader": asyncio.Event(), "other": asyncio.Event()}

    def follower(name: str, subscription: Any) -> Callable[[], str | None]:
        def step() -> str | None:
            # `follow` steps at once, then registers its listener in the same synchronous run: once this is set
            # and the test's task runs again, the subscriber is following.
            following[name].set()
            taken[name] += subscription.take()
            return "end" if subscription.ended else None

        return step

    waits = [asyncio.ensure_future(s.follow(follower(n, s))) for n, s in (("leader", leader), ("other", other))]
    async with asyncio.timeout(5):
        for started in following.values():
            await started.wait()  # both follow before the first event
    assert len(flight._followers) == 2
    await flight.run()
    async with asyncio.timeout(5):
        assert await asyncio.gather(*waits) == ["end", "end"]
    # After each step of the flight, both had already taken every event produced so far.
    assert lags and all(produced == a == b for produced, a, b in lags), lags
    assert [e for e, _, _ in taken["leader"]] == [e for e, _, _ in taken["other"]] == [event(n) for n in range(30)]
    # The leader gets the engine's bytes of each event (pass-through); the others rewrite their own id. Each
    # gets the engine call's token flag of every event (counted once, when the engine's bytes were parsed).
    assert [raw for _, raw, _ in taken["leader"]] == [orjson.dumps(event(n)) for n in range(30)]
    assert {raw for _, raw, _ in taken["other"]} == {None}
    assert {c for _, _, c in taken["leader"] + taken["other"]} == {True}
    assert flight._followers == []


async def test_a_late_joiner_takes_its_replay_in_bounded_batches():
    """A client joining a flight with a long history gets it a batch (`TAKE_BYTES`) at a time, so that its
    writer waits for its transport between batches instead of writing the whole replay at once."""
    from lockgate.dedup.flight import TAKE_BYTES

    owner = Owner()
    engine = FakeEngine(1500)  # ~200 KB of events
    flight = start_flight(owner, engine, lag=4 << 20, history=4 << 20, policy="finish_and_cache")
    first = flight.subscribe()
    await flight.run()
    late = flight.subscribe()
    batches = []
    while True:
        batch = late.take()
        if not batch:
            break
        batches.append(batch)
        assert late.backlog is (sum(len(b) for b in batches) < 1500)
        assert not late.ended or not late.backlog
    assert len(batches) >= 3
    assert all(sum(64 + len(orjson.dumps(e)) for e, _, _ in b) <= TAKE_BYTES for b in batches)
    assert [e for b in batches for e, _, _ in b] == [event(n) for n in range(1500)]
    assert late.ended and not late.broken
    assert first.take()[0][0] == event(0)  # the other subscriber's position is its own


async def test_a_failed_flight_hands_its_events_then_its_error():
    """What a flight kept before it failed is taken first; then `broken` says so and `take()` raises its error."""
    from lockgate.errors import UpstreamError

    class FiveThenMore(FakeEngine):
        def __init__(self) -> None:
            super().__init__(1000)
            self.five = asyncio.Event()

        def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
            taken = super().take()
            if self.produced >= 5:
                self.five.set()
            return taken

    owner = Owner()
    engine = FiveThenMore()
    flight = start_flight(owner, engine, lag=1024 * 1024, history=1024 * 1024, policy="immediate")
    subscription = flight.subscribe()
    task = asyncio.create_task(flight.run())
    async with asyncio.timeout(5):
        await engine.five.wait()
    flight.abort(UpstreamError("the engine went away"))  # (True only for a real engine call, closed by it)
    await asyncio.gather(task, return_exceptions=True)
    assert flight.state is FlightState.FAILED
    kept = flight.statistics()["events_total"]
    got: list[dict[str, Any]] = []
    while not subscription.broken:  # events are still there to take
        got += [e for e, _, _ in subscription.take()]
    assert got == [event(n) for n in range(kept)] and kept >= 5
    assert not subscription.ended
    with pytest.raises(UpstreamError, match="went away"):
        subscription.take()


async def test_a_model_a_reload_removed_takes_its_semantic_cache_with_it() -> None:
    """An outside run: a model removed by a reload and added again answered a paraphrase from the semantic cache
    filled before (perhaps in front of other engines now), and its semantic gauges stayed while it was gone."""
    config = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:9"}]}]})
    metrics = GatewayMetrics()
    coalescer = Coalescer(config, metrics, Fleet(config, metrics))  # a fleet never started
    try:
        coalescer.semantic["m"] = cast(Any, object())  # (the real cache loads an embedding model: not needed here)
        coalescer.metrics.bind_semantic("m", lambda: 3.0, lambda: 300.0)
        assert 'lockgate_semantic_cache_entries{model="m"} 3.0' in metrics.render().decode()
        coalescer.forget_models(["m", "never-had-one"])
        assert "m" not in coalescer.semantic
        assert "lockgate_semantic_cache_entries{" not in metrics.render().decode()
    finally:
        await coalescer.aclose()
