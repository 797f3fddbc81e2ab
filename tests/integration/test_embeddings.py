"""`POST /v1/embeddings` through the gateway: the openai SDK, validation, records, retries, cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from lockgate.records import read_records
from lockgate.server import GatewayServer
from lockgate.sim import SimServer
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean, counter

SIM = {"prefill_tps": 1e6}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def pair(start_sim, start_gateway) -> tuple[GatewayServer, SimServer, SimServer]:
    """One model on two simulators that know it by another name (`served_model`), round-robin."""
    a = await start_sim(("org/model-7b",), **SIM)
    b = await start_sim(("org/model-7b",), **SIM)
    gw = await start_gateway(
        [
            {
                "name": "emb",
                "routing": "round_robin",
                "retries": 1,
                "instances": [
                    instance(a, name="a", served_model="org/model-7b"),
                    instance(b, name="b", served_model="org/model-7b"),
                ],
            }
        ]
    )
    return gw, a, b


async def test_openai_sdk_embeddings_create(pair, tmp_path) -> None:
    gw, a, b = pair
    assert gw.gateway is not None
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
        one = await client.embeddings.create(model="emb", input="the quick brown fox")  # SDK default: base64
        floats = await client.embeddings.create(
            model="emb", input=["the quick brown fox", "a lazy dog"], encoding_format="float", dimensions=32
        )
        tokens = await client.embeddings.create(model="emb", input=[[1, 2, 3], [4, 5]], encoding_format="float")
    assert one.model == "emb" and one.object == "list"
    assert len(one.data) == 1 and len(one.data[0].embedding) == 64
    assert [d.index for d in floats.data] == [0, 1] and all(len(d.embedding) == 32 for d in floats.data)
    assert floats.data[0].embedding != floats.data[1].embedding
    assert one.usage.prompt_tokens > 0 and tokens.usage.prompt_tokens == 5
    # Deterministic: the same input is the same vector, whichever simulator served it (round-robin).
    again = await _embed(gw, "the quick brown fox")
    assert again == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert {a.statistics()["requests_finished"], b.statistics()["requests_finished"]} == {2}
    await gw.gateway.records.wait_flushed()
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert len(rows) == 4
    assert all(r["endpoint"] == "embeddings" and r["status"] == "completed" for r in rows)
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] == 0 for r in rows)
    assert counter(gw.gateway.metrics.endpoint_requests, endpoint="embeddings", status="completed") == 4
    # An embedding's id is no response's: nothing remembered for follow-ups (each pushed out a response's home).
    assert not gw.gateway.fleet.pools["emb"]._response_homes
    assert_gateway_clean(gw.gateway)


async def _embed(gw: GatewayServer, text: str) -> list[float]:
    async with aiohttp.ClientSession() as http:
        body = {"model": "emb", "input": text, "encoding_format": "float"}
        async with http.post(gw.url + "/v1/embeddings", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-lockgate-instance"] in ("a", "b")
            data: dict[str, Any] = await resp.json()
    vector: list[float] = data["data"][0]["embedding"]
    return vector


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"model": "emb"}, "input"),
    ({"model": "emb", "input": ""}, "input"),
    ({"model": "emb", "input": []}, "input"),
    ({"model": "emb", "input": 7}, "input"),
    ({"model": "emb", "input": ["ok", 3]}, "input[1]"),
    ({"model": "emb", "input": ["ok", ""]}, "input[1]"),
    ({"model": "emb", "input": [[1, 2], []]}, "input[1]"),
    ({"model": "emb", "input": [[1, "x"]]}, "input[0]"),
    ({"model": "emb", "input": ["a", [1]]}, "input"),
    ({"model": "emb", "input": ["x"] * 2049}, "input"),
    ({"model": "emb", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "emb", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "emb", "input": "x", "dimensions": "8"}, "dimensions"),
    ({"model": "emb", "input": "x", "stream": True}, "stream"),
    ({"input": "x"}, "model"),
]


async def test_invalid_bodies_get_400_naming_the_field(pair, http) -> None:
    gw, a, b = pair
    for payload, param in INVALID:
        async with http.post(gw.url + "/v1/embeddings", json=payload) as resp:
            assert resp.status == 400, payload
            error = (await resp.json())["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (payload, error)
    assert a.statistics()["requests_started"] == b.statistics()["requests_started"] == 0


async def test_unknown_model_is_404(pair, http) -> None:
    gw, _, _ = pair
    async with http.post(gw.url + "/v1/embeddings", json={"model": "nope", "input": "x"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_an_instance_that_does_not_serve_embeddings_is_passed_over_and_not_ejected(pair, http) -> None:
    """An outside run: one llama.cpp of two started without `--embedding` answered the fleet's embeddings 501, which
    reached the client (no retry) and counted as a failure of the instance's health (toward its ejection, which would
    take it away from chat too). A 501 goes to another instance and says nothing of the engine's health."""
    gw, a, _ = pair
    assert gw.gateway is not None
    a.control.fail_status = 501
    for _ in range(8):  # round robin: half of them start on the instance that cannot serve them
        async with http.post(gw.url + "/v1/embeddings", json={"model": "emb", "input": "x"}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-lockgate-instance"] == "b"
    engine = next(i for i in gw.gateway.fleet.instances.values() if i.name == "a")
    assert a.statistics()["requests_failed"] == 4
    assert engine.ejection.consecutive_failures == 0 and not engine.ejection.ejected and engine.healthy
    assert engine.own.errors == 0 and engine.last_error is None  # (what `/admin/fleet` shows)


async def test_retried_on_another_instance_before_the_first_byte(pair, http, tmp_path) -> None:
    gw, a, _ = pair
    assert gw.gateway is not None
    a.control.fail_status = 503
    for _ in range(2):  # round-robin: one of the two starts on the failing instance
        async with http.post(gw.url + "/v1/embeddings", json={"model": "emb", "input": "x"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-lockgate-instance"] == "b"
    await gw.gateway.records.wait_flushed()
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert sorted(r["attempts"] for r in rows) == [1, 2]
    assert a.statistics()["requests_failed"] == 1


async def test_client_disconnect_aborts_the_engine_call(start_sim, start_gateway, http, tmp_path) -> None:
    sim = await start_sim(("m",), **SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    assert gw.gateway is not None
    sim.control.hold_next = 1
    task = asyncio.create_task(http.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "hold me"}))
    async with asyncio.timeout(10):
        await sim.wait_held(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sim.wait_until(lambda s: not s.stats.open)
        await gw.gateway.registry.wait_empty()
        await gw.gateway.records.wait_flushed()
    assert sim.statistics()["requests_aborted"] == 1
    [row] = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "cancelled" and row["cancel_reason"] == "client_disconnect"
    assert_gateway_clean(gw.gateway)


async def test_tenants_priorities_and_the_model_allow_list(start_sim, start_gateway, http) -> None:
    from lockgate.admission.tenants import hash_key

    sim = await start_sim(("m", "other"), **SIM)
    tenants = [
        # An embedding reserves its prompt alone: no completion tokens (not `assumed_max_tokens`, 1024).
        {"name": "acme", "keys": [hash_key("k-acme")], "models": ["m"], "tokens_per_minute": 100},
        {"name": "all", "keys": [hash_key("k-all")]},
    ]
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}, {"name": "other", "instances": [instance(sim)]}],
        tenants=tenants,
    )

    async def embed(model: str, key: str | None, priority: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if priority:
            headers["x-priority"] = priority
        async with http.post(gw.url + "/v1/embeddings", json={"model": model, "input": "x"}, headers=headers) as r:
            status: int = r.status
            return status

    assert await embed("m", None) == 401
    assert await embed("m", "wrong") == 401
    assert await embed("other", "k-acme") == 404
    assert await embed("m", "k-acme") == 200
    # The lowest class is preemptible; an embedding there is served on the plain path (nothing to resume).
    assert await embed("other", "k-all", priority="P2") == 200


async def test_an_input_whose_fewest_tokens_fit_the_tenants_limit_is_served(start_sim, start_gateway, http) -> None:
    """The "can never pass" refusal counts an input at its fewest tokens: 2,900 five-letter words under a 3,000-token
    limit were refused for good on their ~4-characters estimate (3,625). It waits for a full bucket instead, and the
    refusal that remains speaks of the input, not of a `max_tokens` an embedding does not have."""
    from lockgate.admission.tenants import hash_key

    sim = await start_sim(**SIM)
    tenants = [{"name": "t", "keys": [hash_key("k")], "tokens_per_minute": 3000}]
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=tenants)

    async def embed(text: str) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": "Bearer k"}
        async with http.post(gw.url + "/v1/embeddings", json={"model": "m", "input": text}, headers=headers) as r:
            return r.status, await r.json()

    status, body = await embed("word " * 2900)
    assert status == 200 and body["usage"]["prompt_tokens"] == 2900, body
    status, body = await embed("word " * 7000)
    assert status == 429 and body["error"]["code"] == "tokens_exceed_limit", body
    assert "its input" in body["error"]["message"] and "max_tokens" not in body["error"]["message"]


async def test_an_input_longer_than_the_context_is_context_length_exceeded(start_sim, start_gateway, http) -> None:
    """As for a chat prompt: the simulator says it in vLLM's words (it had words of its own, which the gateway did not
    read as a context overflow: `code` was the engine's `BadRequestError`)."""
    sim = await start_sim(max_model_len=64, **SIM)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with http.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "word " * 100}) as r:
        error = (await r.json())["error"]
        assert r.status == 400 and error["code"] == "context_length_exceeded", error
        assert error["type"] == "invalid_request_error"
