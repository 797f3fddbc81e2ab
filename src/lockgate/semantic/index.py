"""The semantic cache's store: vectors of answered prompts, searched within one scope.

A scope is everything that must match exactly for two requests to share an answer (tenant, model,
endpoint, every sampling parameter, the conversation before the last message); only the last message is
compared by meaning. One usearch index per scope, created on demand and dropped when empty; bounded by
entries overall (least recently used go first), by bytes and by a TTL; an injectable clock for tests.

The bytes counted are what the cache holds: each entry's result, its vector and its text, and each scope's index
(`SCOPE_BYTES`: an index of one vector takes ~50 KB resident). Counting results alone, an outside run's client that
made every request a scope of its own (a system prompt each) took a gateway from 292 to 757 MB while the cache said
it held 3.95 MB of its 64 MiB. Expired entries at the least recently used end go when an entry is added.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..dedup.cache import Result
from .guard import compatible

#: What a scope's index is counted as holding (measured: ~50 KB resident for a usearch index of one 384-d vector).
SCOPE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class SemanticHit:
    result: Result
    similarity: float
    text: str


@dataclass(slots=True)
class _Entry:
    scope: bytes
    text: str
    result: Result
    expires_at: float
    #: What it is counted as holding: its result, vector and text.
    nbytes: int


class SemanticIndex:
    def __init__(
        self,
        dim: int,
        *,
        max_entries: int,
        ttl_ms: int,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        candidates: int = 4,
    ) -> None:
        """Bounded by `max_entries` and by `max_bytes` held (None: entries only; see the module docstring); least
        recently used go first, and an entry larger than `max_bytes` with its scope's index is not added."""
        with contextlib.suppress(ImportError):
            # The embedder's runtime first: loaded after usearch's extension, onnxruntime's crashes the process in
            # libstdc++ (onnxruntime 1.32 with usearch 2.26: a segmentation fault while importing it).
            import onnxruntime  # noqa: F401
        from usearch.index import Index

        self._index_type = Index
        self.dim = dim
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.ttl_s = ttl_ms / 1000
        self._clock = clock
        self._candidates = candidates
        self._scopes: dict[bytes, Any] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def scopes(self) -> int:
        return len(self._scopes)

    def search(self, scope: bytes, vector: Any, text: str, threshold: float) -> SemanticHit | None:
        index = self._scopes.get(scope)
        if index is None:
            return None
        matches = index.search(vector, min(self._candidates, len(index)))
        now = self._clock()
        best: SemanticHit | None = None
        for key, distance in zip(matches.keys, matches.distances, strict=True):
            entry = self._entries.get(int(key))
            if entry is None:
                continue
            if now >= entry.expires_at:
                self._remove(int(key))
                continue
            similarity = 1.0 - float(distance)
            if similarity < threshold or not compatible(text, entry.text):
                continue
            if best is None or similarity > best.similarity:
                best = SemanticHit(entry.result, similarity, entry.text)
                self._entries.move_to_end(int(key))
        return best

    def add(self, scope: bytes, vector: Any, text: str, result: Result) -> None:
        if self.max_entries <= 0 or self.ttl_s <= 0:
            return
        nbytes = result.nbytes + 4 * self.dim + len(text.encode())
        if self.max_bytes is not None and nbytes + SCOPE_BYTES > self.max_bytes:
            return
        now = self._clock()
        while self._entries and now >= self._entries[next(iter(self._entries))].expires_at:
            self._remove(next(iter(self._entries)))
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = self._index_type(ndim=self.dim, metric="cos", dtype="f32")
            self.nbytes += SCOPE_BYTES
        key = self._next_key
        self._next_key += 1
        index.add(key, vector)
        self._entries[key] = _Entry(scope, text, result, now + self.ttl_s, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            self._remove(next(iter(self._entries)))

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        index = self._scopes.get(entry.scope)
        if index is None:
            return
        index.remove(key)
        if len(index) == 0:
            del self._scopes[entry.scope]
            self.nbytes -= SCOPE_BYTES
