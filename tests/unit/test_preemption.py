"""Preemption's sync core: victim choice, re-queueing, resumability, continuations, the transcript."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from lockgate.admission.gate import PoolScheduler
from lockgate.admission.preemption import (
    PREFILL_STOPS,
    Plan,
    Stopped,
    StopSignal,
    Transcript,
    blocker,
    choose_victim,
    continuation,
    fresh,
    plan,
)
from lockgate.admission.scheduler import ClassSpec, SchedulerCore, Ticket, TicketState
from lockgate.config import parse_config
from lockgate.errors import ModelNotFound
from lockgate.fleet.fleet import Fleet
from lockgate.metrics import GatewayMetrics, SchedulingMetrics
from lockgate.wire import Endpoint, validate

CLASSES = (
    ClassSpec("P0", weight=0.6, strict=True, max_queue=8),
    ClassSpec("P1", weight=0.3, max_queue=8),
    ClassSpec("P2", weight=0.1, max_queue=8),
)
LOWEST = frozenset({2})


def offer(core: SchedulerCore, klass: int, tag: Any = True) -> Ticket:
    ticket = Ticket(klass, tag)
    core.offer(ticket, 0.0)
    return ticket


def willing(ticket: Ticket) -> int | None:
    """Stops so far: the tag's count (True: never stopped), None for an unwilling ticket."""
    tag = ticket.tag
    if tag is False:
        return None
    return 0 if tag is True else int(tag)


def test_the_newest_preemptible_ticket_of_the_lowest_class_is_chosen() -> None:
    core = SchedulerCore(CLASSES, capacity=4)
    old, newer = offer(core, 2), offer(core, 2)
    unwilling = offer(core, 2, tag=False)  # e.g. a dedup flight, or a stream that cannot resume
    p1 = offer(core, 1)
    p0 = offer(core, 0)
    assert p0.state is TicketState.QUEUED
    assert choose_victim(core, 0, LOWEST, willing) is newer
    # P1 is preemptible too when configured, but the least urgent class goes first.
    assert choose_victim(core, 0, frozenset({1, 2}), willing) is newer
    assert choose_victim(core, 0, frozenset({1}), willing) is p1
    assert choose_victim(core, 0, frozenset(), willing) is None
    core.release(newer, 1.0)  # P0 takes that slot
    assert p0.running  # not `p0.state is ...`: mypy would keep the QUEUED narrowing from above
    assert choose_victim(core, 0, LOWEST, willing) is old
    assert unwilling.state is TicketState.RUNNING


def test_the_ticket_stopped_fewest_times_goes_first_then_the_newest() -> None:
    """Stops are spread over the running requests: the request just resumed (the newest) is not stopped
    again while others have been stopped less, so a per-request limit is reached late."""
    core = SchedulerCore(CLASSES, capacity=3)
    once, never, resumed_twice = offer(core, 2, tag=1), offer(core, 2, tag=True), offer(core, 2, tag=2)
    offer(core, 0)
    assert choose_victim(core, 0, LOWEST, willing) is never
    core.release(never, 1.0)
    offer(core, 0)
    assert choose_victim(core, 0, LOWEST, willing) is once
    core.release(once, 1.0)
    offer(core, 0)
    assert choose_victim(core, 0, LOWEST, willing) is resumed_twice


def test_no_victim_unless_a_strict_ticket_waits_for_a_full_pool() -> None:
    core = SchedulerCore(CLASSES, capacity=2)
    offer(core, 2)
    assert choose_victim(core, 0, LOWEST, willing) is None  # a slot is free
    offer(core, 2)
    assert choose_victim(core, 1, LOWEST, willing) is None  # only strict classes preempt
    assert choose_victim(core, 2, LOWEST, willing) is None
    assert choose_victim(core, 0, LOWEST, willing) is not None
    # A strict class held back by its own limit would not get the freed slot.
    limited = (ClassSpec("P0", strict=True, max_running=1), *CLASSES[1:])
    core = SchedulerCore(limited, capacity=2)
    offer(core, 0)
    offer(core, 2)
    assert offer(core, 0).state is TicketState.QUEUED
    assert choose_victim(core, 0, LOWEST, willing) is None


