"""SLI values computed from scraped engine metrics and from the gateway's own counters."""

from __future__ import annotations

from lockgate.engines.sglang import SGLANG
from lockgate.engines.vllm import VLLM
from lockgate.fleet.metrics import kv_cache_hit_rate
from lockgate.fleet.scrape import parse_load
from lockgate.fleet.state import EngineLoad
from lockgate.metrics import GatewayMetrics


def test_kv_cache_hit_rate_weighs_instances_by_their_queried_tokens() -> None:
    vllm = 'vllm:prefix_cache_hits_total{model_name="m"} 30\nvllm:prefix_cache_queries_total{model_name="m"} 40\n'
    busy = parse_load(vllm, VLLM.metrics, 0.0)
    idle = EngineLoad(scraped_at=0.0, prefix_hits=0.0, prefix_queries=60.0)
    assert kv_cache_hit_rate([busy, idle, None]) == 0.3
    # An engine counting more hits than queries (an outside run's, which showed 5.05): a rate is at most 1.
    liar = EngineLoad(scraped_at=0.0, prefix_hits=101.0, prefix_queries=20.0)
    assert kv_cache_hit_rate([liar]) == 1.0
    # Nor does it drown its peers: another run's liar (1e14 hits over 1 query) read 1.0 beside an engine's 0 of 66.
    big = EngineLoad(scraped_at=0.0, prefix_hits=1e14, prefix_queries=1.0)
    assert kv_cache_hit_rate([big, EngineLoad(scraped_at=0.0, prefix_hits=0.0, prefix_queries=66.0)]) == 1 / 67


def test_kv_cache_hit_rate_falls_back_to_the_engines_own_rate_and_is_absent_without_one() -> None:
    sglang = parse_load("sglang:cache_hit_rate 0.5\n", SGLANG.metrics, 0.0)
    assert sglang is not None and sglang.prefix_hit_rate == 0.5
    assert kv_cache_hit_rate([sglang, EngineLoad(scraped_at=0.0, prefix_hit_rate=0.25)]) == 0.375
    assert kv_cache_hit_rate([EngineLoad(scraped_at=0.0, waiting=1.0), None]) is None


def test_token_counters_bound_the_tenant_label() -> None:
    metrics = GatewayMetrics(tenants=["a", "b", "c"], max_tenant_labels=1)
    tokens = metrics.tokens
    assert tokens.child("m", "b") is tokens.child("m", "c")  # both `other`
    tokens.child("m", "a").prompt += 3
    tokens.child("m", "b").prompt += 2
    tokens.child("m", "c").completion += 5
    text = metrics.render().decode()
    assert 'lockgate_prompt_tokens_total{model="m",tenant="a"} 3.0' in text
    assert 'lockgate_prompt_tokens_total{model="m",tenant="other"} 2.0' in text
    assert 'lockgate_completion_tokens_total{model="m",tenant="other"} 5.0' in text
    assert 'tenant="b"' not in text and 'tenant="c"' not in text


def test_reloads_never_take_the_tenant_label_past_its_bound() -> None:
    """An outside run: with a bound of 2 and tenants a, b, c, a reload without b labelled c too (three names, and c's
    history split between `other` and its name). A name keeps its label; a new one takes a place never used."""
    metrics = GatewayMetrics(tenants=["a", "b", "c"], max_tenant_labels=2)
    tokens = metrics.tokens
    tokens.child("m", "b").prompt += 1
    tokens.set_tenants(["a", "c", "d"])  # b removed: its place is not given again (its series stays)
    assert [tokens.tenant_label(t) for t in "acd"] == ["a", "other", "other"]
    tokens.child("m", "c").prompt += 2
    text = metrics.render().decode()
    assert 'tenant="b"} 1.0' in text and 'tenant="other"} 2.0' in text and 'tenant="c"' not in text
    grow = GatewayMetrics(tenants=["a"], max_tenant_labels=2).tokens
    grow.set_tenants(["a", "b", "c"])  # a place never used: the first new name takes it
    assert [grow.tenant_label(t) for t in "abc"] == ["a", "b", "other"]


def test_tenants_the_configuration_does_not_name_take_the_places_left() -> None:
    """An outside run: a sidecar (no tenants of its own) counted every tenant its centrals relayed under `other`,
    though its records named them. Names it does not configure take the places left, in the order they come; a
    configured tenant past the bound stays `other`."""
    sidecar = GatewayMetrics(tenants=[], max_tenant_labels=2).tokens
    assert [sidecar.tenant_label(t) for t in ("acme", "beta", "acme", "gamma")] == ["acme", "beta", "acme", "other"]
    sidecar.set_tenants([])  # (a reload: names given keep their label)
    assert sidecar.tenant_label("beta") == "beta" and sidecar.tenant_label("delta") == "other"
    local = GatewayMetrics(tenants=["a", "b", "c"], max_tenant_labels=2).tokens
    assert [local.tenant_label(t) for t in ("c", "relayed")] == ["other", "other"]  # (the two places are a's, b's)
