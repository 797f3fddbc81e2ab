"""`POST /v1/responses` (the Responses API) through the gateway in front of simulators: the openai SDK's
`responses.create`, whole and streamed; the events relayed with their `event:` lines and the client's model name;
usage records; validation; a client that leaves mid-stream; an engine that breaks mid-stream."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

import lockgate.responses
from lockgate.admission.tenants import hash_key
from lockgate.records import read_records
from lockgate.response_ids import MAX_SHOWN_ID_CHARS, ResponseNaming
from tests.conftest import instance
from tests.integration.cancel_support import StreamReader, assert_gateway_clean, counter, wait_sim_idle

SIM = {"prefill_tps": 1e6, "tpot_ms": 1.0}


def rotating(sims: list[Any]) -> list[dict[str, Any]]:
    """Model `m` on `sims` (`sim-0`, `sim-1`, ...), round-robin: a request not pinned moves on to the next one."""
    return [
        {"name": "m", "routing": "round_robin", "instances": [instance(s, name=f"sim-{i}") for i, s in enumerate(sims)]}
    ]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def fleet(start_sim, start_gateway):
    # The engine serves the model under another name: the client's must come back inside every response object.
    sim = await start_sim(("engine-name",), seed=3, **SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, served_model="engine-name")]}])
    return sim, gw


@pytest.fixture
async def client(fleet):
    _, gw = fleet
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_whole_response_through_the_sdk(client, fleet, tmp_path) -> None:
    _, gw = fleet
    raw = await client.responses.with_raw_response.create(
        model="m", input="hello there", instructions="be brief", max_output_tokens=6, temperature=0
    )
    reply = raw.parse()
    assert raw.headers["x-lockgate-cache"] == "miss"  # temperature 0: it led a de-duplication flight
    assert (reply.object, reply.model, reply.status) == ("response", "m", "incomplete")
    assert reply.output_text and reply.usage is not None
    assert reply.usage.output_tokens == 6 and reply.usage.input_tokens > 0
    await gw.gateway.records.wait_flushed()
    (record,) = read_records(str(tmp_path / "usage.sqlite3"))
    assert (record["endpoint"], record["status"], record["stream"]) == ("responses", "completed", 0)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (reply.usage.input_tokens, 6)


async def test_streamed_response_matches_the_whole_one(client, fleet, tmp_path) -> None:
    _, gw = fleet
    items = [{"role": "user", "content": [{"type": "input_text", "text": "tell me"}]}]
    whole = await client.responses.create(model="m", input=items, max_output_tokens=12, temperature=0)
    stream = await client.responses.create(model="m", input=items, max_output_tokens=12, temperature=0, stream=True)
    kinds, text = [], ""
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if hasattr(event, "response"):
            assert event.response.model == "m"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # at max_output_tokens, as OpenAI says it
    assert kinds.count("response.output_text.delta") == 12
    assert text == whole.output_text
    await gw.gateway.records.wait_flushed()
    streamed = [r for r in read_records(str(tmp_path / "usage.sqlite3")) if r["stream"]]
    assert [(r["status"], r["completion_tokens"]) for r in streamed] == [("completed", 12)]
    assert streamed[0]["first_token_at"] is not None


async def test_an_answer_without_a_limit_ends_completed_as_an_engines_does(client) -> None:
    """The simulator ended every answer at a token limit, its own when the client set none: every response
    `incomplete` (the SDK's stream helper then raises: "Didn't receive a response.completed event", a newcomer's
    first try) and every chat answer `length`. Without a limit, its own length is a natural end now."""
    async with client.responses.stream(model="m", input="stream me") as stream:
        final = await stream.get_final_response()
    assert final.status == "completed" and final.output_text
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "stop"
    limited = await client.responses.create(model="m", input="hi", max_output_tokens=3)
    assert limited.status == "incomplete"  # (the client's own limit: as OpenAI says it)


async def test_events_keep_their_type_lines_and_end_without_done(fleet, http) -> None:
    _, gw = fleet
    body = {"model": "m", "input": "hi", "max_output_tokens": 3, "stream": True}
    async with http.post(gw.url + "/v1/responses", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        text = (await resp.read()).decode()
    blocks = [b for b in text.split("\n\n") if b]
    assert b"[DONE]" not in text.encode()
    for block in blocks:
        name, data = block.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
    assert orjson.loads(blocks[-1].split("\n")[1][6:])["response"]["usage"]["output_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": ""}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["text"]}, "input[0]"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"content": "x"}]}, "input[0]"),
        ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "input": "x", "temperature": 9}, "temperature"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "background": "no"}, "background"),
    ],
)
async def test_invalid_requests_get_the_envelope(fleet, http, body, param) -> None:
    sim, gw = fleet
    async with http.post(gw.url + "/v1/responses", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert sim.statistics()["requests_started"] == 0


async def test_unknown_model_is_404(fleet, http) -> None:
    _, gw = fleet
    async with http.post(gw.url + "/v1/responses", json={"model": "nope", "input": "x"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_a_client_leaving_mid_stream_aborts_the_engine_request(fleet, http) -> None:
    sim, gw = fleet
    body = {"model": "m", "input": "a long story", "max_output_tokens": 1000, "stream": True}
    async with asyncio.timeout(10):
        resp = await http.post(gw.url + "/v1/responses", json=body)
        reader = StreamReader(resp)
        await reader.read_tokens(3)
        resp.close()  # the client leaves
        await wait_sim_idle(sim)
        await gw.gateway.registry.wait_empty()
    (rec,) = sim.stats.seen
    assert rec.outcome == "aborted" and rec.completion_tokens < 1000
    assert_gateway_clean(gw.gateway)


async def test_an_engine_breaking_mid_stream_ends_with_an_error_event(fleet, http) -> None:
    sim, gw = fleet
    sim.control.reset_after_tokens = 4
    body = {"model": "m", "input": "x", "max_output_tokens": 50, "stream": True}
    async with asyncio.timeout(5):
        async with http.post(gw.url + "/v1/responses", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
    blocks = [b.split("\n") for b in text.split("\n\n") if b]
    last = blocks[-1]
    assert last[0] == "event: error"
    event = orjson.loads(last[1].removeprefix("data: "))
    assert event["type"] == "error" and event["code"] == "upstream_protocol_error"
    # It follows the engine's events in their numbering (OpenAI's error event has a `sequence_number` too).
    before = orjson.loads(blocks[-2][1].removeprefix("data: "))["sequence_number"]
    assert event["sequence_number"] == before + 1
    assert event["error"]["code"] == "upstream_protocol_error"  # the envelope, for clients that read that
    assert "response.completed" not in text


async def test_a_follow_up_goes_to_the_instance_that_made_the_previous_response(start_sim, start_gateway, http) -> None:
    """`previous_response_id` names a response an engine may have stored: the follow-up is pinned to the instance
    that made it (round-robin would rotate), whole or streamed; an id the gateway never saw is routed as usual."""
    sims = [await start_sim(**SIM) for _ in range(3)]
    gw = await start_gateway(rotating(sims))
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
        first = await r.json()
        home = r.headers["x-lockgate-instance"]
    previous = first["id"]
    for stream in (False, True, False, True):
        body = {
            "model": "m",
            "input": "and?",
            "max_output_tokens": 2,
            "previous_response_id": previous,
            "stream": stream,
        }
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            assert r.status == 200 and r.headers["x-lockgate-instance"] == home
            await r.read()
    # A streamed response's id is remembered too (from its `response.created`).
    body = {"model": "m", "input": "x", "max_output_tokens": 2, "stream": True}
    async with http.post(gw.url + "/v1/responses", json=body) as r:
        streamed_home = r.headers["x-lockgate-instance"]
        created = orjson.loads((await r.read()).split(b"\n\n")[0].split(b"\n")[1][6:])["response"]["id"]
    homes = set()
    for _ in range(3):
        body = {"model": "m", "input": "y", "max_output_tokens": 2, "previous_response_id": created}
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            homes.add(r.headers["x-lockgate-instance"])
    assert homes == {streamed_home}
    unknown = set()
    for _ in range(3):
        body = {"model": "m", "input": "z", "max_output_tokens": 2, "previous_response_id": "resp_never_seen"}
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            unknown.add(r.headers["x-lockgate-instance"])
    assert len(unknown) == 3  # round-robin as usual


async def test_a_follow_up_whose_engine_cannot_take_it_now_is_told_to_retry(start_sim, start_gateway, http) -> None:
    """The engine that holds the previous response is down for a moment (a sidecar restarting, an ejection): the
    follow-up is 503 with Retry-After, not sent to another engine (which answered 404, a status no client retries,
    for a conversation that was only briefly out of reach: an outside run); once it is back, it is served there."""
    sims = [await start_sim(**SIM) for _ in range(2)]
    gw = await start_gateway(rotating(sims))
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
        made, home = await r.json(), r.headers["x-lockgate-instance"]
    fleet = gw.gateway.fleet
    holder = next(i for i in fleet.instances.values() if i.name == home)
    fleet.set_health(holder, False)
    started = [s.statistics()["requests_started"] for s in sims]
    body = {"model": "m", "input": "and?", "max_output_tokens": 2, "previous_response_id": made["id"]}
    for stream in (False, True):
        async with http.post(gw.url + "/v1/responses", json={**body, "stream": stream}) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "previous_response_unavailable"
    assert [s.statistics()["requests_started"] for s in sims] == started  # no engine asked
    fleet.set_health(holder, True)
    async with http.post(gw.url + "/v1/responses", json=body) as r:
        assert r.status == 200 and r.headers["x-lockgate-instance"] == home
    # Gone from the pool for a moment (a sidecar restarting: its engines leave and come back): the same, for the
    # follow-up and for the stored response (a second review: both were sent elsewhere, or 404).
    pool = fleet.pools["m"]
    pool.discard(holder.key)
    async with http.post(gw.url + "/v1/responses", json=body) as r:
        assert r.status == 503 and (await r.json())["error"]["code"] == "previous_response_unavailable"
    async with http.get(gw.url + f"/v1/responses/{made['id']}") as r:
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
    assert [s.statistics()["requests_started"] for s in sims][1 - int(home[-1])] == started[1 - int(home[-1])]


async def test_a_stored_response_whose_engine_is_down_is_told_to_retry(start_sim, start_gateway, http) -> None:
    """An outside run: retrieving a stored response while its engine was down (a member still: not yet ejected) was
    502 `upstream_unreachable`, which no client retries, where the README says 503 `response_unavailable`: only that
    engine holds it, and it may be back in a moment."""
    sim = await start_sim(**SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
        made = await r.json()
    await sim.aclose()
    for method in ("GET", "DELETE"):
        async with http.request(method, gw.url + f"/v1/responses/{made['id']}") as r:
            error = (await r.json())["error"]
            assert (r.status, error["code"], r.headers.get("Retry-After")) == (503, "response_unavailable", "2")
            assert made["id"] in error["message"]


async def test_a_pool_remembers_a_bounded_number_of_responses(fleet) -> None:
    from lockgate.fleet.pool import MAX_RESPONSE_HOMES

    _, gw = fleet
    pool = gw.gateway.fleet.pools["m"]
    for n in range(MAX_RESPONSE_HOMES + 10):
        pool.remember_response(f"resp_{n}", "k", "default")
    homes = pool._response_homes
    assert len(homes) == MAX_RESPONSE_HOMES
    assert "resp_9" not in homes and f"resp_{MAX_RESPONSE_HOMES + 9}" in homes


async def test_a_response_larger_than_one_event_bound_still_ends(start_sim, start_gateway, http) -> None:
    """A response's terminal event carries its whole output: bounded as a whole answer (`max_response_bytes`), not as
    one chat chunk (`max_event_bytes`), or every long answer would break at its end."""
    sim = await start_sim(**SIM)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}], upstream={"max_event_bytes": 1024, "max_response_bytes": 1 << 20}
    )
    body = {"model": "m", "input": "a long story", "max_output_tokens": 600, "stream": True}
    async with http.post(gw.url + "/v1/responses", json=body) as r:
        assert r.status == 200
        blocks = [b for b in (await r.read()).split(b"\n\n") if b]
    last = orjson.loads(blocks[-1].split(b"\n")[1][6:])
    assert last["type"] == "response.incomplete" and len(blocks[-1]) > 1024
    assert last["response"]["usage"]["output_tokens"] == 600


async def test_stored_responses_are_asked_of_the_engine_that_made_them(start_sim, start_gateway, http) -> None:
    """`responses.retrieve`, `input_items.list`, `delete` and `cancel` through the gateway reach the instance that
    made the response (each simulator stores only its own: any other answers 404), with the client's model name."""
    sims = [await start_sim(("engine-name",), **SIM) for _ in range(3)]
    gw = await start_gateway(
        [
            {
                "name": "m",
                "routing": "round_robin",
                "instances": [instance(s, name=f"sim-{i}", served_model="engine-name") for i, s in enumerate(sims)],
            }
        ]
    )
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
        made = [await client.responses.create(model="m", input=f"q{i}", max_output_tokens=3) for i in range(3)]
        for response in made:
            again = await client.responses.retrieve(response.id)
            assert (again.id, again.model, again.output_text) == (response.id, "m", response.output_text)
            items = await client.responses.input_items.list(response.id)
            texts = [(part["type"], part["text"]) for item in items.data for part in item.model_dump()["content"]]
            assert texts == [("input_text", f"q{made.index(response)}")]
        # A follow-up continues the conversation on the engine that holds it (elsewhere: 404 from the engine).
        follow = await client.responses.create(
            model="m", input="and then?", previous_response_id=made[0].id, max_output_tokens=3
        )
        assert follow.usage is not None and made[0].usage is not None
        assert follow.usage.input_tokens > made[0].usage.input_tokens
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(made[1].id)  # not a background response: the engine's 400, passed on
        await client.responses.delete(made[2].id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(made[2].id)  # deleted on its engine
        assert gone.value.status_code == 404
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.retrieve("resp_never_made_here")
        assert isinstance(unknown.value.body, dict) and unknown.value.body["code"] == "response_not_found"
    for query in ("stream=true", "STREAM=yes", "stream=tru%65", "x=1&stream=1"):
        async with http.get(gw.url + f"/v1/responses/{made[0].id}?{query}") as r:
            error = (await r.json())["error"]
            assert (r.status, error["param"], error["code"]) == (400, "stream", "unsupported_value"), query
    async with http.get(gw.url + f"/v1/responses/{made[0].id}?stream=false") as r:
        assert r.status == 200
    # A body on a forwarded route goes to the engine as one request (its Content-Type once).
    async with http.post(gw.url + f"/v1/responses/{made[1].id}/cancel", json={}) as r:
        assert r.status == 400 and "background" in (await r.json())["error"]["message"]
    async with http.get(gw.url + f"/v1/responses/{made[0].id}/nothing") as r:
        assert r.status == 404
    # A route it serves, with a method it does not take there: 405 and what it takes (an outside run: 404).
    for method, path, allow in [("PUT", "", "DELETE, GET"), ("GET", "/cancel", "POST"), ("POST", "", "DELETE, GET")]:
        async with http.request(method, gw.url + f"/v1/responses/{made[0].id}{path}") as r:
            body = await r.json()
            assert (r.status, r.headers["Allow"], body["error"]["code"]) == (405, allow, "method_not_allowed"), method


MADE = {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": []}


async def stored_engine(serve_app, start_gateway, http, retrieve) -> tuple[Any, str]:
    """A gateway in front of a fake engine that makes response `resp_1` (`MADE`) and answers its retrieval with
    `retrieve`; the gateway and the id its client was shown for it."""

    async def create(request: web.Request) -> web.Response:
        return web.json_response(MADE)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_get("/health", health)
    gw = await start_gateway([{"name": "m", "instances": [{"url": await serve_app(app), "engine": "vllm"}]}])
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi"}) as r:
        return gw, (await r.json())["id"]


async def test_a_stored_route_is_recorded_under_the_request_id_its_engine_was_told(
    serve_app, start_gateway, http, tmp_path
) -> None:
    """A stored route forwarded to an engine is a request: one usage record (an outside run found none: no trail of
    who read or deleted what), under the id the engine was told, which its answer carries unless the client sent
    its own (a second id was made for the answer); found or not."""
    told: list[str] = []

    async def retrieve(request: web.Request) -> web.Response:
        told.append(request.headers["x-request-id"])
        if len(told) == 2:  # (deleted meanwhile)
            return web.json_response({"error": {"message": "gone", "type": "NotFoundError"}}, status=404)
        return web.json_response(MADE)

    gw, shown = await stored_engine(serve_app, start_gateway, http, retrieve)
    async with http.get(gw.url + f"/v1/responses/{shown}") as r:
        assert r.status == 200 and r.headers["x-request-id"] == told[-1]
    async with http.get(gw.url + f"/v1/responses/{shown}") as r:
        assert r.status == 404 and r.headers["x-request-id"] == told[-1]
    async with http.get(gw.url + f"/v1/responses/{shown}", headers={"x-request-id": "mine"}) as r:
        assert r.status == 200 and r.headers["x-request-id"] == "mine" and told[-1] != "mine"
    async with http.get(gw.url + "/v1/responses/resp_never_made") as r:
        assert r.status == 404  # (refused before any engine: no record, as for the endpoints)
    await gw.gateway.records.wait_flushed()
    rows = [r for r in read_records(str(tmp_path / "usage.sqlite3")) if r["endpoint"] != "responses"]
    assert [(r["request_id"], r["endpoint"], r["status"], r["http_status"], r["model"]) for r in rows] == [
        (told[0], "responses.retrieve", "completed", 200, "m"),
        (told[1], "responses.retrieve", "rejected", 404, "m"),
        (told[2], "responses.retrieve", "completed", 200, "m"),
    ]
    assert rows[2]["client_request_id"] == "mine" and all(r["instance"] for r in rows)


async def test_a_stored_routes_engine_failure_counts_against_the_instance(
    serve_app, start_gateway, http, tmp_path
) -> None:
    """A 5xx (or a failed connection) on a stored route is the instance's failure, as on a generation: reported to
    the fleet (health, ejection), not only passed on to the client."""

    async def retrieve(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "store is broken", "type": "InternalError"}}, status=500)

    gw, shown = await stored_engine(serve_app, start_gateway, http, retrieve)
    async with http.get(gw.url + f"/v1/responses/{shown}") as r:
        assert r.status == 500 and "store is broken" in (await r.json())["error"]["message"]
    [engine] = gw.gateway.fleet.instances.values()
    assert engine.last_error is not None and "store is broken" in engine.last_error
    await gw.gateway.records.wait_flushed()
    [stored] = [r for r in read_records(str(tmp_path / "usage.sqlite3")) if r["endpoint"] == "responses.retrieve"]
    assert (stored["status"], stored["http_status"]) == ("error", 500) and "store is broken" in stored["error"]


