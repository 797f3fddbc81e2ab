"""The completed-result cache: exact fingerprint -> finished generation.

A result is either a stream's events or one JSON completion (`Result.body`); the coalescer turns either
into what each client asked for.

Bounded by entries, by bytes, and per entry (`max_entry_bytes`: a larger result is not stored);
least recently used go first. Entries expire after a TTL and are dropped eagerly: every entry has the
same TTL, so insertion order is expiry order, and `sweep()` (run on every `put()`, and by the
coalescer's timer at `next_expiry()`) drops the expired ones from the front without a lookup. Purely
synchronous, with an injectable clock so tests control time. Partial results (a flight stopped under
the `cache_partial` policy) are kept apart: `get()` never serves them; `get_partial()` returns them
for a later continuation.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .fingerprint import Fingerprint


class Result:
    """A generation as the engine gave it: its parsed SSE events, or (`body` not None, `events` empty) the one JSON
    completion a non-streaming flight asked for.

    Kept packed, as one JSON bytes object, and decoded anew at each read (`events`, `body`): a full cache holds
    thousands of results of a few dozen nested dicts each, and every one of those dicts would be walked by each
    full garbage collection (bytes are not). A read is a cache hit, much rarer than a store; each reader gets its
    own dicts, so none can change what the next one reads."""

    __slots__ = (
        "_body",
        "_events",
        "complete",
        "completion_tokens",
        "finished_at",
        "instance",
        "nbytes",
        "prompt_tokens",
    )

    def __init__(
        self,
        events: Sequence[dict[str, Any]] = (),
        nbytes: int = 0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        complete: bool = True,
        instance: str | None = None,
        body: dict[str, Any] | None = None,
        *,
        packed_events: bytes | None = None,
        packed_body: bytes | None = None,
        finished_at: float | None = None,
    ) -> None:
        """`packed_events`: the events already packed, a JSON array (a flight joins the engine's bytes of each);
        `packed_body`: the body already packed, a JSON object (the engine's bytes of a JSON flight's answer), kept
        instead of encoding `body`; `finished_at`: when the generation ended (wall clock; now if not given), a
        response's `completed_at` where the engine gave none."""
        if packed_events is not None:
            self._events: bytes | None = packed_events
        else:
            self._events = orjson.dumps(events) if events else None
        if packed_body is not None:
            self._body: bytes | None = packed_body
        else:
            self._body = orjson.dumps(body) if body is not None else None
        self.nbytes = nbytes
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.complete = complete
        self.instance = instance
        self.finished_at = time.time() if finished_at is None else finished_at

    @property
    def events(self) -> tuple[dict[str, Any], ...]:
        return tuple(orjson.loads(self._events)) if self._events is not None else ()

    @property
    def has_events(self) -> bool:
        return self._events is not None

    @property
    def body(self) -> dict[str, Any] | None:
        if self._body is None:
            return None
        body: dict[str, Any] = orjson.loads(self._body)
        return body

    def mentions(self, needle: bytes) -> bool:
        """Whether `needle` occurs in the packed result (its events or body), without decoding it."""
        return (self._events is not None and needle in self._events) or (
            self._body is not None and needle in self._body
        )


#: Deleted ids remembered at once (`ResultCache.forget_mentioning`): each costs a substring search of every result
#: stored within its TTL.
MAX_REFUSED = 1024


class ResultCache:
    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        ttl_ms: int,
        max_entry_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_stored: Callable[[Fingerprint], None] | None = None,
    ) -> None:
        """`on_stored` is called with the key of each stored result (the coalescer wakes those waiting for it and
        arms its expiry timer)."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_bytes if max_entry_bytes is None else min(max_entry_bytes, max_bytes)
        self.ttl_s = ttl_ms / 1000
        self._clock = clock
        self._on_stored = on_stored
        #: digest -> (result, expires_at), in insertion (= expiry) order.
        self._entries: dict[bytes, tuple[Result, float]] = {}
        #: The same digests, least recently used first.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.expirations = 0
        self.too_large = 0
        #: Text no result may carry for a TTL, with when that ends (`forget_mentioning`): a deleted stored response's
        #: id, which a flight still running may be about to store. At most `MAX_REFUSED`, the oldest dropped first.
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        self.refused = 0

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
        self._lru.move_to_end(key.digest)
        return result

    def put(self, key: Fingerprint, result: Result) -> bool:
        """Store a result; False when it is not stored (cache off, or larger than `max_entry_bytes`)."""
        if not self.enabled:
            return False
        self.sweep()
        if result.nbytes > self.max_entry_bytes:
            self.too_large += 1
            return False
        if self._refused and self._carries_refused(result):
            self.refused += 1
            return False
        existing = self._entries.get(key.digest)
        if existing is not None:
            if existing[0].complete and not result.complete:
                return False  # never replace a complete answer with a partial one
            self._drop(key.digest)
        self._entries[key.digest] = (result, self._clock() + self.ttl_s)
        self._lru[key.digest] = None
        self.nbytes += result.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            oldest = next(iter(self._lru))
            self._drop(oldest)
            self.evictions += 1
        if self._on_stored is not None:
            self._on_stored(key)
        return True

    def sweep(self) -> int:
        """Drop every expired entry (oldest first, stopping at the first live one); returns how many."""
        now = self._clock()
        dropped = 0
        for _, expires_at in self._entries.values():
            if expires_at > now:
                break
            dropped += 1
        if dropped:
            for digest in list(itertools.islice(self._entries, dropped)):
                self._drop(digest)
            self.expirations += dropped
        return dropped

    def next_expiry(self) -> float | None:
        """When the oldest entry expires (on the cache's clock), or None when the cache is empty."""
        for _, expires_at in self._entries.values():
            return expires_at
        return None

    def forget_mentioning(self, needle: bytes) -> int:
        """Drop every result carrying `needle`, and store none carrying it for the next TTL (a deleted stored
        response's id: no client may be handed it again from here). Returns how many were dropped."""
        if not self.enabled:
            return 0
        self._refused.pop(needle, None)
        self._refused[needle] = self._clock() + self.ttl_s
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)
        doomed = [digest for digest, (result, _) in self._entries.items() if result.mentions(needle)]
        for digest in doomed:
            self._drop(digest)
        return len(doomed)

    def _carries_refused(self, result: Result) -> bool:
        now = self._clock()
        while self._refused and next(iter(self._refused.values())) <= now:
            self._refused.popitem(last=False)
        return any(result.mentions(needle) for needle in self._refused)

    def _drop(self, digest: bytes) -> None:
        result, _ = self._entries.pop(digest)
        del self._lru[digest]
        self.nbytes -= result.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._lru.clear()
        self.nbytes = 0

    def statistics(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "expirations": self.expirations,
            "too_large": self.too_large,
            "refused": self.refused,
        }