def test_requeue_gives_the_slot_to_the_strict_ticket_and_queues_the_victim_first() -> None:
    core = SchedulerCore(CLASSES, capacity=1)
    victim = offer(core, 2)
    later = offer(core, 2)
    p0 = offer(core, 0)
    assert core.requeue(victim, 5.0) == [p0]
    assert victim.state is TicketState.QUEUED and victim.offered_at == 5.0
    assert core.queued(2) == 2 and core.running(2) == 0
    assert core.release(p0, 6.0) == [victim]  # ahead of the later arrival of its class
    assert next(core.running_newest_first(2), None) is victim
    with pytest.raises(ValueError):
        core.requeue(later, 7.0)  # not running
    assert core.release(victim, 7.0) == [later]
    assert core.release(later, 8.0) == []
    assert core.running_total == 0 and core.queued_total == 0


def test_preemptible_classes_from_config() -> None:
    def classes(**scheduling: Any) -> frozenset[int]:
        data = {"models": [{"name": "m", "instances": [{"url": "http://x"}]}], "scheduling": scheduling}
        return parse_config(data).scheduling.preemptible_classes()

    assert classes() == frozenset({2})  # the lowest class only
    assert classes(preemption={"enabled": False}) == frozenset()
    custom = [
        {"name": "P0", "strict": True},
        {"name": "P1", "preemptible": True},
        {"name": "P2"},
        {"name": "P3", "preemptible": False},
    ]
    assert classes(classes=custom) == frozenset({1})
    with pytest.raises(Exception, match="strict class cannot be preemptible"):
        classes(classes=[{"name": "P0", "strict": True, "preemptible": True}, {"name": "P1"}])
    with pytest.raises(Exception, match="max_per_request"):
        classes(preemption={"max_per_request": 0})