async def test_a_tenant_cannot_reach_another_tenants_stored_response(start_sim, start_gateway, http) -> None:
    sim = await start_sim(**SIM)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "a", "keys": [hash_key("key-a")]}, {"name": "b", "keys": [hash_key("key-b")]}],
    )
    body = {"model": "m", "input": "secret", "max_output_tokens": 2}
    async with http.post(gw.url + "/v1/responses", json=body, headers={"Authorization": "Bearer key-a"}) as r:
        made = (await r.json())["id"]
    async with http.get(gw.url + f"/v1/responses/{made}", headers={"Authorization": "Bearer key-b"}) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
    async with http.get(gw.url + f"/v1/responses/{made}") as r:
        assert r.status == 401
    async with http.get(gw.url + f"/v1/responses/{made}", headers={"Authorization": "Bearer key-a"}) as r:
        assert r.status == 200 and (await r.json())["id"] == made
    # Nor continue it: the engine would put tenant a's conversation in front of b's request.
    follow = {**body, "input": "what did they say?", "previous_response_id": made}
    async with http.post(gw.url + "/v1/responses", json=follow, headers={"Authorization": "Bearer key-b"}) as r:
        assert r.status == 404
        error = (await r.json())["error"]
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    async with http.post(gw.url + "/v1/responses", json=follow, headers={"Authorization": "Bearer key-a"}) as r:
        assert r.status == 200
    assert sim.statistics()["requests_started"] == 2
    # Counted as the endpoints' requests are, refused or served (an outside run: stored routes moved no counter).
    for method in ("DELETE", "POST"):
        path = f"/v1/responses/{made}" + ("/cancel" if method == "POST" else "")
        async with http.request(method, gw.url + path, headers={"Authorization": "Bearer key-b"}) as r:
            assert r.status == 404
    async with http.get(gw.url + "/v1/responses/x/nothing", headers={"Authorization": "Bearer key-b"}) as r:
        assert r.status == 404
    m = gw.gateway.metrics
    assert counter(m.endpoint_requests, endpoint="responses.retrieve", status="rejected") == 2  # (b's, the keyless)
    assert counter(m.endpoint_requests, endpoint="responses.retrieve", status="completed") == 1
    assert counter(m.endpoint_requests, endpoint="responses.delete", status="rejected") == 1
    assert counter(m.endpoint_requests, endpoint="responses.cancel", status="rejected") == 1
    assert counter(m.endpoint_requests, endpoint="responses.unknown", status="rejected") == 1
    assert counter(m.requests, model="", status="rejected") == 6  # (those five, and b's follow-up)
    assert counter(m.requests, model="m", priority="", status="completed") == 1  # (a's retrieve: no class)


