"""W3C traceparent/tracestate validation."""

from __future__ import annotations

import pytest

from lockgate.observe.trace import parse_traceparent, trace_headers

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_parsed() -> None:
    assert parse_traceparent(VALID) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    # A later version may carry more fields; only the ones we know are read.
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra") is not None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        VALID.upper(),  # hex must be lower-case
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
        VALID + "-extra",  # version 00 has exactly four fields
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    ],
)
def test_invalid_traceparents_are_refused(value: str) -> None:
    assert parse_traceparent(value) is None
    assert trace_headers(value, "vendor=x") == ()


def test_tracestate_travels_only_with_a_valid_traceparent_and_within_bounds() -> None:
    assert trace_headers(VALID, "congo=t61rcWkgMzE") == (("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE"))
    assert trace_headers(VALID, None) == (("traceparent", VALID),)
    assert trace_headers(VALID, "x=" + "a" * 600) == (("traceparent", VALID),)  # longer than 512: dropped
    assert trace_headers(VALID, ",".join(f"k{i}=v" for i in range(40))) == (("traceparent", VALID),)