def chat(**extra: Any):
    return validate(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def completion(**extra: Any):
    return validate(Endpoint.COMPLETIONS, {"model": "m", "prompt": "once", **extra})


@pytest.mark.parametrize(
    ("api", "chat_continuation", "why"),
    [
        (chat(max_tokens=10), True, None),
        (chat(max_completion_tokens=10), True, None),
        # The engine's default cap is unknown: a continuation could not be bounded at what is left.
        (chat(), True, "max_tokens"),
        (completion(), False, "max_tokens"),
        (chat(max_tokens=10), False, "dialect"),
        (chat(n=2), True, "n"),
        (chat(max_tokens=10, logprobs=True), True, "logprobs"),
        (chat(max_tokens=10, logprobs=False), True, None),
        (chat(max_tokens=10, tools=[{"type": "function", "function": {"name": "f"}}]), True, "tools"),
        (chat(max_tokens=10, response_format={"type": "json_object"}), True, "response_format"),
        (chat(max_tokens=10, stop=["\n"]), True, "stop"),
        (completion(max_tokens=10), False, None),  # any engine continues a text prompt
        (completion(max_tokens=10, prompt=["once"]), False, None),
        (completion(max_tokens=10, prompt=[1, 2, 3]), False, "prompt"),
        (completion(max_tokens=10, echo=True), False, "echo"),
        (completion(max_tokens=10, logprobs=2), False, "logprobs"),
    ],
)
def test_blocker(api, chat_continuation: bool, why: str | None) -> None:
    assert blocker(api, chat_continuation=chat_continuation) == why


def test_plan_resumes_restarts_or_refuses() -> None:
    t = Transcript(Endpoint.CHAT)
    assert plan(None, t, 10, sent=True) is Plan.RESUME
    assert plan("dialect", t, 10, sent=False) is Plan.RESTART
    assert plan("dialect", t, 10, sent=True) is None  # the client has seen output: keep going
    t.take(chunk(delta={"tool_calls": [{"index": 0, "function": {"name": "f"}}]}))
    assert plan(None, t, 10, sent=True) is None and plan(None, t, 10, sent=False) is Plan.RESTART
    done = Transcript(Endpoint.COMPLETIONS)
    for _ in range(3):
        done.take(chunk(text=" a"))
    assert plan(None, done, 3, sent=True) is None  # everything produced: finishing anyway


def test_an_output_past_the_kept_text_bound_is_no_longer_resumed() -> None:
    """The output is kept for a continuation up to `max_chars` (`upstream.max_response_bytes`: a continuation is a
    prompt): past it the text is dropped, and the request is restarted while its client has seen nothing, else not
    stopped (a client could make a P2 stream endless and its transcript with it)."""
    t = Transcript(Endpoint.COMPLETIONS, keep_events=False, max_chars=10)
    for _ in range(5):
        t.take(chunk(text="ab"))
    assert (t.text, t.overflow, plan(None, t, 100, sent=True)) == ("ababababab", False, Plan.RESUME)
    t.take(chunk(text="c"))
    assert (t.text, t.tokens, t.overflow) == ("", 6, True)
    assert plan(None, t, 100, sent=True) is None and plan(None, t, 100, sent=False) is Plan.RESTART
    t.take(chunk(text="d"))
    assert (t.text, t.tokens) == ("", 7)  # still counted, not kept
    t.reset()
    assert not t.overflow and t.take(chunk(text="e")) is not None and t.text == "e"


def test_continuation_bodies() -> None:
    api = chat(max_tokens=10, stream=False, temperature=0)
    c = continuation(api, " alpha bravo", 2)
    assert c.body["messages"][-1] == {"role": "assistant", "content": " alpha bravo"}
    assert c.body["messages"][:-1] == api.body["messages"]
    assert c.body["continue_final_message"] is True and c.body["add_generation_prompt"] is False
    assert c.body["max_tokens"] == 8 and c.max_tokens == 8 and c.body["stream"] is True and c.stream
    assert api.body["max_tokens"] == 10 and len(api.body["messages"]) == 1  # the client's body is untouched
    t = continuation(completion(prompt=["once"], max_completion_tokens=5), " upon", 1)
    assert t.body["prompt"] == "once upon" and t.body["max_completion_tokens"] == 4
    f = fresh(chat(stream=True, stream_options={"include_usage": False}))
    assert f.body["stream"] is True and "stream_options" not in f.body


def chunk(*, delta: dict[str, Any] | None = None, text: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": None}
    if delta is not None:
        choice["delta"] = delta
    if text is not None:
        choice["text"] = text
    return {"id": "engine-id", "created": 1, "choices": [choice], **extra}


def test_transcript_folds_attempts_into_one_generation() -> None:
    t = Transcript(Endpoint.CHAT)
    assert t.take(chunk(delta={"role": "assistant", "content": ""}, id="first", created=7)) is not None
    t.take(chunk(delta={"content": " alpha"}, id="first", created=7))
    t.take(chunk(delta={"content": " bravo"}, id="first", created=7))
    assert (t.text, t.tokens) == (" alpha bravo", 2)
    t.start_attempt()  # the continuation: its prompt holds the 2 tokens
    assert t.take(chunk(delta={"role": "assistant", "content": ""}, id="second", created=9)) is None
    out = t.take(chunk(delta={"content": " river"}, id="second", created=9))
    assert out is not None and out["id"] == "first" and out["created"] == 7
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 1,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 11},
    }
    last = t.take({"id": "second", "created": 9, "choices": [], "usage": usage})
    assert last is not None
    assert last["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    assert (t.text, t.tokens, len(t.events)) == (" alpha bravo river", 3, 5)
    t.reset()
    assert (t.text, t.tokens, t.events) == ("", 0, [])
    first = t.take(chunk(delta={"role": "assistant", "content": ""}, id="third"))
    assert first is not None and first["choices"][0]["delta"]["role"] == "assistant"  # a restart starts afresh


class _Victim:
    """A preemptible request's owner as the pool scheduler sees it (the tag of its ticket)."""

    def __init__(self, lease: _Lease | None = None, preemptions: int = 0) -> None:
        self.stopped = 0
        self.preemptions = preemptions
        self.lease = lease
        self.on_stop: Callable[[], None] = lambda: None

    def preemptible(self) -> bool:
        return True

    def preempt(self) -> Plan:
        self.stopped += 1
        self.preemptions += 1
        self.on_stop()
        return Plan.RESUME

    def redo_tokens(self) -> int:
        return 10

    def placed(self) -> Any:
        return self.lease


class _Lease:
    """Where a victim's engine call runs, as `ahead_in_engine` reads it (a `Lease`'s timing)."""

    def __init__(self, instance: object, sent_at: float, *, due: float | None = None, answered: bool = False):
        self.instance = instance
        self.sent_at = sent_at
        self.due = due
        self.answered = answered
        self.released = False
        self.full = False
        #: Whether its prompt takes the engine longer than a step to prefill (`Lease.prefill_exceeds_step`).
        self.heavy = False
        #: Times a strict request's lease was marked as holding its instance (`Lease.hold`).
        self.holds = 0
        #: Whether the engine's slots are known; a step (here: a second) of slack in the due time only if so.
        self.known = True
        #: What the looks at the engine's queue find, in turn (None, or none left: it cannot tell), and how many
        #: there were.
        self.queued: list[bool | None] = []
        self.looks = 0
        self.looked = asyncio.Event()

    def engine_full(self) -> bool:
        return self.full

    def first_token_due(self, slack_steps: int = 1) -> float | None:
        return self.due - 1.0 + slack_steps if self.due is not None else None

    def slots_known(self) -> bool:
        return self.known

    def limit_found(self) -> bool:
        return self.known

    def prefill_exceeds_step(self) -> bool:
        return self.heavy

    def hold(self) -> None:
        self.holds += 1

    async def queue_ahead(self) -> bool | None:
        self.looks += 1
        self.looked.set()
        return self.queued.pop(0) if self.queued else None


async def test_a_strict_request_is_not_sent_behind_an_engines_own_queue() -> None:
    """Requests of P2 wait in engine A's own queue (first come, first served: the oldest of them is overdue, and
    every one sent after it waits too): before a P0 goes there, they are stopped, with the running one stopped
    fewest times so that a slot frees. The engine had not started the waiting ones: no re-prefill is counted
    for them. Engine B's queue and a prompt still within its prefill estimate stay."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 16, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    a: Any = object()
    b: Any = object()
    now = time.monotonic()
    overdue, later = now - 1.0, now + 100.0
    victims = {
        "a-running-stopped-once": _Victim(_Lease(a, now - 9, answered=True), preemptions=1),
        "a-running": _Victim(_Lease(a, now - 8, answered=True)),
        "a-running-newer": _Victim(_Lease(a, now - 7.5, answered=True)),
        "a-long-prefill": _Victim(_Lease(a, now - 7, due=later)),  # sent before the queue formed: prefilling
        "a-queued-first": _Victim(_Lease(a, now - 6, due=overdue)),
        "b-queued": _Victim(_Lease(b, now - 5.5, due=overdue)),
        "a-queued-next": _Victim(_Lease(a, now - 5, due=later)),  # not overdue itself, but behind one that is
        "between-calls": _Victim(None),
    }
    tickets = {name: scheduler.offer(2, v) for name, v in victims.items()}
    assert all(t.running for t in tickets.values())
    p0 = scheduler.offer(0)
    assert p0.running  # room in the pool: nothing stopped at admission
    scheduler.make_room(0, _Lease(a, now), True)
    stopped = {name for name, v in victims.items() if v.stopped}
    # The newest of the running ones stopped fewest times (a-running-newer), not the one stopped before.
    assert stopped == {"a-queued-first", "a-queued-next", "a-running-newer"}
    # The pool has room: they are granted again at once, and their owners send them again, after the P0.
    assert all(tickets[name].running for name in stopped) and scheduler.core.running_total == 9
    assert metrics.reprefill_tokens.labels("m")._value.get() == 10  # the running one's work only
    assert metrics.preemptions.labels("m", "P2", "resumed")._value.get() == 3


async def test_no_room_is_made_while_the_engine_takes_in_what_it_is_sent() -> None:
    """Nothing overdue on the instance: its engine took in everything it was sent, and a strict request sent
    there is taken in at its next step. A request of a class that is not strict makes no room either."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 16, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    a: Any = object()
    now = time.monotonic()
    victims = [
        _Victim(_Lease(a, now - 2, answered=True)),
        _Victim(_Lease(a, now - 1, due=now + 1.0)),
        _Victim(_Lease(a, now - 1, due=None)),  # the instance's step time is not measured yet
    ]
    for v in victims:
        scheduler.offer(2, v)
    scheduler.make_room(0, _Lease(a, now), True)
    overdue = _Victim(_Lease(a, now - 1, due=now - 0.5))
    scheduler.offer(2, overdue)
    scheduler.make_room(1, _Lease(a, now, due=now - 1.0), True)  # P1 is not strict: no room, no watch
    assert [v.stopped for v in [*victims, overdue]] == [0, 0, 0, 0]


async def test_a_p0_stops_the_long_prompts_waiting_for_their_first_token_there_and_holds_the_instance() -> None:
    """Nothing overdue on engine A, its limit found: the P2 prompts there that take the engine longer than a step
    to prefill, queued or in prefill, are stopped before a P0 goes (the engine gives them its step's token budget
    first, or takes them in with the P0 and its first step lasts as long as their prefill); a short one stays, and so
    do the generating ones (a slot is free). Before the limit is found (a flood's first moments) only what is overdue
    is stopped. A streamed P0 holds its instance (`Lease.hold`) until its first token."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 16, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    a: Any = object()
    b: Any = object()
    now = time.monotonic()
    a_long, b_long = _Lease(a, now - 0.02, due=now + 5.0), _Lease(b, now - 0.01, due=now + 5.0)
    a_long_again = _Lease(a, now - 0.02, due=now + 5.0)
    a_long.heavy = b_long.heavy = a_long_again.heavy = True
    victims = {
        "a-running": _Victim(_Lease(a, now - 2, answered=True)),
        "a-long": _Victim(a_long),
        # Stopped `PREFILL_STOPS` times already: the rest of its stops are kept for slots.
        "a-long-again": _Victim(a_long_again, preemptions=PREFILL_STOPS),
        "a-short": _Victim(_Lease(a, now - 0.01, due=now + 5.0)),
        "b-long": _Victim(b_long),
    }
    for v in victims.values():
        scheduler.offer(2, v)
    discovering = _Lease(a, now)
    discovering.known = False
    scheduler.make_room(0, discovering, False)
    assert not any(v.stopped for v in victims.values()) and discovering.holds == 0  # not watched: no hold
    p0 = _Lease(a, now)
    scheduler.make_room(0, p0, True)
    assert {name for name, v in victims.items() if v.stopped} == {"a-long"} and p0.holds == 1
    assert metrics.reprefill_tokens.labels("m")._value.get() == 0  # the engine keeps what it prefilled of it
    p1 = _Lease(a, now)
    scheduler.make_room(1, p1, True)  # P1 is not strict: it holds nothing
    assert p1.holds == 0


def _generating_on(
    a: object, now: float, others: dict[str, _Victim]
) -> tuple[SchedulingMetrics, PoolScheduler, dict[str, _Victim]]:
    """A pool scheduler running P2 requests: two generating on engine A (one stopped once before), then `others`."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 16, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    victims = {
        "a-running-stopped-once": _Victim(_Lease(a, now - 9, answered=True), preemptions=1),
        "a-running": _Victim(_Lease(a, now - 8, answered=True)),
        **others,
    }
    for victim in victims.values():
        scheduler.offer(2, victim)
    return metrics, scheduler, victims


