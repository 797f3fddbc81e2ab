"""Own accounting, engine metrics parsing per dialect, and how stale sources are merged."""

from __future__ import annotations

from typing import Any

import pytest

from lockgate.engines import MetricNames, dialect_for
from lockgate.fleet.scrape import parse_load
from lockgate.fleet.state import EngineLoad, HitRateGap, OwnAccounting, merge
from lockgate.routing.policies import InstanceView

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


def _loaded(text: str, names: MetricNames, at: float) -> EngineLoad:
    """`parse_load` of a page that holds the engine's metrics."""
    load = parse_load(text, names, at)
    assert load is not None
    return load


def test_parse_vllm_sums_labels_and_takes_the_older_kv_name():
    load = _loaded(VLLM_TEXT, dialect_for("vllm").metrics, 5.0)
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
    load = _loaded(text, dialect_for(engine).metrics, 0.0)
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
    own.start(100, 10.5)
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
    later = OwnAccounting()
    later.start(100, 12.0)
    stale = merge(**{**args, "own": later}, engine=engine, now=12.0, stale_after=1.0)
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


def _whole(own: OwnAccounting, sent: float, done: float, tokens: int, engine_tpot: float = 0.0) -> None:
    attempt = own.start(100, sent)
    own.end(attempt, done, tokens, whole=True, engine_tpot=engine_tpot)


def test_a_whole_answer_is_split_with_the_streams_tpot():
    own = OwnAccounting()
    streamed = own.start(100, 0.0)
    own.first_token(streamed, 0.05)
    own.end(streamed, 0.05 + 9 * 0.01, 10)  # TPOT 10 ms from a stream
    _whole(own, 1.0, 1.0 + 0.08 + 19 * 0.01, 20)
    assert own.ttft.samples == 2 and own.ttft.value == pytest.approx(0.05 + 0.2 * (0.08 - 0.05))
    assert own.pending == 0 and own.queued_prompt_tokens == 0


def test_whole_answers_alone_fit_ttft_and_tpot_from_their_lengths():
    own = OwnAccounting()
    t = 0.0
    for tokens in [10, 40, 20, 80, 30, 60, 15, 50]:
        _whole(own, t, t + 0.1 + (tokens - 1) * 0.02, tokens)  # TTFT 100 ms, TPOT 20 ms
        t += 1.0
    assert own.whole.slope() == pytest.approx(0.02, rel=1e-6)
    assert own.ttft.samples > 0 and own.ttft.value == pytest.approx(0.1, rel=1e-3)
    assert own.decode.value > 0


def test_whole_answers_of_one_length_fall_back_to_the_engines_tpot_or_stay_unknown():
    own = OwnAccounting()
    for i in range(6):
        _whole(own, i, i + 0.5, 16)
    assert own.ttft.samples == 0  # nothing to split it by: no sample rather than a made-up one
    _whole(own, 10.0, 10.5, 16, engine_tpot=0.02)
    assert own.ttft.samples == 1 and own.ttft.value == pytest.approx(0.5 - 15 * 0.02)


def test_engine_tpot_is_read_from_the_histograms_sum_and_count():
    text = (
        'vllm:time_per_output_token_seconds_sum{model_name="a"} 3.0\n'
        'vllm:time_per_output_token_seconds_count{model_name="a"} 150\n'
    )
    load = _loaded(text, dialect_for("vllm").metrics, 1.0)
    assert load.tpot_s == pytest.approx(0.02)
    assert _loaded(text.splitlines()[0], dialect_for("vllm").metrics, 1.0).tpot_s is None


def test_the_engines_cache_size_is_read_from_vllms_cache_config_info():
    text = (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'num_gpu_blocks="2048",num_cpu_blocks="0"} 1.0\n'
    )
    assert _loaded(text, dialect_for("vllm").metrics, 1.0).cache_tokens == 2048 * 16
    assert parse_load('vllm:cache_config_info{block_size="16"} 1.0\n', dialect_for("vllm").metrics, 1.0) is None
    huge = text.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="' + "9" * 400 + '"')
    running = "vllm:num_requests_running 1\n"
    assert _loaded(running + huge, dialect_for("vllm").metrics, 1.0).cache_tokens is None  # (overflowed floats)


