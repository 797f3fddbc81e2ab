"""Tracing asked for without the `otel` extra: a clear error naming the extra, at load and at start."""

from __future__ import annotations

import sys

import pytest

from lockgate.config import ConfigError, parse_config
from lockgate.observe import config as observe_config
from lockgate.observe.config import TracingConfig
from lockgate.observe.otel import Tracer


def test_tracing_without_the_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe_config, "sdk_installed", lambda: False)
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    with pytest.raises(ConfigError, match=r"tracing: .*lockgate\[otel\]"):
        parse_config({"models": models, "tracing": {"otel": True}})
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # the import fails as if not installed
    with pytest.raises(RuntimeError, match=r"lockgate\[otel\]"):
        Tracer(TracingConfig.model_construct(otel=True, service_name="lockgate", endpoint=None))
