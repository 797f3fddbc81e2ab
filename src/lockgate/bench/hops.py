"""Where a request's time to first token goes, hop by hop (`bench routing` with its gateways as processes).

Each request of the trace carries the client's own `x-request-id`; every gateway keeps the id it was
given as its usage record's `client_request_id` and sends its own `request_id` to the next hop, and
the simulator keeps the one it received. So one request's records chain up: client -> outermost
gateway (a single gateway, or a central replica) -> [sidecar] -> engine. From their wall-clock stamps
(`started_at`, `first_token_at`; every process is on this machine's clock) each request's TTFT splits
into segments: the way in through each gateway, the engine's own TTFT (its queue and prefill), and
the first token's way back out. `table` prints each segment's p50 and p99 over the requests that
chained (a request coalesced into another's flight has no engine record of its own: skipped).

The segments' p99s do not add up to the total's (different requests are slowest in each); what they
say is which hop a slow request spent its time in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import records
from .load import percentile


@dataclass(frozen=True, slots=True)
class Record:
    """One gateway's usage record of a request (wall-clock seconds)."""

    request_id: str
    client_request_id: str | None
    started_at: float
    first_token_at: float | None


def read_records(path: Path) -> list[Record]:
    """A gateway's usage records (its store, once the gateway stopped and flushed it; none if it never wrote)."""
    if not path.exists():
        return []
    return [
        Record(r["request_id"], r["client_request_id"], r["started_at"], r["first_token_at"])
        for r in records.read_records(str(path))
    ]


def names(layers: Sequence[str]) -> tuple[str, ...]:
    """The segment names for gateways `layers` (outermost first), e.g. ("central", "sidecar")."""
    way_in = [f"{a} > {b}" for a, b in itertools.pairwise(["client", *layers, "engine"])]
    way_out = [f"{a} > {b}" for a, b in itertools.pairwise(["engine", *reversed(layers), "client"])]
    return (*way_in, "engine TTFT", *way_out)


def segments(
    client: Mapping[str, tuple[float, float]],
    layers: Sequence[Iterable[Record]],
    engine: Mapping[str, tuple[float, float]],
) -> list[tuple[float, ...]]:
    """Per request that chains through every layer to the engine, its segments in `names` order.
    `client`: the client's id -> (sent, first bytes); `layers`: each gateway layer's records, outermost
    first; `engine`: the id the engine received -> (started, first token)."""
    by_caller = [{r.client_request_id: r for r in records if r.client_request_id} for records in layers]
    out: list[tuple[float, ...]] = []
    for cid, (sent, first) in client.items():
        chain: list[tuple[float, float]] = []  # each gateway's (started, first token), outermost first
        key = cid
        for index in by_caller:
            record = index.get(key)
            if record is None or record.first_token_at is None:
                break
            chain.append((record.started_at, record.first_token_at))
            key = record.request_id
        stamps = engine.get(key) if len(chain) == len(layers) else None
        if stamps is None:
            continue
        starts = [sent, *(c[0] for c in chain), stamps[0]]
        firsts = [stamps[1], *(c[1] for c in reversed(chain)), first]
        way_in = [b - a for a, b in itertools.pairwise(starts)]
        way_out = [b - a for a, b in itertools.pairwise(firsts)]
        out.append((*way_in, stamps[1] - stamps[0], *way_out))
    return out


def table(label: str, segment_names: Sequence[str], rows: Sequence[tuple[float, ...]], requests: int) -> str:
    """Each segment's p50 and p99 (ms) over `rows`, under a heading naming how many of `requests` chained."""
    lines = [f"{label}: TTFT by hop, {len(rows)} of {requests} requests chained (ms)"]
    if rows:
        width = max(len(n) for n in segment_names)
        lines.append(f"  {'segment':<{width}}{'p50':>8}{'p99':>8}")
        for n, name in enumerate(segment_names):
            values = [r[n] for r in rows]
            lines.append(f"  {name:<{width}}{percentile(values, 50) * 1000:>8.1f}{percentile(values, 99) * 1000:>8.1f}")
    return "\n".join(lines)
