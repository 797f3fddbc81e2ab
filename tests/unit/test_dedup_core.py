"""De-duplication's synchronous core: fingerprints, eligibility, the result cache, subscriptions."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import orjson
import pytest
import xxhash

from lockgate.answer import EngineAnswer
from lockgate.assemble import ClientView, assemble
from lockgate.dedup.cache import MAX_REFUSED, Result, ResultCache
from lockgate.dedup.eligibility import eligible, opted_out
from lockgate.dedup.fingerprint import fingerprint, sampling_scope
from lockgate.dedup.flight import Flight, FlightState
from lockgate.errors import UpstreamProtocolError
from lockgate.wire import Endpoint, parse_request

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}


def fp(body: dict[str, Any], tenant: str = "t", endpoint: Endpoint = Endpoint.CHAT) -> bytes:
    return fingerprint(tenant, endpoint, body).digest


def test_fingerprint_ignores_only_fields_that_do_not_change_the_output():
    same = [
        {**BASE, "stream": True, "stream_options": {"include_usage": True}},
        {**BASE, "user": "alice"},
        {**BASE, "temperature": 0.0, "top_p": None},
        dict(reversed(list(BASE.items()))),
    ]
    for body in same:
        assert fp(body) == fp(BASE)
    assert fp({**BASE, "stop": "x"}) == fp({**BASE, "stop": ["x"]})


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.5},
        {"seed": 1},
        {"max_tokens": 9},
        {"stop": ["x"]},
        {"n": 2},
        {"top_p": 0.9},
        {"logprobs": True},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"logit_bias": {"1": 5}},
        {"frequency_penalty": 0.1},
        {"some_engine_extension": 1},  # unknown parameters count
        {"messages": [{"role": "user", "content": "hi!"}]},
        {"model": "other"},
    ],
)
def test_fingerprint_keeps_apart_anything_that_may_change_the_output(change):
    assert fp({**BASE, **change}) != fp(BASE)


def test_fingerprint_of_whole_numbers_beyond_64_bits():
    """A whole-number float beyond what an integer holds keeps its float form (it once broke the digest)."""
    for big in (1e20, -1e300, 2.0**64, -(2.0**63) - 4096):
        assert fp({**BASE, "top_k": big}) == fp({**BASE, "top_k": big})
    assert fp({**BASE, "x": 2.0**64 - 2048}) == fp({**BASE, "x": 2**64 - 2048})
    assert fp({**BASE, "x": -(2.0**63)}) == fp({**BASE, "x": -(2**63)})
    assert fp({**BASE, "x": 1e20}) != fp({**BASE, "x": 1e21})


def test_fingerprint_isolates_tenants_and_endpoints():
    assert fp(BASE, tenant="a") != fp(BASE, tenant="b")
    prompt = {"model": "m", "prompt": "hi", "temperature": 0}
    assert fp(prompt, endpoint=Endpoint.COMPLETIONS) != fp(prompt, endpoint=Endpoint.CHAT)
    assert sampling_scope("t", Endpoint.CHAT, BASE) == sampling_scope(
        "t", Endpoint.CHAT, {**BASE, "messages": [{"role": "user", "content": "other"}]}
    )
    assert sampling_scope("a", Endpoint.CHAT, BASE) != sampling_scope("b", Endpoint.CHAT, BASE)


def test_eligibility():
    assert eligible("deterministic", {"temperature": 0}, None)
    assert eligible("deterministic", {"temperature": 0.9, "seed": 3}, None)
    assert not eligible("deterministic", {}, None)  # the default temperature is 1
    assert not eligible("deterministic", {"temperature": 0.2}, None)
    assert not eligible("deterministic", {"seed": True}, None)
    assert eligible("always", {"temperature": 1}, None)
    assert not eligible("off", {"temperature": 0}, None)
    assert not eligible("always", {"temperature": 0}, "no-cache")
    assert opted_out("max-age=0, No-Store") and opted_out("no-cache=foo")
    assert not opted_out("max-age=10") and not opted_out(None)


def result(nbytes: int, text: str = "x") -> Result:
    return Result(events=({"choices": [{"index": 0, "text": text}]},), nbytes=nbytes)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(n: int):
    return fingerprint("t", Endpoint.CHAT, {**BASE, "max_tokens": n})


def test_cache_ttl_with_a_deterministic_clock():
    clock = Clock()
    cache = ResultCache(max_entries=10, max_bytes=10_000, ttl_ms=5000, clock=clock)
    assert cache.put(key(1), result(10))
    clock.now += 4.999
    assert cache.get(key(1)) is not None
    clock.now += 0.001
    assert cache.get(key(1)) is None
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.statistics()["expirations"] == 1


def test_a_deleted_response_id_leaves_the_cache_and_is_not_stored_for_a_ttl():
    """`forget_mentioning` (a stored response deleted through the gateway): results carrying the id are dropped, and
    one a flight stores later (it was still running at the delete) is refused until the TTL has passed; the memory of
    deleted ids is bounded."""
    clock = Clock()
    cache = ResultCache(max_entries=10, max_bytes=10_000, ttl_ms=5000, clock=clock)
    gone = b'"resp_1"'
    cache.put(key(1), result(10, text="resp_1"))
    cache.put(key(2), result(10, text="resp_2"))
    assert cache.forget_mentioning(gone) == 1
    assert cache.get(key(1)) is None and cache.get(key(2)) is not None
    assert not cache.put(key(3), Result(body={"id": "resp_1", "output": []}, nbytes=10))
    assert cache.statistics()["refused"] == 1
    clock.now += 5.0
    assert cache.put(key(3), Result(body={"id": "resp_1", "output": []}, nbytes=10))
    for n in range(MAX_REFUSED + 10):
        cache.forget_mentioning(b'"resp_x%d"' % n)
    assert len(cache._refused) == MAX_REFUSED


def test_cache_is_lru_and_bounded_by_entries_and_bytes():
    cache = ResultCache(max_entries=3, max_bytes=100, ttl_ms=60_000, clock=Clock())
    for n in range(3):
        cache.put(key(n), result(10))
    assert cache.get(key(0)) is not None  # 0 is now the most recently used
    cache.put(key(3), result(10))
    assert cache.get(key(1)) is None and cache.get(key(0)) is not None
    cache.put(key(4), result(90))  # the byte bound evicts the least recently used until it fits
    assert cache.nbytes <= 100 and cache.get(key(4)) is not None
    assert not cache.put(key(5), result(101))  # larger than the whole cache: not stored
    for n in range(10_000):  # many distinct results: memory stays bounded
        cache.put(key(100 + n), result(7))
        assert len(cache) <= 3 and cache.nbytes <= 100


def test_cache_serves_partial_results_only_as_partials():
    cache = ResultCache(max_entries=3, max_bytes=100, ttl_ms=1000, clock=Clock())
    partial = Result(events=(), nbytes=5, complete=False)
    cache.put(key(1), partial)
    assert cache.get(key(1)) is None
    assert cache.get_partial(key(1)) is partial
    cache.put(key(1), result(5))
    assert not cache.put(key(1), partial)  # a partial never replaces a complete answer
    assert cache.get(key(1)) is not None


def test_a_stored_result_is_packed_out_of_the_collectors_sight_and_each_read_is_its_own():
    events = chat_events()
    body = {"id": "up", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"}}]}
    streamed, whole = Result(events=events, nbytes=400), Result(body=body, nbytes=100)
    # What the garbage collector walks from a result: no dict, list or tuple of the generation (a full cache is
    # thousands of results; each full collection would walk every event's nested dicts).
    for stored in (streamed, whole):
        assert not [o for o in gc.get_referents(stored) if isinstance(o, (dict, list, tuple))]
    assert streamed.events == tuple(events) and streamed.has_events and streamed.body is None
    assert whole.body == body and whole.events == () and not whole.has_events
    first = streamed.events
    first[1]["choices"][0]["delta"]["content"] = "changed by one reader"
    assert streamed.events == tuple(events)  # the next reader is not affected
    assert whole.body is not whole.body


def test_a_cached_result_takes_no_more_memory_than_the_cache_counts_for_it():
    """The cache's byte bounds count a result by its events' bytes (+64 each, as a flight sizes them); what the
    result keeps alive once its flight is gone must fit in that (parsed, it was ~3.4x over)."""
    events = [
        {**event, "choices": [{**choice, "delta": {"content": f"token {n}"}} for choice in event["choices"]]}
        for n in range(20)
        for event in chat_events()[1:2]
    ]
    payloads = [orjson.dumps(event) for event in events]
    tracemalloc.start()
    try:
        flight = make_flight(Owner())
        push(flight, *(orjson.loads(p) for p in payloads))
        result = flight._result(complete=True)
        del flight
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is not None and result.events == tuple(events)
    assert kept <= result.nbytes == sum(64 + len(p) for p in payloads)


def chat_events() -> list[dict[str, Any]]:
    def chunk(delta, finish=None):
        return {
            "id": "up",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "served",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "a"}),
        chunk({"content": "b"}, "length"),
        {"id": "up", "object": "chat.completion.chunk", "created": 7, "model": "served", "choices": [], "usage": usage},
    ]


def test_assemble_and_client_events():
    events = chat_events()
    body = assemble(Endpoint.CHAT, events, response_id="mine", model="m")
    assert body["id"] == "mine" and body["model"] == "m" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["completion_tokens"] == 2
    quiet = ClientView(response_id="mine", model="m", include_usage=False)
    out = quiet.event(events[1])
    assert out is not None and out["id"] == "mine" and out["model"] == "m" and "usage" not in out
    assert events[1]["id"] == "up"  # the shared event is never mutated
    assert quiet.event(events[3]) is None and quiet.final() is None
    asking = ClientView(response_id="mine", model="m", include_usage=True)
    for event in events:
        asking.event(event)
    final = asking.final()
    assert final is not None
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 5 and final["id"] == "mine"
    completions = [
        {"choices": [{"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]},
    ]
    body = assemble(Endpoint.COMPLETIONS, completions, response_id="c", model="m")
    assert body["choices"][0]["text"] == "ab" and body["choices"][0]["finish_reason"] == "stop"


class Owner:
    def __init__(self) -> None:
        self.ended: list[str] = []

    def flight_completed(self, flight, result):
        self.ended.append("completed")

    def flight_failed(self, flight):
        self.ended.append("failed")

    def flight_abandoned(self, flight, partial):
        self.ended.append("abandoned" if partial is None else f"partial:{len(partial.events)}")

    def flight_closed_to_joiners(self, flight):
        pass

    def flight_changed(self, flight):
        pass

    def flight_stopped(self, flight):
        pass

    def flight_resumed(self, flight):
        pass


def make_flight(owner: Owner, policy: str = "immediate") -> Flight:
    """A streaming flight whose engine call is never opened (the tests drive its events themselves)."""

    async def never_opened(flight_id: str, request: Any, hold: Any, drop: Any) -> EngineAnswer:
        raise AssertionError("not run")

    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
    api = parse_request(Endpoint.CHAT, orjson.dumps(body))
    return Flight(owner, "f", key(1), api, never_opened, cancel_policy=policy, max_response_bytes=1 << 20)


class Read:
    """One read of an engine stream, as a flight's step takes it: each event with the engine's bytes of it."""

    ended = broken = False

    def __init__(self, *events: dict[str, Any]) -> None:
        self._taken = [(event, orjson.dumps(event), True) for event in events]

    def take(self) -> list[tuple[dict[str, Any], bytes, bool]]:
        taken, self._taken = self._taken, []
        return taken


def push(flight: Flight, *events: dict[str, Any]) -> None:
    """The engine's next read brought `events`: the flight keeps them and tells its subscribers."""
    assert flight._step(Read(*events)) is None  # no bound crossed


