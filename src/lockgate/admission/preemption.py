"""Preemption with resumption: the synchronous decisions (victim choice, resumability, continuation).

Theory of operation: when a request of a strict class (P0) is queued because every slot of its pool is
taken, `choose_victim` names a running request of the least urgent preemptible class that says it may
be stopped: the one stopped the fewest times so far, the newest of those. Its owner
(`resume.Resumable`, the ticket's tag) aborts the engine call at once and the scheduler re-queues its
ticket at the head of its class; the freed slot goes to the P0 request in the same synchronous step.
When the stopped request gets a slot again it is *resumed*: the output produced so far becomes a
continuation (text completions: prompt + output, chat: an assistant prefix with
`continue_final_message`), `max_tokens` reduced by what was delivered, so that the client sees one
uninterrupted generation. `Transcript` folds the attempts' events into that one generation
(one response id, one role chunk, usage = original prompt + all completion tokens).

Where a continuation is impossible (no `max_tokens`: the engine's own default cap is not known, so a continuation
could not be bounded at what is left; the pool's dialect cannot continue a chat message, n > 1,
logprobs, tools or structured output, stop sequences that could straddle the cut, tool calls already
produced) the request may still be restarted from scratch — but only while nothing has been sent to
its client; after that it is not preemptible at all (`plan`).

Delivered tokens are counted as content-bearing stream events (one token each for vLLM-like engines
and the simulator); the continuation's prompt is re-tokenized by the engine, which for the simulator
(and greedy decoding of most real models) gives the same output as an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Iterator
from enum import StrEnum
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..assemble import has_content
from ..wire import ApiRequest, Endpoint
from .scheduler import SchedulerCore, Ticket

T = TypeVar("T")


class Stopped(Exception):
    """An owner's engine call was stopped by a preemption (`StopSignal`): it goes on once its slot is granted again."""


class StopSignal:
    """A preemption's cancellation of its owner's task (a preempted request, a flight), told apart from any other: the
    owner awaits its engine call through `engine()`; `stop(task)` cancels the task only while it does, and `engine()`
    turns that one cancellation into `Stopped` (a genuine cancellation arriving with it stays a cancellation). Elsewhere
    the owner sees the stop by its own flag, its engine call already aborted."""

    __slots__ = ("_awaiting", "_sent")

    def __init__(self) -> None:
        self._awaiting = False
        self._sent = False

    def stop(self, task: asyncio.Task[Any] | None) -> None:
        # Not the task running now: a stop made from inside the owner's own engine call (its failure ejected its
        # instance, and the pool shrinking preempted it) is seen by the owner's flag; a cancellation of itself would
        # land at its next await, outside `engine()`, and read as its client gone (an outside run: P2 streams closed
        # without a word, recorded `client_disconnect`, whenever their own break ejected the instance).
        if self._awaiting and task is not None and task is not asyncio.current_task():
            self._sent = True
            task.cancel("lockgate: preempted")

    async def engine(self, awaitable: Awaitable[T]) -> T:
        self._awaiting = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._sent:
                self._sent = False
                task = asyncio.current_task()
                assert task is not None
                if task.uncancel() == 0:
                    raise Stopped from None
            raise
        finally:
            self._awaiting = False


class Plan(StrEnum):
    """How a preempted request goes on (also the `outcome` label of `lockgate_preemptions_total`)."""

    RESUME = "resumed"
    RESTART = "restarted"


class Placement(Protocol):
    """An engine call as preemption reads it (a `Lease`): where it runs and how far it got."""

    @property
    def instance(self) -> object: ...

    @property
    def sent_at(self) -> float: ...

    @property
    def answered(self) -> bool: ...

    @property
    def released(self) -> bool: ...

    def first_token_due(self, slack_steps: int = 1) -> float | None: ...

    def engine_full(self) -> bool: ...

    def slots_known(self) -> bool: ...

    async def queue_ahead(self) -> bool | None: ...

    def limit_found(self) -> bool: ...

    def prefill_exceeds_step(self) -> bool: ...

    def hold(self) -> None: ...


