from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.sim.kv import KVCache


def toks(n: int, tag: str = "t") -> list[str]:
    return [f" {tag}{i}" for i in range(n)]


def test_prefix_hit_after_commit_and_free() -> None:
    kv = KVCache(16, 4)
    a = toks(10)
    assert kv.admit("a", a) == 0
    assert kv.blocks_used == 3
    kv.commit("a", a)  # 2 full blocks become cached
    kv.free("a")
    assert kv.blocks_used == 0
    assert kv.admit("b", [*a[:9], " other", " more"]) == 8
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    kv.check_invariants()


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCache(16, 4)
    a = toks(8)
    kv.admit("a", a)
    kv.commit("a", a)
    kv.free("a")
    assert kv.admit("b", a) == 4  # the last token must be computed, so the last full block is recomputed


def test_shared_blocks_are_ref_counted() -> None:
    kv = KVCache(8, 4)
    a = toks(9)
    kv.admit("a", a)
    kv.commit("a", a)
    assert kv.admit("b", a) == 8  # concurrent sharing of a running request's blocks
    assert kv.blocks_used == 4  # 3 for a, 1 new tail block for b
    kv.check_invariants()
    kv.free("a")
    assert kv.blocks_used == 3
    kv.free("b")
    kv.free("b")  # idempotent
    assert kv.blocks_used == 0
    kv.check_invariants()


def test_lru_eviction_keeps_recently_freed() -> None:
    kv = KVCache(4, 2)
    for name in ("x", "y"):
        t = toks(4, name)
        kv.admit(name, t)
        kv.commit(name, t)
        kv.free(name)
    # all 4 blocks free but cached; a new 2-block request evicts the least recently freed (x's)
    kv.admit("z", toks(4, "z"))
    kv.free("z")
    assert kv.admit("x2", [*toks(4, "x"), " q"]) == 0
    kv.free("x2")
    kv.check_invariants()


def test_admission_fails_without_blocks_and_changes_nothing() -> None:
    kv = KVCache(4, 4)
    assert kv.admit("a", toks(12)) == 0
    assert kv.admit("b", toks(8, "b")) is None
    assert not kv.has("b") and kv.blocks_used == 3
    assert kv.grow("a", 16) and not kv.grow("a", 17)
    assert kv.usage == 1.0
    kv.free("a")
    kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "free", "grow"]), st.integers(0, 5), st.integers(1, 30))))
def test_random_operations_never_leak(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCache(12, 4)
    lens: dict[int, int] = {}
    for op, sid, n in ops:
        prompt = toks(n, str(sid % 2))  # only two distinct prefixes: lots of sharing
        if op == "admit" and sid not in lens:
            if kv.admit(sid, prompt) is not None:
                kv.commit(sid, prompt)
                lens[sid] = n
        elif op == "grow" and sid in lens:
            kv.grow(sid, lens[sid] + n)
        elif op == "free":
            kv.free(sid)
            lens.pop(sid, None)
        kv.check_invariants()
    for sid in list(lens):
        kv.free(sid)
    kv.check_invariants()
    assert kv.blocks_used == 0


def test_a_salted_sequence_shares_blocks_with_its_own_salt_only() -> None:
    """vLLM's `cache_salt`: the hash chain starts from the salt, so equal prompts of other salts hit nothing."""
    kv = KVCache(64, 4)
    a = toks(10)
    for seq_id, salt in (("a", None), ("b", "s1")):
        assert kv.admit(seq_id, a, salt) == 0
        kv.commit(seq_id, a)
        kv.free(seq_id)
    assert kv.admit("c", a, "s2") == 0
    assert kv.admit("d", a, "s1") == 8
    assert kv.admit("e", a) == 8
    kv.check_invariants()
