"""Preemption with resumption, end to end through the gateway and the simulator.

One pool slot; a P2 request runs (streaming tokens, or held at the engine before its first token);
a P0 request arrives. The simulator is deterministic (temperature 0) and continuation-stable, so the
preempted-and-resumed P2 answer is compared byte for byte with an uninterrupted run of the same
request. Conditions are awaited (client stream chunks, sim stats changes, scheduler changes), never
slept for; the sim's `hold` switch keeps the P0 request at the engine while the test looks at the
re-queued P2 request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import instance
from tests.integration.test_priority import assert_no_leaks, records, until

P0, P2 = 0, 2
NO_STORE = {"Cache-Control": "no-store"}  # never de-duplicated: a flight is stopped only before it shows anything


def chat(n: int, *, max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"tell me a story number {n}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def completion(n: int, *, max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": f"once upon a time {n}", "max_tokens": max_tokens, "temperature": 0, **extra}


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def one_slot(start_sim, start_gateway, *, engine: str = "vllm", tpot_ms: float = 20.0, **scheduling: Any):
    sim = await start_sim(prefill_tps=1e6, tpot_ms=tpot_ms)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, engine=engine, max_concurrency=1)]}],
        scheduling=scheduling,
    )
    return sim, gw, gw.gateway.admission.schedulers["m"]


class Stream:
    """A streaming client: reads SSE events in a task, signals after `after` content chunks."""

    def __init__(self, http: aiohttp.ClientSession, url: str, body: dict[str, Any], priority: str, after: int = 3):
        self.events: list[dict[str, Any]] = []
        self.done = 0
        self.status = 0
        self.started = asyncio.Event()
        self._after = after
        self._task = asyncio.create_task(self._read(http, url + path_of(body), body, priority))

    async def _read(self, http: aiohttp.ClientSession, url: str, body: dict[str, Any], priority: str) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(url, data=orjson.dumps(body), headers={"x-priority": priority, **NO_STORE}) as resp:
            self.status = resp.status
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    self.done += 1
                    continue
                self.events.append(orjson.loads(payload))
                if len(content_events(self.events)) >= self._after:
                    self.started.set()

    async def wait(self) -> None:
        async with asyncio.timeout(10):
            await self._task

    def cancel(self) -> None:
        self._task.cancel()


def content_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("choices") and text_of(e)]


def text_of(event: dict[str, Any]) -> str:
    choice = event["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def stream_summary(events: list[dict[str, Any]]) -> tuple[str, dict[str, Any], set[str], int]:
    """(content, usage, response ids, assistant-role chunks)."""
    text = "".join(text_of(e) for e in events if e.get("choices"))
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    roles = sum(1 for e in events if e.get("choices") and "role" in e["choices"][0].get("delta", {}))
    return text, usage, {e["id"] for e in events}, roles


async def uninterrupted(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    stream = Stream(http, url, body, "P2")
    await stream.wait()
    assert stream.status == 200 and stream.done == 1
    return stream.events


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], priority: str) -> tuple[int, Any]:
    async with http.post(
        url + path_of(body), data=orjson.dumps(body), headers={"x-priority": priority, **NO_STORE}
    ) as resp:
        return resp.status, await resp.json()


def p2_exchange(gw):
    return next(e for e in gw.gateway.registry.all() if e.record.priority == "P2")


def usage_of(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


async def preempt_with_p0(sim, gw, sched, http) -> tuple[asyncio.Task[tuple[int, Any]], str]:
    """The P2 request is running: hold new engine requests, send a P0 one, and check that it takes
    the P2 request's slot at once while the P2 request is aborted at the engine and queued again."""
    p2 = p2_exchange(gw)
    sim.control.hold = True
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    async with asyncio.timeout(5):
        ended = await sim.wait_ended(p2.id)  # the engine saw the abort
        await sim.wait_held(1)  # the P0 request reached the engine
    assert ended["outcome"] == "aborted"
    assert sched.core.running(P0) == 1 and sched.core.queued(P2) == 1 and sched.core.running(P2) == 0
    async with http.get(gw.url + "/admin/requests") as resp:
        phases = {r["priority"]: r["phase"] for r in (await resp.json())["requests"]}
    assert phases == {"P0": "connecting", "P2": "queued"}
    return urgent, p2.id


async def until_generating(sim) -> None:
    """The engine has produced a few tokens of a request it runs."""
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: any(r.completion_tokens >= 3 for r in s.stats.open.values()))


