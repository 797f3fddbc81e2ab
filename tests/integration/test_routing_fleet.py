"""Routing against a simulator fleet: ejection and return, retries before the first byte only,
cache affinity, and what /admin/fleet and /metrics show."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean

SYSTEM = "You are the support agent of a large company. Follow the policy carefully. " * 8


def chat(content: str = "hi", *, stream: bool = False, max_tokens: int = 4, system: str = SYSTEM) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http, url, body):
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        return resp.status, resp.headers.get("x-lockgate-instance"), await resp.read()


async def control(http, sim, **changes):
    async with http.post(sim.url + "/sim/control", json=changes) as resp:
        assert resp.status == 200


async def round_robin(start_gateway, named: dict[str, Any], *, retries: int = 1, **extra: Any):
    """A gateway routing model `m` round-robin over the `named` simulators, scraping off."""
    instances = [instance(sim, name=name) for name, sim in named.items()]
    model = {"name": "m", "routing": "round_robin", "retries": retries, "instances": instances}
    return await start_gateway([model], scrape={"enabled": False}, **extra)


async def failing_and_good(start_sim, start_gateway, name: str, *, base_ms: int, max_ms: int):
    """Two simulators, `name` (to be made to fail) and `good`, round-robin, ejected after 2 failures in a row: the
    first and the gateway."""
    failing, good = await start_sim(), await start_sim()
    ejection = {"consecutive_failures": 2, "base_ms": base_ms, "max_ms": max_ms}
    gw = await round_robin(
        start_gateway, {name: failing, "good": good}, health={"interval_ms": 60000, "ejection": ejection}
    )
    return failing, gw


def upstream_errors(gw) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(gw.gateway.metrics.render().decode()):
        if family.name == "lockgate_upstream_errors":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["instance"], s.labels["kind"])] = s.value
    return out


def retries(gw) -> float:
    """`lockgate_upstream_retries_total` of model `m`."""
    for family in text_string_to_metric_families(gw.gateway.metrics.render().decode()):
        if family.name == "lockgate_upstream_retries":
            return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["model"] == "m")
    return 0.0


async def test_ejected_instance_gets_no_traffic_and_returns_after_recovery(start_sim, start_gateway, http, caplog):
    caplog.set_level(logging.WARNING, logger="lockgate.fleet.fleet")
    bad, gw = await failing_and_good(start_sim, start_gateway, "bad", base_ms=50, max_ms=400)
    fleet = gw.gateway.fleet
    bad_instance = fleet.instances[bad.url]
    await control(http, bad, fail_status=503, healthy=False)
    for _ in range(4):  # each failure on `bad` is retried on `good`: clients see no error
        status, name, _ = await post(http, gw.url, chat())
        assert status == 200 and name == "good"
    assert bad_instance.ejection.ejected
    seen_by_bad = bad.statistics()["requests_started"]
    assert seen_by_bad == 2
    for _ in range(6):
        status, name, _ = await post(http, gw.url, chat())
        assert status == 200 and name == "good"
    assert bad.statistics()["requests_started"] == seen_by_bad  # ejected: no traffic at all
    async with http.get(gw.url + "/admin/fleet") as resp:
        described = {i["name"]: i for i in (await resp.json())["instances"]}
    assert described["bad"]["ejection"]["ejected"] is True and described["bad"]["routable"] is False
    # The instance recovers; the next probe after its backoff brings it back (no request needed).
    await control(http, bad, fail_status=None, healthy=True)
    async with asyncio.timeout(5):
        await fleet.wait_until(lambda f: bad_instance.routable)
    names = {(await post(http, gw.url, chat()))[1] for _ in range(4)}
    assert names == {"bad", "good"}
    # Operators see both in the log, at WARNING.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("instance bad ejected") for m in warnings), warnings
    assert "instance bad returns after a successful probe" in warnings


async def test_an_engine_refusing_the_gateways_credentials_is_retried_elsewhere_and_ejected(
    start_sim, start_gateway, http, caplog
):
    """An engine answering 401 (its `api_key` wrong in the gateway's configuration): the client, whose own key is
    fine, was told 401 `invalid_api_key`, and the instance went on taking every other request. Now the request is
    retried on another instance, the instance is ejected as for a 5xx, and the operator is told once."""
    caplog.set_level(logging.WARNING, logger="lockgate.fleet.fleet")
    locked, gw = await failing_and_good(start_sim, start_gateway, "locked", base_ms=60000, max_ms=60000)
    await control(http, locked, fail_status=401)
    for _ in range(4):
        status, name, _ = await post(http, gw.url, chat())
        assert status == 200 and name == "good"
    assert gw.gateway.fleet.instances[locked.url].ejection.ejected
    assert upstream_errors(gw)[("locked", "http_401")] == 2
    warnings = [r.getMessage() for r in caplog.records if "credentials" in r.getMessage()]
    assert warnings == ["instance locked refused the gateway's credentials (401): check its `api_key`"]


async def test_stream_failing_before_its_first_event_is_retried_on_another_instance(start_sim, start_gateway, http):
    broken, good = await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"broken": broken, "good": good})
    # The engine answers 200, then its connection drops before the first token.
    await control(http, broken, reset_after_tokens=0)
    async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(chat(stream=True))) as resp:
        assert resp.status == 200
        assert resp.headers["x-lockgate-instance"] == "good"
        raw = await resp.read()
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert broken.statistics()["requests_started"] == 1
    assert good.statistics()["requests_finished"] == 1
    # It broke after its 200 status (a stream error, not a refused connection): retried all the same.
    assert upstream_errors(gw) == {("broken", "stream"): 1}


async def test_error_status_before_first_byte_is_retried_within_the_retry_budget(start_sim, start_gateway, http):
    a, b, c = await start_sim(), await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"a": a, "b": b, "c": c})
    for sim in (a, b, c):
        await control(http, sim, fail_status=503)
    # One attempt and one retry (the budget), both failing: the engine's error reaches the client.
    status, _, raw = await post(http, gw.url, chat())
    assert status == 503 and b"injected failure" in raw
    assert sum(s.statistics()["requests_started"] for s in (a, b, c)) == 2
    assert retries(gw) == 1


async def test_a_retry_with_no_other_instance_to_go_to_is_not_counted(start_sim, start_gateway, http):
    """An outside run: a one-instance model answering 503 counted a retry in `lockgate_upstream_retries_total`
    ("attempts moved to another instance") though nothing moved (the record said one attempt)."""
    only = await start_sim()
    gw = await round_robin(start_gateway, {"only": only}, retries=2)
    await control(http, only, fail_status=503)
    status, _, _ = await post(http, gw.url, chat())
    assert status == 503 and only.statistics()["requests_started"] == 1
    assert retries(gw) == 0


@pytest.mark.parametrize(("status", "retried"), [(500, True), (400, False)])
async def test_an_engines_500_is_retried_elsewhere_and_a_4xx_is_not(start_sim, start_gateway, http, status, retried):
    failing, good = await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"failing": failing, "good": good})
    await control(http, failing, fail_status=status)
    answers = [await post(http, gw.url, chat()) for _ in range(2)]  # round robin: one of them goes there first
    assert sorted(s for s, _, _ in answers) == ([200, 200] if retried else [200, status])
    assert failing.statistics()["requests_started"] == 1
    assert good.statistics()["requests_finished"] == (2 if retried else 1)
    # A 4xx is the request's, refused: not an error of the instance's in `/admin/fleet` (an outside run read a
    # client's bad requests there as the engine failing).
    engine = next(i for i in gw.gateway.fleet.instances.values() if i.name == "failing")
    assert engine.own.errors == (1 if retried else 0) and (engine.last_error is None) is not retried


async def test_instance_killed_mid_stream_yields_an_sse_error_not_a_retry(start_sim, start_gateway, http):
    doomed, spare = await start_sim(tpot_ms=30.0), await start_sim()
    gw = await round_robin(start_gateway, {"doomed": doomed, "spare": spare}, retries=2)
    body = chat(stream=True, max_tokens=200)
    async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        assert resp.status == 200 and resp.headers["x-lockgate-instance"] == "doomed"
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        await doomed.aclose()  # the engine dies mid-stream
        rest = await resp.content.read()
    events = [e for e in rest.split(b"\n\n") if e.strip()]
    assert b"[DONE]" not in rest
    error = orjson.loads(events[-1].removeprefix(b"data: "))
    assert error["error"]["type"] == "upstream_error"
    assert spare.statistics()["requests_started"] == 0


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["direct", "flight"])
async def test_a_whole_answer_that_breaks_midway_is_retried_elsewhere(
    start_sim, start_gateway, http, tmp_path, temperature
):
    """An outside run: llama.cpp killed while it generated a non-streaming client's answer (which the gateway reads
    as a stream, `stream_upstream_always`) gave the client 502 though the other engine was idle and the client had
    received nothing. The answer is read whole while the call opens, so a break midway goes elsewhere like a break
    before the first event (on the direct path and for a de-duplication flight's JSON answer)."""
    broken, good = await start_sim(), await start_sim()
    instances = [instance(sim, name=name, engine="llamacpp") for name, sim in (("broken", broken), ("good", good))]
    model = {"name": "m", "routing": "round_robin", "retries": 1, "instances": instances}
    gw = await start_gateway([model], scrape={"enabled": False})
    await control(http, broken, reset_after_tokens=3)  # three tokens, then its connection drops
    body = {**chat(max_tokens=8), "temperature": temperature}
    status, name, raw = await post(http, gw.url, body)
    assert status == 200 and name == "good", raw
    answer = orjson.loads(raw)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8
    assert broken.statistics()["requests_started"] == 1 and good.statistics()["requests_finished"] == 1
    assert upstream_errors(gw) == {("broken", "stream"): 1} and retries(gw) == 1
    await gw.gateway.records.wait_flushed()
    [record] = read_records(str(tmp_path / "usage.sqlite3"))
    assert record["attempts"] == 2 and record["status"] == "completed" and record["instance"] == "good"


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["direct", "flight"])
async def test_a_whole_response_that_breaks_midway_is_retried_elsewhere(
    start_sim, start_gateway, http, tmp_path, temperature
):
    """An outside run: a non-streaming Responses request at temperature 0 got 502 when its engine broke midway, the
    other engine idle (the same request without temperature was retried there): its de-duplication flight streams
    from the engine, and a streamed flight with events was never tried again, though its only client, a whole one,
    had been sent nothing. Such a flight starts over elsewhere."""
    broken, good = await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"broken": broken, "good": good})
    await control(http, broken, reset_after_tokens=3)  # three tokens, then its connection drops
    body = {"model": "m", "input": "a whole response", "max_output_tokens": 8, "temperature": temperature}
    async with http.post(gw.url + "/v1/responses", data=orjson.dumps(body)) as resp:
        raw = await resp.read()
        assert resp.status == 200 and resp.headers["x-lockgate-instance"] == "good", raw
    answer = orjson.loads(raw)
    assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 8
    [message] = answer["output"]
    assert len(message["content"][0]["text"].split()) == 8  # one answer's tokens, not the broken call's before them
    assert broken.statistics()["requests_started"] == 1 and good.statistics()["requests_finished"] == 1
    # (The direct path reads the engine's whole answer: its break is a dropped connection; a flight's, a stream's.)
    kind = "disconnect" if temperature else "stream"
    assert upstream_errors(gw) == {("broken", kind): 1} and retries(gw) == 1
    await gw.gateway.records.wait_flushed()
    [record] = read_records(str(tmp_path / "usage.sqlite3"))
    assert record["attempts"] == 2 and record["status"] == "completed" and record["instance"] == "good"


