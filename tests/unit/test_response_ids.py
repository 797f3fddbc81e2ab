"""Response ids bound to their tenant and to the instance that made them (`response_ids.py`)."""

from __future__ import annotations

import pytest

from lockgate.response_ids import SECRET_ENV, ResponseIds, home_tag


def test_an_id_is_taken_back_only_from_the_tenant_it_was_shown_to() -> None:
    ids = ResponseIds("secret")
    shown = ids.show("resp_abc", "acme", "http://engine-1")
    assert shown.startswith("resp_abc_lg" + home_tag("http://engine-1")) and shown != ids.show("resp_abc", "beta")
    assert ids.take(shown, "acme") == ("resp_abc", home_tag("http://engine-1"))
    assert ids.take(ids.show("resp_abc", "acme"), "acme") == ("resp_abc", None)  # made where nobody knew
    assert ids.take(shown, "beta") is None
    assert ids.take("resp_abc", "acme") is None  # the engine's own id: never shown, never taken
    tampered = shown[:-1] + ("0" if shown[-1] != "0" else "1")
    assert ids.take(tampered, "acme") is None
    other_home = ids.show("resp_abc", "acme", "http://engine-2")
    assert ids.take(shown[:-24] + other_home[-24:], "acme") is None  # a mac moved to another home
    for junk in ("", "_lg", "x" * 32, "resp_" + "_lg" + "0" * 32, shown[:-24] + "\uff10" * 24, shown[:-1] + "é"):
        assert ids.take(junk, "acme") is None  # (non-ASCII macs too: compared as bytes)
    assert ResponseIds("another secret").take(shown, "acme") is None
    # An engine id holding the marker itself round-trips.
    odd = "resp_x_lg" + "0" * 32
    assert ids.take(ids.show(odd, "acme"), "acme") == (odd, None)


def test_the_secret_comes_from_the_environment_else_is_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "shared")
    assert ResponseIds().take(ResponseIds().show("resp_1", "t"), "t") == ("resp_1", None)
    monkeypatch.delenv(SECRET_ENV)
    assert ResponseIds().take(ResponseIds().show("resp_1", "t"), "t") is None


def test_an_open_gateways_ids_carry_their_home_only() -> None:
    """No tenants: an id is tagged with the instance that made it (no mac, no secret), and any id is taken back:
    a tagged one with its tag, another (an engine's own, or a look-alike) as it is."""
    ids = ResponseIds(bound=False)
    shown = ids.show("resp_abc", "", "http://engine-1")
    assert shown == "resp_abc_lg" + home_tag("http://engine-1")
    assert ResponseIds(bound=False).take(shown, "anyone") == ("resp_abc", home_tag("http://engine-1"))
    assert ids.show("resp_abc", "", None) == "resp_abc"  # made where nobody knew: nothing to add
    for plain in ("resp_abc", "", "_lg", "resp_lgABCDEF12", "resp_abc_lg0123456g", "resp_abc_lg" + "0" * 32):
        assert ids.take(plain, "") == (plain, None)


def test_a_requests_naming_shows_the_followed_up_id_as_its_client_sent_it() -> None:
    """`ResponseNaming`: the response followed up keeps the client's id (in answers and in engine errors), others
    are shown for the instance serving the request, and nothing is remembered while no instance serves it."""
    from types import SimpleNamespace
    from typing import Any

    from lockgate.errors import GatewayError
    from lockgate.response_ids import ResponseNaming

    remembered: list[tuple[str, str, str]] = []
    pool: Any = SimpleNamespace(remember_response=lambda *args: remembered.append(args))
    serving: list[Any] = []
    ids = ResponseIds("secret")
    naming = ResponseNaming(pool, "acme", lambda: serving[0] if serving else None, ids, ("resp_old", "resp_old_shown"))
    assert naming.shows and naming.show("resp_old") == "resp_old_shown"
    assert naming.in_error(GatewayError("Response 'resp_old' failed")).message == "Response 'resp_old_shown' failed"
    naming.made("resp_new")
    assert remembered == []  # (no instance yet: nothing to pin to)
    serving.append(SimpleNamespace(key="http://engine-1"))
    naming.made("resp_new")
    assert remembered == [("resp_new", "http://engine-1", "acme")]
    assert naming.show("resp_new") == ids.show("resp_new", "acme", "http://engine-1")
    plain = ResponseNaming(pool, "acme", lambda: None)
    assert not plain.shows and plain.show("resp_x") == "resp_x" and plain.in_error(GatewayError("m")).message == "m"