@runtime_checkable
class Preemptee(Protocol):
    """What a running ticket's tag must offer for the request to be preemptible. Both synchronous."""

    @property
    def preemptions(self) -> int:
        """Times this request was stopped so far (victims are chosen fewest first)."""
        ...

    def preemptible(self) -> bool: ...

    def preempt(self) -> Plan:
        """Stop the work now (the engine call is aborted before this returns)."""
        ...

    def redo_tokens(self) -> int:
        """Tokens the engine will prefill again when this request goes on (its prompt, and for a
        resumption the output so far): the price of stopping it, reported as re-prefill work."""
        ...

    def placed(self) -> Placement | None:
        """The lease of its engine call now (None between calls): where it runs, and whether it has started."""
        ...


def choose_victim(
    core: SchedulerCore,
    klass: int,
    preemptible: frozenset[int],
    stops_so_far: Callable[[Ticket], int | None],
) -> Ticket | None:
    """The running ticket to stop so that a just-queued ticket of class `klass` gets a slot, or None.

    Only a strict class preempts, only when the pool is full (not when its own `max_running` holds it
    back: a freed slot would not go to it), and only less urgent preemptible classes are stopped —
    the least urgent class first. In it, `stops_so_far(ticket)` says how often a ticket was stopped
    already (None: it may not be stopped now): the one stopped the fewest times goes, the most
    recently granted of those (it has done the least work). Fewest first spreads the stops over the
    running requests, so that a per-request limit is reached late and a strict burst still finds a
    victim; newest alone would stop the request just resumed again and again."""
    spec = core.classes[klass]
    if not spec.strict or not preemptible:
        return None
    if core.running_total < core.capacity:
        return None
    if spec.max_running is not None and core.running(klass) >= spec.max_running:
        return None
    running = _running_below(core, klass, preemptible)
    return _fewest_stopped((t, stops) for t in running if (stops := stops_so_far(t)) is not None)


def waits_in_engine(tag: Preemptee) -> bool:
    """Whether the request's engine call has not started producing (no first token back): stopping it costs the
    engine no prefill again."""
    lease = tag.placed()
    return lease is not None and not lease.answered


#: Stops of a request in its prefill for a strict one (`ahead_in_engine`, `prefills`) at most: the rest of its stops
#: (`max_per_request`) are kept for slots.
PREFILL_STOPS = 2


def ahead_in_engine(
    core: SchedulerCore,
    klass: int,
    preemptible: frozenset[int],
    instance: object,
    now: float,
    stops_so_far: Callable[[Ticket], int | None],
    full: bool = False,
    slack_steps: int = 1,
    *,
    prefills: bool = True,
) -> list[Ticket]:
    """The running tickets to stop before a request of strict class `klass` is sent to `instance` (empty
    when none need be), so that it does not wait there behind less urgent work (`instance`: an `Instance`, compared
    by identity). Pure.

    The engine admits waiting requests first come, first served, whatever the gateway's priorities. When
    the gateway has sent an instance more than its engine runs at once (a flood before its limit was
    discovered, a one-slot probe above it, a limit the workload no longer fits) the excess waits in that
    queue, and a strict request sent there waits behind all of it for slots to free, one generation at a
    time (seen: 100-200 ms where the engine's step is 10 ms). The queue shows in the gateway's own timing:
    a request of a preemptible class there whose first token is overdue (`Lease.first_token_due`) waits
    for a slot, and so does every one sent there after it. Those are stopped (they lose no work: the
    engine has not started them), and with them the running one stopped fewest times, the newest of
    those, so that a slot frees at the engine's next step. Nothing overdue: the engine took in all it was
    sent, and the strict request is taken in at its next step anyway.

    `full`: every slot the engine is known to have is taken by a request already generating (`Lease.engine_full`:
    a learned or declared limit, as during a one-slot probe above it). Then every request waiting there, however
    young, is ahead of the strict one and no slot frees before a generation ends: the same stops, without waiting
    for anything to be overdue. `slack_steps`: of the due time (`Lease.first_token_due`).

    `prefills` (the instance's limit was found, `Lease.limit_found`): whatever is overdue, an unanswered request
    there whose prompt takes the engine longer than a step to prefill (`Lease.prefill_exceeds_step`) is stopped too:
    in prefill, the engine gives it its step's token budget before it takes a new request in; queued, it is taken in
    with the strict one and the step lasts as long as its prefill (an outside fleet of 1,000-4,000-token P2 prompts:
    P0 first tokens 0.5-1 s, steps of 2,048 tokens of prefill). What the engine prefilled of it stays in its prefix
    cache; it is sent again after the strict request's first token (`OwnAccounting.held`). A shorter one costs the
    strict request less than a step and stays, and so does one stopped `PREFILL_STOPS` times already: each stop counts
    against its `max_per_request`, and a flood's P2 requests that had used theirs so could not be stopped for a slot
    (an outside fleet: P0 requests refused after 10 s in their queue, every slot a P2's). Before the limit is found (a
    flood's first moments, the gateway has sent more than the engine runs) the overdue ones are stopped, not these:
    each stopped then was sent to the other engine, whose next P0 stopped it again (2x4 slots: P0 p99 115-152 ms
    against 49-71 in the flood's first second)."""
    if not core.classes[klass].strict:
        return []
    waiting: list[tuple[Ticket, float, bool]] = []
    generating: list[tuple[Ticket, int]] = []
    since: float | None = None
    for ticket, lease, stops in _stoppable_there(core, klass, preemptible, instance, stops_so_far):
        if lease.answered:
            generating.append((ticket, stops))
            continue
        waiting.append((ticket, lease.sent_at, stops < PREFILL_STOPS and lease.prefill_exceeds_step()))
        due = lease.first_token_due(slack_steps)
        if due is not None and now > due and (since is None or lease.sent_at < since):
            since = lease.sent_at
    if full:
        since = float("-inf")
    after = float("inf") if since is None else since
    victims = [ticket for ticket, sent_at, heavy in waiting if (heavy and prefills) or sent_at >= after]
    if since is not None:
        best = _fewest_stopped(generating)
        if best is not None:
            victims.append(best)
    return victims