async def let_go(sim) -> None:
    sim.control.hold = False
    sim.release()


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completion"])
async def test_streaming_p2_is_preempted_and_resumed_seamlessly(start_sim, start_gateway, http, make):
    sim, gw, sched = await one_slot(start_sim, start_gateway)
    body = make(1)
    victim = Stream(http, gw.url, body, "P2")
    async with asyncio.timeout(5):
        await victim.started.wait()
    urgent, p2_id = await preempt_with_p0(sim, gw, sched, http)
    await let_go(sim)
    status, answer = await urgent
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    await victim.wait()
    assert victim.status == 200 and victim.done == 1
    text, usage, ids, roles = stream_summary(victim.events)
    # The continuation reached the engine under its own id, after the P0 request.
    assert sim.stats.find(f"{p2_id}-p1") is not None
    expected_text, expected_usage, _, expected_roles = stream_summary(await uninterrupted(http, gw.url, body))
    assert text == expected_text and len(ids) == 1 and roles == expected_roles
    assert usage_of(usage) == usage_of(expected_usage) and usage["completion_tokens"] == 40
    rows = {r["request_id"]: r for r in await records(gw)}
    row = rows[p2_id]
    assert row["status"] == "completed" and row["preemptions"] == 1 and row["restarts"] == 0
    assert row["completion_tokens"] == 40 and row["prompt_tokens"] == expected_usage["prompt_tokens"]
    assert row["attempts"] == 2
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 1.0' in metrics
    # A preemption is a cancellation of the engine generation, by reason `preempted`.
    assert 'lockgate_cancellations_total{model="m",priority="P2",reason="preempted"} 1.0' in metrics
    assert_no_leaks(gw)


async def test_non_streaming_p2_gets_the_complete_answer(start_sim, start_gateway, http):
    sim, gw, sched = await one_slot(start_sim, start_gateway)
    body = chat(2)
    waiting = asyncio.create_task(post(http, gw.url, body, "P2"))
    await until_generating(sim)
    urgent, p2_id = await preempt_with_p0(sim, gw, sched, http)
    await let_go(sim)
    assert (await urgent)[0] == 200
    status, answer = await waiting
    assert status == 200
    _, expected = await post(http, gw.url, body, "P2")
    assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"] == "length"
    assert usage_of(answer["usage"]) == usage_of(expected["usage"])
    # The engine did part of the work once: the resumed call asked only for the rest.
    first = next(r for r in sim.stats.seen if r.request_id == p2_id)
    rest = sim.stats.find(f"{p2_id}-p1")
    assert rest is not None and 3 <= first.completion_tokens < 40
    assert first.completion_tokens + rest.completion_tokens == 40
    rows = {r["request_id"]: r for r in await records(gw)}
    assert rows[p2_id]["preemptions"] == 1 and rows[p2_id]["completion_tokens"] == 40
    assert_no_leaks(gw)


async def test_restarts_before_the_first_byte_when_the_dialect_cannot_continue(start_sim, start_gateway, http):
    # The `openai` dialect cannot continue an assistant message: the held (silent) P2 stream is
    # restarted from scratch; once it has sent something it is no longer preemptible.
    sim, gw, sched = await one_slot(start_sim, start_gateway, engine="openai")
    sim.control.hold = True
    body = chat(3, max_tokens=30)
    victim = Stream(http, gw.url, body, "P2")
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.running(P0) == 1 and core.queued(P2) == 1)
    await let_go(sim)
    assert (await urgent)[0] == 200
    async with asyncio.timeout(5):
        await victim.started.wait()
    # Streaming now, nothing to continue from on this dialect: a P0 arrival waits instead.
    second = asyncio.create_task(post(http, gw.url, chat(98, max_tokens=4), "P0"))
    await until(sched, lambda core: core.queued(P0) == 1)
    assert sched.core.running(P2) == 1
    await victim.wait()
    assert (await second)[0] == 200
    text, usage, _, _ = stream_summary(victim.events)
    expected_text, expected_usage, _, _ = stream_summary(await uninterrupted(http, gw.url, body))
    assert text == expected_text and usage_of(usage) == usage_of(expected_usage)
    rows = [r for r in await records(gw) if r["priority"] == "P2"]
    assert rows[0]["preemptions"] == 1 and rows[0]["restarts"] == 1 and rows[0]["completion_tokens"] == 30
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="restarted",priority="P2"} 1.0' in metrics
    assert 'outcome="resumed"' not in metrics
    assert_no_leaks(gw)


async def test_preemptions_per_request_are_bounded(start_sim, start_gateway, http):
    sim, gw, sched = await one_slot(start_sim, start_gateway, tpot_ms=1.0, preemption={"max_per_request": 1})
    sim.control.hold = True
    body = chat(4, max_tokens=8)
    victim = asyncio.create_task(post(http, gw.url, body, "P2"))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    p2_id = p2_exchange(gw).id
    first = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    async with asyncio.timeout(5):
        await sim.wait_ended(p2_id)
        await sim.wait_held(1)  # the P0 request, at the engine
    # The P0 request finishes; the P2 one gets its slot back and is held at the engine again.
    sim.release()
    assert (await first)[0] == 200
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: s.stats.find(f"{p2_id}-p1") is not None and s.stats.held == 1)
    second = asyncio.create_task(post(http, gw.url, chat(98, max_tokens=4), "P0"))
    await until(sched, lambda core: core.queued(P0) == 1)
    assert sched.core.running(P2) == 1  # preempted once already: not again
    await let_go(sim)
    status, answer = await victim
    assert status == 200 and (await second)[0] == 200
    _, expected = await post(http, gw.url, body, "P2")
    assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
    metrics = gw.gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 1.0' in metrics
    assert_no_leaks(gw)