def test_an_unbound_follow_up_may_not_continue_a_response_remembered_for_another_tenant() -> None:
    """Ids are not bound at a sidecar (no tenants of its own): a direct caller naming a response a central made there
    for one of its tenants was served (and its `input_items` then showed that tenant's prompt), while the stored
    routes refused it. The gateway's memory of who made which response counts for follow-ups too."""
    from types import SimpleNamespace
    from typing import Any

    from lockgate.errors import NotFound
    from lockgate.response_ids import take_references

    homes = {"resp_1": ("http://engine-1", "tenant-a")}
    pool: Any = SimpleNamespace(response_home=homes.get, instances=[])
    ids = ResponseIds(bound=False)
    with pytest.raises(NotFound):
        take_references({"input": "x", "previous_response_id": "resp_1"}, "default", ids, pool)
    body = {"input": "x", "previous_response_id": "resp_1"}
    assert take_references(body, "tenant-a", ids, pool) == ("resp_1", "resp_1")
    assert take_references({"input": "x", "previous_response_id": "resp_new"}, "default", ids, pool) == (
        "resp_new",
        "resp_new",
    )


def test_a_gateway_with_tenants_and_no_secret_says_its_ids_hold_in_this_process_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas with different (or no) secrets refuse each other's ids: an outside run saw 404s that depended on the
    load balancer's pick, and no word from either replica (`lockgate serve` logs this once it listens)."""
    from lockgate.admission.tenants import hash_key
    from lockgate.config import parse_config
    from lockgate.gateway import Gateway

    def warning(tenants: bool) -> str | None:
        instances = [{"url": "http://127.0.0.1:9", "engine": "vllm"}]
        raw: dict[str, object] = {"usage": {"path": ":memory:"}, "models": [{"name": "m", "instances": instances}]}
        if tenants:
            raw["tenants"] = [{"name": "a", "keys": [hash_key("k")]}]
        said = [w for w in Gateway(parse_config(raw, "test")).warnings() if SECRET_ENV in w]
        return said[0] if said else None

    monkeypatch.delenv(SECRET_ENV, raising=False)
    said = warning(tenants=True)
    assert said is not None and "valid here only" in said
    assert warning(tenants=False) is None  # (an open gateway's ids need no secret)
    monkeypatch.setenv(SECRET_ENV, "shared")
    assert warning(tenants=True) is None


def test_a_gateway_with_tenants_says_when_its_metrics_need_no_key() -> None:
    """/metrics names the tenants, their usage and their remaining quotas: open to whoever reaches the port unless
    `admin.metrics_require_key` (an outside security run read them with no key)."""
    from lockgate.admission.tenants import hash_key
    from lockgate.config import parse_config
    from lockgate.gateway import Gateway

    def said(tenants: bool, require: bool) -> bool:
        instances = [{"url": "http://127.0.0.1:9", "engine": "vllm"}]
        raw: dict[str, object] = {"usage": {"path": ":memory:"}, "models": [{"name": "m", "instances": instances}]}
        raw["admin"] = {"keys": [hash_key("admin")], "metrics_require_key": require}
        if tenants:
            raw["tenants"] = [{"name": "a", "keys": [hash_key("k")]}]
        return any("/metrics needs no key" in w for w in Gateway(parse_config(raw, "test")).warnings())

    assert said(tenants=True, require=False)
    assert not said(tenants=True, require=True) and not said(tenants=False, require=False)


def test_a_sidecar_does_not_believe_the_tags_of_ids_taken_back() -> None:
    """A tag is a public hash of an instance's key: at a sidecar (ids unbound, tenants relayed by centrals) a direct
    caller could name a central tenant's response as `<engine id>_lg<tag>`, and once the sidecar had forgotten it,
    be forwarded there under its own tenant (a second review). There the tag is stripped and not believed."""
    shown = ResponseIds(bound=False).show("resp_abc", "", "http://engine-1")
    assert ResponseIds(bound=False, trusts_tags=False).take(shown, "default") == ("resp_abc", None)
    assert ResponseIds(bound=False).take(shown, "default") == ("resp_abc", home_tag("http://engine-1"))


def test_an_id_shown_through_a_sidecar_and_a_central_is_taken_back() -> None:
    """An outside run: a central showed a 261-character id (an engine's of 215, a sidecar's suffix, the central's) and
    refused it as a `previous_response_id` (the cap was the engine's 256). Whatever two tiers make of an engine's
    longest id is taken back, and remembered."""
    from types import SimpleNamespace
    from typing import Any

    from lockgate.response_ids import MAX_RESPONSE_ID_CHARS, ResponseNaming, take_references

    engine_id = "r" * MAX_RESPONSE_ID_CHARS
    at_sidecar = ResponseIds("sidecar's").show(engine_id, "relayed", "http://engine")
    remembered: dict[str, tuple[str, str]] = {}
    pool: Any = SimpleNamespace(
        response_home=remembered.get,
        remember_response=lambda rid, key, tenant: remembered.__setitem__(rid, (key, tenant)),
        instances=[],
    )
    central = ResponseIds("central's")
    serving: Any = SimpleNamespace(key="http://sidecar#http://engine")
    naming = ResponseNaming(pool, "acme", lambda: serving, central)
    naming.made(at_sidecar)
    shown = naming.show(at_sidecar)
    assert len(shown) > MAX_RESPONSE_ID_CHARS + 40 and at_sidecar in remembered
    assert take_references({"input": "x", "previous_response_id": shown}, "acme", central, pool) == (at_sidecar, shown)
