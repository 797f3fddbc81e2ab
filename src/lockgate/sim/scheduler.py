"""Continuous batching with chunked prefill, as in vLLM's v1 scheduler (simplified).

Theory of operation: each ``step()`` is one forward pass of the modelled engine. It spends a budget of
``max_num_batched_tokens`` tokens: first one token for every running sequence that is decoding, then prompt
chunks for running sequences still in prefill, then admits waiting sequences (ordered by ``priority``, then
arrival) while there is a free sequence slot, budget left and KV blocks for the whole prompt. Cached prefix
tokens need no prefill. A sequence whose prompt completes in this step samples its first token in the same
step. When a decoding sequence needs a KV block and none is free, the most recently admitted sequence is
preempted (its blocks freed, put back at the head of the queue, recomputed later from its prompt plus what
it generated -- which the prefix cache often makes cheap), as vLLM does.

The step's modelled duration is ``prefill_tokens / prefill_tps + tpot * (1 + batch_growth * (n - 1))``
where ``n`` is the number of sequences sampling a token in the step (0 ⇒ no decode term). The scheduler
never sleeps: the async engine does, and the tests do not.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .generator import Token, TokenStream
from .kv import KVCache


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 4096
    block_size: int = 16
    prefill_tps: float = 8000.0  # prompt tokens per second
    tpot_ms: float = 10.0  # time per output token with a batch of one
    batch_growth: float = 0.02  # relative TPOT growth per extra sequence in the batch


@dataclass(eq=False, slots=True)
class SequenceState:
    seq_id: object
    prompt_tokens: list[str]
    stream: TokenStream
    priority: int = 0
    arrival: int = 0
    tokens: list[str] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0
    num_cached: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    admitted: bool = False
    #: Its prefix-cache salt (vLLM's `cache_salt`): it shares cached blocks with the same salt's sequences only.
    salt: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_tokens)

    @property
    def prefilling(self) -> bool:
        # In prefill while some token before the last one is uncomputed. (The last token of a decoding
        # sequence is always uncomputed: it is the input of the next step.)
        return self.num_computed < len(self.tokens) - (1 if self.num_generated else 0)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    seq_id: object
    token: Token
    first: bool  # the sequence's first generated token


@dataclass(frozen=True, slots=True)
class StepResult:
    events: tuple[TokenEvent, ...]
    finished: tuple[object, ...]
    admitted: tuple[SequenceState, ...]
    preempted: tuple[object, ...]
    prefill_tokens: int
    num_sampled: int
    duration_s: float

    @property
    def idle(self) -> bool:
        return not self.events and not self.prefill_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCache(config.num_kv_blocks, config.block_size)
        self._waiting: list[SequenceState] = []  # kept sorted by (priority, arrival)
        self._running: list[SequenceState] = []  # in admission order
        self._by_id: dict[object, SequenceState] = {}
        self._arrivals = itertools.count()

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, seq_id: object) -> SequenceState | None:
        return self._by_id.get(seq_id)

    # -- operations ----------------------------------------------------------------------------------------
    def add(
        self,
        seq_id: object,
        prompt_tokens: Sequence[str],
        stream: TokenStream,
        priority: int = 0,
        salt: str | None = None,
    ) -> SequenceState:
        if seq_id in self._by_id:
            raise ValueError(f"duplicate sequence id {seq_id!r}")
        if not prompt_tokens:
            raise ValueError("empty prompt")
        if self.config.block_size * self.config.num_kv_blocks < len(prompt_tokens) + stream.max_tokens:
            raise ValueError("request does not fit in the KV cache")
        seq = SequenceState(seq_id, list(prompt_tokens), stream, priority, next(self._arrivals), salt=salt)
        seq.tokens = list(prompt_tokens)
        self._by_id[seq_id] = seq
        self._enqueue(seq)
        return seq

    def abort(self, seq_id: object) -> bool:
        """Remove the sequence wherever it is and free its blocks at once. Idempotent."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.kv.free(seq_id)
        return True

    def _enqueue(self, seq: SequenceState) -> None:
        key = (seq.priority, seq.arrival)
        i = len(self._waiting)
        while i > 0 and (self._waiting[i - 1].priority, self._waiting[i - 1].arrival) > key:
            i -= 1
        self._waiting.insert(i, seq)

    def _preempt_last(self) -> SequenceState:
        victim = self._running.pop()
        self.kv.free(victim.seq_id)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self._enqueue(victim)
        return victim

    def step(self) -> StepResult:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        prefill_tokens = 0
        sample: list[SequenceState] = []
        preempted: list[object] = []
        admitted: list[SequenceState] = []

        # 1. Decodes: one token each; make room in the KV cache by preempting the newest sequences.
        for seq in list(self._running):
            if seq.prefilling or budget <= 0 or seq not in self._running:
                continue
            while not self.kv.grow(seq.seq_id, len(seq.tokens)):
                victim = self._preempt_last()
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq not in self._running:
                continue
            budget -= 1
            sample.append(seq)

        # 2. Running sequences in (chunked) prefill.
        for seq in self._running:
            if budget <= 0:
                break
            if seq.prefilling:
                budget, n = self._prefill(seq, budget)
                prefill_tokens += n
                if not seq.prefilling:
                    sample.append(seq)

        # 3. Admit waiting sequences.
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            cached = self.kv.admit(seq.seq_id, seq.tokens, seq.salt)
            if cached is None:
                break  # head-of-line blocking on KV space, as in vLLM
            self._waiting.pop(0)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached = cached
            seq.num_computed = cached
            self._running.append(seq)
            admitted.append(seq)
            budget, n = self._prefill(seq, budget)
            prefill_tokens += n
            if not seq.prefilling:
                sample.append(seq)

        # 4. Sample one token for every sequence whose inputs are all computed.
        events: list[TokenEvent] = []
        finished: list[object] = []
        for seq in sample:
            if seq.num_generated:
                seq.num_computed += 1  # the previous token went through this step
            self.kv.commit(seq.seq_id, seq.tokens[: seq.num_computed])
            tok = seq.stream.next()
            first = seq.num_generated == 0
            seq.tokens.append(tok.token)
            events.append(TokenEvent(seq.seq_id, tok, first))
            if tok.finish_reason is not None:
                finished.append(seq.seq_id)
                self.abort(seq.seq_id)

        n = len(sample)
        duration = prefill_tokens / cfg.prefill_tps
        if n:
            duration += cfg.tpot_ms / 1000.0 * (1.0 + cfg.batch_growth * (n - 1))
        return StepResult(
            tuple(events), tuple(finished), tuple(admitted), tuple(preempted), prefill_tokens, n, duration
        )

    def _prefill(self, seq: SequenceState, budget: int) -> tuple[int, int]:
        target = len(seq.tokens) - (1 if seq.num_generated else 0)
        n = min(target - seq.num_computed, budget)
        seq.num_computed += n
        self.kv.commit(seq.seq_id, seq.tokens[: seq.num_computed])
        return budget - n, n