def holding_up(
    core: SchedulerCore,
    klass: int,
    preemptible: frozenset[int],
    instance: object,
    sent_at: float,
    stops_so_far: Callable[[Ticket], int | None],
) -> list[Ticket]:
    """The running tickets to stop for a request of strict class `klass` sent to `instance` at `sent_at` whose own
    first token is overdue (`Lease.first_token_due`): it waits in that engine's queue, behind what is ahead of it
    there and for a slot. Every unanswered request of a less urgent preemptible class sent there before it (ahead
    of it, first come first served), and the answered one stopped fewest times, the newest of those (a slot).
    Pure.

    `ahead_in_engine` saw nothing to stop when it was sent: an engine exactly full, or a queue too young to be
    called overdue (a flood's first tenths of a second, before the instance's limit is discovered). Without this
    the request waits for a generation to end (seen: 98-124 ms where a step is 10 ms)."""
    if not core.classes[klass].strict:
        return []
    ahead: list[Ticket] = []
    generating: list[tuple[Ticket, int]] = []
    for ticket, lease, stops in _stoppable_there(core, klass, preemptible, instance, stops_so_far):
        if lease.answered:
            generating.append((ticket, stops))
        elif lease.sent_at < sent_at:
            ahead.append(ticket)
    best = _fewest_stopped(generating)
    if best is not None:
        ahead.append(best)
    return ahead


def sent_ahead(core: SchedulerCore, klass: int, preemptible: frozenset[int], instance: object, sent_at: float) -> bool:
    """Whether a running request of a less urgent preemptible class was sent to `instance` before `sent_at` and has
    not been answered: a request of class `klass` sent then may wait behind it there. Pure."""
    return any(
        not lease.answered and lease.sent_at < sent_at for _, lease in _placed_there(core, klass, preemptible, instance)
    )


def _running_below(core: SchedulerCore, klass: int, preemptible: frozenset[int]) -> Iterator[Ticket]:
    """The running tickets of preemptible classes less urgent than `klass`: the least urgent class first, the newest
    first within a class."""
    for k in sorted(preemptible, reverse=True):
        if k <= klass:
            break
        yield from core.running_newest_first(k)


def _fewest_stopped(candidates: Iterable[tuple[Ticket, int]]) -> Ticket | None:
    """Of `candidates` (tickets that may be stopped, with their stops so far, in `_running_below`'s order): in the
    least urgent class among them, the one stopped fewest times, the newest of those."""
    best: Ticket | None = None
    fewest = 0
    for ticket, stops in candidates:
        if best is not None and ticket.klass != best.klass:
            break  # a more urgent class: the rest are too
        if best is None or stops < fewest:
            best, fewest = ticket, stops
            if stops == 0:
                break  # none can do better
    return best