def test_an_engines_bad_lines_and_samples_are_skipped():
    """What an outside run fed the gateway from an engine's page: a line without its closing brace (it stopped every
    instance's scraping, silently), `+Inf` requests waiting (every request of the model answered 500), NaN and
    negative KV-cache use (which captured the `score` policy), numbers past any engine's, fractions above 1."""
    names = dialect_for("vllm").metrics
    text = (
        'vllm:num_requests_waiting{model_name="m" 3\n'  # no closing brace
        "vllm:num_requests_waiting +Inf\n"
        "vllm:num_requests_waiting 2\n"
        "vllm:num_requests_running NaN\n"
        "vllm:num_requests_running -4\n"
        "vllm:num_requests_running 1e300\n"
        "vllm:num_requests_running 5\n"
        "vllm:kv_cache_usage_perc 7.5\n"
        "vllm:prefix_cache_hits_total 1" + "0" * 400 + "\n"
        "vllm:prefix_cache_queries_total 10\n"
    )
    load = _loaded(text, names, 1.0)
    assert (load.waiting, load.running, load.kv_usage) == (2.0, 5.0, 1.0)
    assert (load.prefix_hits, load.prefix_queries) == (None, 10.0)
    assert parse_load("vllm:kv_cache_usage_perc NaN\n", names, 1.0) is None  # nothing usable: no signals


def test_a_page_without_the_engines_metrics_is_no_load():
    """A login page served at `/metrics` (or a proxy's HTML): a failed scrape, not an engine reporting nothing."""
    names = dialect_for("vllm").metrics
    assert parse_load("<html><body>Sign in</body></html>\n", names, 1.0) is None
    assert parse_load("# HELP x\nprocess_cpu_seconds_total 3\n", names, 1.0) is None


def test_hit_rate_gap_compares_the_indexs_prediction_with_the_engines_hits_between_scrapes():
    gap = HitRateGap()
    gap.observe(0, 0, EngineLoad(scraped_at=0.0, prefix_hits=0.0, prefix_queries=0.0))
    assert gap.ewma.samples == 0  # needs two scrapes
    # Between scrapes: 900 of 1000 prompt tokens predicted cached; the engine hit 500 of 1000.
    gap.observe(900, 1000, EngineLoad(scraped_at=1.0, prefix_hits=500.0, prefix_queries=1000.0))
    assert gap.value == pytest.approx(0.4)
    gap.observe(900, 1000, EngineLoad(scraped_at=2.0, prefix_hits=500.0, prefix_queries=1000.0))
    assert gap.ewma.samples == 1  # no traffic in between: no sample
    gap.observe(900, 1000, EngineLoad(scraped_at=3.0))  # an engine without prefix-cache counters
    assert gap.ewma.samples == 1


def test_queued_prompt_tokens_count_only_what_is_not_prefilled_yet():
    """Short requests should not wait behind a long prefill: the view counts what is left of the work
    sent (at the measured rate), so of two instances each prefilling a long prompt, the one nearer done
    looks less queued."""
    early, late = OwnAccounting(), OwnAccounting()
    for own in (early, late):
        own.prefill_tps.add(8000.0, 0.0)
    early.start(2000, 0.0)  # 0.25 s of prefill
    late.start(2000, 0.1)
    assert early.remaining_prompt_tokens(0.2) == 400 and late.remaining_prompt_tokens(0.2) == 1200
    # Work sent behind it queues after it; what is left never exceeds what is queued.
    early.start(800, 0.2)
    assert early.remaining_prompt_tokens(0.2) == 1200 and early.queued_prompt_tokens == 2800
    # Past the estimate with the first token not back: nothing more is assumed (the next sample re-measures).
    assert early.remaining_prompt_tokens(1.0) == 0 and early.queued_prompt_tokens == 2800
    args: dict[str, Any] = {"routable": True, "in_flight": 1, "max_concurrency": 16, "engine": None}
    views = [merge(key=k, name=k, own=o, now=0.2, stale_after=1.0, **args) for k, o in (("e", early), ("l", late))]
    assert [v.queued_prompt_tokens for v in views] == [1200, 1200]