async def test_with_tenants_names_the_gateway_cannot_bind_are_refused(start_sim, start_gateway, http) -> None:
    """A `conversation` or an `item_reference` names something in a store every tenant shares: refused with tenants
    (400, before any engine sees it); an open gateway (one party) passes them on."""
    sim = await start_sim(**SIM)
    models = [{"name": "m", "instances": [instance(sim)]}]
    tenanted = await start_gateway(models, tenants=[{"name": "a", "keys": [hash_key("key-a")]}])
    a = {"Authorization": "Bearer key-a"}
    hi = {"role": "user", "content": "hi"}
    reference = {"type": "item_reference", "id": "msg_of_another_tenant"}
    for extra, param in (
        ({"input": "hi", "conversation": "conv_of_another_tenant"}, "conversation"),
        ({"input": [hi, reference]}, "input[1]"),
        ({"input": [hi, {**reference, "type": "Item_Reference"}]}, "input[1]"),  # whatever its spelling
    ):
        async with http.post(tenanted.url + "/v1/responses", json={"model": "m", **extra}, headers=a) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert sim.statistics()["requests_started"] == 0
    open_gateway = await start_gateway(models)
    body = {"model": "m", "input": [hi, reference], "max_output_tokens": 2}
    async with http.post(open_gateway.url + "/v1/responses", json=body) as r:
        assert r.status == 200
    assert sim.statistics()["requests_started"] == 1


