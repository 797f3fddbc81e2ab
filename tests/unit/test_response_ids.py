"""Response ids bound to their tenant (`response_ids.py`)."""

from __future__ import annotations

import pytest

from lockgate.response_ids import SECRET_ENV, ResponseIds


def test_an_id_is_taken_back_only_from_the_tenant_it_was_shown_to() -> None:
    ids = ResponseIds("secret")
    shown = ids.show("resp_abc", "acme")
    assert shown.startswith("resp_abc_lg") and shown != ids.show("resp_abc", "beta")
    assert ids.engine_id(shown, "acme") == "resp_abc"
    assert ids.engine_id(shown, "beta") is None
    assert ids.engine_id("resp_abc", "acme") is None  # the engine's own id: never shown, never taken
    tampered = shown[:-1] + ("0" if shown[-1] != "0" else "1")
    assert ids.engine_id(tampered, "acme") is None
    assert ids.engine_id(ids.show("resp_other", "acme")[:-24] + shown[-24:], "acme") is None  # a mac moved over
    for junk in ("", "_lg", "x" * 24, "resp_" + "_lg" + "0" * 24):
        assert ids.engine_id(junk, "acme") is None
    assert ResponseIds("another secret").engine_id(shown, "acme") is None


def test_the_secret_comes_from_the_environment_else_is_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "shared")
    assert ResponseIds().engine_id(ResponseIds().show("resp_1", "t"), "t") == "resp_1"
    monkeypatch.delenv(SECRET_ENV)
    assert ResponseIds().engine_id(ResponseIds().show("resp_1", "t"), "t") is None
