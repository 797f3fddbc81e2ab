"""lockgate in front of a real llama.cpp engine (SmolLM2-135M on CPU), driven by the openai SDK."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None,
    reason="xllamacpp is not installed (optional extra: pip install 'lockgate[llamacpp]')",
)

LONG = 400  # tokens: several seconds of generation on this machine (minutes when it is busy)
#: How long an engine may take to free a slot after its client left. Generous: it bounds a hang, and a
#: loaded 2-core machine is slow; whether the generation was really stopped is checked by counting the
#: engine's decode steps (`decode_steps`), not by the clock.
IDLE_WITHIN_S = 30.0


async def long_story(client: openai.AsyncOpenAI, *, stream: bool) -> Any:
    """A request that generates LONG tokens (EOS ignored) unless it is stopped."""
    return await client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=LONG,
        stream=stream,
        extra_body={"ignore_eos": True},
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from lockgate.launch import SyncLlamaCppEngine

    # `embedding`: the same llama.cpp server also answers /v1/embeddings (mean-pooled).
    with SyncLlamaCppEngine(parallel=2, alias="smollm2", embedding=True) as eng:
        yield eng


@pytest.fixture
async def gateway(engine, start_gateway):
    return await start_gateway(
        [
            {
                "name": "smol",
                "instances": [
                    {"url": engine.url, "engine": "llamacpp", "served_model": "smollm2", "max_concurrency": 2}
                ],
            }
        ],
        # Scraped metrics count as fresh for 30 s: the fleet test must not depend on an idle machine.
        scrape={"stale_after_ms": 30_000},
    )


@pytest.fixture
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0) as c:
        yield c


async def busy_slots(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/slots") as resp:
        slots = await resp.json()
    return sum(1 for slot in slots if slot.get("is_processing"))


async def wait_idle(url: str, within_s: float = IDLE_WITHIN_S) -> None:
    """The engine is another process: ask it until its slots are idle, bounded by a deadline."""
    async with asyncio.timeout(within_s):
        # A separate process with no push channel: asking it is the only way (bounded by the timeout).
        while await busy_slots(url):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def decode_steps(url: str) -> int:
    """The engine's `llama_decode` calls so far: one per generated token while one request runs."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("llamacpp:n_decode_total "):
            return int(float(line.split()[1]))
    raise AssertionError("llama.cpp exported no llamacpp:n_decode_total")


async def assert_stopped_early(url: str, steps_before: int) -> None:
    """The slot goes idle and the engine decoded far fewer than LONG tokens: the generation was stopped,
    not run to its end (which a clock-based bound could only tell on an idle machine)."""
    await wait_idle(url)
    assert await decode_steps(url) - steps_before < LONG // 2


async def test_real_chat_completion(client):
    reply = await client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert reply.model == "smol"
    assert reply.choices[0].message.content.strip()
    assert reply.usage.prompt_tokens > 5
    assert 0 < reply.usage.completion_tokens <= 24


async def test_real_stream_with_usage_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = await client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0)
    stream = await client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    async for chunk in stream:
        assert chunk.model == "smol"
        if chunk.usage is not None:
            usage = chunk.usage
        text += [c.delta.content or "" for c in chunk.choices]
    assert "".join(text) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_text_completion_usage_arrives_as_its_own_chunk(client):
    stream = await client.completions.create(
        model="smol",
        prompt="The sky is",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


async def test_batched_prompts(client):
    """llama.cpp opens a batched prompt's stream with `data: null` (the gateway streams from it for every client):
    it answered 502 for every batched prompt."""
    reply = await client.completions.create(
        model="smol", prompt=["The sky is", "Grass is"], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in reply.choices) == [0, 1] and all(c.text for c in reply.choices)
    stream = await client.completions.create(
        model="smol", prompt=["The sky is", "Grass is"], max_tokens=3, temperature=0, stream=True
    )
    indexes = {c.index async for chunk in stream for c in chunk.choices}
    assert indexes == {0, 1}
    # Usage counts both prompts (llama.cpp reports each choice's on its finish chunk: the last one was the answer's,
    # one prompt's tokens; an outside run).
    alone = [
        await client.completions.create(model="smol", prompt=p, max_tokens=3, temperature=0)
        for p in ("The sky is", "Grass is")
    ]
    assert reply.usage is not None and all(a.usage is not None for a in alone)
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone if a.usage)
    stream = await client.completions.create(
        model="smol", prompt=["The sky is", "Grass is"], max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    [streamed] = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )


async def test_streamed_usage_counts_every_choice(client):
    """llama.cpp's usage counts one choice's tokens for `n` > 1; the answer whole was fixed, the streamed one not."""
    request: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hi."}],
        "n": 2,
        "max_tokens": 2,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens == 4