def _fake_responses_engine() -> web.Application:
    """A Responses engine whose answer the request's `input` picks: `fail` (the engine fails the response: streamed
    `response.failed`, whole `status: failed`), `cut` (the stream ends after a delta, without a terminal event), else
    a completed response without `completed_at` (as llama.cpp streams it)."""

    def response(status: str, text: str | None, **extra: Any) -> dict[str, Any]:
        output = (
            []
            if text is None
            else [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
        )
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        return {
            "id": "resp_fake",
            "object": "response",
            "status": status,
            "model": "m",
            "output": output,
            "usage": usage,
            **extra,
        }

    failed = {"error": {"code": "server_error", "message": "the model crashed"}}

    async def create(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = body["input"]
        if not body.get("stream"):
            whole = response("failed", None, **failed) if mode == "fail" else response("completed", "hi")
            return web.json_response(whole)
        events: list[dict[str, Any]] = [{"type": "response.created", "response": response("in_progress", None)}]
        if mode == "nodelta":  # the output item sent whole, no delta event
            item = response("completed", "hi")["output"][0]
            events.append({"type": "response.output_item.added", "output_index": 0, "item": item})
            events.append({"type": "response.output_item.done", "output_index": 0, "item": item})
        elif mode != "fail":
            events.append({"type": "response.output_text.delta", "delta": "hi"})
        if mode == "fail":
            events.append({"type": "response.failed", "response": response("failed", None, **failed)})
        elif mode != "cut":
            events.append({"type": "response.completed", "response": response("completed", "hi")})
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for event in events:
            await stream.write(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")
        await stream.write_eof()
        return stream

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "total_slots": 2})

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/health", health)
    app.router.add_get("/props", health)
    return app


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])  # llama.cpp's dialect reads every answer as a stream
async def test_a_response_the_engine_failed_is_recorded_as_an_error(
    engine, serve_app, start_gateway, http, tmp_path
) -> None:
    url = await serve_app(_fake_responses_engine())
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": engine}]}])
    for stream in (True, False):
        body = {"model": "m", "input": "fail", "stream": stream}
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            assert r.status == 200  # the client gets the engine's failed response, as the engine said it
            raw = await r.read()
        assert b"the model crashed" in raw
    await gw.gateway.records.wait_flushed()
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert [(r["status"], r["error"]) for r in rows] == [("error", "the model crashed")] * 2


