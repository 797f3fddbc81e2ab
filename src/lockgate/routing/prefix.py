"""An approximate, memory-bounded index of which instance was sent which prompt prefix.

Theory of operation: a prompt is cut into blocks of `block_chars` characters (its UTF-8 bytes); block
*i*'s key is a 64-bit hash of the block seeded with block *i-1*'s key, so equal keys mean equal
prefixes (the engines' own paged KV caches work the same way). The index maps each key to a bitmask of
the instances the gateway routed that prefix to, in an `OrderedDict` kept in least-recently-used order:
routing a prompt touches its blocks, and once the index holds more than `max_bytes` worth of entries
the least recently used blocks are evicted. Memory is therefore bounded whatever the traffic (an
unbounded router index is a known way to run a router out of memory, vLLM production-stack #687).

`match()` walks a prompt's keys from the start and counts, per instance, how many leading blocks it
holds — a guess at how much of the prompt that instance has cached.

Engines evict too. An instance whose prefix-cache size is known (`set_capacity`, in blocks: from the
engine's own report, vLLM's `cache_config_info`, or the configuration) gets its own LRU of the blocks
routed to it, trimmed to that size as the engine's LRU would be: a block that engine has most likely
evicted stops counting as cached there, and `room()` says how much more it takes before evicting.
Without a known size an instance keeps its blocks until the global bound evicts them (the old
behaviour: optimistic when the working set outgrows the engine's cache). The per-instance LRUs hold
the same keys as the global map, so the global `max_bytes` bound (counting their entries too) still
bounds everything.

Everything here is synchronous; one index per pool, used from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

#: Bytes one entry costs (key int, value int, OrderedDict node and dict slot with its growth slack),
#: measured with tracemalloc on CPython 3.11 and rounded up; `bench routing` re-checks it.
ENTRY_BYTES = 200
_ROOT = 0x9E3779B97F4A7C15


def prompt_blocks(text: str, block_chars: int, salt: str | None = None) -> tuple[int, ...]:
    """Hash chain of the full blocks of `text` (a partial last block is not cached by engines either), from a root
    of its `salt`'s (the engine's `cache_salt`: requests of other salts share no block with it there)."""
    data = text.encode()
    keys: list[int] = []
    h = _ROOT if salt is None else xxhash.xxh3_64_intdigest(salt.encode(), _ROOT)
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - block_chars + 1, block_chars):
        h = digest(data[start : start + block_chars], h)
        keys.append(h)
    return tuple(keys)


#: Bytes one block costs in an instance's own LRU (an OrderedDict node with a None value).
RESIDENT_BYTES = 120
#: `room()` of an instance no prompt was routed to yet, whatever its cache size: placing one there evicts nothing.
UNTOUCHED_ROOM = 1 << 40


class PrefixIndex:
    def __init__(self, max_bytes: int, block_chars: int = 64) -> None:
        self.block_chars = block_chars
        self.max_bytes = max_bytes
        self.max_entries = max(1, max_bytes // ENTRY_BYTES)
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._slots: dict[str, int] = {}
        #: Per slot with a known cache size: its blocks in LRU order, and that size (in blocks).
        self._resident: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self._resident_total = 0
        self.evictions = 0
        #: Blocks dropped from an instance's LRU because its engine's cache is full (modelled evictions).
        self.engine_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def approx_bytes(self) -> int:
        return len(self._entries) * ENTRY_BYTES + self._resident_total * RESIDENT_BYTES

    def _slot(self, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self._slots)
        return slot

    def set_capacity(self, instance_key: str, blocks: int | None) -> None:
        """The instance's prefix cache holds about this many blocks (None: unknown, no per-instance LRU)."""
        slot = self._slot(instance_key)
        if blocks is None:
            dropped = self._resident.pop(slot, None)
            self._capacity.pop(slot, None)
            if dropped is not None:
                self._resident_total -= len(dropped)
            return
        self._capacity[slot] = max(1, blocks)
        if slot not in self._resident:
            # Start from what the global map says it holds (oldest first, as the map is ordered).
            bit = 1 << slot
            self._resident[slot] = OrderedDict((k, None) for k, m in self._entries.items() if m & bit)
            self._resident_total += len(self._resident[slot])
        self._trim(slot)

    def capacity(self, instance_key: str) -> int | None:
        slot = self._slots.get(instance_key)
        return None if slot is None else self._capacity.get(slot)

    def room(self, instance_key: str) -> int | None:
        """Blocks the instance takes before its cache evicts (None: its cache size is unknown). An instance no
        prompt was routed to yet holds nothing of ours to evict, whatever its size: `UNTOUCHED_ROOM`."""
        slot = self._slots.get(instance_key)
        if slot is None:
            return UNTOUCHED_ROOM
        capacity = self._capacity.get(slot)
        if capacity is None:
            return None
        return max(0, capacity - len(self._resident[slot]))

    def forget(self, instance_key: str) -> int:
        """The instance lost its cache (it went down: a restarted engine starts empty): it holds no block
        any more. Returns how many blocks it held. O(entries); called on a health change, not per request."""
        slot = self._slots.get(instance_key)
        if slot is None:
            return 0
        clear = ~(1 << slot)
        entries = self._entries
        held = 0
        for key, mask in list(entries.items()):
            if mask >> slot & 1:
                held += 1
                mask &= clear
                if mask:
                    entries[key] = mask
                else:
                    del entries[key]
        resident = self._resident.get(slot)
        if resident is not None:
            self._resident_total -= len(resident)
            resident.clear()
        return held

    def _trim(self, slot: int) -> None:
        resident = self._resident[slot]
        excess = len(resident) - self._capacity[slot]
        if excess <= 0:
            return
        entries = self._entries
        clear = ~(1 << slot)
        for _ in range(excess):
            key, _ = resident.popitem(last=False)
            mask = entries.get(key)
            if mask is not None:
                mask &= clear
                if mask:
                    entries[key] = mask
                else:
                    del entries[key]
        self._resident_total -= excess
        self.engine_evictions += excess

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
        slot = self._slot(instance_key)
        bit = 1 << slot
        entries = self._entries
        for key in blocks:
            mask = entries.get(key)
            if mask is None:
                entries[key] = bit
            else:
                if not mask & bit:
                    entries[key] = mask | bit
                entries.move_to_end(key)
        resident = self._resident.get(slot)
        if resident is not None:
            before = len(resident)
            # Like vLLM's free-block queue, a prompt's tail goes first: touch its blocks last to first.
            for key in reversed(blocks):
                resident[key] = None
                resident.move_to_end(key)
            self._resident_total += len(resident) - before
            self._trim(slot)
        self._bound()

    def _bound(self) -> None:
        """Evict the least recently used blocks everywhere until the index fits its memory bound."""
        entries = self._entries
        excess = len(entries) - self.max_entries
        if self._resident_total:
            excess = max(excess, (self.approx_bytes - self.max_bytes + ENTRY_BYTES - 1) // ENTRY_BYTES)
        if excess <= 0:
            return
        residents = self._resident
        for _ in range(min(excess, len(entries))):
            key, mask = entries.popitem(last=False)
            if residents:
                for slot, resident in residents.items():
                    if mask >> slot & 1 and resident.pop(key, 0) is None:
                        self._resident_total -= 1
        self.evictions += excess

    def blocks_of(self, instance_key: str) -> int:
        """How many indexed blocks this instance holds (for `/admin/fleet`; O(entries) unless its cache
        size is known)."""
        slot = self._slots.get(instance_key)
        if slot is None:
            return 0
        resident = self._resident.get(slot)
        if resident is not None:
            return len(resident)
        bit = 1 << slot
        return sum(1 for mask in self._entries.values() if mask & bit)


def _record(counts: dict[int, int], mask: int, depth: int) -> None:
    slot = 0
    while mask:
        if mask & 1:
            counts[slot] = depth
        mask >>= 1
        slot += 1
