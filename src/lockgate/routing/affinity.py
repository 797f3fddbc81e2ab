"""`consistent_hash`: session affinity on a hash ring, with bounded load.

A session key (a client header, else the body's `user`) maps to a point on a ring of virtual nodes;
the request goes to the first instance clockwise that is a candidate and is not over its bound,
`ceil(load_factor * (total in flight + 1) / candidates)` ("Consistent Hashing with Bounded Loads",
Mirrokni et al.). A hot session therefore spills to the next instance on the ring instead of piling
onto one, and adding or removing an instance moves only its share of sessions. Requests without a key
go to the least loaded instance.
"""

from __future__ import annotations

import bisect
import math

import xxhash

from .config import ConsistentHashOptions
from .policies import InstanceView, LeastLoad, PoolSnapshot, RouteRequest, candidates, with_room


class HashRing:
    def __init__(self, keys: tuple[str, ...], virtual_nodes: int) -> None:
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{key}#{n}".encode()), key) for key in keys for n in range(virtual_nodes)
        )
        self.keys = keys
        self._hashes = [h for h, _ in points]
        self._owners = [k for _, k in points]

    def walk(self, session: str) -> list[str]:
        """Distinct instance keys in ring order, starting at the session's point."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, xxhash.xxh3_64_intdigest(session.encode())) % len(self._hashes)
        seen: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n], None)
            if len(seen) == len(self.keys):
                break
        return list(seen)


class ConsistentHash:
    name = "consistent_hash"
    uses_prefix = False

    def __init__(self, options: ConsistentHashOptions | None = None) -> None:
        self._options = options or ConsistentHashOptions()
        self._ring: HashRing | None = None
        self._fallback = LeastLoad()

    def _ring_for(self, snapshot: PoolSnapshot) -> HashRing:
        keys = tuple(i.key for i in snapshot.instances)
        if self._ring is None or self._ring.keys != keys:
            self._ring = HashRing(keys, self._options.virtual_nodes)
        return self._ring

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options or request.affinity_key is None:
            return self._fallback.choose(request, snapshot)
        by_key = {o.key: o for o in options}
        total = sum(o.in_flight for o in options)
        bound = math.ceil(self._options.load_factor * (total + 1) / len(options))
        # An instance's limit is a ceiling too: past it, the session spills to the next on the ring.
        roomy = {o.key for o in with_room(options)}
        for key in self._ring_for(snapshot).walk(request.affinity_key):
            view = by_key.get(key)
            if view is not None and view.in_flight < bound and key in roomy:
                return view
        return self._fallback.choose(request, snapshot)  # none under both the bound and its limit: the least loaded
