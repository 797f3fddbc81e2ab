"""Own accounting, engine metrics parsing per dialect, and how stale sources are merged."""

from __future__ import annotations

from typing import Any

import pytest

from lockgate.engines import dialect_for
from lockgate.fleet.scrape import parse_load
from lockgate.fleet.state import EngineLoad, OwnAccounting, merge

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b"} 2.0
vllm:num_requests_waiting{model_name="a"} 4.0
vllm:gpu_cache_usage_perc{model_name="a"} 0.5
vllm:prefix_cache_hits_total{model_name="a"} 120.0
vllm:prefix_cache_queries_total{model_name="a"} 400.0
vllm:num_requests_waiting_by_reason{model_name="a"} 99.0
"""


def test_parse_vllm_sums_labels_and_takes_the_older_kv_name():
    load = parse_load(VLLM_TEXT, dialect_for("vllm").metrics, 5.0)
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 4.0, 0.5)
    assert (load.prefix_hits, load.prefix_queries) == (120.0, 400.0)
    assert load.scraped_at == 5.0


@pytest.mark.parametrize(
    ("engine", "text", "expected"),
    [
        (
            "sglang",
            'sglang:num_queue_reqs{name="x y"} 7\nsglang:num_running_reqs 2\nsglang:token_usage 0.25\n',
            (7, 2, 0.25),
        ),
        ("tgi", "tgi_queue_size 3\ntgi_batch_current_size 8\n", (3, 8, None)),
        (
            "llamacpp",
            # llama-server exports no KV-cache use: unknown, not 0.
            "llamacpp:requests_deferred 1\nllamacpp:requests_processing 2\n",
            (1, 2, None),
        ),
    ],
)
def test_parse_other_dialects(engine, text, expected):
    load = parse_load(text, dialect_for(engine).metrics, 0.0)
    assert (load.waiting, load.running, load.kv_usage) == expected


def test_own_accounting_queues_prompt_tokens_until_the_first_token():
    own = OwnAccounting()
    a = own.start(1000, 0.0)
    b = own.start(500, 0.0)
    assert own.queued_prompt_tokens == 1500 and own.pending == 2
    own.first_token(a, 0.1)
    assert own.queued_prompt_tokens == 500
    assert own.ttft.value == pytest.approx(0.1)
    assert own.prefill_tps.value == pytest.approx(10_000)
    own.end(a, 0.5, completion_tokens=5)
    assert own.tpot.value == pytest.approx(0.1) and own.decode.value == pytest.approx(0.4)
    own.end(b, 0.6, completion_tokens=0)  # never answered: its tokens leave the queue
    assert own.queued_prompt_tokens == 0 and own.pending == 0


def test_merge_trusts_fresh_engine_metrics_and_ignores_stale_ones():
    own = OwnAccounting()
    own.start(100, 0.0)
    engine = EngineLoad(scraped_at=10.0, waiting=6, running=16, kv_usage=0.9)
    args: dict[str, Any] = {
        "key": "k",
        "name": "k",
        "routable": True,
        "in_flight": 2,
        "max_concurrency": 16,
        "own": own,
    }
    fresh = merge(**args, engine=engine, now=10.5, stale_after=1.0)
    assert (fresh.running, fresh.waiting, fresh.kv_usage) == (16, 6, 0.9)
    # 5 waiting there that this gateway did not send, at its mean prompt size (100).
    assert fresh.queued_prompt_tokens == 100 + 5 * 100
    stale = merge(**args, engine=engine, now=12.0, stale_after=1.0)
    assert (stale.running, stale.waiting, stale.kv_usage, stale.queued_prompt_tokens) == (2, 0, 0.0, 100)


def test_merge_never_lowers_own_accounting_below_an_older_scrape():
    own = OwnAccounting()
    engine = EngineLoad(scraped_at=0.0, waiting=0, running=0, kv_usage=0.0)
    view = merge(
        key="k",
        name="k",
        routable=True,
        in_flight=20,
        max_concurrency=16,
        own=own,
        engine=engine,
        now=0.1,
        stale_after=1,
    )
    assert (view.running, view.waiting) == (16, 4)