async def test_a_strict_request_whose_first_token_is_due_and_missing_is_given_a_slot() -> None:
    """Nothing was overdue on engine A when the P0 went (a queue too young, or an engine exactly full): when the
    P0's own first token is due and has not come, it waits there. The P2 requests sent there before it and still
    unanswered are stopped (ahead of it, first come first served), and the running one stopped fewest times (a
    slot); one sent after it (behind it), engine B's, and the rest stay. An answered or ended P0 stops nothing."""
    a: Any = object()
    b: Any = object()
    now = time.monotonic()
    metrics, scheduler, victims = _generating_on(
        a,
        now,
        {
            "a-before": _Victim(_Lease(a, now - 0.02, due=now + 1.0)),
            "a-after": _Victim(_Lease(a, now - 0.005, due=now + 1.0)),
            "b-before": _Victim(_Lease(b, now - 0.02, due=now + 1.0)),
        },
    )
    loop = asyncio.get_running_loop()
    answered, ended = _Lease(a, now - 0.01, due=now), _Lease(a, now - 0.01, due=now)
    scheduler.make_room(0, answered, True)
    scheduler.make_room(0, ended, True)
    answered.answered, ended.released = True, True
    p0 = _Lease(a, now - 0.01, due=now + 0.02)
    scheduler.make_room(0, p0, True)
    assert not any(v.stopped for v in victims.values())  # nothing overdue when it was sent
    looked = asyncio.Event()
    loop.call_later(0.001, looked.set)  # after the first two P0s' due times (now): they stopped nothing
    await looked.wait()
    assert not any(v.stopped for v in victims.values())
    stopped = asyncio.Event()
    victims["a-before"].on_stop = stopped.set
    async with asyncio.timeout(5):
        await stopped.wait()
    assert {name for name, v in victims.items() if v.stopped} == {"a-before", "a-running"}
    assert metrics.reprefill_tokens.labels("m")._value.get() == 10  # the running one's work only