@pytest.mark.parametrize(("endpoint", "whole_leads"), [("chat", False), ("responses", False), ("responses", True)])
async def test_a_whole_answer_sharing_a_stream_that_broke_midway_starts_over_elsewhere(
    start_sim, start_gateway, http, endpoint, whole_leads
):
    """An outside run: a non-streaming request that joined an identical streaming one (temperature 0: one flight) got
    502 when the engine broke midway, where alone it was retried on the other engine: the stream's client had been sent
    part of the generation, so the flight could not start over, and every client got the error. The streaming client
    still gets it (an SSE error event after what it was sent); the whole one, sent nothing, starts over elsewhere."""
    broken, good = await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"broken": broken, "good": good})
    flights = gw.gateway.dedup.flights
    await control(http, broken, reset_after_tokens=3, hold=True)  # held, then three tokens and a dropped connection
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {**chat(max_tokens=8), "temperature": 0}
    else:
        path, body = "/v1/responses", {"model": "m", "input": "shared", "max_output_tokens": 8, "temperature": 0}

    async def ask(stream: bool) -> tuple[int, str | None, bytes]:
        async with http.post(gw.url + path, data=orjson.dumps({**body, "stream": stream})) as resp:
            return resp.status, resp.headers.get("x-lockgate-instance"), await resp.read()

    # (A response's flight streams from the engine whoever leads it: a whole answer may lead, its slot taken again.)
    first = asyncio.create_task(ask(not whole_leads))
    async with asyncio.timeout(5):
        await broken.wait_held(1)
    second = asyncio.create_task(ask(whole_leads))
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["subscribers"] == 2)
    await control(http, broken, hold=False)
    broken.release()
    async with asyncio.timeout(10):
        done = await first, await second
    (lead_status, _, streamed), (status, name, raw) = done[::-1] if whole_leads else done
    assert lead_status == 200 and b"upstream_protocol_error" in streamed.rstrip().split(b"\n\n")[-1]
    assert status == 200 and name == "good", raw
    answer = orjson.loads(raw)
    if endpoint == "chat":
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8
    else:
        assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 8
    assert broken.statistics()["requests_started"] == 1 and good.statistics()["requests_finished"] == 1
    assert retries(gw) == 1
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["in_flight"] == 0)
    assert_gateway_clean(gw.gateway)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["resumable", "flight"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_preemptible_generation_that_breaks_midway_goes_on_elsewhere(
    start_sim, start_gateway, http, tmp_path, stream, temperature
):
    """A P2 request (one generation over several engine calls, `resume.py`) whose engine dropped its connection
    midway ended in 502, or an SSE error, with the other engine idle: its path reads its events itself to be
    preemptible, and a break was never tried elsewhere. It goes on there as after a preemption: continued from the
    tokens it had (the streaming client sees one stream), within the model's `retries`. So does a de-duplicated one
    (temperature 0: a flight, whose every subscriber sees the one stream)."""
    broken, good = await start_sim(), await start_sim()
    gw = await round_robin(start_gateway, {"broken": broken, "good": good})
    await control(http, broken, reset_after_tokens=3)  # three tokens, then its connection drops
    body = {**chat(stream=stream, max_tokens=8), "temperature": temperature}
    async with http.post(
        gw.url + "/v1/chat/completions", data=orjson.dumps(body), headers={"x-priority": "P2"}
    ) as resp:
        assert resp.status == 200
        # (A streaming client's headers went out with its first tokens; a whole answer's name who made it.)
        assert resp.headers["x-lockgate-instance"] == ("broken" if stream else "good")
        raw = await resp.read()
    if stream:
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert sum(1 for c in chunks for choice in c["choices"] if choice["delta"].get("content")) == 8
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    else:
        answer = orjson.loads(raw)
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8
    assert broken.statistics()["requests_started"] == 1 and good.statistics()["requests_finished"] == 1
    # (A JSON flight's engine answers as one body: its break is a dropped connection, not a broken stream.)
    kind = "disconnect" if temperature == 0 and not stream else "stream"
    assert upstream_errors(gw) == {("broken", kind): 1} and retries(gw) == 1
    await gw.gateway.records.wait_flushed()
    [record] = read_records(str(tmp_path / "usage.sqlite3"))
    assert record["status"] == "completed" and record["instance"] == "good" and record["completion_tokens"] == 8


@pytest.mark.parametrize("retries_", [1, 0])
async def test_a_preemptible_generation_with_nowhere_else_to_go_ends_in_its_engines_error(
    start_sim, start_gateway, http, retries_
):
    """With no other instance (or `retries: 0`), a P2 generation that broke midway fails as it did: the engine's
    error (502), not a 503 for the instance it ruled out."""
    broken = await start_sim()
    gw = await round_robin(start_gateway, {"broken": broken}, retries=retries_)
    await control(http, broken, reset_after_tokens=3)
    async with http.post(
        gw.url + "/v1/chat/completions", data=orjson.dumps(chat(max_tokens=8)), headers={"x-priority": "P2"}
    ) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_protocol_error"
    assert broken.statistics()["requests_started"] == 1 and retries(gw) == 0


async def test_an_engine_that_breaks_every_stream_midway_is_ejected(start_sim, start_gateway, http):
    """An outside run: a simulator breaking every stream after 20 tokens kept a third of the traffic, never ejected
    (`consecutive_failures` stayed at 1): each call's success was counted when its headers came, which undid the
    failure of the one before. A call succeeds when its answer is complete."""
    failing, gw = await failing_and_good(start_sim, start_gateway, "failing", base_ms=60_000, max_ms=60_000)
    await control(http, failing, reset_after_tokens=3)
    engine = next(i for i in gw.gateway.fleet.instances.values() if i.name == "failing")
    outcomes = []
    for _ in range(4):  # round robin: two of them there (P1: a break mid-stream reaches the client)
        async with http.post(gw.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=8)) as resp:
            outcomes.append((resp.headers["x-lockgate-instance"], b"[DONE]" in await resp.read()))
    assert sorted(outcomes) == [("failing", False), ("failing", False), ("good", True), ("good", True)]
    assert engine.ejection.ejected and failing.statistics()["requests_started"] == 2
    _, name, _ = await post(http, gw.url, chat())
    assert name == "good"