def _stoppable_there(
    core: SchedulerCore,
    klass: int,
    preemptible: frozenset[int],
    instance: object,
    stops_so_far: Callable[[Ticket], int | None],
) -> Iterator[tuple[Ticket, Placement, int]]:
    """The running tickets of preemptible classes less urgent than `klass` whose engine call is on `instance` and
    that may be stopped now, with that call's lease and their stops so far: the least urgent class first, the
    newest first within a class."""
    for ticket, lease in _placed_there(core, klass, preemptible, instance):
        stops = stops_so_far(ticket)  # after the cheap check: it plans the request's resumption
        if stops is not None:
            yield ticket, lease, stops


def _placed_there(
    core: SchedulerCore, klass: int, preemptible: frozenset[int], instance: object
) -> Iterator[tuple[Ticket, Placement]]:
    """The running tickets of preemptible classes less urgent than `klass` whose engine call is on `instance` now, with
    that call's lease, in `_running_below`'s order."""
    for ticket in _running_below(core, klass, preemptible):
        tag = ticket.tag
        lease = tag.placed() if isinstance(tag, Preemptee) else None
        if lease is not None and lease.instance is instance:
            yield ticket, lease


_UNRESUMABLE_FIELDS = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "tools",
    "functions",
    "tool_choice",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "stop",
    "continue_final_message",
    "add_generation_prompt",
)


def blocker(api: ApiRequest, *, chat_continuation: bool) -> str | None:
    """Why this request can never be resumed from partial output (None: it can). Pure.

    `chat_continuation`: every instance of the pool can continue a final assistant message."""
    if not api.endpoint.chunked:
        # A response's typed events (the Responses API) are not continued from partial output: restarted from scratch
        # while its client has been sent nothing (a whole answer), else not stopped.
        return "endpoint"
    body = api.body
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and value > 1:
            return key
    if api.max_tokens is None:
        # The engine's own cap (vLLM's generation config, TGI's or the simulator's default, ...) is unknown here: a
        # continuation would get all of it again and run past where one generation stops.
        return "max_tokens"
    for key in _UNRESUMABLE_FIELDS:
        value = body.get(key)
        if value is not None and value is not False and value != [] and value != 0:
            return key
    if api.endpoint is Endpoint.CHAT:
        if not chat_continuation:
            return "dialect"
        last = body["messages"][-1]
        if not isinstance(last, dict):
            return "messages"
    elif _prompt_text(body.get("prompt")) is None:
        return "prompt"
    return None


def plan(static_blocker: str | None, transcript: Transcript, max_tokens: int | None, *, sent: bool) -> Plan | None:
    """How the request would go on if stopped now; None: it must not be stopped. Pure."""
    if transcript.finished or (max_tokens is not None and transcript.tokens >= max_tokens):
        # It has produced all it may, or its end came (its last events may be on their way to the client, its `[DONE]`
        # not read yet): a continuation would add a second ending.
        return None
    if static_blocker is None and not transcript.tool_calls and not transcript.overflow:
        return Plan.RESUME
    return None if sent else Plan.RESTART


def fresh(api: ApiRequest) -> ApiRequest:
    """The request as first sent upstream: always a stream (partial output must be observable)."""
    body = {k: v for k, v in api.body.items() if k not in ("stream", "stream_options")}
    body["stream"] = True
    return dataclasses.replace(api, body=body, stream=True, include_usage=True)


def continuation(api: ApiRequest, text: str, tokens: int) -> ApiRequest:
    """The request that continues `api` after `tokens` delivered tokens whose text is `text`. Pure."""
    request = fresh(api)
    body = request.body
    max_tokens = api.max_tokens
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = max(1, value - tokens)
    if max_tokens is not None:
        max_tokens = max(1, max_tokens - tokens)
    if api.endpoint is Endpoint.CHAT:
        body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = _prompt_text(body.get("prompt"))
        assert prompt is not None  # checked by blocker()
        body["prompt"] = prompt + text
    return dataclasses.replace(request, body=body, max_tokens=max_tokens)


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