async def test_a_strict_request_sent_to_a_full_engine_makes_room_without_waiting_for_anything_overdue() -> None:
    """Every slot engine A is known to have is generating (`Lease.engine_full`, e.g. a probe's slot in the pool
    above a learned limit): the P2 requests waiting there, however young, are ahead of the P0 and no slot frees
    before a generation ends. They are stopped at once, with the running one stopped fewest times."""
    a: Any = object()
    now = time.monotonic()
    _, scheduler, victims = _generating_on(a, now, {"a-young": _Victim(_Lease(a, now - 0.001, due=now + 1.0))})
    scheduler.make_room(0, _Lease(a, now), False)  # room while it is not full: nothing overdue, nothing stopped
    assert not any(v.stopped for v in victims.values())
    full = _Lease(a, now)
    full.full = True
    scheduler.make_room(0, full, False)
    assert {name for name, v in victims.items() if v.stopped} == {"a-young", "a-running"}


async def test_while_an_engines_slots_are_unknown_a_request_is_overdue_a_step_earlier() -> None:
    """A flood's first moments, before the engine's parallelism is discovered: a P2 request not answered by its
    due time without the step of slack waits in the engine's queue (it is stopped for a P0); once the slots are
    known, the same request is still within its due time."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 16, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    a: Any = object()
    now = time.monotonic()
    waiting = _Victim(_Lease(a, now - 0.1, due=now + 0.5))  # overdue by half a step without the slack
    scheduler.offer(2, waiting)
    scheduler.make_room(0, _Lease(a, now), False)
    assert waiting.stopped == 0
    unknown = _Lease(a, now)
    unknown.known = False
    scheduler.make_room(0, unknown, False)
    assert waiting.stopped == 1


def _unknown(a: object, now: float, *answers: bool | None, due_in: float, known: bool = False) -> _Lease:
    """A P0's lease on engine A, sent now, first token due in `due_in` s (slots unknown: no slack), whose looks at the
    engine's queue find `answers` in turn."""
    lease = _Lease(a, now, due=now + 1.0 + due_in)
    lease.known = known
    lease.queued = list(answers)
    return lease