def test_one_far_off_sample_moves_a_settled_prefill_rate_at_most_four_times():
    """An outside run: a P0 sent behind 45,000 tokens of queued P2 prompts had them stopped, and its first token came
    in 20 ms: a sample of millions of tokens a second took the rate 100x up, and the queue there read as no prefill
    work (an 8-slot engine's limit held at 3). A settled rate moves at most 4x a sample; the first samples are taken
    as they come."""
    own = OwnAccounting()
    for n in range(3):
        own.first_token(own.start(800, n), n + 0.1)  # 8,000 tokens a second, three times
    assert own.prefill_tps.value == pytest.approx(8_000)
    behind = own.start(300, 10.0)
    behind.backlog = 45_000  # (what was queued ahead of it when it was sent, since stopped)
    own.first_token(behind, 10.01)
    assert own.prefill_tps.value == pytest.approx(8_000 + 0.2 * (4 * 8_000 - 8_000))
    fresh = OwnAccounting()
    fresh.first_token(fresh.start(800, 0.0), 0.001)  # unsettled: taken as it comes
    assert fresh.prefill_tps.value == pytest.approx(800_000)


def test_an_instance_past_its_estimate_counts_as_slower_not_idle():
    """A slow engine that has not answered by the time its estimate ran out used to count as having nothing
    queued, so it looked idle exactly while it was overdue and took every arrival until its first answer
    (`bench routing` bursty/slow: 22 requests in its first 0.16 s, 170-320 ms each). Now what is unanswered
    counts, scaled by how far past the estimate the run of prompts is."""
    own = OwnAccounting()
    own.default_tps = 40_000.0  # unmeasured: the routing's default (a pool sets it), not the module's
    first = own.start(1200, 0.0)  # estimated prefilled at 0.03 s
    assert own.backlog_tokens(0.015) == own.remaining_prompt_tokens(0.015) == 600
    assert own.remaining_prompt_tokens(0.06) == 0  # the estimate has run out, the first token is not back
    assert own.backlog_tokens(0.06) == 2400  # twice as long as estimated: at least twice as slow
    own.start(40, 0.06)  # behind it, in the same run
    assert own.backlog_tokens(0.09) == round(1240 * 0.09 / 0.031)
    assert own.backlog_tokens(5.0) == 1240 * 20  # at most 20x slower
    own.first_token(first, 0.2)  # measured (1200 tokens in 0.2 s) and estimated afresh from here
    assert own.prefill_tps.value == pytest.approx(6000.0)
    assert own.backlog_tokens(0.2) == 40 and own.prefill_until == pytest.approx(0.2 + 40 / 6000)
    args: dict[str, Any] = {"routable": True, "in_flight": 2, "max_concurrency": 16, "engine": None}
    overdue = merge(key="s", name="s", own=own, now=0.3, stale_after=1.0, **args)
    assert overdue.queued_prompt_tokens == round(40 * (0.3 - 0.2) / (40 / 6000))  # still unanswered: overdue again


def test_an_attempt_past_its_prefill_and_three_steps_is_overdue() -> None:
    """`OwnAccounting.overdue`: an unanswered attempt is due by its prefill (with the prompt work queued ahead
    of it) at the measured rate plus three steps; later, it waits in the engine's own queue for a slot."""
    own = OwnAccounting()
    own.default_tps = 1000.0
    first = own.start(100, 0.0)  # 0.1 s of prefill
    assert own.overdue(10.0) is None  # no step time measured: nothing can be called overdue
    own.tpot.add(0.01, 0.0)
    assert own.first_token_due(first) == pytest.approx(0.1 + 0.03)
    assert own.first_token_due(first, slack_steps=0) == pytest.approx(0.1 + 0.02)  # the engine's slots unknown
    second = own.start(50, 0.06)  # queued behind what remains of the first (40 tokens): 0.09 s of prefill
    assert own.first_token_due(second) == pytest.approx(0.06 + 0.09 + 0.03)
    assert own.overdue(0.12) is False
    assert own.overdue(0.14) is True  # the first
    own.first_token(first, 0.14)
    assert own.first_token_due(first) is None and own.overdue(0.14) is False
    assert own.overdue(0.2) is True  # the second
    own.end(second, 0.2, 0)
    assert own.overdue(5.0) is False


