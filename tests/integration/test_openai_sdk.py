"""The official openai SDK against the gateway in front of simulators."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import instance


@pytest.fixture
async def client(start_sim, start_gateway):
    sims = [await start_sim(("m",), seed=1), await start_sim(("m",), seed=1)]
    gw = await start_gateway([{"name": "m", "instances": [instance(s) for s in sims]}])
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="client-secret", max_retries=0) as c:
        yield c


async def test_chat_non_streaming(client):
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert reply.model == "m"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


async def test_chat_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "tell me"}]
    whole = await client.chat.completions.create(model="m", messages=messages, max_tokens=10, seed=7)
    stream = await client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, seed=7, stream=True, stream_options={"include_usage": True}
    )
    parts, usage, finish = [], None, None
    async for chunk in stream:
        assert chunk.model == "m"
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10
    assert finish == "length"


async def test_stream_without_include_usage_has_no_usage_chunk(client):
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


async def test_text_completions(client):
    whole = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert whole.choices[0].text
    stream = await client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == whole.choices[0].text


async def test_models_lists_configured(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["m"]


async def test_models_retrieve(client):
    model = await client.models.retrieve("m")
    assert (model.id, model.object, model.owned_by) == ("m", "model", "lockgate")
    assert model.created > 0
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("nope")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"


async def test_embeddings_create(client):
    reply = await client.embeddings.create(model="m", input=["hello", "world"])
    assert reply.model == "m" and [d.index for d in reply.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in reply.data)
    assert reply.data[0].embedding != reply.data[1].embedding
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0


async def test_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], temperature=9)
    with pytest.raises(openai.APIStatusError) as big:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert big.value.status_code == 413
    # The engine's own refusal, in OpenAI's terms: a client that trims its conversation tests this code.
    with pytest.raises(openai.BadRequestError) as long:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1 << 20)
    assert long.value.code == "context_length_exceeded" and "maximum context length" in long.value.message


async def test_typed_errors_for_fleet_failures(start_sim, start_gateway):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    sim = await start_sim(("m",))
    gw = await start_gateway(
        [
            {"name": "dead", "retries": 0, "instances": [{"url": dead_url, "engine": "vllm"}]},
            {"name": "m", "instances": [instance(sim)]},
        ]
    )
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x"}]
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        await gw.gateway.fleet.probe_all()
        gw.gateway.fleet.instances[dead_url].healthy = True
        with pytest.raises(openai.InternalServerError) as unreachable:
            await client.chat.completions.create(model="dead", messages=messages)
        assert unreachable.value.status_code == 502
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.chat.completions.create(model="dead", messages=messages)
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["retry-after"] == "1"
        sim.control.update({"fail_status": 500})
        with pytest.raises(openai.InternalServerError) as passthrough:
            await client.chat.completions.create(model="m", messages=messages)
        assert passthrough.value.status_code == 500
        with pytest.raises(openai.APIStatusError) as bad_json:
            await client.post("/chat/completions", cast_to=object, content=b"{nope")
        assert bad_json.value.status_code == 400
