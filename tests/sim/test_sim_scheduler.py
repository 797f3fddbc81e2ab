"""The batching model, stepped by hand: no asyncio, no time."""

from __future__ import annotations

import pytest

from lockgate.sim.generator import TokenStream
from lockgate.sim.scheduler import Scheduler, SchedulerConfig, StepResult


def prompt(n: int, tag: str = "w") -> list[str]:
    return [f" {tag}{i}" for i in range(n)]


def add(s: Scheduler, sid: str, n_prompt: int, max_tokens: int, tag: str = "w", priority: int = 0) -> None:
    p = prompt(n_prompt, tag)
    s.add(sid, p, TokenStream(p, 1, max_tokens), priority)


def run_all(s: Scheduler, limit: int = 10_000) -> list[StepResult]:
    out = []
    while s.has_work and limit:
        out.append(s.step())
        limit -= 1
    return out


def cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=4, prefill_tps=1000.0, tpot_ms=10.0
    )
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_single_request_prefill_then_decode_durations() -> None:
    s = Scheduler(cfg())
    add(s, "a", 40, 3)
    r1 = s.step()  # whole prompt fits the budget: prefill + first token in one step
    assert r1.prefill_tokens == 40 and [e.first for e in r1.events] == [True]
    assert r1.duration_s == pytest.approx(40 / 1000 + 0.010)
    r2 = s.step()
    assert r2.prefill_tokens == 0 and r2.duration_s == pytest.approx(0.010)
    r3 = s.step()
    assert r3.finished == ("a",) and r3.events[0].token.finish_reason == "length"
    assert not s.has_work and s.kv.blocks_used == 0


def test_chunked_prefill_respects_token_budget() -> None:
    s = Scheduler(cfg(max_num_batched_tokens=16))
    add(s, "a", 40, 2)
    results = [s.step() for _ in range(3)]
    assert [r.prefill_tokens for r in results] == [16, 16, 8]
    assert [len(r.events) for r in results] == [0, 0, 1]
    assert results[0].duration_s == pytest.approx(16 / 1000)  # no token sampled: no decode term


def test_max_num_seqs_limits_the_batch_and_tpot_grows() -> None:
    s = Scheduler(cfg(max_num_seqs=2, batch_growth=0.5))
    for i in range(3):
        add(s, f"r{i}", 4, 5, tag=f"t{i}")
    r = s.step()
    assert s.num_running == 2 and s.num_waiting == 1
    assert r.num_sampled == 2
    r = s.step()
    assert r.duration_s == pytest.approx(0.010 * 1.5)
    results = run_all(s)
    assert s.kv.blocks_used == 0
    assert sum(len(x.events) for x in results) == 15 - 4


def test_prefix_cache_cuts_prefill_of_a_later_request() -> None:
    s = Scheduler(cfg())
    add(s, "a", 20, 1)
    assert s.step().prefill_tokens == 20
    add(s, "b", 20, 1)  # same prompt
    r = s.step()
    assert r.prefill_tokens == 4  # 16 tokens (4 full blocks) cached; the last block is recomputed
    assert r.admitted[0].num_cached == 16
    assert s.kv.prefix_cache_hits == 16 and s.kv.prefix_cache_queries == 40


def test_priority_orders_the_waiting_queue() -> None:
    s = Scheduler(cfg(max_num_seqs=1))
    add(s, "low", 4, 1, priority=5)
    add(s, "high", 4, 1, priority=-1)
    add(s, "mid", 4, 1, priority=0)
    order = [e.seq_id for r in run_all(s) for e in r.events]
    assert order == ["high", "mid", "low"]


def test_waits_for_kv_space_then_runs() -> None:
    s = Scheduler(cfg(num_kv_blocks=10, block_size=4))
    add(s, "a", 30, 2, tag="a")  # 8 blocks
    add(s, "b", 12, 2, tag="b")  # 3 blocks: does not fit beside a
    r = s.step()
    assert [x.seq_id for x in r.admitted] == ["a"] and s.num_waiting == 1
    run_all(s)
    assert s.kv.blocks_used == 0 and not s.has_work


def test_decode_preempts_newest_when_kv_runs_out_and_output_is_unchanged() -> None:
    s = Scheduler(cfg(num_kv_blocks=6, block_size=4, max_num_seqs=4))
    add(s, "a", 7, 9, tag="a")  # needs up to 4 blocks over its lifetime
    add(s, "b", 7, 9, tag="b")
    results = run_all(s)
    assert sum(len(r.preempted) for r in results) >= 1
    toks: dict[object, list[str]] = {"a": [], "b": []}
    for r in results:
        for e in r.events:
            toks[e.seq_id].append(e.token.token)
    for sid, tag in (("a", "a"), ("b", "b")):
        p = prompt(7, tag)
        ref = TokenStream(p, 1, 9)
        assert toks[sid] == [ref.next().token for _ in range(9)]
    assert s.kv.blocks_used == 0
    s.kv.check_invariants()


@pytest.mark.parametrize("when", [0, 1, 2, 5])
def test_abort_frees_everything_wherever_the_request_is(when: int) -> None:
    s = Scheduler(cfg(max_num_seqs=1, max_num_batched_tokens=8))
    add(s, "a", 20, 10, tag="a")
    add(s, "b", 20, 10, tag="b")  # waiting behind a
    for _ in range(when):
        s.step()
    assert s.abort("a") and not s.abort("a")
    assert s.abort("b")
    assert not s.has_work and s.num_running == 0 and s.num_waiting == 0
    assert s.kv.blocks_used == 0
    s.kv.check_invariants()
    assert s.step().idle


def test_request_that_can_never_fit_is_refused() -> None:
    s = Scheduler(cfg(num_kv_blocks=2, block_size=4))
    with pytest.raises(ValueError):
        add(s, "a", 6, 4)


async def test_a_request_id_reused_while_a_step_runs_keeps_its_own_sequence() -> None:
    """A gateway's retry reuses the request id. When the first attempt's last token was stepped but not yet
    delivered (the step loop sleeps for the step's duration) and the attempt is closed and retried meanwhile,
    that token belongs to the closed attempt: the retry neither receives it nor loses its own sequence (which
    was left running in the scheduler with nobody to deliver to; seen as `running: 1` after a chaos test)."""
    from lockgate.sim.engine import Engine
    from lockgate.sim.metrics import LiveGauges, SimMetrics
    from lockgate.sim.stats import SimStats

    stats = SimStats()
    engine = Engine(cfg(), stats, SimMetrics("m", lambda: LiveGauges(0, 0, 0.0)))
    p = prompt(4)
    first = stats.open_request("x", "m", "chat", False)
    attempt = engine.submit(first, p, TokenStream(p, 1, 1))
    step = engine.scheduler.step()  # its only token, finish included: the step loop now sleeps
    attempt.close()  # the client (the gateway) went: reset, and retried at once with the same id
    stats.close_request(first, "reset")
    second = stats.open_request("x", "m", "chat", False)
    retry = engine.submit(second, p, TokenStream(p, 1, 1))
    engine._deliver(step)  # the sleep is over
    assert second.completion_tokens == 0 and not retry.closed
    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 1
    engine._deliver(engine.scheduler.step())
    assert second.completion_tokens == 1 and retry.finish_reason == "length"
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