async def test_while_an_engines_slots_are_unknown_a_look_at_its_queue_makes_room_before_the_due_time() -> None:
    """Slots unknown and a P2 request sent to engine A just before the P0, too young to be overdue: a look at the
    engine's queue (`Placement.queue_ahead`) decides at once. A queue beyond what arrived within the last step: it is
    full, and the young request is ahead of the P0 (stopped, with the running one stopped fewest times). No such
    queue, or no answer: nothing is stopped then. No look where the slots are known, or where nothing unanswered was
    sent there before the P0."""
    a: Any = object()
    now = time.monotonic()
    young = {"a-young": _Victim(_Lease(a, now - 0.002, due=now + 100.0))}
    _, scheduler, victims = _generating_on(a, now, young)
    quiet = [_unknown(a, now, False, due_in=1.0), _unknown(a, now, None, due_in=1.0)]
    known = _unknown(a, now, True, due_in=1.0, known=True)
    sent_first = _Lease(a, now - 0.003, due=now + 100.0)  # the young request was sent after it: not ahead of it
    sent_first.known, sent_first.queued = False, [True]
    for lease in (*quiet, known, sent_first):
        scheduler.make_room(0, lease, True)
    assert len(scheduler._looks) == 2  # the quiet leases' looks only
    for lease in quiet:
        await lease.looked.wait()
    assert [lease.looks for lease in (*quiet, known, sent_first)] == [1, 1, 0, 0]
    assert not any(v.stopped for v in victims.values())
    for lease in (*quiet, known):
        lease.answered = True  # first tokens came: no second look, no rescue at the due time
    await asyncio.gather(*scheduler._looks)
    assert [lease.looks for lease in quiet] == [1, 1] and not scheduler._looks  # each look ends, and is forgotten
    assert not any(v.stopped for v in victims.values())
    _, scheduler, victims = _generating_on(a, now, {"a-young": _Victim(_Lease(a, now - 0.002, due=now + 100.0))})
    full = _unknown(a, now, True, due_in=100.0)
    scheduler.make_room(0, full, True)
    await asyncio.gather(*scheduler._looks)
    assert full.looks == 1
    assert {name for name, v in victims.items() if v.stopped} == {"a-young", "a-running"}


async def test_an_engine_exactly_full_when_a_strict_request_was_sent_shows_at_a_second_look() -> None:
    """The first look finds no queue beyond the last step's arrivals (the engine had just filled: the P0 itself and
    the young P2 ahead of it were the queue). Half way to the P0's due time it is looked at again: the P0, older than a
    step now and unanswered, still waits, so the stops are made then, a step before the due time would."""
    a: Any = object()
    now = time.monotonic()
    _, scheduler, victims = _generating_on(a, now, {"a-young": _Victim(_Lease(a, now - 0.002, due=now + 100.0))})
    lease = _unknown(a, now, False, True, due_in=2.0)  # the rescue at the due time comes a second after the look
    scheduler.make_room(0, lease, True)
    await asyncio.gather(*scheduler._looks)
    assert lease.looks == 2
    assert {name for name, v in victims.items() if v.stopped} == {"a-young", "a-running"}