def test_an_engine_queueing_more_than_arrived_within_the_last_step_is_full() -> None:
    """`OwnAccounting.queued_beyond`: the requests the gateway sent an engine within the step before a scrape may
    be waiting only for the step they arrived in; more waiting means older requests wait for a slot (full)."""
    own = OwnAccounting()
    own.start(10, 0.0)
    assert own.queued_beyond(5, 1.0) is None  # no step time measured
    own.tpot.add(0.01, 0.0)
    own.start(10, 0.995)
    own.start(10, 0.998)
    assert own.queued_beyond(2, 1.0) is False  # the two sent within the last step
    assert own.queued_beyond(3, 1.0) is True  # and one more: the one sent at 0.0 waits for a slot
    assert own.queued_beyond(0, 1.0) is False


def view_of(own: OwnAccounting, now: float, in_flight: int = 2) -> InstanceView:
    """What routing sees of an instance with only `own` accounting (no scrape), at `now`."""
    return merge(
        key="k",
        name="k",
        routable=True,
        in_flight=in_flight,
        max_concurrency=4,
        own=own,
        engine=None,
        now=now,
        stale_after=1.0,
    )


def test_the_view_shows_the_oldest_unanswered_attempt_and_the_floor_of_recent_first_tokens() -> None:
    own = OwnAccounting()
    first = own.start(100, now=10.0)
    own.start(50, now=10.5)
    view = view_of(own, 12.0)
    assert (view.oldest_wait_s, view.oldest_work, view.latency_floor_s) == (2.0, 100, 0.0)
    own.first_token(first, now=13.0)
    later = view_of(own, 14.0)
    # The second has waited 3.5 s, but the engine answered the first at 13.0: it is working, the wait counts from there.
    # Its first token took 3 s, of which its 100 tokens' prefill at the default rate is a few ms.
    assert later.oldest_wait_s == 1.0 and later.latency_floor_s == pytest.approx(3.0 - 100 / own.default_tps)
    for n in range(8):  # the floor is the least of the last eight
        own.first_token(own.start(10, now=20.0 + n), now=20.5 + n)
    assert own.latency_floor == pytest.approx(0.5 - 10 / own.rate, abs=0.01)
    assert own.oldest_unanswered()[0] is not None


def test_a_whole_answer_is_never_overdue_and_is_shown_apart() -> None:
    """A request answered as one body shows no first token until its end: judged like a stream's, every
    non-streaming answer longer than three steps looked late (to routing, and to a P0 deciding whether the engine's
    queue is backed up)."""
    own = OwnAccounting()
    stream = own.start(10, now=0.0)
    own.first_token(stream, now=0.01)
    own.end(stream, now=0.1, completion_tokens=10)  # a step measured: attempts may be overdue
    whole = own.start(10, now=1.0, whole=True)
    assert own.oldest_unanswered() == (None, whole)
    assert own.first_token_due(whole) is None and own.overdue(now=100.0) is False
    view = view_of(own, 3.0, in_flight=1)
    assert (view.oldest_wait_s, view.oldest_whole_wait_s, view.oldest_whole_work) == (0.0, 2.0, 10)
    own.end(whole, now=4.0, completion_tokens=30, whole=True)
    done = view_of(own, 5.0, in_flight=0)
    assert (done.oldest_whole_wait_s, done.whole_s) == (0.0, 3.0)  # a whole answer's time, whatever the step


def test_a_whole_answer_is_waited_on_only_while_nothing_else_progresses_there() -> None:
    own = OwnAccounting()
    own.start(10, now=0.0, whole=True)  # a long generation
    other = own.start(10, now=1.0)
    view = view_of(own, 5.0)
    assert view.oldest_whole_wait_s == 5.0
    own.first_token(other, now=6.0)  # the engine answers others: it is working
    view = view_of(own, 7.0)
    assert view.oldest_whole_wait_s == 1.0


