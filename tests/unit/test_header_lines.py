"""Header lines for the wire, shared by the edge server and the engine client: CR or LF inside is refused."""

from __future__ import annotations

import pytest

from lockgate.edge.response import render_head
from lockgate.header_lines import render


def test_lines_end_in_crlf() -> None:
    assert render([("X-A", "1"), ("x-b", "two words")]) == "X-A: 1\r\nx-b: two words\r\n"
    assert render([]) == ""


@pytest.mark.parametrize("pair", [("X-A", "1\r\nSet-Cookie: x"), ("X-A", "1\n"), ("X\rA", "1"), ("X-A", "\r")])
def test_cr_or_lf_in_a_name_or_value_is_refused_naming_the_header(pair: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="CR or LF in header"):
        render([("X-Ok", "fine"), pair])


def test_the_edge_refuses_cr_or_lf_even_in_a_framing_header_it_drops() -> None:
    assert b"content-length" not in render_head(200, None, {"content-length": "5", "X-A": "1"}).lower()
    with pytest.raises(ValueError):
        render_head(200, None, {"Content-Length": "5\r\nX-Evil: 1"})