async def test_conversation_follows_its_cached_prefix_and_admin_fleet_shows_sources(start_sim, start_gateway, http):
    sims = [await start_sim(num_kv_blocks=512) for _ in range(3)]
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(s, name=f"s{n}") for n, s in enumerate(sims)]}],
        scrape={"interval_ms": 60000, "stale_after_ms": 60000},
    )
    fleet = gw.gateway.fleet
    other = "Another product line entirely, with other rules. " * 8
    _, first_home, _ = await post(http, gw.url, chat("turn one", system=SYSTEM))
    _, other_home, _ = await post(http, gw.url, chat("turn one", system=other))
    assert other_home != first_home  # an idle fleet spreads new prefixes
    for turn in range(4):  # later turns extend the prompt: they follow the cached prefix
        _, home, _ = await post(http, gw.url, chat(f"turn one. turn {turn}", system=SYSTEM))
        assert home == first_home
    sim = next(s for n, s in enumerate(sims) if f"s{n}" == first_home)
    assert sim.statistics()["prefix_cache_hit_tokens"] > 0
    await fleet.scraper.scrape_all()
    async with http.get(gw.url + "/admin/fleet") as resp:
        report = await resp.json()
    described = {i["name"]: i for i in report["instances"]}
    home = described[first_home]
    assert home["sources"]["gateway"]["age_s"] >= 0
    assert home["sources"]["gateway"]["ttft_s"] is None  # non-streaming: no first-token time
    engine = home["sources"]["engine"]
    assert engine["stale"] is False and engine["age_s"] < 60
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert engine["prefix_cache_hits"] > 0
    assert home["prefix_index_blocks"] > 0
    pool = report["pools"][0]
    assert pool["policy"] == "predicted_ttft"
    assert 0 < pool["prefix_index"]["blocks"] <= pool["prefix_index"]["max_blocks"]
    metrics = {f.name: f for f in text_string_to_metric_families(gw.gateway.metrics.render().decode())}
    decisions = {
        s.labels["instance"]: s.value
        for s in metrics["lockgate_routing_decisions"].samples
        if s.name.endswith("_total")
    }
    assert decisions[first_home] == 5 and sum(decisions.values()) == 6
    assert {s.labels["instance"] for s in metrics["lockgate_instance_engine_running"].samples} == {"s0", "s1", "s2"}


