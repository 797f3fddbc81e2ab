"""Non-streaming flights: a non-streaming leader's flight asks the engine for one JSON body, shares it with
its non-streaming joiners and the result cache, and never makes a streaming client wait for the whole answer.
And the leader of a streaming flight gets the engine's bytes as they are (pass-through).

What the engine was asked is read from the simulator's own request records (`stream`); the engine is held
(`SimControl.hold` / `hold_next`) so that every client has subscribed before it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from lockgate.assemble import assemble
from lockgate.dedup.flights import MIXED_WINDOW_S
from lockgate.dedup.synthesize import events_of
from lockgate.records import read_records
from lockgate.wire import Endpoint
from tests.conftest import instance
from tests.integration.test_dedup import BODY, call, chat_text, join_in_order, solo, stream_text, wait_subscribers


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def engine_modes(sim) -> list[bool]:
    """`stream` of every generation request the simulator has seen (finished or still open)."""
    records = [*sim.stats.seen, *sim.stats.open.values()]
    return [r.stream for r in records if r.kind == "chat"]


async def test_a_non_streaming_flight_makes_one_json_call_shared_by_its_joiners(start_sim, start_gateway, http):
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    sim.control.hold = True
    tasks = await join_in_order(gw, http, BODY, (False, False, False))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    (flight,) = gw.gateway.dedup.flights.all()
    assert not flight.stream and flight.subscribers == 3
    assert engine_modes(sim) == [False]  # one engine call, for one JSON body
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        results = await asyncio.gather(*tasks)
    expected = await solo(sim, http, BODY)
    bodies = [orjson.loads(raw) for _, _, raw in results]
    assert [status for status, _, _ in results] == [200] * 3
    assert [chat_text(raw) for _, _, raw in results] == [expected] * 3
    assert len({b["id"] for b in bodies}) == 3 and {b["model"] for b in bodies} == {"m"}
    assert all(b["usage"]["completion_tokens"] == 12 for b in bodies)
    assert sorted(h["x-lockgate-cache"] for _, h, _ in results) == ["coalesced", "coalesced", "miss"]
    assert {h["x-lockgate-instance"] for _, h, _ in results} == {sim.url}
    # The body went to the result cache: a non-streaming repeat gets it, a streaming one a stream made of it.
    status, headers, raw = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "hit" and chat_text(raw) == expected
    status, headers, raw = await call(http, gw.url, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["x-lockgate-cache"] == "hit"
    assert stream_text(raw)[0] == expected and b'"usage":{"prompt_tokens"' in raw
    assert engine_modes(sim) == [False, False]  # the flight's, and the solo reference call
    await gw.gateway.records.wait_flushed()
    records = read_records(gw.gateway.records._path)
    assert sorted(r["served_by"] for r in records) == ["coalesced", "coalesced", "hit", "hit", "miss"]
    assert all(r["status"] == "completed" and r["completion_tokens"] == 12 for r in records)


async def test_a_streaming_arrival_during_a_json_flight_gets_a_live_stream(start_sim, start_gateway, http):
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    sim.control.hold_next = 1  # the JSON flight's call is held; whatever comes next is not
    (leader,) = await join_in_order(gw, http, BODY, (False,))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    # The whole stream arrives while the JSON flight is still waiting for its engine.
    async with asyncio.timeout(10):
        status, headers, raw = await call(http, gw.url, {**BODY, "stream": True})
    expected = await solo(sim, http, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "miss"
    assert stream_text(raw)[0] == expected
    flights = gw.gateway.dedup.flights
    (json_flight,) = flights.all()
    assert not json_flight.stream and not json_flight.done and not leader.done()
    # The streaming flight's result is cached: a later non-streaming arrival takes it, without a third call.
    status, headers, raw = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "hit" and chat_text(raw) == expected
    assert not json_flight.done
    sim.release()
    async with asyncio.timeout(10):
        status, headers, raw = await leader
    assert status == 200 and headers["x-lockgate-cache"] == "miss" and chat_text(raw) == expected
    assert sorted(engine_modes(sim)) == [False, False, True]  # the JSON flight, solo, the streaming flight


async def test_after_a_split_non_streaming_leaders_stream_for_a_while(start_sim, start_gateway, http):
    """Clients that mix: once a streaming duplicate needed a call of its own, the model's non-streaming leaders
    lead streaming flights (which streaming duplicates join) until `MIXED_WINDOW_S` has passed."""
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    flights = gw.gateway.dedup.flights
    now = [1000.0]
    flights._clock = lambda: now[0]
    sim.control.hold_next = 1
    (leader,) = await join_in_order(gw, http, BODY, (False,))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    status, headers, _ = await call(http, gw.url, {**BODY, "stream": True})
    assert status == 200 and headers["x-lockgate-cache"] == "miss" and flights.statistics()["splits"] == 1
    sim.release()
    async with asyncio.timeout(10):
        assert (await leader)[0] == 200
    other = {**BODY, "messages": [{"role": "user", "content": "another story"}]}
    sim.control.hold = True
    tasks = await join_in_order(gw, http, other, (False, True))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    (flight,) = flights.all()
    assert flight.stream and flight.subscribers == 2  # one call for both kinds of client
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(10):
        (_, h1, raw1), (_, h2, raw2) = await asyncio.gather(*tasks)
    assert chat_text(raw1) == stream_text(raw2)[0] and (h1["x-lockgate-cache"], h2["x-lockgate-cache"]) == (
        "miss",
        "coalesced",
    )
    now[0] += MIXED_WINDOW_S  # the window passes: JSON flights again
    status, _, _ = await call(http, gw.url, {**BODY, "messages": [{"role": "user", "content": "a third story"}]})
    assert status == 200
    assert engine_modes(sim) == [True, False, True, False]  # split, JSON leader, mixed flight, JSON again


@pytest.mark.parametrize("policy", ["immediate", "cache_partial"])
async def test_the_last_subscriber_leaving_aborts_the_json_call(start_sim, start_gateway, http, policy):
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "cancel_policy": policy, "instances": [instance(sim)]}])
    sim.control.hold = True
    tasks = await join_in_order(gw, http, BODY, (False, False))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    tasks[0].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[0]
    await wait_subscribers(gw, 1)
    assert sim.statistics()["requests_aborted"] == 0  # a joiner is still there
    tasks[1].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[1]
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.requests_aborted == 1)
    dedup = gw.gateway.dedup
    assert len(dedup.flights) == 0 and len(dedup.cache) == 0  # a JSON call has no partial output to keep
    assert gw.gateway.fleet.instances[sim.url].in_flight == 0
    await gw.gateway.registry.wait_empty()
    await gw.gateway.records.wait_flushed()
    records = read_records(gw.gateway.records._path)
    assert [(r["status"], r["cancel_reason"]) for r in records] == [("cancelled", "client_disconnect")] * 2
    sim.control.hold = False
    status, headers, _ = await call(http, gw.url, BODY)
    assert status == 200 and headers["x-lockgate-cache"] == "miss"


async def test_a_detached_json_flight_finishes_into_the_cache(start_sim, start_gateway, http):
    sim = await start_sim(tpot_ms=2.0)
    gw = await start_gateway([{"name": "m", "cancel_policy": "finish_and_cache", "instances": [instance(sim)]}])
    sim.control.hold = True
    (task,) = await join_in_order(gw, http, BODY, (False,))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_subscribers(gw, 0)
    flights = gw.gateway.dedup.flights
    assert len(flights) == 1
    sim.control.hold = False
    sim.release()
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: len(flights) == 0)
    status, headers, raw = await call(http, gw.url, {**BODY, "stream": True})
    assert status == 200 and headers["x-lockgate-cache"] == "hit"
    assert stream_text(raw)[0] == await solo(sim, http, BODY)
    assert sim.statistics()["requests_aborted"] == 0


def test_a_stream_synthesized_from_a_body_assembles_back_to_it():
    chat: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "system_fingerprint": "fp",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                "logprobs": {"content": [{"token": "a", "logprob": -0.1}]},
                "finish_reason": "tool_calls",
            },
            {
                "index": 1,
                # vLLM's whole answer: a reasoning model's `reasoning`, nulls and an empty list, the `stop_reason`.
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "reasoning": "short",
                    "refusal": None,
                    "annotations": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            },
        ],
        "service_tier": None,
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    events = events_of(Endpoint.CHAT, chat)
    assert [e["object"] for e in events] == ["chat.completion.chunk"] * 7 and events[-1]["choices"] == []
    # As an engine streams a choice (an outside run: clients that expect a role-only first chunk saw one chunk with
    # everything): its role, its message, then its finish reason.
    first = [e["choices"][0] for e in events[:3]]
    assert first[0]["delta"] == {"role": "assistant"} and first[0]["finish_reason"] is None  # (content None: tools)
    assert "tool_calls" in first[1]["delta"] and first[1]["finish_reason"] is None
    assert first[2]["delta"] == {} and first[2]["finish_reason"] == "tool_calls"
    assert events[3]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert assemble(Endpoint.CHAT, events, model="m", response_id="x") == chat
    text: dict[str, Any] = {
        "id": "y",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    assert assemble(Endpoint.COMPLETIONS, events_of(Endpoint.COMPLETIONS, text), model="m", response_id="y") == text


async def test_a_streaming_flights_leader_gets_the_engines_bytes_and_a_joiner_its_own_id(
    start_gateway, serve_app, http
):
    """The engine writes its events with spacing orjson would not produce: the leader's stream carries them
    byte for byte (after the first, read while opening); a joiner gets the same content under its own id."""
    gate = asyncio.Event()
    chunk = b'{"id": "e1", "model": "m", "choices": [{"index": 0, "delta": {"content": "%d"}}]}'
    spaced = [chunk % n for n in (1, 2, 3)]

    async def engine(request: web.Request) -> web.StreamResponse:
        assert (await request.json())["stream"] is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + spaced[0] + b"\n\n")
        await gate.wait()
        for payload in spaced[1:]:
            await response.write(b"data: " + payload + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    app.router.add_get("/health", health)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    body = {**BODY, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as leader:
        first = await leader.content.readuntil(b"\n\n")
        joiner = asyncio.create_task(call(http, gw.url, body))
        await wait_subscribers(gw, 2)
        gate.set()
        rest = await leader.read()
    status, headers, raw = await joiner
    assert headers["x-lockgate-cache"] == "coalesced"
    assert orjson.loads(first[6:])["id"] == "e1"
    assert rest == b"".join(b"data: " + p + b"\n\n" for p in spaced[1:]) + b"data: [DONE]\n\n"
    text, ids = stream_text(raw)
    assert status == 200 and text == "123" and len(ids) == 1 and ids != {"e1"}
    assert spaced[1] not in raw  # re-encoded for the joiner, with its own id
