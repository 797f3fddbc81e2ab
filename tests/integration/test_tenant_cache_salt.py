"""Tenants do not share an engine's prefix cache: a tenant's request reuses cached blocks of its own cache group's
prompts only (vLLM's `cache_salt`, which the simulator honours), so no tenant can test guesses of another's prompt
through `cached_tokens` or its time to first token. Tenants naming one `cache_group` share; a client's own salt
partitions its tenant's cache further and can never reach into another group; an open gateway passes a client's
salt on as it is."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.admission.tenants import group_salt, hash_key
from tests.conftest import instance

#: ~400 prompt tokens: many full KV blocks.
SECRET = "alice confidential merger plan " + " ".join(f"word{i}" for i in range(400))
TENANTS = [
    {"name": "alice", "keys": [hash_key("key-alice")], "cache_group": "acme"},
    {"name": "carol", "keys": [hash_key("key-carol")], "cache_group": "acme"},
    {"name": "bob", "keys": [hash_key("key-bob")]},
]


async def _cached(http: aiohttp.ClientSession, url: str, key: str | None, **extra: Any) -> int:
    """The prompt tokens the engine found cached for `SECRET`, asked as the tenant of `key`."""
    body = {"model": "m", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 2, "temperature": 1.0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(url + "/v1/chat/completions", json={**body, **extra}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def test_a_tenant_never_hits_another_groups_cached_prompt(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS)
    async with aiohttp.ClientSession() as http:
        assert await _cached(http, gw.url, "key-alice") == 0
        assert await _cached(http, gw.url, "key-alice") > 300  # her own prompt, cached
        assert await _cached(http, gw.url, "key-bob") == 0  # another group: nothing to learn
        assert await _cached(http, gw.url, "key-bob", cache_salt="acme") == 0  # nor by naming a group
        assert await _cached(http, gw.url, "key-carol") > 300  # her group's
        assert await _cached(http, gw.url, "key-alice", cache_salt="user-7") == 0  # a client's own partition
        assert await _cached(http, gw.url, "key-alice", cache_salt="user-7") > 300


async def test_an_open_gateway_passes_a_clients_salt_on_as_it_is(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with aiohttp.ClientSession() as http:
        assert await _cached(http, gw.url, None) == 0
        assert await _cached(http, gw.url, None) > 300  # no tenants: one cache
        assert await _cached(http, gw.url, None, cache_salt="s1") == 0
        assert await _cached(http, gw.url, None, cache_salt="s1") > 300


async def test_a_client_of_an_open_gateway_cannot_name_a_tenants_salt(start_sim, start_gateway):
    """An open gateway (a sidecar reached directly, an internal one) sharing an engine with a gateway of tenants passed
    a client's salt on as it is, and a tenant's salt is a digest of its name: a client that named it read the
    tenant's cached prompt (an outside run: 592 of 602 prompt tokens cached). Salts beginning like the gateway's are
    refused."""
    sim = await start_sim()
    tenants = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS)
    open_gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    async with aiohttp.ClientSession() as http:
        assert await _cached(http, tenants.url, "key-alice") == 0
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": SECRET}],
            "cache_salt": group_salt("alice", "acme"),
        }
        async with http.post(open_gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["param"] == "cache_salt" and "the gateway's own" in error["message"]


@pytest.mark.parametrize("salt", [123, "", "x" * 257, "a\r\nb", "caf\u00e9", "lg1-0123"])
async def test_a_bad_cache_salt_is_refused(start_sim, start_gateway, salt):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "cache_salt"


async def test_a_shared_call_carries_its_tenants_salt(start_sim, start_gateway):
    """A de-duplicable request (temperature 0) is sent by its flight, from a copy of the request: the copy lost the
    salt, and every tenant's flights shared one cache partition (a code review)."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}], tenants=TENANTS)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": SECRET}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def cached(http: aiohttp.ClientSession, key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200 and resp.headers["x-lockgate-cache"] == "miss"
            events = [line for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: {")]
        usage = orjson.loads(events[-1].removeprefix(b"data: "))["usage"]
        tokens: int = usage["prompt_tokens_details"]["cached_tokens"]
        return tokens

    async with aiohttp.ClientSession() as http:
        assert await cached(http, "key-alice") == 0
        assert await cached(http, "key-bob") == 0  # (a flight of its own: another tenant) and no hit on alice's