async def test_health_probe_does_not_reset_load_accounting(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], scrape={"enabled": False})
    fleet = gw.gateway.fleet
    await control(http, sim, delay_first_token_ms=30000)  # the request stays queued there
    task = asyncio.create_task(post(http, gw.url, chat(stream=True)))
    try:
        async with asyncio.timeout(5):
            await sim.wait_until(lambda s: s.stats.requests_started >= 1)
        inst = fleet.instances[sim.url]
        before = (inst.in_flight, inst.own.pending, inst.own.queued_prompt_tokens)
        await fleet.probe_all()
        assert (inst.in_flight, inst.own.pending, inst.own.queued_prompt_tokens) == before
        assert before[:2] == (1, 1) and before[2] > 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_non_streaming_traffic_alone_feeds_the_instances_ttft_and_tpot(start_sim, start_gateway, http):
    """Non-streamed answers carry no first-token time; the fleet still learns TTFT/TPOT from them (a
    fit over answers of different lengths), so load-aware routing works for non-streaming traffic."""
    sim = await start_sim(tpot_ms=5.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, name="only")]}], scrape={"enabled": False})
    for n, tokens in enumerate([4, 24, 8, 32, 12, 40, 6, 20]):
        status, _, _ = await post(http, gw.url, chat(f"question {n}", max_tokens=tokens))
        assert status == 200
    async with http.get(gw.url + "/admin/fleet") as resp:
        fleet = await resp.json()
    (entry,) = [i for i in fleet["instances"] if i["name"] == "only"]
    own = entry["sources"]["gateway"]
    assert own["ttft_s"] is not None and own["ttft_s"] > 0 and own["decode_s"] is not None
    own_state = gw.gateway.fleet.instances[sim.url].own
    assert own_state.whole.slope() > 0  # the per-token time, fitted from the answers' lengths


