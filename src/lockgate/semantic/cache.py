"""The semantic cache of one model: "has a question that means the same been answered?"

Only requests already eligible for de-duplication get here, and only after an exact miss (no cached
result, no flight to join). A request is `probe`d: its scope (everything but the last message, exactly)
and the last message's text, embedded in a worker thread so the event loop never runs the model.
`lookup` returns a hit above the model's threshold that passes the lexical guards; in shadow mode the
coalescer only records it. A request that led a flight is `add`ed when the flight completes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from ..dedup.cache import Result
from ..dedup.fingerprint import canonical_params, scoped
from ..wire import ApiRequest, Endpoint
from .embedder import Embedder
from .index import SemanticHit, SemanticIndex


@dataclass(frozen=True, slots=True)
class Probe:
    scope: bytes
    text: str
    vector: Any


#: Completion fields whose answer carries the prompt itself (`echo`) or a score of each of its tokens (vLLM's
#: `prompt_logprobs`): a paraphrase's answer would show the other text.
_ECHOED = ("echo", "prompt_logprobs")


def probe_input(tenant: str, api: ApiRequest) -> tuple[bytes, str] | None:
    """The exact scope and the text compared by meaning; None when the request has no such text."""
    body = api.body
    context: Any
    if api.endpoint is Endpoint.CHAT:
        messages = body["messages"]
        last = messages[-1]
        content = last.get("content")
        if last.get("role") != "user" or not isinstance(content, str):
            return None
        # The last message's other fields (its `name`: "greet me by my name") change the answer as much as the text.
        text, context = content, [*messages[:-1], {k: v for k, v in last.items() if k != "content"}]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or any(body.get(key) not in (None, False, 0) for key in _ECHOED):
            # (An answer that repeats its prompt, or scores it, is another prompt's answer word for word.)
            return None
        text, context = prompt, None
    if not text.strip():
        return None
    scope = scoped(
        tenant,
        xxhash.xxh3_128_digest(
            orjson.dumps(
                {"endpoint": api.endpoint.value, "params": canonical_params(body), "context": context},
                option=orjson.OPT_SORT_KEYS,
            )
        ),
    )
    return scope, text


#: `statistics()`: the latest shadow-mode would-be hits shown, and the characters of each text.
_SHADOW_SHOWN = 20
_SHOWN = 200


class SemanticCache:
    def __init__(
        self,
        embedder: Embedder,
        *,
        threshold: float,
        shadow: bool,
        max_entries: int,
        ttl_ms: int,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.embedder = embedder
        self.threshold = threshold
        self.shadow = shadow
        self.index = SemanticIndex(
            embedder.dim, max_entries=max_entries, ttl_ms=ttl_ms, max_bytes=max_bytes, clock=clock
        )
        #: Recent would-be hits in shadow mode: (probe text, cached text, similarity).
        self.shadow_log: deque[tuple[str, str, float]] = deque(maxlen=256)

    async def probe(self, tenant: str, api: ApiRequest) -> Probe | None:
        found = probe_input(tenant, api)
        if found is None:
            return None
        scope, text = found
        vector = await asyncio.to_thread(self._embed_one, text)
        return None if vector is None else Probe(scope, text, vector)

    def _embed_one(self, text: str) -> Any:
        if not self.embedder.fits(text):
            return None  # the model would read only the beginning: two long texts could look identical
        return self.embedder.embed([text])[0]

    def lookup(self, probe: Probe) -> SemanticHit | None:
        hit = self.index.search(probe.scope, probe.vector, probe.text, self.threshold)
        if hit is not None and self.shadow:
            self.shadow_log.append((probe.text, hit.text, hit.similarity))
        return hit

    def add(self, probe: Probe, result: Result) -> None:
        self.index.add(probe.scope, probe.vector, probe.text, result)

    def entries(self) -> int:
        return len(self.index)

    def bytes_held(self) -> int:
        return self.index.nbytes

    def statistics(self) -> dict[str, Any]:
        """What `GET /admin/flights` shows: its size, and in shadow mode the latest would-be hits (the question, the
        cached question it matched, their similarity: what an operator judges before turning hits on)."""
        out: dict[str, Any] = {
            "entries": self.entries(),
            "bytes": self.bytes_held(),
            "threshold": self.threshold,
            "shadow": self.shadow,
        }
        if self.shadow:
            out["shadow_hits"] = [
                {"question": q[:_SHOWN], "matched": m[:_SHOWN], "similarity": round(sim, 4)}
                for q, m, sim in list(self.shadow_log)[-_SHADOW_SHOWN:]
            ]
        return out
