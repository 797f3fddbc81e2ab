"""Routing: which instance serves a request.

A policy's `choose(request, snapshot)` is synchronous and sees only an immutable snapshot of the pool,
so it can be unit-tested on crafted snapshots. Policies may keep their own small state (a round-robin
cursor) but never touch the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class InstanceView:
    key: str
    name: str
    healthy: bool
    in_flight: int
    max_concurrency: int

    @property
    def load(self) -> float:
        return self.in_flight / self.max_concurrency


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    model: str
    instances: tuple[InstanceView, ...]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt: str = ""
    #: Instances already tried for this request (retries go elsewhere).
    exclude: frozenset[str] = field(default_factory=frozenset)


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None: ...


def candidates(request: RouteRequest, snapshot: PoolSnapshot) -> list[InstanceView]:
    """Healthy instances not yet tried; if every untried one is unhealthy, none."""
    return [i for i in snapshot.instances if i.healthy and i.key not in request.exclude]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        chosen = options[self._cursor % len(options)]
        self._cursor += 1
        return chosen


class LeastLoad:
    """Fewest requests in flight relative to capacity; ties go round-robin so idle fleets spread."""

    name = "least_load"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, request: RouteRequest, snapshot: PoolSnapshot) -> InstanceView | None:
        options = candidates(request, snapshot)
        if not options:
            return None
        best = min(i.load for i in options)
        tied = [i for i in options if i.load == best]
        chosen = tied[self._cursor % len(tied)]
        self._cursor += 1
        return chosen


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown routing policy {name!r}")