async def test_the_engines_cache_size_is_learned_and_its_evictions_modelled(start_sim, start_gateway, http):
    """The simulator reports its KV cache like vLLM (`cache_config_info`); the gateway's prefix index then
    keeps no more of that instance's blocks than its cache holds, and says how far its hit-rate
    prediction runs from the engine's."""
    sim = await start_sim(num_kv_blocks=64, block_size=16)  # 1024 tokens: about two of the prompts below
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, name="small")]}], scrape={"interval_ms": 50, "timeout_ms": 500}
    )
    fleet = gw.gateway.fleet
    # The size is applied once an answer's usage has shown how the engine counts tokens.
    status, _, _ = await post(http, gw.url, chat("warm up", system="Prompt W. " + "policy text " * 150))
    assert status == 200
    async with asyncio.timeout(10):
        await fleet.wait_until(lambda f: f.pools["m"].index.capacity(sim.url) is not None)
    pool = fleet.pools["m"]
    ratio = fleet.instances[sim.url].token_ratio.value
    assert pool.index.capacity(sim.url) == int(1024 / ((pool.index.block_chars // 4) * round(ratio, 2)))
    for n in range(6):  # six different long system prompts: more than the cache holds
        status, _, _ = await post(http, gw.url, chat("hi", system=f"Prompt {n}. " + "policy text " * 150))
        assert status == 200
    assert pool.index.blocks_of(sim.url) <= pool.index.capacity(sim.url)
    assert pool.index.engine_evictions > 0
    async with http.get(gw.url + "/admin/fleet") as resp:
        entry = next(i for i in (await resp.json())["instances"] if i["name"] == "small")
    assert entry["prefix_cache"]["tokens"] == 1024
    assert b"lockgate_prefix_hit_rate_gap{" in gw.gateway.metrics.render()


async def test_an_instance_that_fails_its_health_check_is_believed_to_have_lost_its_cache(
    start_sim, start_gateway, http
):
    """A failed health check most likely means a restart: when the instance answers again its cache is
    empty, so the prefix index must not keep sending its prefixes there to miss."""
    sims = [await start_sim() for _ in range(2)]
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(s, name=f"s{n}") for n, s in enumerate(sims)]}],
        health={"interval_ms": 60000},
        scrape={"enabled": False},
    )
    fleet = gw.gateway.fleet
    pool = fleet.pools["m"]
    _, home, _ = await post(http, gw.url, chat("turn one"))
    sim = next(s for n, s in enumerate(sims) if f"s{n}" == home)
    assert pool.index.blocks_of(sim.url) > 0
    await control(http, sim, healthy=False)
    await fleet.probe_all()
    assert not fleet.instances[sim.url].healthy
    assert pool.index.blocks_of(sim.url) == 0
    await control(http, sim, healthy=True)
    await fleet.probe_all()
    assert fleet.instances[sim.url].routable and pool.index.blocks_of(sim.url) == 0
    # The other instance's residency is untouched by it.
    other = next(s for s in sims if s is not sim)
    _, there, _ = await post(http, gw.url, chat("turn one", system="Another system prompt. " * 8))
    assert pool.index.blocks_of(other.url if there != home else sim.url) > 0