async def test_late_subscriber_gets_replay_then_live_tail():
    owner = Owner()
    flight = make_flight(owner)
    early = flight.subscribe()
    events = chat_events()
    push(flight, events[0])
    push(flight, events[1])
    assert await anext(early) is events[0]
    late = flight.subscribe()  # joins after two events were produced

    async def read_all(sub):
        return [e async for e in sub]

    readers = [asyncio.create_task(read_all(s)) for s in (early, late)]
    for event in events[2:]:
        await asyncio.sleep(0)  # let the readers block on the live tail
        push(flight, event)
    flight._complete()
    async with asyncio.timeout(5):
        got_early, got_late = await asyncio.gather(*readers)
    assert got_early == events[1:]
    assert got_late == events  # the full replay, then the tail
    assert owner.ended == ["completed"]


async def test_error_reaches_every_subscriber():
    owner = Owner()
    flight = make_flight(owner)
    subs = [flight.subscribe() for _ in range(3)]
    waiter = asyncio.create_task(subs[2].wait_done())
    await asyncio.sleep(0)
    error = UpstreamProtocolError("broken")
    flight._fail(error)
    for sub in subs[:2]:
        with pytest.raises(UpstreamProtocolError) as info:
            await anext(sub)
        assert info.value is error
    with pytest.raises(UpstreamProtocolError):
        await waiter
    assert owner.ended == ["failed"]


