"""The completed-result cache: exact fingerprint -> finished generation.

Bounded by entries and by bytes, entries expire after a TTL, least recently used go first. Purely
synchronous, with an injectable clock so tests control time. Partial results (a flight stopped under
the `cache_partial` policy) are kept apart: `get()` never serves them; `get_partial()` returns them
for a later continuation.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .fingerprint import Fingerprint


@dataclass(frozen=True, slots=True)
class Result:
    """A generation as the engine streamed it: its parsed SSE events (never mutated once stored)."""

    events: tuple[dict[str, Any], ...]
    nbytes: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    complete: bool = True
    instance: str | None = None


class ResultCache:
    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        ttl_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_ms / 1000
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[Result, float]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self.max_entries > 0 and self.max_bytes > 0

    def get(self, key: Fingerprint) -> Result | None:
        result = self._lookup(key)
        if result is None or not result.complete:
            self.misses += 1
            return None
        self.hits += 1
        return result

    def get_partial(self, key: Fingerprint) -> Result | None:
        result = self._lookup(key)
        return result if result is not None and not result.complete else None

    def _lookup(self, key: Fingerprint) -> Result | None:
        entry = self._entries.get(key.digest)
        if entry is None:
            return None
        result, expires_at = entry
        if self._clock() >= expires_at:
            self._drop(key.digest)
            self.expirations += 1
            return None
        self._entries.move_to_end(key.digest)
        return result

    def put(self, key: Fingerprint, result: Result) -> bool:
        """Store a result; False when it cannot be stored (cache off, or larger than the byte bound)."""
        if not self.enabled or result.nbytes > self.max_bytes:
            return False
        existing = self._entries.get(key.digest)
        if existing is not None:
            if existing[0].complete and not result.complete:
                return False  # never replace a complete answer with a partial one
            self._drop(key.digest)
        self._entries[key.digest] = (result, self._clock() + self.ttl_s)
        self.nbytes += result.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1
        return True

    def _drop(self, digest: bytes) -> None:
        result, _ = self._entries.pop(digest)
        self.nbytes -= result.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def statistics(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "expirations": self.expirations,
        }