async def test_an_instance_that_has_answered_nothing_borrows_its_peers_token_ratio(start_sim, start_gateway, http):
    """An instance whose cache size is unknown counts as full for routing, so one that never answered
    (and so never taught the engine's token ratio) would never be given a request: the size of its
    cache is applied with the ratio its pool's other instances learned."""
    sims = [await start_sim(num_kv_blocks=256, block_size=16) for _ in range(2)]
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(s, name=f"s{n}") for n, s in enumerate(sims)]}],
        scrape={"interval_ms": 50, "timeout_ms": 500},
    )
    fleet = gw.gateway.fleet
    pool = fleet.pools["m"]
    status, home, _ = await post(http, gw.url, chat("warm up"))
    assert status == 200
    idle = next(s for n, s in enumerate(sims) if f"s{n}" != home)
    assert fleet.instances[idle.url].token_ratio.samples == 0
    async with asyncio.timeout(10):
        await fleet.wait_until(lambda f: all(pool.index.capacity(s.url) is not None for s in sims))
    assert pool.index.room(idle.url) == pool.index.capacity(idle.url)


async def test_a_scrape_does_not_wait_behind_generation_requests(start_sim, start_gateway, http):
    """Scrapes have a connection of their own (`Instance.scrapes`): with the instance's only generation
    connection busy, its metrics are still read within the scrape timeout (a scrape queued behind the
    generations would time out exactly when the load it reports matters)."""
    sim = await start_sim(tpot_ms=50.0)
    gw = await start_gateway(
        [{"name": "m", "dedup": "off", "instances": [instance(sim)]}],
        upstream={"max_connections": 1},
        scrape={"enabled": False, "timeout_ms": 1000},
    )
    assert gw.gateway is not None
    fleet = gw.gateway.fleet
    [engine] = fleet.instances.values()
    async with http.post(gw.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=100)) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the stream runs (~5 s): the generation connection is taken
        assert engine.http.statistics().in_use == 1
        await fleet.scraper.scrape_all()
        assert engine.scrape_error is None and engine.engine_load is not None
        assert engine.engine_load.running == 1  # the request in flight, as the engine reports it


