"""Default placement of a prefix that every gateway replica computes alike: rendezvous hashing.

Replicas behind a load balancer each keep a private prefix index, so a prompt's follow-up that reaches
another replica would find no cached prefix there and could go anywhere. Rendezvous (highest random
weight) hashing gives every replica the same answer from the same inputs: the prompt's anchor (the
hash chain of its first blocks) and the set of live instances. A replica whose own index knows nothing
of the prompt beyond its anchor treats the winner as holding the prompt (`Pool._place`), which a cost
policy (`predicted_ttft`) weighs against load like any cached prefix, so a busy winner still loses.
When an instance leaves, only the anchors it won move (to their second choice).
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def anchor_depth(blocks: tuple[int, ...], depth: int) -> int:
    """How many leading blocks form the anchor (0: the prompt is too short to have one)."""
    return min(len(blocks), depth)


def rendezvous_top(anchor: int, keys: Iterable[str]) -> str | None:
    """The key with the highest weight for `anchor`; None for no keys. Pure and stable."""
    best: str | None = None
    best_weight = -1
    digest = xxhash.xxh3_64_intdigest
    for key in keys:
        weight = digest(key.encode(), anchor)
        if weight > best_weight or (weight == best_weight and best is not None and key < best):
            best, best_weight = key, weight
    return best