async def test_a_response_stream_cut_before_its_end_says_so(serve_app, start_gateway, http) -> None:
    url = await serve_app(_fake_responses_engine())
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "cut", "stream": True}) as r:
        last = [b for b in (await r.read()).split(b"\n\n") if b][-1].split(b"\n")
    assert last[0] == b"event: error"
    assert "without its terminal event (response.completed)" in orjson.loads(last[1][6:])["message"]


async def test_a_whole_response_from_an_engine_stream_says_when_it_completed(serve_app, start_gateway, http) -> None:
    url = await serve_app(_fake_responses_engine())
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "llamacpp"}]}])
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "ok"}) as r:
        whole = await r.json()
    assert whole["status"] == "completed" and isinstance(whole["completed_at"], int)
    assert whole["output"][0]["content"][0]["text"] == "hi"


async def test_a_whole_response_served_again_says_when_it_completed_not_when_served(fleet, http, monkeypatch) -> None:
    """An outside run: the same whole response served again from the result cache (its id the same) gave another
    `completed_at` each time, the time it was served: the gateway stamps one where the engine's stream carried none
    (as the simulator's does not). It is the time the generation ended, for every answer of it."""
    clock = itertools.count(2_000_000_000, 1000)  # (where the gateway would still ask the time at each answer)
    monkeypatch.setattr(lockgate.responses, "time", SimpleNamespace(time=lambda: next(clock)))
    body = {"model": "m", "input": "when did it end", "temperature": 0}  # (no limit: it ends `completed`)
    answers = []
    for _ in range(2):
        async with http.post(fleet[1].url + "/v1/responses", json=body) as r:
            answers.append((r.headers["x-lockgate-cache"], await r.json()))
    (first_outcome, first), (second_outcome, second) = answers
    assert (first_outcome, second_outcome) == ("miss", "hit") and first["id"] == second["id"]
    assert first["status"] == "completed" and isinstance(first["completed_at"], int)
    assert second["completed_at"] == first["completed_at"] >= first["created_at"]


async def test_a_response_event_past_its_bound_names_the_bound_it_passed(start_sim, start_gateway, http) -> None:
    sim = await start_sim(**SIM)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}], upstream={"max_event_bytes": 1024, "max_response_bytes": 4096}
    )
    body = {"model": "m", "input": "a long story", "max_output_tokens": 2000, "stream": True}
    async with http.post(gw.url + "/v1/responses", json=body) as r:
        last = [b for b in (await r.read()).split(b"\n\n") if b][-1].split(b"\n")
    error = orjson.loads(last[1][6:])
    assert error["code"] == "upstream_response_too_large"
    assert "larger than upstream.max_response_bytes (4096 bytes)" in error["message"]