async def test_an_engine_never_reachable_is_reported_at_its_first_health_check(start_gateway, caplog):
    """A newcomer's run: an instance URL with nothing listening logged nothing at the default level (every request
    got 503 and the reason was only in `/admin/fleet`'s `last_error`, as a long exception repr)."""
    caplog.set_level(logging.WARNING, logger="lockgate.fleet.fleet")
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    gw = await start_gateway(
        [{"name": "m", "instances": [{"url": f"http://127.0.0.1:{port}", "name": "nowhere"}]}],
        health={"interval_ms": 60000, "timeout_ms": 1000},
    )
    fleet = gw.gateway.fleet
    async with asyncio.timeout(30):  # bounds a hang only: the first check runs at start
        await fleet.wait_until(lambda f: not f.instances[next(iter(f.instances))].healthy)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("instance nowhere is now unhealthy: health check failed: Cannot connect") for m in warnings)


async def test_an_engine_that_does_not_know_the_model_name_is_reported_once(start_sim, start_gateway, http, caplog):
    """A newcomer's run: a model named `llama-3` in front of an engine serving `m` (no `served_model`) answered every
    request with the engine's 404 while `/v1/models` listed it, and nothing pointed at `served_model`."""
    caplog.set_level(logging.WARNING, logger="lockgate.fleet.fleet")
    sim = await start_sim()
    gw = await start_gateway([{"name": "llama-3", "instances": [instance(sim, name="engine")]}])
    for _ in range(2):
        async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps({**chat(), "model": "llama-3"})) as r:
            assert r.status == 404  # the engine's answer, passed on
    hints = [r.getMessage() for r in caplog.records if "served_model" in r.getMessage()]
    assert len(hints) == 1 and hints[0].startswith("instance engine answered 404")


async def test_an_engine_404_about_something_else_than_the_model_gives_no_model_hint(
    start_sim, start_gateway, http, caplog
):
    """A follow-up naming a response its engine no longer holds is the engine's 404 too: nothing to do with the
    model's name (an outside run saw the `served_model` hint for it)."""
    caplog.set_level(logging.WARNING, logger="lockgate.fleet.fleet")
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, name="engine")]}])
    body = {"model": "m", "input": "and?", "max_output_tokens": 2, "previous_response_id": "resp_evicted"}
    async with http.post(gw.url + "/v1/responses", data=orjson.dumps(body)) as r:
        assert r.status == 404 and (await r.json())["error"]["param"] == "previous_response_id"
    assert not [r.getMessage() for r in caplog.records if "served_model" in r.getMessage()]
