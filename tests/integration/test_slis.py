"""The design's SLIs (section 8) in `/metrics`, each with its bounded label set."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from lockgate.admission.tenants import hash_key
from tests.conftest import instance

TENANTS = [
    {"name": "acme", "keys": [hash_key("key-acme")]},
    {"name": "globex", "keys": [hash_key("key-globex")]},
    {"name": "initech", "keys": [hash_key("key-initech")]},
]


def chat(**extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **extra}
    return orjson.dumps(body)


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def labelsets(family: Any, suffix: str = "") -> list[dict[str, str]]:
    return [s.labels for s in family.samples if s.name == family.name + suffix]


async def test_every_sli_is_in_metrics_with_its_labels(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=TENANTS,
        # Two tenants keep their own label; the third is counted under `other`.
        metrics={"max_tenant_labels": 2},
    )
    assert gw.gateway is not None
    async with aiohttp.ClientSession() as http:
        calls = [("key-acme", "P0", False), ("key-globex", "P1", True), ("key-initech", "P2", True)]
        for key, priority, stream in calls:
            headers = {"Authorization": f"Bearer {key}", "x-priority": priority}
            async with http.post(gw.url + "/v1/chat/completions", data=chat(stream=stream), headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
        await gw.gateway.fleet.scraper.scrape_all()
        families = await scrape(http, gw.url)

    # Request latency {model, priority, status}, and the request counter with the same labels.
    for name, suffix in [("lockgate_request_duration_seconds", "_count"), ("lockgate_requests", "_total")]:
        seen = labelsets(families[name], suffix)
        for priority in ("P0", "P1", "P2"):
            assert {"model": "m", "priority": priority, "status": "completed"} in seen, (name, seen)
    # TTFT {model, priority, stream}: a whole response's first token is not comparable to a stream's.
    ttft = labelsets(families["lockgate_time_to_first_token_seconds"], "_count")
    assert {"model": "m", "priority": "P0", "stream": "false"} in ttft
    assert {"model": "m", "priority": "P1", "stream": "true"} in ttft
    # KV-cache hit rate per model, from the engines' prefix-cache counters.
    [rate] = families["lockgate_kv_cache_hit_rate"].samples
    assert rate.labels == {"model": "m"} and 0.0 <= rate.value <= 1.0
    [queried] = families["lockgate_instance_engine_prefix_cache_queries"].samples
    [hits] = families["lockgate_instance_engine_prefix_cache_hits"].samples
    assert queried.value > 0 and hits.value / queried.value == rate.value
    # De-duplication: the outcomes and the hit ratio computed from them.
    assert {s.labels["outcome"] for s in families["lockgate_dedup"].samples if s.name == "lockgate_dedup_total"}
    [ratio] = families["lockgate_dedup_hit_ratio"].samples
    assert 0.0 <= ratio.value <= 1.0
    # Cancellations by reason (none happened: the family is there, with its labels documented).
    assert "lockgate_cancellations" in families
    # Queue depth by priority class.
    depth = labelsets(families["lockgate_queue_depth"])
    assert {"model": "m", "priority": "P0"} in depth and {"model": "m", "priority": "P2"} in depth
    # Stream backpressure: one observation per stream (0 here: the client kept up).
    backpressure = families["lockgate_stream_backpressure_seconds"]
    [count] = [s for s in backpressure.samples if s.name.endswith("_count")]
    assert count.labels == {"model": "m"} and count.value == 2
    # Tokens by model and tenant, the tenant label bounded by `metrics.max_tenant_labels`: the first
    # configured tenants keep their names, the rest are `other`.
    for name in ("lockgate_prompt_tokens", "lockgate_completion_tokens"):
        by_tenant = {s.labels["tenant"]: s.value for s in families[name].samples}
        assert set(by_tenant) == {"acme", "globex", "other"}, by_tenant
        assert all(value > 0 for value in by_tenant.values())
