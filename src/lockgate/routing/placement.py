"""Default placement of a prefix that every gateway replica computes alike: rendezvous hashing.

Replicas behind a load balancer each keep a private prefix index, so a prompt's follow-up that reaches
another replica would find no cached prefix there and could go anywhere. Rendezvous (highest random
weight) hashing gives every replica the same answer from the same inputs: the prompt's anchor (the
hash chain of its first blocks) and the set of live instances. A replica whose own index knows nothing
of the prompt beyond its anchor treats the winners as holding the prompt (`Pool._place`), which a cost
policy (`predicted_ttft`) weighs against load like any cached prefix, so a busy winner still loses.
When an instance leaves, only the anchors it won move (to their next choice).

A prefix gets the winners on `choices` distinct nodes (`cluster.placement_choices`, default 2) and load
picks among them. With one home per prefix, a few hot system prompts hash onto the nodes unevenly
(8 prompts over 2 nodes split 6:2 or worse in 29% of cases) and the fuller node's queues set the
cluster's TTFT p99. Two choices keep the agreement (each replica's pick is one of the same two) and
even the load, the power of two choices (`docs/decisions.md`, "Scale-out, fourth pass").
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def anchor_depth(blocks: tuple[int, ...], depth: int) -> int:
    """How many leading blocks form the anchor (0: the prompt is too short to have one)."""
    return min(len(blocks), depth)


def rendezvous_spread(anchor: int, keys: Iterable[tuple[str, str]], choices: int) -> list[str]:
    """The `choices` highest-weight keys for `anchor` from as many distinct groups as there are (a
    group is a node: its sidecar picks among the node's engines, so two choices on one node would be
    one), best first; fewer only if there are fewer keys. `keys` are (key, group) pairs. Pure and
    stable: the same for any order of `keys`, and a key's removal moves only the anchors it held."""
    digest = xxhash.xxh3_64_intdigest
    ranked = sorted(keys, key=lambda kg: (-digest(kg[0].encode(), anchor), kg[0]))
    picked: list[str] = []
    groups: set[str] = set()
    for key, group in ranked:
        if group not in groups:
            picked.append(key)
            groups.add(group)
            if len(picked) == choices:
                return picked
    for key, _ in ranked:
        if len(picked) == choices:
            break
        if key not in picked:
            picked.append(key)
    return picked
