"""The OpenAI-compatible surface over real loopback HTTP, with aiohttp and the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import itertools
import struct
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from lockgate.sim import SimServer, handlers

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}


def sse_events(raw: bytes) -> list[object]:
    out: list[object] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


async def test_openai_sdk_chat_and_completions(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.id.startswith("chatcmpl-") and chat.model == "m"
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
    comp = await client.completions.create(model="m", prompt="once upon a time", max_tokens=4)
    assert comp.id.startswith("cmpl-") and len(comp.choices[0].text.split()) == 4
    assert comp.usage is not None and comp.usage.prompt_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["m"]


async def test_openai_sdk_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    full = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0
    )
    assert full.choices[0].message.content == text
    cstream = await client.completions.create(model="m", prompt="a b c", max_tokens=3, stream=True)
    parts = [c async for c in cstream]
    assert len(parts) == 3 and parts[-1].choices[0].finish_reason == "length"


async def test_raw_sse_format(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    first = events[0]
    assert isinstance(first, dict) and first["choices"][0]["delta"]["role"] == "assistant"
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


async def test_stop_and_seed_determinism(client: openai.AsyncOpenAI) -> None:
    async def text(**kw: Any) -> tuple[str, str]:
        r = await client.completions.create(model="m", prompt="the quick brown fox", **kw)
        return r.choices[0].text, r.choices[0].finish_reason

    a, _ = await text(max_tokens=20, seed=42, temperature=0.8)
    assert (a, "length") == await text(max_tokens=20, seed=42, temperature=0.8)
    g, _ = await text(max_tokens=20, temperature=0)
    assert g == (await text(max_tokens=20, temperature=0, seed=5))[0]  # greedy ignores the seed
    stop = a.split()[3]
    t, reason = await text(max_tokens=20, seed=42, temperature=0.8, stop=[stop, "zzz"])
    assert reason == "stop" and t == a[: a.index(stop)]


async def test_continue_final_message_continues_exactly(client: openai.AsyncOpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "write"}]
    full = await client.chat.completions.create(model="m", messages=msgs, max_tokens=12, seed=9)
    text = full.choices[0].message.content or ""
    head = text[: len(" ".join(text.split(" ")[:6]))]  # the first 5 tokens
    rest = await client.chat.completions.create(
        model="m",
        messages=[*msgs, {"role": "assistant", "content": head}],
        max_tokens=7,
        seed=9,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert head + (rest.choices[0].message.content or "") == text
    assert rest.usage is not None and full.usage is not None
    assert rest.usage.prompt_tokens == full.usage.prompt_tokens + 5


async def test_prefix_cache_hits_show_in_usage_and_stats(sim: SimServer, http: aiohttp.ClientSession) -> None:
    long = " ".join(f"w{i}" for i in range(100))
    body = {"model": "m", "prompt": long, "max_tokens": 2}
    for _ in range(2):
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            usage = (await resp.json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 96
    stats = sim.statistics()
    assert stats["prefix_cache_query_tokens"] == 200 and stats["prefix_cache_hit_tokens"] == 96
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


async def test_errors_use_the_openai_envelope(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async def post(data: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any]]:
        async with http.post(sim.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            body = await r.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
            return r.status, body["error"]

    status, err = await post(orjson.dumps({**CHAT, "model": "nope"}))
    assert status == 404 and err["code"] == 404
    assert (await post(b"{not json"))[0] == 400
    assert (await post(orjson.dumps({**CHAT, "n": 2})))[0] == 400
    assert (await post(orjson.dumps({"model": "m", "prompt": [[1], [2]]}), "/v1/completions"))[0] == 400  # a batch
    # What vLLM would answer and the simulator cannot is refused, not ignored (an outside run got 200 without them).
    for extra in ({"suffix": "x"}, {"echo": True}, {"logprobs": 2}):
        status, err = await post(orjson.dumps({"model": "m", "prompt": "hi", **extra}), "/v1/completions")
        assert status == 400 and err["param"] == next(iter(extra)), err
    status, err = await post(orjson.dumps({**CHAT, "logprobs": True, "top_logprobs": 2}))
    assert status == 400 and err["param"] == "logprobs"
    async with http.post(sim.url + "/v1/completions", json={"model": "m", "prompt": [7, 8, 9], "max_tokens": 2}) as r:
        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 3  # token ids: one each
    assert (await post(orjson.dumps({**CHAT, "max_tokens": "x"})))[0] == 400
    # It never calls a tool: a choice that demands a call is refused (it was answered in text); "auto" may be text.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        status, err = await post(orjson.dumps({**CHAT, "tools": tools, "tool_choice": choice}))
        assert status == 400 and err["param"] == "tool_choice", err
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "auto"}) as r:
        assert r.status == 200
    ok = {**CHAT, "priority": 3, "unknown_field": {"x": 1}, "continue_final_message": False}
    async with http.post(sim.url + "/v1/chat/completions", json=ok) as r:
        assert r.status == 200


async def test_metrics_parse_with_vllm_names(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    ):
        assert name in fams, name
        assert all(s.labels.get("model_name") == "m" for s in fams[name].samples)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("vllm:generation_tokens_total", (("model_name", "m"),))] == 6
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert samples[("vllm:time_to_first_token_seconds_count", (("model_name", "m"),))] == 1


async def test_health_models_control_and_reset(make_sim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(models=("a", "b"))
    async with http.get(sim.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["a", "b"]
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    async with http.post(sim.url + "/sim/control", json={"healthy": False, "fail_status": 503}) as r:
        assert r.status == 200
    async with http.get(sim.url + "/health") as r:
        assert r.status == 503
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "b"}) as r:
        assert r.status == 503 and "error" in await r.json()
    async with http.post(sim.url + "/sim/control", json={"bogus": 1}) as r:
        assert r.status == 400
    async with http.post(sim.url + "/sim/control", json={"healthy": True, "fail_status": None}) as r:
        assert r.status == 200
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "model": "b"}) as r:
        assert r.status == 200
    assert sim.statistics()["requests_failed"] == 1
    async with http.post(sim.url + "/sim/reset_stats") as r:
        assert r.status == 200
    async with http.get(sim.url + "/sim/stats") as r:
        stats = await r.json()
    assert stats["requests_started"] == 0 and stats["requests_seen"] == []


async def test_request_id_is_recorded(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc"}) as r:
        assert r.status == 200
    rec = sim.stats.find("abc")
    assert rec is not None and rec.outcome == "finished" and rec.completion_tokens == 6
    async with http.get(sim.url + "/sim/wait", params={"request_id": "abc", "outcome": "finished"}) as r:
        assert r.status == 200 and (await r.json())["request"]["request_id"] == "abc"


async def test_unix_socket(make_sim, tmp_path) -> None:
    path = str(tmp_path / "sim.sock")
    sim = await make_sim(uds=path)
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s,
        s.post(sim.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3}) as r,
    ):
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3


async def test_fast_mode_answers_and_counts(make_sim, http: aiohttp.ClientSession) -> None:
    slow = await make_sim(tpot_ms=1.0)
    fast = await make_sim(fast=True, tpot_ms=1000.0)  # timings are ignored in fast mode
    bodies = []
    for sim in (slow, fast):
        async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "temperature": 0}) as r:
            bodies.append(await r.json())
        async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "stream": True, "temperature": 0}) as r:
            events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
    assert bodies[0]["choices"] == bodies[1]["choices"]  # same output in both modes
    stats = fast.statistics()
    assert stats["requests_finished"] == 2 and stats["tokens_generated"] == 12


async def test_continuous_batching_serves_many_concurrently(make_sim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(max_num_seqs=4)

    async def one(i: int) -> int:
        body = {"model": "m", "prompt": f"p{i} q", "max_tokens": 5}
        async with http.post(sim.url + "/v1/completions", json=body) as r:
            tokens: int = (await r.json())["usage"]["completion_tokens"]
            return tokens

    assert await asyncio.gather(*(one(i) for i in range(12))) == [5] * 12
    stats = sim.statistics()
    assert stats["requests_finished"] == 12 and stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0


async def test_first_token_delays_and_prefill_time(make_sim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(prefill_tps=4000.0)
    body = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(200)), "max_tokens": 1}
    async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": "cold"}) as r:
        assert r.status == 200
    async with http.post(sim.url + "/sim/control", json={"delay_first_token_ms": 30}) as r:
        assert r.status == 200
    async with http.post(sim.url + "/v1/completions", json=body, headers={"x-request-id": "warm"}) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    async with http.post(sim.url + "/sim/control", json={"delay_first_token_ms": 0}) as r:
        assert r.status == 200
    hdrs = {"x-request-id": "hdr", "x-sim-delay-ms": "40"}
    async with http.post(sim.url + "/v1/completions", json={**body, "prompt": "x"}, headers=hdrs) as r:
        assert r.status == 200
    ttft = {}
    for rid in ("cold", "warm", "hdr"):
        rec = sim.stats.find(rid)
        assert rec is not None and rec.first_token_at is not None
        ttft[rid] = rec.first_token_at - rec.started_at
    assert ttft["cold"] >= 200 / 4000  # prefill of 200 uncached tokens
    assert ttft["warm"] >= 0.030  # injected delay (the cached prompt itself needs only 8 tokens of prefill)
    assert ttft["hdr"] >= 0.040


async def test_embeddings_are_deterministic_unit_vectors_in_vllms_shape(make_sim, http: aiohttp.ClientSession) -> None:
    sims = [await make_sim(fast=True), await make_sim()]
    bodies = []
    for sim, encoding in zip(sims, ("float", "base64"), strict=True):
        payload = {"model": "m", "input": ["hello world", [7, 8, 9]], "encoding_format": encoding}
        async with http.post(sim.url + "/v1/embeddings", json=payload) as r:
            assert r.status == 200
            bodies.append(await r.json())
    floats, encoded = bodies
    assert floats["object"] == "list" and floats["model"] == "m"
    assert [d["object"] for d in floats["data"]] == ["embedding", "embedding"]
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 3
    first = floats["data"][0]["embedding"]
    assert len(first) == 64 and sum(v * v for v in first) == pytest.approx(1.0)
    raw = [base64.b64decode(d["embedding"]) for d in encoded["data"]]
    decoded = [list(struct.unpack(f"<{len(b) // 4}f", b)) for b in raw]
    assert decoded == [pytest.approx(d["embedding"], abs=1e-6) for d in floats["data"]]
    async with http.post(sims[0].url + "/v1/embeddings", json={"model": "m", "input": "x", "dimensions": 0}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "dimensions"
    async with http.post(sims[0].url + "/v1/embeddings", json={"model": "zz", "input": "x"}) as r:
        assert r.status == 404
    assert sims[0].statistics()["requests_finished"] == 1 and sims[1].statistics()["requests_finished"] == 1


async def test_responses_whole_and_streamed_in_both_modes(make_sim, http: aiohttp.ClientSession) -> None:
    """`/v1/responses`: the same text whole and streamed (typed events with their `event:` lines, no `[DONE]`), in
    the step loop and in `--fast` mode; `incomplete` at `max_output_tokens`; instructions and typed input items."""
    body = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "max_output_tokens": 5,
        "temperature": 0,
    }
    texts = []
    for sim in (await make_sim(tpot_ms=1.0), await make_sim(fast=True)):
        async with http.post(sim.url + "/v1/responses", json=body) as r:
            whole = await r.json()
        assert (whole["object"], whole["status"], whole["model"]) == ("response", "incomplete", "m")
        assert whole["usage"]["output_tokens"] == 5 and whole["usage"]["input_tokens"] > 5
        text = whole["output"][0]["content"][0]["text"]
        async with http.post(sim.url + "/v1/responses", json={**body, "stream": True}) as r:
            raw = (await r.read()).decode()
        events = []
        for block in filter(None, raw.split("\n\n")):
            name, data = block.split("\n")
            events.append(orjson.loads(data.removeprefix("data: ")))
            assert name == "event: " + events[-1]["type"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == whole | {
            "id": events[-1]["response"]["id"],
            "created_at": events[-1]["response"]["created_at"],
            "output": events[-1]["response"]["output"],
        }
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == text == events[-1]["response"]["output"][0]["content"][0]["text"]
        texts.append(text)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_stored_response_says_it_was_created_when_its_answer_does(
    make_sim, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """An outside run: `GET /v1/responses/{id}` said the response was created a second after its answer did (the
    store stamped the time it ended). One time for both: when the request came."""
    clock = itertools.count(2_000_000_000, 1000)  # (where the simulator would still ask the time again)
    monkeypatch.setattr(handlers, "time", SimpleNamespace(time=lambda: next(clock), monotonic=time.monotonic))
    sim = await make_sim(tpot_ms=1.0)
    body = {"model": "m", "input": "when", "max_output_tokens": 3, "stream": stream}
    async with http.post(sim.url + "/v1/responses", json=body) as r:
        if stream:
            last = (await r.read()).decode().strip().split("\n\n")[-1].split("\n")[1]
            answer = orjson.loads(last.removeprefix("data: "))["response"]
        else:
            answer = await r.json()
    async with http.get(sim.url + f"/v1/responses/{answer['id']}") as r:
        stored = await r.json()
    assert stored["id"] == answer["id"] and stored["created_at"] == answer["created_at"]


async def test_a_stored_responses_input_items_page_as_openais_do(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """An outside run: `input_items` ignored `limit`, `order` and `after` and listed oldest first; OpenAI lists newest
    first (`order=desc`) by default, 20 to a page."""
    conversation = [{"role": "user", "content": f"message {i}"} for i in range(25)]
    async with http.post(
        sim.url + "/v1/responses", json={"model": "m", "input": conversation, "max_output_tokens": 2}
    ) as r:
        made = await r.json()
    base = sim.url + f"/v1/responses/{made['id']}/input_items"

    async def listed(query: str) -> tuple[list[str], bool]:
        async with http.get(base + query) as r:
            page = await r.json()
            return [item["content"][0]["text"] for item in page["data"]], page["has_more"]

    texts, more = await listed("")
    assert (len(texts), texts[0], more) == (20, "message 24", True)
    async with http.get(base + "?order=asc&limit=2") as r:
        page = await r.json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["message 0", "message 1"] and page["has_more"]
    assert await listed(f"?order=asc&after={page['last_id']}&limit=100") == (
        [f"message {i}" for i in range(2, 25)],
        False,
    )
    async with http.get(base + "?limit=0") as r:
        assert r.status == 400