async def test_identical_responses_share_one_engine_call_and_its_stored_result(fleet, http) -> None:
    """Temperature 0: identical responses in flight share one engine call (streamed or whole, every client gets the
    engine's events and response id), a later one is served from the stored result (replayed with its `event:`
    lines), and a follow-up of the shared response still goes to the engine that made it."""
    sim, gw = fleet
    flights = gw.gateway.dedup.flights
    body = {"model": "m", "input": "the same question", "max_output_tokens": 8, "temperature": 0}

    async def ask(payload: dict[str, Any]) -> tuple[str, bytes]:
        async with http.post(gw.url + "/v1/responses", json=payload) as r:
            assert r.status == 200
            return r.headers["x-lockgate-cache"], await r.read()

    sim.control.hold = True
    leader = asyncio.create_task(ask({**body, "stream": True}))
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["subscribers"] == 1)
    joiner = asyncio.create_task(ask(body))
    async with asyncio.timeout(5):
        await flights.wait_until(lambda: flights.statistics()["subscribers"] == 2)
        await sim.wait_held(1)
    sim.control.hold = False
    sim.release()
    (lead_outcome, streamed), (join_outcome, whole) = await leader, await joiner
    assert (lead_outcome, join_outcome) == ("miss", "coalesced")
    assert sim.statistics()["requests_started"] == 1
    events = [orjson.loads(b.split(b"\n")[1][6:]) for b in streamed.split(b"\n\n") if b]
    final = events[-1]["response"]
    answer = orjson.loads(whole)
    assert answer["id"] == final["id"] and answer["model"] == "m"  # one id for both, the client's model name
    assert answer["output"][0]["content"][0]["text"] == final["output"][0]["content"][0]["text"]
    # Served from the stored result: replayed as it came.
    outcome, replayed = await ask({**body, "stream": True})
    assert outcome == "hit" and sim.statistics()["requests_started"] == 1
    blocks = [b for b in replayed.split(b"\n\n") if b]
    assert [b.split(b"\n")[0] for b in blocks] == [b"event: " + e["type"].encode() for e in events]
    # The joiner's response id leads back to the engine that made it.
    home = gw.gateway.fleet.pools["m"].response_home(answer["id"].rsplit("_lg", 1)[0])
    assert home is not None and home[0] == gw.gateway.fleet.pools["m"].instances[0].key


async def test_a_deleted_response_is_not_handed_out_again_from_the_result_cache(fleet, http) -> None:
    """An outside run: after `DELETE /v1/responses/{id}`, the same temperature-0 request within the cache's TTL was a
    cache hit carrying the deleted id (which the gateway then answered 404 for, and refused as a
    `previous_response_id`). A delete through the gateway drops cached results carrying the id (a flight still
    running when its response is deleted does not store it: `test_dedup_core`)."""
    _, gw = fleet
    body = {"model": "m", "input": "delete me", "max_output_tokens": 5, "temperature": 0}

    async def ask(payload: dict[str, Any]) -> tuple[str, str]:
        async with http.post(gw.url + "/v1/responses", json=payload) as r:
            assert r.status == 200
            return r.headers["x-lockgate-cache"], (await r.json())["id"]

    outcome, first = await ask(body)
    assert outcome == "miss" and await ask(body) == ("hit", first)
    async with http.delete(gw.url + f"/v1/responses/{first}") as r:
        assert r.status == 200
    outcome, second = await ask(body)
    assert outcome == "miss" and second != first  # a new generation, with an id that exists
    async with http.get(gw.url + f"/v1/responses/{second}") as r:
        assert r.status == 200


async def test_a_made_up_previous_response_id_of_any_length_is_not_remembered(fleet, http) -> None:
    """An outside run: a `previous_response_id` of a megabyte ending in a real instance's tag (`_lg<tag>`, shown in
    any response id) was kept in the pool's memory of responses' homes before the engine answered 404: 65,536 of them
    per model, each as long as a body. An id longer than any engine makes is refused at once and never remembered."""
    _, gw = fleet
    pool = gw.gateway.fleet.pools["m"]
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
        real = (await r.json())["id"]
    remembered = len(pool._response_homes)
    tag = real.rsplit("_lg", 1)[1]
    for made_up in ("x" * 100_000 + "_lg" + tag, "y" * MAX_SHOWN_ID_CHARS + "_lg" + tag):
        body = {"model": "m", "input": "hi", "max_output_tokens": 2, "previous_response_id": made_up}
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "previous_response_not_found"
    assert len(pool._response_homes) == remembered
    ResponseNaming(pool, "default", lambda: pool.instances[0]).made("z" * (MAX_SHOWN_ID_CHARS + 1))  # (an engine's)
    assert len(pool._response_homes) == remembered


async def test_an_unknown_previous_response_has_one_code_whoever_finds_it_missing(fleet, http, tmp_path) -> None:
    """An outside run: an unknown `previous_response_id` was 404 `previous_response_not_found` when the gateway refused
    it (another tenant's, a made-up tag) but the engine's `NotFoundError` when the engine did (an open gateway). One
    condition, one code; recorded as the request's fault (rejected), not the service's."""
    _, gw = fleet
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "previous_response_id": "resp_nope"}
    async with http.post(gw.url + "/v1/responses", json=body, headers={"x-request-id": "prev-404"}) as r:
        error = (await r.json())["error"]
        assert r.status == 404
    assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    assert "'resp_nope'" in error["message"]
    await gw.gateway.records.wait_flushed()
    [row] = [r for r in read_records(str(tmp_path / "usage.sqlite3")) if r["client_request_id"] == "prev-404"]
    assert row["status"] == "rejected"


