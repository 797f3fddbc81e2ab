"""`GET /v1/models` and `GET /v1/models/{id}`: the OpenAI shape, ids with `/`, and tenants' allow-lists."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from lockgate.admission.tenants import hash_key
from lockgate.config import load_config
from lockgate.server import GatewayServer
from tests.conftest import instance


@pytest.fixture
async def gateway(start_sim, start_gateway) -> GatewayServer:
    sim = await start_sim(("m", "org/model-7b"))
    tenants = [
        {"name": "acme", "keys": [hash_key("k-acme")], "models": ["org/model-7b"]},
        {"name": "all", "keys": [hash_key("k-all")]},
    ]
    models = [{"name": name, "instances": [instance(sim)]} for name in ("m", "org/model-7b")]
    server: GatewayServer = await start_gateway(models, tenants=tenants)
    return server


async def _get(url: str, key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        body: dict[str, Any] = await resp.json()
        return resp.status, body


async def test_list_is_filtered_by_the_tenants_allow_list(gateway) -> None:
    status, body = await _get(gateway.url + "/v1/models", "k-acme")
    assert status == 200 and [m["id"] for m in body["data"]] == ["org/model-7b"]
    status, body = await _get(gateway.url + "/v1/models", "k-all")
    assert status == 200 and [m["id"] for m in body["data"]] == ["m", "org/model-7b"]


@pytest.mark.parametrize("key", [None, "unknown"])
async def test_without_a_valid_key_the_answer_is_401_as_on_chat(gateway, key) -> None:
    for path in ("/v1/models", "/v1/models/m"):
        status, body = await _get(gateway.url + path, key)
        assert status == 401 and body["error"]["type"] == "authentication_error", body


async def test_retrieve_ids_with_a_slash_and_hide_models_a_tenant_may_not_use(gateway) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k-acme", max_retries=0) as client:
        model = await client.models.retrieve("org/model-7b")  # the SDK sends org%2Fmodel-7b
        assert (model.id, model.object) == ("org/model-7b", "model")
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("m")  # exists, but not for this tenant: the same 404 as unknown
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    status, body = await _get(gateway.url + "/v1/models/org/model-7b", "k-all")  # the unencoded slash too
    assert status == 200 and body["id"] == "org/model-7b" and set(body) == {"id", "object", "created", "owned_by"}
    status, body = await _get(gateway.url + "/v1/models/nope", "k-all")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_a_reload_updates_the_models_and_the_allow_lists(stack, start_sim, tmp_path) -> None:
    sim = await start_sim(("m", "n"))
    path = tmp_path / "gw.yaml"

    def write(models: list[str]) -> None:
        lines = [
            "listen: {host: 127.0.0.1, port: 0}",
            f"usage: {{path: '{tmp_path / 'usage.sqlite3'}'}}",
            "health: {interval_ms: 60000}",
            "models:",
            *(f"  - {{name: {m}, instances: [{{url: '{sim.url}', engine: vllm}}]}}" for m in models),
            "tenants:",
            f"  - {{name: acme, keys: ['{hash_key('k-acme')}'], models: [{', '.join(models)}]}}",
        ]
        path.write_text("\n".join(lines) + "\n")

    write(["m"])
    server = await stack.enter_async_context(GatewayServer(load_config(path), config_path=path))
    assert (await _get(server.url + "/v1/models/n", "k-acme"))[0] == 404
    write(["m", "n"])
    assert server.gateway.reloader is not None
    await server.gateway.reloader.reload()
    status, body = await _get(server.url + "/v1/models", "k-acme")
    assert status == 200 and [m["id"] for m in body["data"]] == ["m", "n"]
    assert (await _get(server.url + "/v1/models/n", "k-acme"))[0] == 200


async def test_an_unknown_models_name_is_repeated_at_most_200_characters(gateway) -> None:
    """A 100,000-character model name came back whole in the 404's message (and 12 KB for a models route)."""
    long = "m" * 100_000
    body = {"model": long, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": "Bearer k-all"}
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and f"'{'m' * 200}…'" in error["message"]
        assert len(error["message"]) < 300
    status, answer = await _get(gateway.url + "/v1/models/" + "x" * 12_000, "k-all")
    assert status == 404 and len(answer["error"]["message"]) < 300
