"""Which prefix-cache salt a request's engine is told (`admission.tenants.cache_salt_for`, the dialects)."""

from __future__ import annotations

import orjson

from lockgate.admission.config import SchedulingConfig, TenantConfig
from lockgate.admission.tenants import TenantBook, cache_salt_for, group_salt, hash_key
from lockgate.cluster.identity import Relayed
from lockgate.engines import dialect_for
from lockgate.wire import Endpoint, parse_request


def _book(*tenants: TenantConfig) -> TenantBook:
    return TenantBook(list(tenants), SchedulingConfig())


def test_each_tenant_salts_with_its_group_and_a_client_salt_comes_after() -> None:
    book = _book(
        TenantConfig(name="alice", keys=[hash_key("a")], cache_group="acme"),
        TenantConfig(name="carol", keys=[hash_key("c")], cache_group="acme"),
        TenantConfig(name="bob", keys=[hash_key("b")]),
    )
    alice, carol, bob = (book.authenticate(f"Bearer {k}") for k in "acb")
    acme = group_salt("alice", "acme")
    assert cache_salt_for(alice, None) == cache_salt_for(carol, None) == acme == group_salt("carol", "acme")
    assert cache_salt_for(bob, None) == group_salt("bob") != acme
    assert group_salt("acme") != acme  # a group named like a tenant is not that tenant's cache
    assert cache_salt_for(alice, "u1") == acme + ".u1"
    assert cache_salt_for(bob, acme) != acme  # naming another group's salt reaches nothing
    assert "acme" not in acme  # engines' logs do not carry the names


def test_an_open_gateway_and_a_relayed_tenant_leave_the_bodys_salt_as_it_is() -> None:
    open_book = _book(TenantConfig(name="default"))
    assert open_book.open and cache_salt_for(open_book.authenticate(None), "s1") is None
    central_key = "central-secret"
    relayed = Relayed([hash_key(central_key)], default_priority=1).tenant(f"Bearer {central_key}", "alice")
    assert relayed is not None and cache_salt_for(relayed, group_salt("acme")) is None  # the central set it


def test_only_an_engine_that_keeps_salts_apart_is_sent_one() -> None:
    api = parse_request(Endpoint.CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    api.cache_salt = group_salt("alice")
    for engine, expected in (("vllm", group_salt("alice")), ("sglang", None), ("llamacpp", None), ("openai", None)):
        body = dialect_for(engine).upstream_body(api, served_model="m", request_id="r", stream=False)
        assert body.get("cache_salt") == expected, engine
    assert api.engine_cache_salt() == group_salt("alice")
    api.cache_salt = None
    client = parse_request(
        Endpoint.CHAT,
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": "mine"}),
    )
    assert client.engine_cache_salt() == "mine"
    body = dialect_for("vllm").upstream_body(client, served_model="m", request_id="r", stream=False)
    assert body["cache_salt"] == "mine"


async def test_a_gateway_with_tenants_names_the_engines_whose_cache_they_share() -> None:
    from lockgate.config import parse_config
    from lockgate.gateway import Gateway

    async def warned(engine: str) -> bool:
        models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:9", "engine": engine, "name": "e1"}]}]
        raw = {"usage": {"path": ":memory:"}, "models": models, "tenants": [{"name": "a", "keys": [hash_key("k")]}]}
        gateway = Gateway(parse_config(raw, "test"))
        gateway.fleet._build(gateway.config)  # (not started: its instances only)
        try:
            return any("instances e1 take no cache_salt" in w for w in gateway.warnings())
        finally:
            await gateway.fleet.aclose()

    assert await warned("sglang") and await warned("llamacpp") and not await warned("vllm")


def test_a_relayed_salt_is_taken_only_printable_and_within_its_bound() -> None:
    from lockgate.cluster.identity import relayed_cache_salt

    assert relayed_cache_salt("x" * 512) == "x" * 512
    assert relayed_cache_salt("x" * 513) is None and relayed_cache_salt("a\x00b") is None
    assert relayed_cache_salt("") is None and relayed_cache_salt(None) is None


async def test_the_first_worker_names_the_engines_every_worker_reaches_on_its_own() -> None:
    """An outside run: under `--workers 3` with engines listed in `models:`, P0 waited 4.7 s behind other workers' P2
    streams (each worker admits up to the engine's limit and preempts only its own), where one process took 45-110 ms;
    nothing said so. The first worker says it; engines behind a sidecar are not named."""
    from lockgate.config import parse_config
    from lockgate.gateway import Gateway
    from lockgate.workerset import WorkerSet

    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:9", "name": "e1"}]}]
    raw = {"usage": {"path": ":memory:"}, "models": models}

    async def said(index: int | None) -> list[str]:
        gateway = Gateway(parse_config(raw, "test"))
        gateway.fleet._build(gateway.config)
        if index is not None:
            gateway.workers = WorkerSet("/nonexistent", index, 3)
        try:
            return [w for w in gateway.warnings() if "workers on its own" in w]
        finally:
            await gateway.fleet.aclose()

    (warning,) = await said(0)
    assert warning.startswith("instances e1 are reached by each of the 3 workers on its own") and "sidecar" in warning
    assert await said(1) == [] and await said(None) == []
