"""An approximate, memory-bounded index of which instance was sent which prompt prefix.

Theory of operation: a prompt is cut into blocks of `block_chars` characters (its UTF-8 bytes); block
*i*'s key is a 64-bit hash of the block seeded with block *i-1*'s key, so equal keys mean equal
prefixes (the engines' own paged KV caches work the same way). The index maps each key to a bitmask of
the instances the gateway routed that prefix to, in an `OrderedDict` kept in least-recently-used order:
routing a prompt touches its blocks, and once the index holds more than `max_bytes` worth of entries
the least recently used blocks are evicted. Memory is therefore bounded whatever the traffic (an
unbounded router index is a known way to run a router out of memory, vLLM production-stack #687).

`match()` walks a prompt's keys from the start and counts, per instance, how many leading blocks it
holds — a guess at how much of the prompt that instance has cached. It is only a guess: the engine may
have evicted the blocks since; the cost model treats it as likely, not certain.

Everything here is synchronous; one index per pool, used from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

#: Bytes one entry costs (key int, value int, OrderedDict node and dict slot with its growth slack),
#: measured with tracemalloc on CPython 3.11 and rounded up; `bench routing` re-checks it.
ENTRY_BYTES = 200
_ROOT = 0x9E3779B97F4A7C15


def prompt_blocks(text: str, block_chars: int) -> tuple[int, ...]:
    """Hash chain of the full blocks of `text` (a partial last block is not cached by engines either)."""
    data = text.encode()
    keys: list[int] = []
    h = _ROOT
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - block_chars + 1, block_chars):
        h = digest(data[start : start + block_chars], h)
        keys.append(h)
    return tuple(keys)


class PrefixIndex:
    def __init__(self, max_bytes: int, block_chars: int = 64) -> None:
        self.block_chars = block_chars
        self.max_entries = max(1, max_bytes // ENTRY_BYTES)
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._slots: dict[str, int] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def approx_bytes(self) -> int:
        return len(self._entries) * ENTRY_BYTES

    def _bit(self, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self._slots)
        return 1 << slot

    def match(self, blocks: tuple[int, ...]) -> dict[str, int]:
        """Leading blocks of the prompt each instance (by key) holds; instances holding none are absent."""
        if not blocks or not self._entries:
            return {}
        entries = self._entries
        counts: dict[int, int] = {}
        alive = (1 << len(self._slots)) - 1  # every instance, until it misses a block
        depth = 0
        for key in blocks:
            mask = entries.get(key)
            if mask is None:
                break
            ended = alive & ~mask
            if ended:
                _record(counts, ended, depth)
            alive &= mask
            if not alive:
                break
            depth += 1
        if alive:
            _record(counts, alive, depth)
        return {key: counts[slot] for key, slot in self._slots.items() if counts.get(slot)}

    def insert(self, instance_key: str, blocks: tuple[int, ...]) -> None:
        """Note that the prompt with these blocks was routed to this instance (most recently used now)."""
        if not blocks:
            return
        bit = self._bit(instance_key)
        entries = self._entries
        for key in blocks:
            mask = entries.get(key)
            if mask is None:
                entries[key] = bit
            else:
                if not mask & bit:
                    entries[key] = mask | bit
                entries.move_to_end(key)
        excess = len(entries) - self.max_entries
        for _ in range(max(0, excess)):
            entries.popitem(last=False)
        if excess > 0:
            self.evictions += excess

    def blocks_of(self, instance_key: str) -> int:
        """How many indexed blocks this instance holds (for `/admin/fleet`; O(entries))."""
        slot = self._slots.get(instance_key)
        if slot is None:
            return 0
        bit = 1 << slot
        return sum(1 for mask in self._entries.values() if mask & bit)


def _record(counts: dict[int, int], mask: int, depth: int) -> None:
    slot = 0
    while mask:
        if mask & 1:
            counts[slot] = depth
        mask >>= 1
        slot += 1
