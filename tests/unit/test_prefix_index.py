"""The prefix index: hash-chained blocks, per-instance longest match, LRU bound."""

from __future__ import annotations

from lockgate.routing.prefix import ENTRY_BYTES, PrefixIndex, prompt_blocks

SYSTEM = "You are a careful assistant. " * 20


def test_blocks_are_hash_chained_prefixes():
    a = prompt_blocks(SYSTEM + "question one", 64)
    b = prompt_blocks(SYSTEM + "question two, longer", 64)
    shared = len(SYSTEM) // 64
    assert a[:shared] == b[:shared]
    # Same block text at another position hashes differently (the chain carries the prefix).
    same_text = prompt_blocks("x" * 128, 64)
    assert same_text[0] != same_text[1]
    assert prompt_blocks("short", 64) == ()


def test_match_counts_leading_blocks_per_instance():
    index = PrefixIndex(1 << 20, 64)
    long_conv = prompt_blocks(SYSTEM + "turn one. " * 30, 64)
    index.insert("a", long_conv)
    index.insert("b", prompt_blocks(SYSTEM, 64))
    query = prompt_blocks(SYSTEM + "turn one. " * 30 + "turn two", 64)
    match = index.match(query)
    assert match["a"] == len(long_conv)
    assert match["b"] == len(SYSTEM) // 64
    assert "c" not in match
    assert index.match(prompt_blocks("something else entirely " * 10, 64)) == {}


def test_lru_eviction_keeps_the_index_within_its_memory_bound():
    max_bytes = 64 * 1024
    index = PrefixIndex(max_bytes, 64)
    hot = prompt_blocks(SYSTEM, 64)
    for n in range(5000):
        index.insert(f"i{n % 4}", prompt_blocks(f"distinct prompt number {n} " * 6, 64))
        if n % 50 == 0:
            index.insert("i0", hot)  # used again and again: never the least recently used
    assert len(index) <= index.max_entries == max_bytes // ENTRY_BYTES
    assert index.evictions > 0
    assert index.match(hot)["i0"] == len(hot)


def test_entry_cost_estimate_is_an_upper_bound():
    import tracemalloc

    tracemalloc.start()
    try:
        index = PrefixIndex(10 * 1024 * 1024, 64)
        before = tracemalloc.get_traced_memory()[0]
        for n in range(20_000):
            index.insert(f"i{n % 8}", (n * 0x9E3779B97F4A7C15 % (1 << 64),))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used <= len(index) * ENTRY_BYTES


def test_an_instance_with_a_known_cache_size_forgets_what_its_engine_evicted() -> None:
    index = PrefixIndex(max_bytes=1 << 20, block_chars=4)
    a, b, c = (prompt_blocks(ch * 40, 4) for ch in "abc")  # 10 blocks each
    index.set_capacity("e1", 25)  # room for two prompts and a half
    index.insert("e1", a)
    index.insert("e1", b)
    assert index.room("e1") == 5 and index.match(a) == {"e1": 10}
    index.insert("e1", c)  # evicts the least recently used half of `a` ...
    assert index.room("e1") == 0 and index.engine_evictions == 5
    assert index.match(a) == {"e1": 5}  # ... its tail first, as vLLM evicts: the leading half still matches
    assert index.match(b) == {"e1": 10} and index.match(c) == {"e1": 10}
    # Another instance without a known size keeps the old optimistic behaviour.
    index.insert("e2", a)
    assert index.room("e2") is None and index.match(a) == {"e1": 5, "e2": 10}
    assert index.blocks_of("e1") == 25 and index.capacity("e1") == 25


def test_the_memory_bound_counts_the_per_instance_lrus() -> None:
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES, block_chars=4)
    for n in range(4):
        index.set_capacity(f"e{n}", 1000)
    for i in range(200):
        index.insert(f"e{i % 4}", prompt_blocks(f"{i:04d}" * 5, 4))
    assert index.approx_bytes <= index.max_bytes
    assert sum(index.blocks_of(f"e{n}") for n in range(4)) <= len(index)


def test_an_instance_that_went_down_holds_nothing() -> None:
    """`forget`: a restarted engine starts with an empty cache; the other instances keep theirs."""
    index = PrefixIndex(1 << 20, block_chars=8)
    blocks = prompt_blocks("a shared prefix of several blocks", 8)
    index.insert("a", blocks)
    index.insert("b", blocks)
    index.set_capacity("b", 100)
    index.insert("c", prompt_blocks("only on c, nowhere else", 8))
    assert index.forget("b") == len(blocks) and index.forget("b") == 0
    assert index.match(blocks) == {"a": len(blocks)}
    assert index.blocks_of("b") == 0 and index.room("b") == 100
    assert index.forget("c") > 0 and len(index) == len(blocks)  # c's own blocks are gone from the map
    assert index.forget("never-seen") == 0


def test_a_salt_gives_a_prompt_blocks_of_its_own() -> None:
    """The index predicts what the engine will find: prompts of other cache salts share no block there."""
    text = "the same shared system prompt " * 20
    plain, salted, other = (prompt_blocks(text, 64, salt) for salt in (None, "lg1-a", "lg1-b"))
    assert len(plain) == len(salted) == len(other) > 3
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert prompt_blocks(text, 64, "lg1-a") == salted