@pytest.mark.parametrize(
    ("policy", "expected_state", "ended"),
    [
        ("immediate", FlightState.ABORTED, ["abandoned"]),
        ("cache_partial", FlightState.ABORTED, ["partial:1"]),
        ("finish_and_cache", FlightState.RUNNING, []),
    ],
)
def test_last_subscriber_leaving_applies_the_cancel_policy(policy, expected_state, ended):
    owner = Owner()
    flight = make_flight(owner, policy)
    leader, follower = flight.subscribe(), flight.subscribe()
    push(flight, chat_events()[0])
    leader.close()
    leader.close()  # idempotent
    assert flight.state is FlightState.RUNNING and flight.subscribers == 1  # the leader leaving changes nothing
    follower.close()
    assert flight.state is expected_state
    assert owner.ended == ended


def test_two_tenants_never_share_a_key_even_if_the_hash_collides(monkeypatch: pytest.MonkeyPatch) -> None:
    """xxh3 is not built to resist a crafted collision: the tenant is written out beside the digest, so a collision
    could only ever join a tenant's requests to its own."""
    from lockgate.dedup import fingerprint as module

    monkeypatch.setattr(module, "_digest", lambda obj: b"\0" * 16)  # every request collides
    monkeypatch.setattr(xxhash, "xxh3_128_digest", lambda data: b"\0" * 16)  # the semantic scope's hash too
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    keys = {tenant: module.fingerprint(tenant, Endpoint.CHAT, body) for tenant in ("alice", "bob", "", "alice\0")}
    assert len(set(keys.values())) == 4
    assert module.fingerprint("alice", Endpoint.CHAT, {"prompt": "other"}) == keys["alice"]  # (the collision itself)
    assert module.sampling_scope("alice", Endpoint.CHAT, body) != module.sampling_scope("bob", Endpoint.CHAT, body)
    from lockgate.semantic.cache import probe_input

    api = parse_request(Endpoint.CHAT, orjson.dumps(body))
    alice, bob = probe_input("alice", api), probe_input("bob", api)
    assert alice is not None and bob is not None and alice[0] != bob[0]
