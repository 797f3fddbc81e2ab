"""An engine's signals that are wrong (an outside run's engines that lied in `/metrics`): the gateway serves on, each
instance's scrapes go on, and what it could not read is a failed scrape, said as such."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import instance


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def paged_engine(page: dict[str, str]) -> web.Application:
    """A chat engine whose `/metrics` answers `page["text"]` (changed by the test as it goes)."""

    async def chat(request: web.Request) -> web.Response:
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        return web.json_response(body)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


@pytest.mark.parametrize("routing", ["predicted_ttft", "score", "least_load"])
async def test_an_engine_reporting_impossible_numbers_takes_nothing_down(
    serve_app, start_sim, start_gateway, http, routing
) -> None:
    """`+Inf` requests waiting made every request of the model a 500 (the gateway's arithmetic on it overflowed) and
    `/admin/fleet` too; a line without its closing brace ended the scrape loop for every instance, silently."""
    page = {"text": "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1e300\nvllm:kv_cache_usage_perc -1\n"}
    url = await serve_app(paged_engine(page))
    sim = await start_sim()
    liar_spec = {"url": url, "engine": "vllm", "name": "liar"}
    gw = await start_gateway([{"name": "m", "routing": routing, "instances": [liar_spec, instance(sim)]}])
    fleet = gw.gateway.fleet
    liar = next(i for i in fleet.instances.values() if i.name == "liar")
    await fleet.scraper.scrape_all()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(6):
        async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body)) as r:
            assert r.status == 200
    async with http.get(gw.url + "/admin/fleet") as r:
        assert r.status == 200
    # (Nothing usable in its page: a failed scrape, said as such.)
    assert liar.scrape_error is not None and "none of the engine's metrics" in liar.scrape_error
    # A malformed line among good ones: skipped, the rest read, the scrape a success.
    page["text"] = (
        'vllm:num_requests_waiting{model_name="m" 3\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1\n'
    )
    await fleet.scraper.scrape_all()
    assert liar.scrape_error is None and liar.engine_load is not None
    assert (liar.engine_load.waiting, liar.engine_load.running) == (2.0, 1.0)


async def test_a_byte_that_is_not_utf8_loses_only_its_line(serve_app, start_gateway) -> None:
    """An outside run: one such byte in a comment line made the whole page a failed scrape (the load went stale)."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=b"# HELP x caf\xe9\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    url = await serve_app(app)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}])
    fleet = gw.gateway.fleet
    await fleet.scraper.scrape_all()
    (engine,) = fleet.instances.values()
    assert engine.scrape_error is None and engine.engine_load is not None
    assert (engine.engine_load.waiting, engine.engine_load.running) == (2.0, 1.0)
    assert engine.engine_load.own_left == 0  # none of the gateway's own ended unanswered (`merge`'s foreign requests)


async def test_a_scrape_the_gateway_fails_to_apply_ends_no_other_instances_scrapes(
    start_sim, start_gateway, monkeypatch, caplog
) -> None:
    """Whatever fails while one instance's scrape is applied is logged, and the round goes on for the others (the
    loop that an error ended left every instance's signals to go stale)."""
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([{"name": "m", "instances": [instance(s, name=f"sim-{i}") for i, s in enumerate(sims)]}])
    fleet = gw.gateway.fleet
    first, second = fleet.instances.values()
    second.engine_load = None
    scraper = fleet.scraper
    applied = scraper._on_result

    def on_result(instance, ok):
        if instance is first:
            raise RuntimeError("a bug")
        applied(instance, ok)

    monkeypatch.setattr(scraper, "_on_result", on_result)
    await scraper.scrape_all()  # (raised before)
    assert second.engine_load is not None
    assert any("sim-0: its scrape failed in the gateway" in r.getMessage() for r in caplog.records)
