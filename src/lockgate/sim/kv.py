"""A paged KV cache with automatic prefix caching, modelled on vLLM's block manager.

Theory of operation: the cache has ``num_blocks`` blocks of ``block_size`` tokens. A *full* block is
identified by a hash chain, ``hash(parent_hash, block tokens)``, so equal hashes mean equal prefixes. A
sequence holds a list of blocks, each pinned by a reference count. When a sequence is freed its blocks go
to the back of the free queue but keep their hash, so a later request with the same prefix can take them
back (a prefix-cache hit). A fresh allocation takes the block at the front of the free queue (least
recently freed) and evicts its hash. Blocks are registered as cached only once their tokens have been
computed (``commit``), as in vLLM.

Everything here is synchronous and deterministic; the scheduler is the only caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT_HASH = 0x9E3779B97F4A7C15


def root_hash(salt: str | None) -> int:
    """The root of a sequence's hash chain: a salted request's (vLLM's `cache_salt`) shares no block with others."""
    return _ROOT_HASH if salt is None else hash((_ROOT_HASH, salt))


def block_hashes(tokens: Sequence[str], block_size: int, parent: int = _ROOT_HASH) -> list[int]:
    """Hash chain of the full blocks of ``tokens``."""
    out: list[int] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[start : start + block_size])))
        out.append(h)
    return out


class _Block:
    __slots__ = ("block_id", "hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: int | None = None


@dataclass(slots=True)
class _SeqBlocks:
    blocks: list[_Block]
    hashes: list[int]  # hash chain of the committed full blocks
    root: int  # the chain's root (`root_hash` of the sequence's salt)


@dataclass(frozen=True, slots=True)
class KVStatistics:
    num_blocks: int
    block_size: int
    blocks_used: int  # pinned by at least one sequence
    blocks_cached: int  # holding a hash (in use or free-but-reusable)
    num_sequences: int
    prefix_cache_queries: int  # tokens looked up on admission
    prefix_cache_hits: int  # of which found cached

    @property
    def usage(self) -> float:
        return self.blocks_used / self.num_blocks if self.num_blocks else 0.0


class KVCache:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, _Block] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[int, _Block] = {}
        self._seqs: dict[object, _SeqBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.blocks_used / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_blocks(self, seq_id: object) -> list[int]:
        return [b.block_id for b in self._seqs[seq_id].blocks]

    def statistics(self) -> KVStatistics:
        return KVStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=self.blocks_used,
            blocks_cached=len(self._cached),
            num_sequences=len(self._seqs),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def _lookup(self, hashes: Sequence[int]) -> list[_Block]:
        hit: list[_Block] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    # -- operations ----------------------------------------------------------------------------------------
    def admit(self, seq_id: object, tokens: Sequence[str], salt: str | None = None) -> int | None:
        """Allocate blocks for all of ``tokens``, reusing the longest cached prefix of the same ``salt``.

        Returns the number of cached tokens (always less than ``len(tokens)``, as at least one token must be
        computed to sample from), or ``None`` -- changing nothing -- if there are not enough free blocks.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        bs = self.block_size
        root = root_hash(salt)
        hashes = block_hashes(tokens[: max(0, len(tokens) - 1)], bs, root)
        hit = self._lookup(hashes)
        # Hit blocks that are free must leave the free queue, so they count against it too.
        free_hits = sum(1 for b in hit if b.ref_cnt == 0)
        new_needed = self.blocks_needed(len(tokens)) - len(hit)
        if new_needed + free_hits > len(self._free):
            return None
        for b in hit:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1
        blocks = hit + [self._take_free() for _ in range(new_needed)]
        self._seqs[seq_id] = _SeqBlocks(blocks, hashes[: len(hit)], root)
        num_cached = len(hit) * bs
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += num_cached
        return num_cached

    def grow(self, seq_id: object, num_tokens: int) -> bool:
        """Make the sequence's blocks cover ``num_tokens`` tokens; ``False`` (nothing changed) if out of blocks."""
        seq = self._seqs[seq_id]
        extra = self.blocks_needed(num_tokens) - len(seq.blocks)
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        seq.blocks.extend(self._take_free() for _ in range(extra))
        return True

    def commit(self, seq_id: object, tokens: Sequence[str]) -> None:
        """Record that ``tokens`` (the sequence's computed tokens) are in its blocks: full blocks become cached."""
        seq = self._seqs[seq_id]
        bs = self.block_size
        n_full = min(len(tokens) // bs, len(seq.blocks))
        while len(seq.hashes) < n_full:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else seq.root
            h = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            seq.hashes.append(h)
            block = seq.blocks[i]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block

    def free(self, seq_id: object) -> None:
        """Release the sequence's blocks (idempotent). Cached blocks stay reusable until evicted."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Free the tail first so that, under LRU eviction, a prefix outlives its own continuation.
        for b in reversed(seq.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def _take_free(self) -> _Block:
        _, b = self._free.popitem(last=False)
        if b.hash is not None:
            del self._cached[b.hash]
            b.hash = None
        b.ref_cnt = 1
        return b

    def reset_prefix_cache(self) -> None:
        for b in self._free.values():
            if b.hash is not None:
                del self._cached[b.hash]
                b.hash = None

    def check_invariants(self) -> None:
        """For tests: reference counts match the sequences' block lists; free queue == unreferenced blocks."""
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            for b in seq.blocks:
                refs[b.block_id] += 1
        for b in self._blocks:
            assert b.ref_cnt == refs[b.block_id], (b.block_id, b.ref_cnt, refs[b.block_id])
            assert (b.ref_cnt == 0) == (b.block_id in self._free), b.block_id
            if b.hash is not None:
                assert self._cached[b.hash] is b
        assert len(self._cached) == sum(1 for b in self._blocks if b.hash is not None)