async def test_stored_routes_count_against_the_tenants_rate_limit(start_sim, start_gateway, http) -> None:
    sim = await start_sim(**SIM)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "a", "keys": [hash_key("key-a")], "requests_per_minute": 3}],
    )
    key = {"Authorization": "Bearer key-a"}
    async with http.post(
        gw.url + "/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2}, headers=key
    ) as r:
        made = (await r.json())["id"]
    statuses = []
    for _ in range(3):
        async with http.get(gw.url + f"/v1/responses/{made}", headers=key) as r:
            statuses.append(r.status)
    assert statuses == [200, 200, 429]


async def test_stored_routes_at_their_gateway_wide_bound_are_refused(fleet, http, monkeypatch) -> None:
    from lockgate import stored

    _, gw = fleet
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2}) as r:
        made = (await r.json())["id"]
    monkeypatch.setattr(stored, "MAX_IN_FLIGHT", 0)
    async with http.get(gw.url + f"/v1/responses/{made}") as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "too_many_stored_requests"
    monkeypatch.setattr(stored, "MAX_IN_FLIGHT", 1)
    async with http.get(gw.url + f"/v1/responses/{made}") as r:
        assert r.status == 200
    assert gw.gateway._stored_in_flight == 0


async def test_a_tenant_bound_id_holds_across_gateway_processes(start_sim, start_gateway, http, monkeypatch) -> None:
    """With tenants, a client sees the engine's id bound to its tenant: a second gateway (a restart, another replica)
    with the same secret and no memory of the response still refuses it to another tenant, and still takes it from
    its own; with another secret, nobody's old ids are taken."""
    from lockgate.response_ids import SECRET_ENV

    sim = await start_sim(**SIM)
    tenants = [{"name": "a", "keys": [hash_key("key-a")]}, {"name": "b", "keys": [hash_key("key-b")]}]
    monkeypatch.setenv(SECRET_ENV, "shared by the replicas")
    first = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=tenants)
    second = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=tenants)
    monkeypatch.setenv(SECRET_ENV, "another secret")
    other = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=tenants)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    body = {"model": "m", "input": "my secret is 42", "max_output_tokens": 2}
    async with http.post(first.url + "/v1/responses", json=body, headers=a) as r:
        shown = (await r.json())["id"]
    engine_id = shown.rsplit("_lg", 1)[0]
    assert shown != engine_id and engine_id.startswith("resp_")
    follow = {"model": "m", "input": "what was it?", "max_output_tokens": 2}
    for gateway, key, expected in ((second, b, 404), (second, a, 200), (other, a, 404)):
        async with http.post(
            gateway.url + "/v1/responses", json={**follow, "previous_response_id": shown}, headers=key
        ) as r:
            assert r.status == expected, (gateway.url, key, await r.text())
    # Nor is the engine's own id taken from a client: it was never shown to one.
    async with http.post(
        second.url + "/v1/responses", json={**follow, "previous_response_id": engine_id}, headers=a
    ) as r:
        assert r.status == 404
    assert sim.statistics()["requests_started"] == 2  # the first response and its one accepted follow-up


@pytest.mark.parametrize("tenants", [False, True])
async def test_another_process_finds_a_responses_engine_by_its_id(
    start_sim, start_gateway, http, monkeypatch, tenants
) -> None:
    """A shown id names the instance that made the response (its tag): another gateway process that never saw it (a
    restart, a `--workers` sibling, a replica) pins the follow-up there and forwards a retrieval there (each
    simulator stores only its own responses: elsewhere both would be 404), and the echoed `previous_response_id` is
    the id the client sent. With tenants the processes share the secret; an open gateway needs none."""
    from lockgate.response_ids import SECRET_ENV

    sims = [await start_sim(**SIM) for _ in range(3)]
    models = rotating(sims)
    extra: dict[str, Any] = {}
    auth: dict[str, str] = {}
    if tenants:
        extra["tenants"] = [{"name": "a", "keys": [hash_key("key-a")]}]
        auth = {"Authorization": "Bearer key-a"}
        monkeypatch.setenv(SECRET_ENV, "kept across restarts")
    first, second = await start_gateway(models, **extra), await start_gateway(models, **extra)
    first_body = {"model": "m", "input": "hi", "max_output_tokens": 2}
    async with http.post(first.url + "/v1/responses", json=first_body, headers=auth) as r:
        made, home = await r.json(), r.headers["x-lockgate-instance"]
    assert made["previous_response_id"] is None
    for stream in (False, True, False):
        body = {
            "model": "m",
            "input": "and?",
            "max_output_tokens": 2,
            "previous_response_id": made["id"],
            "stream": stream,
        }
        async with http.post(second.url + "/v1/responses", json=body, headers=auth) as r:
            assert r.status == 200 and r.headers["x-lockgate-instance"] == home
            raw = await r.read()
        answer = orjson.loads(raw) if not stream else orjson.loads(raw.rstrip().split(b"\n")[-1][6:])["response"]
        assert answer["previous_response_id"] == made["id"]  # as the client sent it, not the engine's
        assert answer["id"].rsplit("_lg", 1)[0] != answer["id"]  # its own id shown tagged, too
    async with http.get(second.url + f"/v1/responses/{made['id']}", headers=auth) as r:
        assert r.status == 200 and (await r.json())["id"] == made["id"]
    if not tenants:
        # An engine's own id (no tag) is routed as any request, and reaches the engine as it is.
        engine_id = made["id"].rsplit("_lg", 1)[0]
        body = {"model": "m", "input": "z", "max_output_tokens": 2, "previous_response_id": engine_id}
        async with http.post(first.url + "/v1/responses", json=body) as r:
            assert r.status == 200 and r.headers["x-lockgate-instance"] == home  # (the first process remembers it)


