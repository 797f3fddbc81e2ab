"""What each engine likely holds, as its sidecar reported it: a shared correction of prefix affinity.

A sidecar sees every request for its engines, whichever central replica sent it. For each request it
routes it records a few of the prompt's chain hashes (`anchors`: the blocks at depths 1, 2, 4, 8, ...
and the last full block) and publishes them with its engines' state; every central replica adds them
to its `Residency`. Because a block's hash covers the whole prefix up to it, an engine holding anchor
`blocks[d - 1]` holds the prompt's first `d` blocks: `match` finds, per engine, the deepest anchor of a
prompt that engine was reported with. So a conversation's next turn (its prompt extends the previous
one, whose last block is an anchor) and prompts sharing a long system prompt (a power-of-two depth)
find the engine any replica sent them to, a publication later.

Bound: at most `max_entries` anchors (LRU), like the replica's own prefix index. Engine-side evictions
are not reported (neither index knows them); entries age out by LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


def anchors(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The chain hashes a sidecar reports for one routed prompt (a handful, whatever its length)."""
    if not blocks:
        return ()
    out = []
    depth = 1
    while depth < len(blocks):
        out.append(blocks[depth - 1])
        depth *= 2
    out.append(blocks[-1])
    return tuple(out)


class Residency:
    def __init__(self, max_entries: int = 262_144) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, instance_key: str, hashes: Iterable[int]) -> None:
        entries = self._entries
        for h in hashes:
            holders = entries.get(h)
            if holders is None:
                entries[h] = {instance_key}
                if len(entries) > self.max_entries:
                    entries.popitem(last=False)
            else:
                holders.add(instance_key)
                entries.move_to_end(h)

    def match(self, blocks: tuple[int, ...]) -> dict[str, int]:
        """Per engine, the leading blocks of this prompt it was reported to hold (absent: none)."""
        entries = self._entries
        if not entries or not blocks:
            return {}
        found: dict[str, int] = {}
        for depth in range(len(blocks), 0, -1):
            holders = entries.get(blocks[depth - 1])
            if holders is not None:
                for key in holders:
                    if key not in found:
                        found[key] = depth
        return found
