"""The `metrics:`, `admin:`, `access_log:` and `tracing:` sections."""

from __future__ import annotations

import pytest

from lockgate.admission.tenants import hash_key
from lockgate.config import ConfigError, parse_config

MODELS = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]


def test_defaults_are_off_and_open() -> None:
    config = parse_config({"models": MODELS})
    assert config.admin.keys == [] and not config.admin.metrics_require_key
    assert not config.access_log.enabled and config.access_log.path == "-" and not config.access_log.include_prompts
    assert not config.tracing.otel
    assert config.metrics.max_tenant_labels == 100


def test_a_plaintext_admin_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": MODELS, "admin": {"keys": ["super-secret-admin"]}})
    assert "admin.keys" in str(info.value) and "super-secret-admin" not in str(info.value)


def test_metrics_require_key_needs_a_key_and_keys_are_not_shared_with_tenants() -> None:
    with pytest.raises(ConfigError, match="metrics_require_key"):
        parse_config({"models": MODELS, "admin": {"metrics_require_key": True}})
    key = hash_key("k")
    with pytest.raises(ConfigError, match="tenant's key"):
        parse_config({"models": MODELS, "tenants": [{"name": "t", "keys": [key]}], "admin": {"keys": [key]}})


def test_access_log_sample_is_a_fraction() -> None:
    with pytest.raises(ConfigError, match=r"access_log\.sample"):
        parse_config({"models": MODELS, "access_log": {"sample": 1.5}})
