"""An engine that says how many sequences it runs at once (llama.cpp `/props`, SGLang `/get_server_info`, TGI
`/info`) gets that as its concurrency limit before any traffic, asked again when it comes back from being down;
one that does not say, or says something unusable, keeps the discovered limit (real loopback servers)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lockgate.fleet.declared import ask_parallelism


class FakeEngine:
    """Answers its health check and its dialect's parallelism call with whatever the test sets."""

    def __init__(self, path: str, answer: Any, *, status: int = 200) -> None:
        self.answer = answer
        self.status = status
        self.healthy = True
        self.asked = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get(path, self.parallelism)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok", status=200 if self.healthy else 503)

    async def parallelism(self, request: web.Request) -> web.Response:
        self.asked += 1
        if isinstance(self.answer, bytes):
            return web.Response(body=self.answer, status=self.status, content_type="application/json")
        return web.json_response(self.answer, status=self.status)


@pytest.mark.parametrize(
    ("engine", "path", "answer", "expected"),
    [
        ("llamacpp", "/props", {"total_slots": 3, "default_generation_settings": {}}, 3),
        ("sglang", "/get_server_info", {"max_running_requests": 48, "internal_states": [{}]}, 48),
        (
            "sglang",
            "/get_server_info",
            {"max_running_requests": None, "internal_states": [{"max_running_requests": 16}] * 2},
            32,
        ),
        ("sglang", "/get_server_info", {"max_running_requests": None, "internal_states": [{}]}, None),
        ("tgi", "/info", {"max_batch_size": 12, "max_concurrent_requests": 128}, 12),
        ("tgi", "/info", {"max_batch_size": None, "max_concurrent_requests": 128}, None),
        ("llamacpp", "/props", {"total_slots": "4"}, None),
        ("llamacpp", "/props", {"total_slots": 0}, None),
        ("llamacpp", "/props", {"total_slots": True}, None),
        ("llamacpp", "/props", [3], None),
        ("llamacpp", "/props", b"{not json", None),
    ],
)
async def test_what_each_engine_says_it_runs_at_once(engine, path, answer, expected, serve_app, start_gateway) -> None:
    fake = FakeEngine(path, answer)
    url = await serve_app(fake.app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": engine}]}])
    instance = gw.gateway.fleet.instances[url]
    assert await ask_parallelism(instance, timeout_s=5.0) == expected


async def test_an_unanswered_or_failed_call_says_nothing(serve_app, start_gateway) -> None:
    fake = FakeEngine("/props", {"total_slots": 3}, status=404)
    url = await serve_app(fake.app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "llamacpp"}]}])
    assert await ask_parallelism(gw.gateway.fleet.instances[url], timeout_s=5.0) is None
    vllm = FakeEngine("/props", {"total_slots": 3})  # vLLM exports no max_num_seqs: never asked
    url = await serve_app(vllm.app)
    gw = await start_gateway([{"name": "v", "instances": [{"url": url, "engine": "vllm"}]}])
    assert await ask_parallelism(gw.gateway.fleet.instances[url], timeout_s=5.0) is None
    assert vllm.asked == 0


async def test_the_declared_number_is_the_limit_from_the_first_probe_and_is_asked_again_after_a_restart(
    serve_app, start_gateway
) -> None:
    fake = FakeEngine("/props", {"total_slots": 3})
    url = await serve_app(fake.app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "llamacpp"}]}])
    fleet = gw.gateway.fleet
    instance = fleet.instances[url]
    await fleet.wait_until(lambda f: instance.concurrency.declared == 3)  # the start-up probe asked
    assert instance.max_concurrency == 3 and fake.asked == 1
    await fleet.probe_all()  # healthy again: not asked again
    assert fake.asked == 1
    fake.healthy = False  # down, then back with more slots: asked again
    await fleet.probe_all()
    assert not instance.healthy
    fake.healthy = True
    fake.answer = {"total_slots": 6}
    await fleet.probe_all()
    assert instance.healthy and fake.asked == 2 and instance.max_concurrency == 6
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/admin/fleet") as resp:
        (shown,) = (await resp.json())["instances"]
    assert shown["engine_parallelism"] == 6 and shown["max_concurrency"] == 6