async def _shared(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """A P2 request that may be de-duplicated (temperature 0, no `Cache-Control`): served by a flight."""
    async with http.post(url + path_of(body), data=orjson.dumps(body), headers={"x-priority": "P2"}) as resp:
        return resp.status, await resp.read()


def _preemptions(gw) -> str:
    return "\n".join(
        line for line in gw.gateway.metrics.render().decode().splitlines() if line.startswith("lockgate_preemptions_")
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_flight_that_has_shown_nothing_is_stopped_and_sent_again(start_sim, start_gateway, http, stream):
    """A P2 flight (a de-duplicable request) held in the engine before its first token when a P0 arrives: flights were
    never preempted, and under a flood of temperature-0 P2 requests P0 waited for whole P2 generations (an outside
    run: P0 TTFT 1-2 s through a flood's first seconds, 67 ms with the same flood sampled). Nobody has seen anything
    of it: its engine call is stopped, and sent again (`-p1`) once the P0 is done."""
    sim, gw, sched = await one_slot(start_sim, start_gateway, tpot_ms=1.0)
    sim.control.hold = True
    body = chat(5, max_tokens=4, stream=stream)
    flight = asyncio.create_task(_shared(http, gw.url, body))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.running(P0) == 1)  # at once: the flight gave its slot up
    assert sched.core.queued(P2) == 1 and sched.core.running(P2) == 0
    await let_go(sim)
    async with asyncio.timeout(10):
        status, raw = await flight
        assert (await urgent)[0] == 200
    assert status == 200
    if stream:
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"content":"') >= 4
    else:
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 4
    assert 'lockgate_preemptions_total{model="m",outcome="restarted",priority="P2"} 1.0' in _preemptions(gw)
    seen = [r.request_id for r in sim.stats.seen]
    assert any(i.endswith("-p1") for i in seen) and sim.stats.requests_aborted >= 1
    # The leader's record counts the stop, as a preempted request's own does (an outside run: always 0).
    leader = next(r for r in await records(gw) if r["priority"] == "P2")
    assert (leader["preemptions"], leader["restarts"]) == (1, 1)
    assert_no_leaks(gw)


async def test_a_flight_with_output_or_a_joiner_is_not_stopped(start_sim, start_gateway, http):
    """What a flight has received may be on its way to several clients, and another client that joined it would pay
    for a stop: neither kind is stopped; the P0 waits for the slot."""
    sim, gw, sched = await one_slot(start_sim, start_gateway, tpot_ms=1.0)
    sim.control.hold = True
    body = chat(6, max_tokens=4)
    leader = asyncio.create_task(_shared(http, gw.url, body))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    joiner = asyncio.create_task(_shared(http, gw.url, body))
    flights = gw.gateway.dedup.flights
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: any(f.subscribed_total == 2 for f in flights.all()))
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.queued(P0) == 1)
    assert sched.core.running(P2) == 1 and "lockgate_preemptions_total{" not in _preemptions(gw)
    await let_go(sim)
    async with asyncio.timeout(10):
        assert (await leader)[0] == 200 and (await joiner)[0] == 200
        assert (await urgent)[0] == 200
    assert "lockgate_preemptions_total{" not in _preemptions(gw)
    assert_no_leaks(gw)


@pytest.mark.parametrize("how", ["client_disconnect", "timeout", "admin"])
async def test_leaving_while_requeued_leaks_nothing(start_sim, start_gateway, http, how):
    sim, gw, sched = await one_slot(start_sim, start_gateway)
    headers = {"x-priority": "P2", **NO_STORE}
    if how == "timeout":
        headers["x-lockgate-timeout-ms"] = "1500"
    body = {**chat(7), "stream": True}
    response: list[aiohttp.ClientResponse] = []
    started = asyncio.Event()

    async def read() -> None:
        async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
            response.append(resp)
            chunks = 0
            async for line in resp.content:
                chunks += b'"content":"' in line and b'"content":""' not in line
                if chunks >= 2:
                    started.set()

    victim = asyncio.create_task(read())
    async with asyncio.timeout(5):
        await started.wait()
    urgent, p2_id = await preempt_with_p0(sim, gw, sched, http)
    if how == "client_disconnect":
        victim.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await victim
    elif how == "admin":
        async with http.delete(f"{gw.url}/admin/requests/{p2_id}") as resp:
            assert resp.status == 200
    await until(sched, lambda core: core.queued(P2) == 0)
    if how != "client_disconnect":
        async with asyncio.timeout(5):
            await victim  # the stream ends with an error event (its status line was 200)
    await let_go(sim)
    assert (await urgent)[0] == 200
    async with asyncio.timeout(5):
        await gw.gateway.registry.wait_empty()
    rows = {r["request_id"]: r for r in await records(gw)}
    row = rows[p2_id]
    assert row["status"] == "cancelled" and row["cancel_reason"] == how and row["preemptions"] == 1
    assert 2 <= row["completion_tokens"] < 40
    assert sim.stats.find(f"{p2_id}-p1") is None  # never resumed
    assert_no_leaks(gw)
    text = gw.gateway.metrics.render().decode()
    assert 'lockgate_permits_in_use{instance="' in text and "lockgate_permits_in_use{" in text
    assert all(
        line.endswith(" 0.0")
        for line in text.splitlines()
        if line.startswith(("lockgate_permits_in_use{", "lockgate_upstream_calls_in_flight{"))
    )


