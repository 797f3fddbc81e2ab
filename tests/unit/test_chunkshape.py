"""`ChunkShape` makes a stream's token chunks from their bytes: proven equal to parsing them, over odd chunks."""

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.assemble import has_content
from lockgate.chunkshape import MAX_LEARNED, ChunkShape

#: Chunks as engines and odd engines lay them out: `TEXT` is a JSON string (the token), `N` a number that changes
#: from chunk to chunk where it appears.
TEMPLATES = [
    # vLLM, SGLang: chat and completions
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":TEXT},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":TEXT,'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null}]}',
    # a gateway in front, OpenAI: a null usage; a role beside the text; reasoning models
    b'{"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":TEXT}}],"usage":null}',
    b'{"id":"c","model":"m","choices":[{"index":0,"delta":{"reasoning_content":TEXT,"content":null}}]}',
    b'{"id":"c","model":"m","choices":[{"index":0,"delta":{"reasoning":TEXT}}]}',
    # spacing (Python's json), a per-chunk number (a timestamp), the key spelled with an escape
    b'{"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": TEXT}, "finish_reason": null}]}',
    b'{"id":"c","created":N,"choices":[{"index":0,"delta":{"content":TEXT}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"con\\u0074ent":TEXT}}]}',
    # what is never learned: several choices, objects beside the text, tool calls, a usage object
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT}},{"index":1,"delta":{"content":"b"}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT},"logprobs":{"content":[{"token":"a"}]}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT,"tool_calls":[{"index":0}]}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT}}],"usage":{"completion_tokens":N}}',
    # the key's bytes elsewhere: a field of the same name first, inside a string, a duplicate key
    b'{"content":"x","choices":[{"index":0,"delta":{"content":TEXT}}]}',
    b'{"id":"a\\"content\\":\\"b","choices":[{"index":0,"delta":{"content":TEXT}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT,"content":"y"}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":"y","content":TEXT}}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT}}],"choices":[]}',
    # not a chunk with a token at all
    b'{"id":"c","choices":[{"index":0,"delta":{"content":TEXT}}]',
    b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":TEXT}]}',
    b'{"type":"response.output_text.delta","delta":TEXT}',
]

#: A token's text as a JSON string: printable (what most tokens are), as orjson writes it, with escapes for all but
#: ASCII (Python's json), or as raw bytes between quotes (invalid UTF-8, raw control characters, quotes and backslashes
#: as they come).
texts = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=6).map(orjson.dumps),
    st.text(max_size=8).map(orjson.dumps),
    st.text(max_size=8).map(lambda text: json.dumps(text).encode()),
    st.binary(max_size=8).map(lambda raw: b'"' + raw + b'"'),
    st.sampled_from([b'"hello "', b'" the"', b'"\\n"', b'"\\""', b'"\xc3\xa9t\xc3\xa9"', b'"\\u00e9"', b'""']),
    # quotes that end the string early: an invalid chunk, or one with a key of its own
    st.sampled_from([b'"a"b"', b'"a","x":"b"', b'"a"},"x":{"y":"b"', b'"a\\\\"']),
)


def parsed(payload: bytes) -> dict[str, object] | None:
    """The event as the parser gives it (None: not a JSON object)."""
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


@settings(max_examples=500)
@given(st.sampled_from(TEMPLATES), st.lists(texts, min_size=1, max_size=12))
def test_made_chunks_are_the_parsed_ones(template, chunk_texts):
    """Fed as `UpstreamEvents.take` feeds it (a chunk it did not make is parsed, and learned from when it has a
    token), every chunk it makes is the one the parser gives, key order included, and carries a token."""
    shape = ChunkShape()
    for n, text in enumerate(chunk_texts):
        payload = template.replace(b"TEXT", text).replace(b"N", str(n).encode())
        expected = parsed(payload)
        made = shape.event(payload)
        if made is None:
            if expected is not None and has_content(expected):
                shape.learn(expected, payload)
            continue
        assert expected is not None
        assert made == expected
        assert orjson.dumps(made) == orjson.dumps(expected)
        assert has_content(made)
        _scramble(made)  # (a shape that shared an object with the events it made would now make others wrong)


def _scramble(value: object) -> None:
    """Empty every list and dict inside `value`."""
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    for child in children:
        _scramble(child)
    if isinstance(value, dict | list):
        value.clear()


def test_the_usual_chunk_is_learned_once_and_made_fresh():
    template = TEMPLATES[0]
    shape = ChunkShape()
    first = template.replace(b"TEXT", b'"hello"')
    assert shape.event(first) is None
    shape.learn(orjson.loads(first), first)
    one = shape.event(template.replace(b"TEXT", b'" w\xc3\xb6rld"'))
    two = shape.event(template.replace(b"TEXT", b'" again"'))
    assert one is not None and two is not None
    assert one["choices"][0]["delta"]["content"] == " wörld"
    # No dict or list shared between events (a flight keeps them; the usage merge rewrites one).
    assert one["choices"] is not two["choices"]
    assert one["choices"][0] is not two["choices"][0]
    assert one["choices"][0]["delta"] is not two["choices"][0]["delta"]
    # A text the shape leaves to the parser: escapes, a raw control character, none at all.
    for text in (b'"a\\nb"', b'"\\u00e9"', b'"a\tb"', b'""'):
        assert shape.event(template.replace(b"TEXT", text)) is None


@pytest.mark.parametrize("template", [TEMPLATES[6]])
def test_learning_stops_after_a_few_proofs(template):
    """Chunks that differ by more than their text (a number in each) are each parsed: learned at most
    `MAX_LEARNED` times in a stream."""
    shape = ChunkShape()
    proofs = 0
    for n in range(10):
        payload = template.replace(b"TEXT", b'"x"').replace(b"N", str(n).encode())
        assert shape.event(payload) is None
        before = shape._learned
        shape.learn(orjson.loads(payload), payload)
        proofs += shape._learned - before
    assert proofs == MAX_LEARNED