async def test_stream_disconnect_frees_the_slot(client, engine):
    before = await decode_steps(engine.url)
    stream = await long_story(client, stream=True)
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    assert await busy_slots(engine.url) == 1
    await stream.close()
    await assert_stopped_early(engine.url, before)


async def test_non_streaming_disconnect_frees_the_slot(gateway, engine):
    """llama.cpp ignores a disconnect on non-streaming requests; the gateway streams from it instead."""
    before = await decode_steps(engine.url)
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=0.5) as short:
        with pytest.raises(openai.APITimeoutError):
            await long_story(short, stream=False)
    await assert_stopped_early(engine.url, before)


async def test_responses_whole_and_streamed(client, gateway):
    """The Responses API: llama.cpp streams it without `[DONE]`; a whole response is the terminal event's (the
    gateway streams from llama.cpp whatever the client asked)."""
    request: dict[str, Any] = {"model": "smol", "input": "Name three colours.", "max_output_tokens": 16}
    whole = await client.responses.create(**request, temperature=0)
    assert (whole.model, whole.object) == ("smol", "response")
    assert whole.output_text.strip() and whole.usage is not None and 0 < whole.usage.output_tokens <= 16
    stream = await client.responses.create(**request, temperature=0, stream=True)
    events = [event async for event in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and events[-1].response.model == "smol"
    assert text == events[-1].response.output_text == whole.output_text
    await gateway.gateway.records.wait_flushed()


async def test_responses_stream_disconnect_frees_the_slot(client, engine):
    before = await decode_steps(engine.url)
    stream = await client.responses.create(
        model="smol", input="Write a long story.", max_output_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    seen = 0
    async for event in stream:
        seen += event.type == "response.output_text.delta"
        if seen >= 3:
            break
    assert await busy_slots(engine.url) == 1  # (`ignore_eos`: it would generate LONG tokens)
    await stream.close()
    await assert_stopped_early(engine.url, before)


async def test_fleet_state_shows_the_engines_scraped_metrics(client, gateway, engine):
    stream = await long_story(client, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await gateway.gateway.fleet.scraper.scrape_all()
    async with aiohttp.ClientSession() as session, session.get(gateway.url + "/admin/fleet") as resp:
        fleet = await resp.json()
    await stream.close()
    (instance,) = fleet["instances"]
    engine_state = instance["sources"]["engine"]
    assert instance["engine"] == "llamacpp"
    assert engine_state is not None and engine_state["scrape_error"] is None
    assert engine_state["running"] == 1 and engine_state["waiting"] == 0
    assert not engine_state["stale"]
    assert instance["sources"]["gateway"]["pending_first_token"] == 0
    await wait_idle(engine.url)


def cosine(a: list[float], b: list[float]) -> float:
    dot: float = sum(x * y for x, y in zip(a, b, strict=True))
    norms: float = sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5
    return dot / norms


async def test_embeddings_through_the_gateway(client, gateway):
    reply = await client.embeddings.create(model="smol", input=["The sky is blue.", "Bonjour"])
    again = await client.embeddings.create(model="smol", input="The sky is blue.", encoding_format="float")
    assert reply.model == "smol" and [d.index for d in reply.data] == [0, 1]
    assert len(reply.data[0].embedding) == len(reply.data[1].embedding) > 100  # SmolLM2-135M: 576
    # Batched and single inputs are computed a little differently (llama.cpp's batching), so the same
    # text is compared by direction: closer to itself than to another text.
    sky, bonjour, sky_again = reply.data[0].embedding, reply.data[1].embedding, again.data[0].embedding
    assert cosine(sky, sky_again) > max(0.9, cosine(sky, bonjour))
    assert reply.usage.prompt_tokens > 2
    await gateway.gateway.records.wait_flushed()


async def test_the_engines_slots_are_the_concurrency_limit_without_configuring_one(engine, start_gateway):
    """llama.cpp says how many slots it has (`/props` `total_slots`): with no `max_concurrency` configured,
    the instance's limit is that number from its first health probe, before any traffic."""
    gw = await start_gateway(
        [{"name": "smol", "instances": [{"url": engine.url, "engine": "llamacpp", "served_model": "smollm2"}]}]
    )
    fleet = gw.gateway.fleet
    (instance,) = fleet.instances.values()
    await fleet.wait_until(lambda f: instance.concurrency.declared is not None)
    assert instance.concurrency.declared == 2 and instance.max_concurrency == 2


async def test_a_real_engine_passes_the_answer_probe(gateway):
    """The one-token request that brings back an engine ejected for going silent (`fleet/answers.py`) is one a real
    llama.cpp answers: a probe it could never pass would keep a recovered engine out for good."""
    from lockgate.fleet.answers import answers

    (instance,) = gateway.gateway.fleet.instances.values()
    assert await answers(instance, "smollm2", 30.0), instance.last_error