async def first_of(n: int, events: list[asyncio.Event]) -> None:
    """Wait until `n` of `events` are set."""
    waits = {asyncio.ensure_future(e.wait()) for e in events}
    try:
        while len(events) - len(waits) < n:
            _, waits = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def gauges(sim: Any) -> tuple[int, int]:
    """What the simulator runs and queues now."""
    live = sim.engine.gauges()
    return live.running, live.waiting


async def test_a_p0_waiting_for_a_slot_inside_a_full_engine_gets_one_when_its_first_token_is_due(
    start_sim, start_gateway, http
):
    """The engine runs two sequences and both are P2 answers; nothing waits there, so nothing is stopped when a
    P0 stream is sent (the gateway's ceiling is above the engine's slots, as in a flood's first moments, before
    the limit is discovered). The P0 request waits in the engine's queue for a slot. When its first token is due
    and has not come, the newest P2 request there is stopped: the P0 answer is whole while both P2 answers still
    run, and both P2 answers are whole later (one resumed)."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=10.0, max_num_seqs=2)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=8)]}], scrape={"enabled": False}
    )
    gateway = gw.gateway
    await uninterrupted(http, gw.url, chat(0, max_tokens=4))  # the instance's step time is measured
    p2 = [Stream(http, gw.url, chat(n, max_tokens=100), "P2", after=1) for n in (1, 2)]
    async with asyncio.timeout(5):
        await first_of(2, [s.started for s in p2])
    assert gauges(sim) == (2, 0)
    p0 = Stream(http, gw.url, chat(99, max_tokens=4), "P0", after=1)
    await p0.wait()
    assert p0.status == 200 and p0.done == 1 and stream_summary(p0.events)[1]["completion_tokens"] == 4
    assert [s.done for s in p2] == [0, 0]  # without the stop, the P0 request would have waited for one to end
    for stream in p2:
        await stream.wait()
        assert stream.status == 200 and stream.done == 1
        assert stream_summary(stream.events)[1]["completion_tokens"] == 100
    rows = [r for r in await records(gw) if r["priority"] == "P2" and r["preemptions"]]
    assert len(rows) == 1 and rows[0]["status"] == "completed"
    record = await sim.wait_ended(rows[0]["request_id"])
    assert record["outcome"] == "aborted" and record["first_token_at"] is not None  # it was generating
    metrics = gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 1.0' in metrics
    assert_no_leaks(gw)


@pytest.mark.parametrize(("p0_path", "measured"), [("direct", True), ("flight", True), ("direct", False)])
async def test_a_p0_is_not_sent_behind_p2_requests_queued_in_the_engine(
    start_sim, start_gateway, http, p0_path, measured
):
    """The gateway sent an engine more than it runs at once (a ceiling above its two sequence slots, and no scrape
    to discover them: as in a flood's first moments, or a probe above a learned limit). Two P2 requests wait in
    the engine's own queue, first come, first served; a P0 request sent there would wait behind both for slots
    to free, a whole generation each. Before it goes, they are stopped (the engine had not started them: no
    token lost, no prefill counted again) and so is the newest running P2 request, so that the P0 request is
    taken in at the engine's next step. Every P2 request still gets its whole answer, once. The same when the P0
    request leads a de-duplication flight (its engine calls are the flight's), and on a fresh gateway, before any
    stream ended there (`measured=False`: no step time measured yet, only first tokens; a newcomer's P0 waited a
    whole P2 generation there, nothing ever called overdue)."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=20.0, max_num_seqs=2)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=8)]}], scrape={"enabled": False}
    )
    gateway = gw.gateway
    if measured:
        await uninterrupted(http, gw.url, chat(0, max_tokens=4))  # the instance's step time is measured
    streams = [Stream(http, gw.url, chat(n, max_tokens=30), "P2", after=1) for n in (1, 2, 3, 4)]
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: gauges(s) == (2, 2))
        await first_of(2, [s.started for s in streams])  # two answers have begun: the other two wait
    exchanges = [e for e in gateway.registry.all() if e.record.priority == "P2"]
    assert len(exchanges) == 4 and all(e.lease is not None for e in exchanges)
    queued = [e for e in exchanges if not e.lease.answered]
    running = [e.id for e in exchanges if e.lease.answered]
    assert len(queued) == 2
    # Overdue is a matter of time (three of the engine's steps past its estimate): wait until then.
    due = max(e.lease.first_token_due() for e in queued)
    await asyncio.sleep(max(0.0, due - time.monotonic()) + 0.005)
    assert all(e.lease.first_token_due() < time.monotonic() for e in queued)  # both wait in the engine's queue now
    queued_ids = [e.id for e in queued]
    if p0_path == "direct":
        status, answer = await post(http, gw.url, chat(99, max_tokens=4), "P0")
    else:
        async with http.post(
            gw.url + "/v1/chat/completions", json=chat(99, max_tokens=4), headers={"x-priority": "P0"}
        ) as resp:
            status, answer = resp.status, await resp.json()
            assert resp.headers["x-lockgate-cache"] == "miss"
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    for request_id in queued_ids:  # stopped where they waited, never given a slot there
        record = await sim.wait_ended(request_id)
        assert record["outcome"] == "aborted" and record["first_token_at"] is None
    stopped = [rid for rid in running if (await sim.wait_ended(rid))["outcome"] == "aborted"]
    assert len(stopped) == 1
    for stream in streams:
        await stream.wait()
        assert stream.status == 200 and stream.done == 1
        assert stream_summary(stream.events)[1]["completion_tokens"] == 30
    rows = {r["request_id"]: r for r in await records(gw)}
    assert {rid for rid, r in rows.items() if r["preemptions"]} == {*queued_ids, *stopped}
    assert all(r["status"] == "completed" for r in rows.values())
    metrics = gateway.metrics.render().decode()
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 3.0' in metrics
    # Only the running request's work is done again: its prompt and the tokens it had.
    assert 0 < gateway.metrics.scheduling.reprefill_tokens.labels("m")._value.get() < 60
    assert_no_leaks(gw)