async def test_ids_shown_to_a_stored_results_clients_and_engine_errors_name_no_engine_id(
    start_sim, start_gateway, http, monkeypatch
) -> None:
    """With tenants: a client served from a stored result (a de-duplication hit) is shown an id naming the instance
    that made it, as the first client was (another process finds it); an engine's 404 for a deleted response is the
    gateway's `response_not_found`, and an engine error about a followed-up response names the id the client sent."""
    from lockgate.response_ids import SECRET_ENV, home_tag

    sims = [await start_sim(**SIM) for _ in range(2)]
    models = [{"name": "m", "routing": "round_robin", "instances": [instance(s) for s in sims]}]
    tenants = [{"name": "a", "keys": [hash_key("key-a")]}]
    monkeypatch.setenv(SECRET_ENV, "kept")
    first, second = await start_gateway(models, tenants=tenants), await start_gateway(models, tenants=tenants)
    a = {"Authorization": "Bearer key-a"}
    body = {"model": "m", "input": "the same", "max_output_tokens": 2, "temperature": 0}
    shown = []
    for outcome in ("miss", "hit"):
        async with http.post(first.url + "/v1/responses", json=body, headers=a) as r:
            assert r.headers["x-lockgate-cache"] == outcome
            shown.append((await r.json())["id"])
    miss, hit = shown
    assert hit[-32:-24] == miss[-32:-24] != "0" * 8  # the same instance's tag
    assert hit[-32:-24] in {home_tag(s.url) for s in sims}
    for _ in range(2):  # round-robin would take the other engine half the time
        async with http.get(second.url + f"/v1/responses/{hit}", headers=a) as r:
            assert r.status == 200
    async with http.delete(second.url + f"/v1/responses/{hit}", headers=a) as r:
        assert r.status == 200 and await r.json() == {"id": hit, "object": "response", "deleted": True}
    async with http.get(second.url + f"/v1/responses/{hit}", headers=a) as r:
        error = (await r.json())["error"]
    assert r.status == 404 and error["code"] == "response_not_found" and hit in error["message"]
    follow = {"model": "m", "input": "and?", "max_output_tokens": 2, "previous_response_id": hit}
    async with http.post(second.url + "/v1/responses", json=follow, headers=a) as r:
        error = (await r.json())["error"]
    assert r.status == 404 and hit in error["message"] and hit.rsplit("_lg", 1)[0] + "'" not in error["message"]


async def test_a_response_whose_output_came_in_no_delta_has_a_first_token_time(
    serve_app, start_gateway, http, tmp_path
) -> None:
    url = await serve_app(_fake_responses_engine())
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "nodelta", "stream": True}) as r:
        assert r.status == 200
        await r.read()
    await gw.gateway.records.wait_flushed()
    (row,) = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "completed" and row["completion_tokens"] == 1 and row["first_token_at"] is not None


async def test_a_stored_route_keeps_the_clients_deadline(serve_app, start_gateway, http) -> None:
    """`x-lockgate-timeout-ms` bounds a stored route's wait for its engine as it bounds a generation (504), not only
    the model's `timeout_ms` (an outside run held a slot of the 32 for the model's 60 s); a bad value is 400."""
    never = asyncio.Event()

    async def create(request: web.Request) -> web.Response:
        usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {"id": "resp_h", "object": "response", "status": "completed", "output": [], "usage": usage}
        )

    async def stuck(request: web.Request) -> web.Response:
        await never.wait()  # an engine that does not answer (until the test ends)
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", stuck)
    gw = await start_gateway(
        [{"name": "m", "timeout_ms": 600_000, "instances": [{"url": await serve_app(app), "engine": "openai"}]}]
    )
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "x"}) as r:
        assert r.status == 200
    async with asyncio.timeout(10):
        async with http.get(gw.url + "/v1/responses/resp_h", headers={"x-lockgate-timeout-ms": "200"}) as r:
            assert r.status == 504 and (await r.json())["error"]["code"] == "deadline_exceeded"
    async with http.get(gw.url + "/v1/responses/resp_h", headers={"x-lockgate-timeout-ms": "soon"}) as r:
        assert r.status == 400
    assert gw.gateway._stored_in_flight == 0
    never.set()


async def test_a_follow_up_whose_engine_just_died_is_told_to_retry(start_sim, start_gateway, http) -> None:
    """An outside run: the first follow-up after its engine crashed (before anything had noticed) was 502
    `upstream_unreachable`, later ones 503 `previous_response_unavailable`: one answer for one condition."""
    sims = [await start_sim(**SIM) for _ in range(2)]
    gw = await start_gateway(rotating(sims))
    async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
        made, home = await r.json(), r.headers["x-lockgate-instance"]
    await sims[int(home[-1])].__aexit__(None, None, None)  # the engine is gone; the gateway has not looked yet
    body = {"model": "m", "input": "and?", "max_output_tokens": 2, "previous_response_id": made["id"]}
    for _ in range(2):
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            error = (await r.json())["error"]
            assert r.status == 503 and error["code"] == "previous_response_unavailable", error
            assert int(r.headers["Retry-After"]) >= 1
