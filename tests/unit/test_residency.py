"""Residency reported by sidecars: a few anchors per prompt find the engine holding a prompt's prefix."""

from __future__ import annotations

from lockgate.routing.prefix import prompt_blocks
from lockgate.routing.residency import Residency, anchors


def blocks(text: str) -> tuple[int, ...]:
    return prompt_blocks(text, 64)


def test_anchors_are_few_and_end_with_the_last_block() -> None:
    chain = blocks("x" * 64 * 100)
    assert anchors(chain) == (chain[0], chain[1], chain[3], chain[7], chain[15], chain[31], chain[63], chain[99])
    assert anchors(()) == ()


def test_a_next_turn_and_a_shared_system_prompt_find_their_engine() -> None:
    system = "You are the support agent of a large company. " * 40
    turn1 = system + "User: where is my parcel? " * 3
    residency = Residency()
    residency.add("engine-a", anchors(blocks(turn1)))
    residency.add("engine-b", anchors(blocks("another system prompt entirely " * 40)))
    turn2 = turn1 + "Assistant: on its way. User: when will it arrive? " * 3
    found = residency.match(blocks(turn2))
    assert found == {"engine-a": len(blocks(turn1))}  # every block of the previous turn
    other_user = residency.match(blocks(system + "User: a different question " * 5))
    assert other_user["engine-a"] >= 16 and "engine-b" not in other_user  # a power-of-two depth of the system prompt


def test_the_bound_evicts_the_least_recently_reported() -> None:
    residency = Residency(max_entries=4)
    residency.add("a", [1, 2, 3, 4])
    residency.add("b", [1])  # refreshes 1
    residency.add("a", [5])
    assert len(residency) == 4
    assert residency.match((2,)) == {}
    assert residency.match((1,)) == {"a": 1, "b": 1}