async def test_an_engine_is_full_when_its_known_slots_are_all_generating() -> None:
    """`Lease.engine_full`: the slots an engine is known to have (here declared: 2) all hold requests whose first
    token is back. One that has not answered yet may be starting in a slot or waiting: it does not count."""
    config = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]})
    fleet = Fleet(config, GatewayMetrics())
    fleet._build(config)  # not entered: no health probes, no scrapes
    try:
        [a] = fleet.pools["m"].instances
        first = fleet.lease(a, "m", 8, 8)
        first.first_token()
        assert not fleet.lease(a, "m", 8, 8).engine_full()  # the engine's slots are not known
        a.concurrency.declare(2)
        young = fleet.lease(a, "m", 8, 8)
        assert not young.engine_full()  # one generating, one unanswered
        young.first_token()
        p0 = fleet.lease(a, "m", 8, 8)
        assert p0.engine_full()
        first.release()
        assert not p0.engine_full()
    finally:
        await fleet.aclose()


async def test_a_strict_arrival_after_a_shrink_preempts_the_excess_not_just_one() -> None:
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 6, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    victims = [_Victim() for _ in range(6)]
    tickets = [scheduler.offer(2, v) for v in victims]
    assert all(t.running for t in tickets)
    scheduler.resize(4, 0)  # e.g. the engine's discovered limit fell: 6 running in 4 slots
    p0 = scheduler.offer(0)
    # Three stopped (the newest first), not one: otherwise P0 would wait for two others to finish.
    assert p0.running
    assert [v.stopped for v in victims] == [0, 0, 0, 1, 1, 1]
    assert scheduler.core.running_total == 4 and scheduler.core.queued(2) == 3
    # The work preemption costs, reported as it is done: when a stopped request is sent again, not when it leaves
    # meanwhile; nor is a grant again a new admission.
    reprefill = metrics.reprefill_tokens.labels("m")
    admitted = metrics.admissions.labels("m", "P2")
    assert reprefill._value.get() == 0 and admitted.value == 6
    scheduler.release(tickets[5])  # its client left while it waited
    scheduler.release(p0)
    assert tickets[3].running and reprefill._value.get() == 10 and admitted.value == 6  # (requeued last: the head)
    scheduler.release(tickets[4])  # left too
    assert reprefill._value.get() == 10 and not scheduler._stopped


@pytest.mark.parametrize("p0_running", [True, False])
async def test_a_shrink_under_running_strict_work_sheds_the_excess_at_once(p0_running: bool) -> None:
    """The discovery window: a flood reached an engine before its limit was learned, so the excess waits in
    the engine's own queue, where a P0 already sent waits behind it (first come, first served). When the
    limit falls, the excess is stopped at once if strict work runs; else it drains on its own."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 8, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    p0 = scheduler.offer(0) if p0_running else None
    victims = [_Victim() for _ in range(7 if p0_running else 8)]
    tickets = [scheduler.offer(2, v) for v in victims]
    assert all(t.running for t in tickets)
    scheduler.resize(3, 0)  # the engine runs 3
    if p0 is not None:
        assert p0.running
        assert [v.stopped for v in victims] == [0, 0] + [1] * 5  # the newest five: 3 left running with the P0
        assert scheduler.core.running_total == 3 and scheduler.core.queued(2) == 5
    else:
        assert [v.stopped for v in victims] == [0] * 8
        assert scheduler.core.running_total == 8


async def test_a_lent_slot_ending_with_its_request_sheds_nothing() -> None:
    """A reload retired the engine a P2 request runs on: the pool lends it a slot on top of its members' one, where a
    P0 runs. When the P2's lease ends (before its ticket), the lent slot goes: for that moment the pool holds one
    more than its capacity, which is not an excess to stop (nothing is preempted), and the P2's ticket, released
    next, grants nothing."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 1, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    retired = _Victim()
    p2 = scheduler.offer(2, retired)
    scheduler.resize(1, 0, lent=1)  # the reload: one member slot, one lent to the P2 on the retired engine
    p0 = scheduler.offer(0)
    queued = scheduler.offer(2, _Victim())
    assert p0.running and not queued.running and scheduler.core.capacity == 2
    scheduler.resize(1, 0, lent=0)  # the P2's lease ended
    assert retired.stopped == 0 and scheduler.core.capacity == 1
    scheduler.release(p2)
    assert not queued.running and scheduler.core.running_total == 1 and scheduler.lent == 0


