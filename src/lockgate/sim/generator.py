"""Deterministic text generation.

Theory of operation: the next token is a pure function of ``(seed, last K words of the context)``, where
the context is the prompt's tokens followed by the tokens generated so far, and a "word" is a token with its
leading whitespace stripped. Every generated token starts with a space, so appending generated text to a
prompt re-tokenizes into the same words. Hence generating ``N`` tokens from ``P`` equals generating ``k``
tokens, then ``N - k`` tokens from ``P + "".join(first k)`` -- the property the gateway's preemption relies
on. Stripping whitespace makes it robust to a prompt that ends in whitespace, too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

K = 4
GREEDY_SEED = 0

_WORDS = [
    "alpha",
    "bravo",
    "river",
    "stone",
    "cloud",
    "ember",
    "maple",
    "orbit",
    "quartz",
    "saffron",
    "tundra",
    "violet",
    "willow",
    "zephyr",
    "amber",
    "basalt",
    "cedar",
    "delta",
    "echo",
    "falcon",
    "garnet",
    "harbor",
    "iris",
    "jasper",
    "kestrel",
    "lotus",
    "meadow",
    "nectar",
    "onyx",
    "pebble",
    "quill",
    "raven",
    "sierra",
    "thistle",
    "umber",
    "vale",
    "wren",
    "yarrow",
    "acorn",
    "birch",
    "coral",
    "dune",
    "fjord",
    "glacier",
    "heron",
    "indigo",
    "juniper",
    "kelp",
    "lagoon",
    "mesa",
    "nimbus",
    "opal",
    "prairie",
    "reef",
    "sparrow",
    "tide",
    "upland",
    "vortex",
]
VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS) + tuple(" " + w + "." for w in _WORDS[:6])


def _word(token: str) -> str:
    return token.strip()


def context_key(tokens: Sequence[str]) -> tuple[str, ...]:
    """The part of a context that determines the next token: its last ``K`` words."""
    return tuple(_word(t) for t in tokens[-K:])


def next_token(seed: int, key: tuple[str, ...]) -> str:
    h = xxhash.xxh64_intdigest("\x1f".join(key).encode(), seed=seed & 0xFFFFFFFFFFFFFFFF)
    return VOCAB[h % len(VOCAB)]


class StopMatcher:
    """Finds stop strings in generated text, holding back text that may be the start of one.

    ``feed(text_so_far)`` returns ``(delta, stopped)``: the text that is now safe to emit, and whether a
    stop string was found (the delta then ends right before it).
    """

    __slots__ = ("_emitted", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._emitted = 0

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            delta = text[self._emitted :]
            self._emitted = len(text)
            return delta, False
        # A stop string may start in already emitted text only within the held-back tail.
        search_from = self._emitted - max(len(s) for s in self._stops) + 1
        best = -1
        for s in self._stops:
            i = text.find(s, max(0, search_from))
            if i != -1 and (best == -1 or i < best):
                best = i
        if best != -1:
            delta = text[self._emitted : best]
            self._emitted = max(self._emitted, best)
            return delta, True
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        safe = max(self._emitted, len(text) - hold)
        delta = text[self._emitted : safe]
        self._emitted = safe
        return delta, False

    def flush(self, text: str) -> str:
        """At the end of generation the held-back text is released."""
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta


@dataclass(frozen=True, slots=True)
class Token:
    token: str  # the sampled token
    delta: str  # text to send to the client (may be "" while a stop string is possibly being matched)
    finish_reason: str | None  # "stop", "length" or None


class TokenStream:
    """Generates tokens for one request, one ``next()`` at a time (a pure, synchronous state machine)."""

    __slots__ = ("_key", "_matcher", "_natural", "_text", "finish_reason", "max_tokens", "num_generated", "seed")

    def __init__(
        self,
        prompt_tokens: Sequence[str],
        seed: int,
        max_tokens: int,
        stop: Sequence[str] = (),
        natural_end: bool = False,
    ) -> None:
        """`natural_end`: the client set no limit, and `max_tokens` is the simulator's own answer length: reaching it
        is the answer's natural end (`stop`, as an engine's end-of-sequence token is), not the client's limit."""
        self.seed = seed
        self.max_tokens = max_tokens
        self._natural = natural_end
        self.num_generated = 0
        self.finish_reason: str | None = None
        self._key = context_key(prompt_tokens)
        self._matcher = StopMatcher(stop)
        self._text = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next(self) -> Token:
        if self.finish_reason is not None:
            raise RuntimeError("stream already finished")
        tok = next_token(self.seed, self._key)
        self._key = (*self._key[1 - K :], _word(tok)) if K > 1 else (_word(tok),)
        self.num_generated += 1
        self._text += tok
        delta, stopped = self._matcher.feed(self._text)
        if stopped:
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_tokens:
            self.finish_reason = "stop" if self._natural else "length"
            delta += self._matcher.flush(self._text)
        return Token(tok, delta, self.finish_reason)


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: tuple[Token, ...]
    text: str
    finish_reason: str


@functools.lru_cache(maxsize=8192)
def _generate_cached(
    key: tuple[str, ...], seed: int, max_tokens: int, stop: tuple[str, ...], natural_end: bool
) -> Completion:
    stream = TokenStream(key, seed, max_tokens, stop, natural_end)
    tokens: list[Token] = []
    while True:
        t = stream.next()
        tokens.append(t)
        if t.finish_reason is not None:
            return Completion(tuple(tokens), "".join(x.delta for x in tokens), t.finish_reason)


def generate(
    prompt_tokens: Sequence[str], seed: int, max_tokens: int, stop: Sequence[str] = (), natural_end: bool = False
) -> Completion:
    """All of a request's output at once (memoised: the output depends only on a few small inputs)."""
    return _generate_cached(context_key(prompt_tokens), seed, max_tokens, tuple(stop), natural_end)
