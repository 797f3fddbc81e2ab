"""A feature asked for without its extra (`otel`, `semantic`): a clear error naming the extra, at load (so
`check-config` says it too) and at start."""

from __future__ import annotations

import sys

import pytest

from lockgate import extras
from lockgate.config import ConfigError, parse_config
from lockgate.observe import config as observe_config
from lockgate.observe.config import TracingConfig
from lockgate.observe.otel import Tracer
from lockgate.semantic import MiniLM, SemanticUnavailable


def test_tracing_without_the_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe_config, "sdk_installed", lambda: False)
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    with pytest.raises(ConfigError, match=r"tracing: .*lockgate\[otel\]"):
        parse_config({"models": models, "tracing": {"otel": True}})
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # the import fails as if not installed
    with pytest.raises(RuntimeError, match=r"lockgate\[otel\]"):
        Tracer(TracingConfig.model_construct(otel=True, service_name="lockgate", endpoint=None))


def test_a_semantic_cache_without_the_extra_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outside run: `check-config` said OK to a config with `semantic:` and `serve` then died with a Python repr of
    `SemanticUnavailable`; the `otel` extra was refused at load. Both are now refused at load, naming the extra and
    how to install it from a checkout as the README does."""
    assert extras.missing("semantic") == []  # (the test environment has every extra)
    real = extras._findable
    monkeypatch.setattr(extras, "_findable", lambda name: name != "usearch" and real(name))
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}], "semantic": {}}]
    with pytest.raises(ConfigError, match=r"semantic: .*usearch missing.*lockgate\[semantic\].*-e '\.\[semantic\]'"):
        parse_config({"models": models})
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # the import fails as if not installed
    with pytest.raises(SemanticUnavailable, match=r"pip install -e '\.\[semantic\]'"):
        MiniLM()
