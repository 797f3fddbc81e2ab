import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockgate.sse import EventTooLarge, SSEDecoder, encode


def decode_in_chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    """Every event of `stream`, fed to one decoder in pieces of the given sizes (then the rest), then closed."""
    decoder = SSEDecoder()
    out, pos = [], 0
    for cut in cuts:
        out += decoder.feed(stream[pos : pos + cut])
        pos += cut
    out += decoder.feed(stream[pos:])
    return out + decoder.close()


def test_events_split_anywhere_decode_the_same():
    stream = encode({"a": 1}) + b": comment\n\n" + b"event: x\ndata: two\ndata: lines\n\n" + b"data: [DONE]\n\n"
    whole = SSEDecoder().feed(stream)
    assert whole == [b'{"a":1}', b"two\nlines", b"[DONE]"]


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_chunking_never_changes_events(cuts):
    stream = b"".join(encode({"i": i, "t": "x" * i}) for i in range(10)).replace(b"\n\n", b"\r\n\r\n", 3)
    out = decode_in_chunks(stream, cuts)
    assert out == SSEDecoder().feed(stream)
    assert len(out) == 10


def test_final_event_without_blank_line_counts_on_close():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: last") == []
    assert decoder.close() == [b"last"]


@given(
    st.lists(
        st.sampled_from(
            [
                b"data: {}\n\n",
                b'data: {"x": 1}\n\n',
                b"data:tight\n\n",
                b"data: \n\n",
                b": comment\n\n",
                b"event: e\ndata: a\ndata: b\n\n",
                b"\n",
                b"data: crlf\r\n\r\n",
                b"data: cr\r\r",
                b"event: e\rdata: c\rdata: d\r\r",
                b"id: 7\n\n",
                b"data: [DONE]\n\n",
            ]
        ),
        max_size=12,
    ),
    st.lists(st.integers(min_value=1, max_value=25), max_size=20),
)
def test_the_fast_path_decodes_like_the_line_parser(parts, cuts):
    """Whole `data:` events are split off at once; every other shape goes line by line. Both agree on any
    stream, however it is cut into chunks."""
    stream = b"".join(parts)
    reference = SSEDecoder()
    expected = reference._feed_lines(stream) + reference.close()
    assert decode_in_chunks(stream, cuts) == expected


def test_an_event_larger_than_the_bound_raises():
    decoder = SSEDecoder(max_event_bytes=1024)
    assert decoder.feed(b"data: " + b"x" * 1000 + b"\n\n") == [b"x" * 1000]  # within the bound
    with pytest.raises(EventTooLarge):
        for _ in range(10):  # a line that never ends
            decoder.feed(b"y" * 200)
    # An event that arrives whole in one read is held to the bound too (an outside run: a 1.1 MB event passed a
    # 1 MiB bound whenever the engine's read brought it whole): alone, among others, and line by line.
    for whole in (
        b"data: " + b"z" * 1025 + b"\n\n",
        b"data: a\n\ndata: " + b"z" * 1025 + b"\n\n",
        b"data: " + b"z" * 1025 + b"\r\n\r\n",
    ):
        with pytest.raises(EventTooLarge):
            SSEDecoder(max_event_bytes=1024).feed(whole)
    assert SSEDecoder(max_event_bytes=1024).feed(b"data: " + b"z" * 1024 + b"\n\n") == [b"z" * 1024]
    lines = SSEDecoder(max_event_bytes=1024)  # many short data lines of one event count together
    with pytest.raises(EventTooLarge):
        for _ in range(100):
            lines.feed(b"data: abcdefghij\r\n")


def test_a_responses_error_event_is_named_and_keeps_the_envelope():
    from lockgate.sse import encode_error

    envelope = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "upstream_protocol_error"}}
    assert encode_error(envelope) == b"data: " + orjson.dumps(envelope) + b"\n\n"
    name, data = encode_error(envelope, sequence_number=7).rstrip(b"\n").split(b"\n")
    event = orjson.loads(data.removeprefix(b"data: "))
    assert name == b"event: error"
    assert event == {
        "type": "error",
        "code": "upstream_protocol_error",
        "message": "boom",
        "param": None,
        "sequence_number": 7,
        **envelope,
    }


def test_comment_lines_without_a_blank_line_take_no_room():
    """An outside run: more than the bound of keep-alive comment lines, each ending in one newline and no blank line
    between them, ended a stream as one event too large; each is a complete line, not an event growing."""
    decoder = SSEDecoder(max_event_bytes=1024)
    for _ in range(200):
        assert decoder.feed(b": keep-alive\n") == []
    assert decoder.feed(b"data: after\n\n") == [b"after"]
    # An open event's data lines still count together.
    with pytest.raises(EventTooLarge):
        for _ in range(200):
            decoder.feed(b": keep-alive\ndata: abcdefghij\n")


def test_a_lone_cr_ends_a_line_and_a_crlf_split_between_reads_is_one_line_end():
    """The SSE specification's line ends are CRLF, LF and CR alone (an outside run's engine used CR: 502, "not
    JSON")."""
    lone = SSEDecoder()
    assert lone.feed(b"data: a\r\rdata: b\r\r") == [b"a"]  # (the last CR may be a CRLF's: the next read says)
    assert lone.feed(b"data: c\r\r") == [b"b"] and lone.close() == [b"c"]
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # the CR and this LF are one line end: no blank line yet
    assert decoder.feed(b"\r\n") == [b"a"]