async def test_a_request_without_max_tokens_is_not_resumed_past_the_engines_own_cap(start_sim, start_gateway, http):
    """The engine's default cap (here the simulator's 12 tokens) is unknown to the gateway: a continuation got all
    of it again (a stream of 12 + 12 tokens where one run gives 12). Such a request is stopped only while nothing
    has reached its client, and then restarted from scratch; a stream already under way runs to its end."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=20.0, default_max_tokens=12)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=1)]}],
        tenants=[{"name": "default", "tokens_per_minute": 10**6}],
    )
    body = chat(7)
    del body["max_tokens"]
    expected_text, expected_usage, _, _ = stream_summary(await uninterrupted(http, gw.url, body))
    assert expected_usage["completion_tokens"] == 12

    victim = Stream(http, gw.url, body, "P2")
    async with asyncio.timeout(5):
        await victim.started.wait()
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await victim.wait()
    assert (await urgent)[0] == 200
    text, usage, _, _ = stream_summary(victim.events)
    assert text == expected_text and usage_of(usage) == usage_of(expected_usage)

    # Not streamed: nothing reaches the client before the end, so it is restarted (not resumed): the same answer.
    waiting = asyncio.create_task(post(http, gw.url, body, "P2"))
    await until_generating(sim)
    allowance = p2_exchange(gw).allowance
    urgent, p2_id = await preempt_with_p0(sim, gw, sched := gw.gateway.admission.schedulers["m"], http)
    await let_go(sim)
    assert (await urgent)[0] == 200
    status, answer = await waiting
    assert status == 200 and answer["usage"]["completion_tokens"] == 12
    assert answer["choices"][0]["message"]["content"] == expected_text
    rows = {r["request_id"]: r for r in await records(gw)}
    assert rows[p2_id]["restarts"] == 1 and rows[p2_id]["completion_tokens"] == 12
    # Its tenant is charged what it got, not also the output the stop threw away (an outside run: ~115 tokens for
    # an answer of 71).
    assert allowance is not None and allowance.reservation.used == rows[p2_id]["prompt_tokens"] + 12
    assert sched.core.running(P2) == 0
    metrics = gw.gateway.metrics.render().decode()
    assert 'outcome="resumed"' not in metrics
    assert_no_leaks(gw)


async def test_a_whole_p2_response_is_restarted_and_a_streamed_one_runs_on(start_sim, start_gateway, http):
    """The Responses API: a P2 response whose client waits for the whole answer is stopped for a P0 and restarted from
    scratch (nothing was sent; typed events are not continued), its answer the same as an uninterrupted run; once a
    streamed response has sent its first events it is not stopped (the P0 waits for it)."""
    sim, gw, sched = await one_slot(start_sim, start_gateway)
    body = {"model": "m", "input": "tell me a story", "max_output_tokens": 40, "temperature": 0}

    async def respond(payload: dict[str, Any], priority: str) -> tuple[int, Any]:
        headers = {"x-priority": priority, **NO_STORE}
        async with http.post(gw.url + "/v1/responses", data=orjson.dumps(payload), headers=headers) as resp:
            return resp.status, (await resp.json() if not payload.get("stream") else await resp.read())

    waiting = asyncio.create_task(respond(body, "P2"))
    await until_generating(sim)
    urgent, p2_id = await preempt_with_p0(sim, gw, sched, http)
    await let_go(sim)
    assert (await urgent)[0] == 200
    status, answer = await waiting
    assert status == 200 and answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 40
    _, expected = await respond(body, "P2")
    assert answer["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    # Restarted: the second call asked for the whole answer again.
    restarted = sim.stats.find(f"{p2_id}-p1")
    assert restarted is not None and restarted.completion_tokens == 40
    rows = {r["request_id"]: r for r in await records(gw)}
    assert (rows[p2_id]["preemptions"], rows[p2_id]["restarts"], rows[p2_id]["completion_tokens"]) == (1, 1, 40)

    streamed = asyncio.create_task(respond({**body, "stream": True}, "P2"))
    await until_generating(sim)
    second = asyncio.create_task(post(http, gw.url, chat(98, max_tokens=4), "P0"))
    await until(sched, lambda core: core.queued(P0) == 1)
    assert sched.core.running(P2) == 1
    status, raw = await streamed
    assert status == 200 and raw.rstrip().split(b"\n\n")[-1].startswith(b"event: response.incomplete")
    assert (await second)[0] == 200
    assert_no_leaks(gw)


async def test_a_whole_p2_response_of_a_flight_with_output_is_restarted(start_sim, start_gateway, http):
    """An outside run: a non-streaming P2 Responses request at temperature 0 (de-duplicable: a flight, which streams
    from the engine) was never stopped once the engine had sent it events, though its client, waiting for the whole
    answer, had been sent nothing: the P0 waited a whole generation (0.93 s). It is stopped, restarted from scratch,
    and answers what an uninterrupted run does; its tenant is charged what it got, not also what the stop threw
    away."""
    sim = await start_sim(prefill_tps=1e6, tpot_ms=20.0)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=1)]}],
        tenants=[{"name": "default", "tokens_per_minute": 10**6}],
    )
    sched = gw.gateway.admission.schedulers["m"]
    body = {"model": "m", "input": "tell me a story", "max_output_tokens": 40, "temperature": 0}

    async def respond(headers: dict[str, str]) -> tuple[int, Any]:
        async with http.post(gw.url + "/v1/responses", data=orjson.dumps(body), headers=headers) as resp:
            return resp.status, await resp.json()

    waiting = asyncio.create_task(respond({"x-priority": "P2"}))
    await until_generating(sim)
    allowance = p2_exchange(gw).allowance
    [flight] = gw.gateway.dedup.flights.all()
    async with asyncio.timeout(5):
        while flight.tokens < 2:  # the flight has kept output (its subscriber has taken it)
            await flight.wait_changed()
    sim.control.hold = True
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.running(P0) == 1)  # at once: the flight gave its slot up
    assert sched.core.queued(P2) == 1 and sched.core.running(P2) == 0
    await let_go(sim)
    async with asyncio.timeout(10):
        assert (await urgent)[0] == 200
        status, answer = await waiting
    assert status == 200 and answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 40
    _, expected = await respond({"x-priority": "P2", **NO_STORE})
    assert answer["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    assert sim.stats.find(f"{flight.id}-p1") is not None
    assert 'lockgate_preemptions_total{model="m",outcome="restarted",priority="P2"} 1.0' in _preemptions(gw)
    row = next(r for r in await records(gw) if r["priority"] == "P2" and r["completion_tokens"])
    assert allowance is not None and allowance.reservation.used == row["prompt_tokens"] + 40
    assert_no_leaks(gw)


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completion"])
async def test_a_streaming_flight_with_output_is_stopped_and_continued_seamlessly(start_sim, start_gateway, http, make):
    """A P2 flight that has streamed tokens to its client is stopped for a P0 and continued from its output, as a
    sampled request is: its client sees one uninterrupted generation, and the result the flight stores for the next
    identical request is that same generation."""
    sim, gw, _ = await one_slot(start_sim, start_gateway)
    body = {**make(11), "stream": True, "stream_options": {"include_usage": True}}
    expected = await uninterrupted(http, gw.url, body)  # (no-store: not a flight, nothing cached)
    started = asyncio.Event()
    chunks: list[bytes] = []

    async def shared() -> int:
        async with http.post(gw.url + path_of(body), data=orjson.dumps(body), headers={"x-priority": "P2"}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunks.append(line[6:].strip())
                    if sum(b'"content":"' in c or b'"text":"' in c for c in chunks) >= 3:
                        started.set()
            status: int = resp.status
            return status

    victim = asyncio.create_task(shared())
    async with asyncio.timeout(5):
        await started.wait()
    urgent = asyncio.create_task(post(http, gw.url, make(99, max_tokens=4), "P0"))
    async with asyncio.timeout(10):
        assert (await urgent)[0] == 200
        assert await victim == 200
    events = [orjson.loads(c) for c in chunks]
    text, usage, ids, roles = stream_summary(events)
    want_text, want_usage, _, want_roles = stream_summary(expected)
    assert text == want_text and roles == want_roles == (1 if make is chat else 0)
    assert usage_of(usage) == usage_of(want_usage) and len(ids) == 1
    assert 'lockgate_preemptions_total{model="m",outcome="resumed",priority="P2"} 1.0' in _preemptions(gw)
    assert any(r.request_id.endswith("-p1") for r in sim.stats.seen)
    async with http.post(gw.url + path_of(body), data=orjson.dumps(body), headers={"x-priority": "P2"}) as resp:
        assert resp.headers["x-lockgate-cache"] == "hit"
        cached = [orjson.loads(line[6:]) for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: {")]
    assert stream_summary(cached)[:2] == (want_text, want_usage)
    assert_no_leaks(gw)


async def test_an_identical_request_does_not_join_a_stopped_flight(start_sim, start_gateway, http):
    """A stopped flight waits for its P2 slot again: an identical P0 request joined it and waited behind the P2 queue
    (a code review). It now leads a flight of its own."""
    sim, gw, sched = await one_slot(start_sim, start_gateway, tpot_ms=1.0)
    sim.control.hold = True
    body = chat(7, max_tokens=4)
    flight = asyncio.create_task(_shared(http, gw.url, body))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.running(P0) == 1 and core.queued(P2) == 1)  # the flight was stopped
    # The operator's views say so (they read "streaming" and "running", frozen, while the queue gauges counted it).
    async with http.get(gw.url + "/admin/requests") as resp:
        phases = {r["priority"]: r["phase"] for r in (await resp.json())["requests"]}
    async with http.get(gw.url + "/admin/flights") as resp:
        states = sorted((f["state"], f["stops"]) for f in (await resp.json())["flights"])
    assert phases["P2"] == "queued" and states == [("queued", 1)]  # (the P0 is not shared: `post` opts out)

    async def identical_p0() -> str:
        async with http.post(gw.url + path_of(body), data=orjson.dumps(body), headers={"x-priority": "P0"}) as resp:
            assert resp.status == 200
            await resp.read()
            outcome: str = resp.headers["x-lockgate-cache"]
            return outcome

    same = asyncio.create_task(identical_p0())
    await until(sched, lambda core: core.queued(P0) == 1)  # it queued to lead, ahead of the stopped P2
    await let_go(sim)
    async with asyncio.timeout(10):
        assert await same == "miss"
        assert (await flight)[0] == 200 and (await urgent)[0] == 200
    assert_no_leaks(gw)


async def test_a_resumed_flight_takes_joiners_again(start_sim, start_gateway, http):
    """Stopped, a flight left the registry; resumed, it never came back: identical requests waited for its end
    unseen or made a second whole generation of it (an outside run)."""
    sim, gw, sched = await one_slot(start_sim, start_gateway, tpot_ms=20.0)
    sim.control.hold = True
    body = chat(8, max_tokens=100, stream=True, stream_options={"include_usage": True})
    flight = asyncio.create_task(_shared(http, gw.url, body))
    async with asyncio.timeout(5):
        await sim.wait_held(1)
    urgent = asyncio.create_task(post(http, gw.url, chat(99, max_tokens=4), "P0"))
    await until(sched, lambda core: core.running(P0) == 1 and core.queued(P2) == 1)  # the flight was stopped
    await let_go(sim)
    async with asyncio.timeout(10):
        assert (await urgent)[0] == 200
        await sim.stats.wait_until(lambda: any(i.endswith("-p1") for i in sim.stats.open))  # sent again: 2 s of it
    async with http.post(gw.url + path_of(body), data=orjson.dumps(body), headers={"x-priority": "P2"}) as resp:
        assert resp.headers["x-lockgate-cache"] == "coalesced"
        joined = await resp.read()
    async with asyncio.timeout(10):
        status, raw = await flight
    assert status == 200

    def generation(raw: bytes) -> tuple[str, dict[str, Any]]:
        events = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
        text, usage, _, roles = stream_summary(events)
        assert roles == 1
        return text, usage

    assert generation(joined) == generation(raw)  # the one generation, replayed and followed to its end
    assert_no_leaks(gw)


def long_chat(n: int, words: int, *, max_tokens: int = 8) -> dict[str, Any]:
    """A chat whose prompt is `words` tokens to the simulator (a word a token) and about 1.5x that to the gateway's
    estimate (4 characters a token)."""
    return {**chat(n, max_tokens=max_tokens), "messages": [{"role": "user", "content": f"{n} " + "alpha " * words}]}


async def slow_prefill(start_sim, start_gateway, http):
    """An engine that prefills 2,000 tokens a second in chunks of 256 (a step of 128 ms while it prefills, 10 ms
    while it only decodes), behind a gateway that knows its four slots and has measured its step."""
    sim = await start_sim(prefill_tps=2000.0, tpot_ms=10.0, max_num_seqs=4, max_num_batched_tokens=256)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=4)]}], scrape={"enabled": False}
    )
    warm_up = Stream(http, gw.url, chat(0, max_tokens=4), "P1")  # the instance's step time is measured
    await warm_up.wait()
    assert warm_up.status == 200 and warm_up.done == 1
    return sim, gw


def seen(sim: Any, request_id: str) -> list[dict[str, Any]]:
    """The simulator's records of the engine calls of one request, in order (one sent again after a stop is
    `<id>-p<n>`)."""
    return [r.as_dict() for r in sim.stats.seen if r.request_id.split("-p")[0] == request_id]


async def test_a_p0_does_not_wait_behind_a_p2_prompt_in_prefill(start_sim, start_gateway, http):
    """A P2 request's 2,000-token prompt is in the engine's prefill (a second of it), its first token not due yet: a
    P0 request sent there would wait for all of it (the engine gives a running prefill its step's budget before it
    takes a new request in). It is stopped before the P0 goes, with no token out, and sent again after it: the P0
    answer comes while the P2 request has shown nothing, and the P2 answer is whole later, once. The engine keeps
    what it prefilled in its prefix cache: no re-prefill is counted."""
    sim, gw = await slow_prefill(start_sim, start_gateway, http)
    p2 = Stream(http, gw.url, long_chat(1, 2000), "P2", after=1)
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: gauges(s) == (1, 0))  # in prefill
    status, answer = await post(http, gw.url, chat(99, max_tokens=4), "P0")
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert not p2.started.is_set()
    await p2.wait()
    assert p2.status == 200 and p2.done == 1 and stream_summary(p2.events)[1]["completion_tokens"] == 8
    (row,) = [r for r in await records(gw) if r["priority"] == "P2"]
    assert row["status"] == "completed" and row["preemptions"] == 1
    first, again = seen(sim, row["request_id"])
    assert first["outcome"] == "aborted" and first["first_token_at"] is None
    assert again["outcome"] == "finished" and again["cached_tokens"] > 0  # what the first call prefilled
    assert gw.gateway.metrics.scheduling.reprefill_tokens.labels("m")._value.get() == 0
    assert_no_leaks(gw)


@pytest.mark.parametrize(
    ("p0_stream", "long_class"), [(True, "P2"), (False, "P2"), (True, "P1")], ids=["streamed", "whole", "P1"]
)
async def test_a_long_prompt_is_not_sent_where_a_p0_waits_for_its_first_token(
    start_sim, start_gateway, http, p0_stream, long_class
):
    """A P0 request's 1,200-token prompt is in the engine's prefill; a P2 request with a 2,000-token prompt arrives.
    Sent now, the engine would take it into the P0's first step, which would last as long as its prefill: it waits in
    the gateway until the P0's first token, then goes. A short P2 prompt (less than a step of prefill) is sent at once.
    The same for a P0 client that asked for one body: its engine call is a stream (an outside run: read as one body,
    nothing watched it, and non-streamed P0 answers took 7-11 s behind long P2 prompts); and for a P1 request, which
    is not stopped, but waits (an outside run: a P1 flood held P0 first tokens 7-11 s, and P0s timed out queued)."""
    sim, gw = await slow_prefill(start_sim, start_gateway, http)
    if p0_stream:
        p0: Any = Stream(http, gw.url, long_chat(2, 1200), "P0", after=1)
    else:
        p0 = asyncio.create_task(post(http, gw.url, long_chat(2, 1200), "P0"))
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: gauges(s) == (1, 0))  # the P0 prompt in prefill
    long_p2 = Stream(http, gw.url, long_chat(3, 2000), long_class, after=1)
    short_p2 = Stream(http, gw.url, chat(4, max_tokens=4), "P2", after=1)
    async with asyncio.timeout(5):
        await sim.wait_until(lambda s: len(s.stats.open) == 2)  # the short one reached the engine
    if not p0_stream:
        async with asyncio.timeout(10):
            status, answer = await p0
        assert status == 200 and answer["usage"]["completion_tokens"] == 8
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    for stream in (p0, long_p2, short_p2) if p0_stream else (long_p2, short_p2):
        await stream.wait()
        assert stream.status == 200 and stream.done == 1
    ids = {r["priority"] + ("-long" if r["prompt_tokens"] > 1000 else ""): r["request_id"] for r in await records(gw)}
    (urgent,), (held,) = seen(sim, ids["P0-long"]), seen(sim, ids[f"{long_class}-long"])
    (short,) = seen(sim, ids["P2"])
    assert short["started_at"] < urgent["first_token_at"] <= held["started_at"]
    assert gw.gateway.metrics.strict_first_token_waits.labels("m")._value.get() == 1
    assert_no_leaks(gw)
