"""The workload families of `lockgate bench routing`: seeded traces of chat requests, pure data.

Each family is a function `(Shape) -> list[TraceRequest]`, deterministic for a seed, so every policy
replays exactly the same requests. Word counts are the simulator's token counts (one token a word).

- `agent`: a handful of long shared system prompts, many users, each a multi-turn conversation whose
  prompt extends the previous turn's (agents with a long tool/system preamble).
- `rag`: a short common instruction, then one of a set of documents (Zipf popularity: a few are hot),
  then a question: sharing only up to the end of the document.
- `chat`: chat sessions with a short common system prompt and a history that grows every turn
  (sharing within a session only, and the session grows past what any one cache holds).
- `uniform`: no sharing at all: every prompt is fresh random text.
- `bursty`: one system prompt takes 80% of the traffic, the rest spread over the others, and arrivals
  come in bursts (0.5 s at 1.8x the mean rate, then 0.5 s at 0.2x), which tests spreading a hot prefix under load.

`working_set_tokens` counts the distinct prompt tokens (by cache block) a whole trace touches: what
the simulator configurations size the caches against.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

FAMILIES = ("agent", "rag", "chat", "uniform", "bursty")

_WORDS = [
    "account",
    "billing",
    "refund",
    "policy",
    "customer",
    "order",
    "shipping",
    "warranty",
    "invoice",
    "support",
    "ticket",
    "escalate",
    "product",
    "service",
    "contract",
    "renewal",
    "discount",
    "payment",
    "method",
    "address",
    "delivery",
    "return",
    "exchange",
    "status",
]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float
    user: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True, slots=True)
class Shape:
    """The load; the defaults keep one run to a few seconds against four simulated instances."""

    rate: float = 65.0  # requests per second (mean)
    duration_s: float = 3.0
    seed: int = 7
    system_words: int = 1200  # agent / bursty system prompts
    prefixes: int = 8
    users: int = 64
    turns: int = 5
    documents: int = 24
    document_words: int = 500
    chat_turn_words: int = 40
    chat_turns: int = 12
    uniform_words: int = 400


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _systems(shape: Shape, rng: random.Random) -> list[str]:
    return [f"System prompt {p}. " + _text(rng, shape.system_words) for p in range(shape.prefixes)]


def _arrivals(shape: Shape, rng: random.Random, bursty: bool = False) -> list[float]:
    """Poisson arrivals at `shape.rate`; `bursty`: modulated, 0.5 s at 1.8x then 0.5 s at 0.2x (same mean)."""
    times: list[float] = []
    t = 0.0
    while True:
        rate = shape.rate
        if bursty:
            rate *= 1.8 if int(t / 0.5) % 2 == 0 else 0.2
        t += rng.expovariate(rate)
        if t >= shape.duration_s:
            return times
        times.append(t)


def agent_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed)
    systems = _systems(shape, rng)
    history: dict[int, list[dict[str, str]]] = {}
    out = []
    for at in _arrivals(shape, rng):
        user = rng.randrange(shape.users)
        convo = history.get(user)
        if convo is None or len(convo) >= 1 + 2 * shape.turns:  # a new conversation
            convo = history[user] = [{"role": "system", "content": systems[user % shape.prefixes]}]
        elif len(convo) > 1:
            convo.append({"role": "assistant", "content": _text(rng, 20)})
        convo.append({"role": "user", "content": f"User {user}: " + _text(rng, 30)})
        out.append(TraceRequest(at, f"user-{user}", tuple(convo)))
    return out


def rag_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed + 2)
    system = {"role": "system", "content": "Answer from the document only. " + _text(rng, 40)}
    docs = [f"Document {d}. " + _text(rng, shape.document_words) for d in range(shape.documents)]
    weights = [1.0 / (d + 1) ** 1.1 for d in range(shape.documents)]  # Zipf: a few documents are hot
    out = []
    for n, at in enumerate(_arrivals(shape, rng)):
        (doc,) = rng.choices(docs, weights)
        question = f"{doc}\n\nQuestion {n}: " + _text(rng, 30)
        out.append(
            TraceRequest(at, f"user-{rng.randrange(shape.users)}", (system, {"role": "user", "content": question}))
        )
    return out


def chat_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed + 3)
    system = {"role": "system", "content": "You are a helpful assistant. " + _text(rng, 40)}
    history: dict[int, list[dict[str, str]]] = {}
    out = []
    for at in _arrivals(shape, rng):
        user = rng.randrange(shape.users)
        convo = history.get(user)
        if convo is None or len(convo) >= 1 + 2 * shape.chat_turns:
            convo = history[user] = [system]
        elif len(convo) > 1:
            convo.append({"role": "assistant", "content": _text(rng, shape.chat_turn_words)})
        convo.append({"role": "user", "content": f"Session {user}: " + _text(rng, shape.chat_turn_words)})
        out.append(TraceRequest(at, f"user-{user}", tuple(convo)))
    return out


def uniform_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed + 4)
    return [
        TraceRequest(
            at,
            f"user-{rng.randrange(shape.users)}",
            ({"role": "user", "content": f"{n} " + _text(rng, shape.uniform_words)},),
        )
        for n, at in enumerate(_arrivals(shape, rng))
    ]


def bursty_trace(shape: Shape) -> list[TraceRequest]:
    rng = random.Random(shape.seed + 1)
    systems = _systems(shape, rng)
    out = []
    for n, at in enumerate(_arrivals(shape, rng, bursty=True)):
        prefix = 0 if rng.random() < 0.8 else rng.randrange(1, shape.prefixes)
        messages = (
            {"role": "system", "content": systems[prefix]},
            {"role": "user", "content": f"Question {n}: " + _text(rng, 30)},
        )
        out.append(TraceRequest(at, f"user-{rng.randrange(shape.users)}", messages))
    return out


MAKERS: dict[str, Callable[[Shape], list[TraceRequest]]] = {
    "agent": agent_trace,
    "rag": rag_trace,
    "chat": chat_trace,
    "uniform": uniform_trace,
    "bursty": bursty_trace,
}


def prompt_words(request: TraceRequest) -> list[str]:
    return [w for m in request.messages for w in (m["role"], *m["content"].split())]


def working_set_tokens(trace: list[TraceRequest], block: int = 16) -> int:
    """Distinct prompt tokens the trace touches, counted in hash-chained blocks of `block` words."""
    seen: set[int] = set()
    for request in trace:
        words = prompt_words(request)
        h = 0
        for i in range(0, len(words) - block + 1, block):
            h = hash((h, *words[i : i + block]))
            seen.add(h)
    return len(seen) * block


def longest_prompt(trace: list[TraceRequest]) -> int:
    return max((len(prompt_words(r)) for r in trace), default=0)
