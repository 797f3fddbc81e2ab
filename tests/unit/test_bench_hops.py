"""The TTFT of `bench routing` split by hop: records chained by the ids each hop passes on."""

from __future__ import annotations

import pytest

from lockgate.bench.hops import Record, names, segments, table


def test_segment_names_go_in_through_every_gateway_and_back_out() -> None:
    assert names(("gateway",)) == (
        "client > gateway",
        "gateway > engine",
        "engine TTFT",
        "engine > gateway",
        "gateway > client",
    )
    assert names(("central", "sidecar")) == (
        "client > central",
        "central > sidecar",
        "sidecar > engine",
        "engine TTFT",
        "engine > sidecar",
        "sidecar > central",
        "central > client",
    )


def test_a_request_chains_from_the_clients_id_through_each_gateways_own_to_the_engine() -> None:
    client = {"bench-0": (100.0, 100.050), "bench-1": (101.0, 101.5), "bench-2": (102.0, 102.1)}
    centrals = [Record("c-0", "bench-0", 100.001, 100.049), Record("c-1", "bench-1", 101.0, 101.4)]
    sidecars = [Record("s-0", "c-0", 100.003, 100.046), Record("s-1", "c-1", 101.0, None)]  # s-1: no token
    engine = {"s-0": (100.004, 100.044), "c-2": (0.0, 0.0)}
    (row,) = segments(client, [centrals, sidecars], engine)  # bench-1 broke at its sidecar, bench-2 never arrived
    assert row == pytest.approx((0.001, 0.002, 0.001, 0.040, 0.002, 0.003, 0.001))
    assert sum(row) == pytest.approx(0.050)  # the segments add up to the client's TTFT


def test_a_request_without_an_engine_record_of_its_own_is_skipped() -> None:
    """A request coalesced into another's flight reached no engine under its own id."""
    client = {"bench-0": (1.0, 1.2), "bench-1": (1.0, 1.2)}
    gateway = [Record("g-0", "bench-0", 1.01, 1.19), Record("g-1", "bench-1", 1.01, 1.19)]
    rows = segments(client, [gateway], {"g-0": (1.02, 1.18)})
    assert len(rows) == 1
    text = table("agent/small predicted_ttft, one gateway", names(("gateway",)), rows, 2)
    assert text.splitlines()[0] == "agent/small predicted_ttft, one gateway: TTFT by hop, 1 of 2 requests chained (ms)"
    assert "engine TTFT" in text and "160.0" in text