async def test_a_first_token_that_may_have_waited_for_a_slot_does_not_measure_the_prefill_rate() -> None:
    """An outside run: under a flood, first tokens that had waited for one of an 8-slot engine's sequence slots were
    measured as prefill (the prompt tokens ahead of them over their wait): its rate fell to a few hundred tokens a
    second, every queue there read as prefill work, and its concurrency limit stayed at 256 with 240 requests waiting
    inside it. While the engine's last scrape shows a queue at least as long as what it runs, a first token measures
    neither the rate nor the latency floor."""
    import dataclasses

    from lockgate.config import parse_config
    from lockgate.fleet.fleet import Fleet
    from lockgate.fleet.instance import engine_queues
    from lockgate.metrics import GatewayMetrics

    model = {"name": "m", "instances": [{"url": "http://127.0.0.1:9", "engine": "vllm"}]}
    config = parse_config({"models": [model], "scrape": {"enabled": False}, "health": {"interval_ms": 600000}})
    async with Fleet(config, GatewayMetrics()) as fleet:
        [engine] = fleet.pools["m"].instances
        load = EngineLoad(scraped_at=0.0, waiting=240.0, running=8.0)
        engine.engine_load = load
        assert engine_queues(engine)
        queued = fleet.lease(engine, "m", 1000, 1000)
        queued._attempt.sent_at -= 5.0  # five seconds waiting for a slot
        queued.first_token()
        assert engine.own.prefill_tps.samples == 0 and engine.own.latency_floor == 0.0
        assert engine.own.ttft.samples == 1  # (what a client waited, all the same)
        queued.release()
        engine.engine_load = dataclasses.replace(load, waiting=0.0)
        assert not engine_queues(engine)
        taken = fleet.lease(engine, "m", 1000, 1000)
        taken._attempt.sent_at -= 0.2
        taken.first_token()
        assert engine.own.prefill_tps.samples == 1
        taken.release()


def test_how_long_a_request_holds_its_slot_is_bounded_below_by_the_oldest_still_decoding() -> None:
    """`OwnAccounting.decode_s`: the mean measured at the ends of generations; before any ended here (a flood's first
    generation, an engine just added), how long the oldest stream still running has decoded so far."""
    own = OwnAccounting()
    assert own.decode_s(5.0) == 0.0  # nothing decodes here
    first = own.start(10, 0.0)
    whole = own.start(10, 0.0, whole=True)  # its first token is never seen: it says nothing of this
    assert own.decode_s(5.0) == 0.0
    own.first_token(first, 1.0)
    second = own.start(10, 1.5)
    own.first_token(second, 2.0)
    assert own.decode_s(4.0) == pytest.approx(3.0)  # the first, decoding since 1.0
    own.end(first, 4.5, 40)
    assert own.decode_s(9.0) == pytest.approx(3.5)  # measured now: the bound is no longer needed
    own.end(whole, 9.0, 0)
    own.end(second, 9.0, 40)
    assert own.decode.samples == 2 and not own._decoding


def test_requests_stopped_since_the_scrape_are_not_someone_elses() -> None:
    """The engine's `waiting` is as of its scrape: the gateway's own requests stopped since (a P0's room made) were
    among them. Counted against those unanswered now, 27 P2 requests stopped for a P0 read as 27 waiting there that
    another client had sent, ~73,000 prompt tokens: a 6-slot engine priced 9 s away for the scrape's age, and the next
    P0 went to a slow engine where it waited 10-15 s (an outside fleet)."""
    own = OwnAccounting()
    sent = [own.start(2700, 9.0) for _ in range(28)]
    engine = EngineLoad(scraped_at=10.0, waiting=28, running=4, own_left=own.left_unanswered)
    for attempt in sent[1:]:
        own.end(attempt, 10.05, completion_tokens=0)  # stopped before their first token

    fields: dict[str, Any] = {"key": "k", "name": "k", "routable": True, "in_flight": 5, "max_concurrency": 6}

    def queued(engine: EngineLoad) -> int:
        return merge(**fields, own=own, engine=engine, now=10.1, stale_after=1).queued_prompt_tokens

    assert queued(engine) <= 2700  # the one still unanswered, nothing of anyone else's
    # What another client has there still shows (30 waiting as of the scrape: 28 of them the gateway's then).
    assert queued(EngineLoad(scraped_at=10.0, waiting=30, running=4, own_left=0)) >= 2 * 2700