def test_a_resumed_request_is_not_charged_its_class_share_again() -> None:
    """A stopped request re-granted from the head of its queue continues work its class was already charged
    for: the weighted shares of completed requests stay as configured however often P0 stops P2 (each P2
    stopped once here; charging it twice gave P2 about half its share)."""
    classes = tuple(dataclasses.replace(spec, max_queue=100) for spec in CLASSES)
    core = SchedulerCore(classes, capacity=1)  # P1:P2 weights 0.3:0.1, a 3:1 share of completions
    for _ in range(60):
        offer(core, 1)
        offer(core, 2)
    stopped: set[Ticket] = set()
    done: list[int] = []
    now = 0.0
    while len(done) < 40:
        now += 1.0
        [running] = [t for k in (1, 2) for t in core.running_newest_first(k)]
        if running.klass == 2 and running not in stopped:
            stopped.add(running)
            p0 = offer(core, 0)  # queued: the pool is full; P0 stops the P2
            assert choose_victim(core, 0, LOWEST, willing) is running
            assert core.requeue(running, now) == [p0] and p0.running
            core.release(p0, now)  # P0 done: the stopped P2 (head of its queue) or a P1 goes next
            continue
        core.release(running, now)
        done.append(running.klass)
    # Stride scheduling keeps each class within one grant of its exact share (10 of 40); charged twice: 5.
    assert abs(done.count(2) - 10) <= 1 and done.count(1) + done.count(2) == 40, done


def test_a_generation_whose_finish_came_is_not_stopped() -> None:
    """Its finish chunk taken, its `[DONE]` not read yet: a stop then would continue a finished answer (a second
    ending for its client). Found in a review of flights' preemption; the direct path had the same gap."""
    transcript = Transcript(Endpoint.CHAT)
    for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": "Hi"}, None)):
        transcript.take({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    assert plan(None, transcript, 50, sent=True) is Plan.RESUME
    transcript.take({"id": "c", "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]})
    assert transcript.finished and plan(None, transcript, 50, sent=True) is None
    transcript.reset()
    assert not transcript.finished


async def test_a_stopped_request_of_a_withdrawn_pool_gets_the_withdrawal_not_an_internal_error() -> None:
    """A reload removed the model while a stopped request (re-queued, its owner not yet waiting again: a flight
    still waiting for a slow subscriber) held a ticket: its wait raised RuntimeError("not waiting"), an internal
    error for its clients (a code review)."""
    metrics = GatewayMetrics().scheduling
    scheduler = PoolScheduler("m", CLASSES, 1, metrics, preemptible=LOWEST, clock=lambda: 0.0)
    running = scheduler.offer(2)
    queued = scheduler.offer(2)
    assert running.running and not queued.running
    scheduler.withdraw(lambda: ModelNotFound("gone"))
    with pytest.raises(ModelNotFound):
        await scheduler.wait_granted(queued)


async def test_a_stop_from_inside_its_own_engine_call_cancels_nothing() -> None:
    """An outside run: a P2 stream's break ejected its instance from inside that stream's own task; the pool shrinking
    preempted the same request, whose stop cancelled its own task: the cancellation landed at its next await, outside
    the engine call, and read as its client gone (the stream closed without a word, `client_disconnect`). The owner
    sees such a stop by its flag; only another task is cancelled."""
    from lockgate.errors import UpstreamProtocolError

    signal = StopSignal()
    own = asyncio.current_task()

    async def breaks() -> None:
        signal.stop(own)  # (the failure's report ejected the instance, which preempted this request, right here)
        raise UpstreamProtocolError("the stream broke")

    with pytest.raises(UpstreamProtocolError):
        await signal.engine(breaks())
    await asyncio.sleep(0)  # a cancellation of itself would land here
    assert own is not None and own.cancelling() == 0
    # Another task awaiting its engine call is stopped as before.
    started = asyncio.Event()

    async def waits() -> None:
        async def engine_call() -> None:
            started.set()
            await asyncio.Event().wait()

        await signal.engine(engine_call())

    other = asyncio.create_task(waits())
    await started.wait()
    signal.stop(other)
    with pytest.raises(Stopped):
        await other