class Transcript:
    """One logical generation folded from the events of its attempts (sync, no I/O).

    `take(event)` returns the event as the client must see it — the first attempt's `id` and
    `created`, no second assistant-role chunk, usage counted against the original prompt — or None
    when nothing is left of it. With `keep_events` (non-streaming clients) the events taken are kept
    (`events`), to be assembled at the end; a streaming client's are not. The output's text is kept for a
    continuation up to `max_chars` (a continuation is a prompt too: past it, the text is dropped and the
    generation can no longer be resumed, `overflow`)."""

    __slots__ = (
        "_chars",
        "_created",
        "_id",
        "_keep",
        "_max_chars",
        "_offset",
        "_parts",
        "_role_seen",
        "chat",
        "chunked",
        "events",
        "finished",
        "overflow",
        "tokens",
        "tool_calls",
    )

    def __init__(self, endpoint: Endpoint, *, keep_events: bool = True, max_chars: int | None = None) -> None:
        self.chat = endpoint is Endpoint.CHAT
        #: Chat or text completion chunks; else a response's events, only counted and kept (never continued).
        self.chunked = endpoint.chunked
        self._keep = keep_events
        self._max_chars = max_chars
        self.reset()

    def reset(self) -> None:
        """Forget everything (a restart from scratch: the client has seen none of it)."""
        self.events: list[dict[str, Any]] = []
        #: The output's text, in the pieces it came in (joined only for a continuation: appending to one string
        #: copied the whole output at every token).
        self._parts: list[str] = []
        self._chars = 0
        self.overflow = False
        #: Content-bearing events taken (the tokens delivered, as the gateway counts them).
        self.tokens = 0
        self.tool_calls = False
        #: A choice's `finish_reason` came: the generation is over.
        self.finished = False
        self._id: str | None = None
        self._created: Any = None
        self._role_seen = False
        self._offset = 0

    def start_attempt(self) -> None:
        """A new engine call begins; its prompt holds the `tokens` taken so far."""
        self._offset = self.tokens

    def take(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if not self.chunked:  # a response's event, as it came (restarts only: one attempt's events are the answer)
            self.tokens += has_content(event)
            if self._keep:
                self.events.append(event)
            return event
        if self._id is None:
            if isinstance(event.get("id"), str):
                self._id = event["id"]
                self._created = event.get("created")
        else:
            event["id"] = self._id
            if self._created is not None:
                event["created"] = self._created
        choices = event.get("choices")
        if isinstance(choices, list) and choices:
            kept = [c for c in choices if not isinstance(c, dict) or self._choice(c)]
            if not kept and not isinstance(event.get("usage"), dict):
                return None
            event["choices"] = kept
        usage = event.get("usage")
        if self._offset and isinstance(usage, dict):
            event["usage"] = self._usage(usage)
        if self._keep:
            self.events.append(event)
        return event

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Account for one choice; False drops it (a repeated role chunk with nothing else)."""
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return True
            if "role" in delta:
                if self._role_seen:
                    del delta["role"]
                    if not delta.get("content") and not delta.get("tool_calls") and choice.get("finish_reason") is None:
                        return False
                self._role_seen = True
            content = delta.get("content")
            if delta.get("tool_calls"):
                self.tool_calls = True
                self.tokens += 1
            elif isinstance(content, str) and content:
                self._add(content)
            return True
        text = choice.get("text")
        if isinstance(text, str) and text:
            self._add(text)
        return True

    def _add(self, text: str) -> None:
        self.tokens += 1
        if self.overflow:
            return
        self._chars += len(text)
        limit = self._max_chars
        if limit is not None and self._chars > limit:
            self.overflow = True
            self._parts = []
        else:
            self._parts.append(text)

    @property
    def text(self) -> str:
        """The output so far (empty once `overflow`)."""
        return "".join(self._parts)

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage, restated for the whole generation."""
        offset = self._offset
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        out = dict(usage)
        if isinstance(prompt, int):
            out["prompt_tokens"] = prompt = max(0, prompt - offset)
        if isinstance(completion, int):
            out["completion_tokens"] = completion = completion + offset
        if isinstance(prompt, int) and isinstance(completion, int):
            out["total_tokens"] = prompt + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int) and isinstance(prompt, int):
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
        return out
