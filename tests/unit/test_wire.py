import dataclasses

import orjson
import pytest

from lockgate.dedup.coalescer import upstream_request
from lockgate.errors import InvalidRequest
from lockgate.wire import Endpoint, parse_request


def chat(**extra) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return orjson.dumps(body)


def test_tools_tool_choice_and_response_format_in_their_forms_pass():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra in (
        {"tools": [tool], "tool_choice": "required"},
        {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"tools": None, "tool_choice": None, "response_format": None},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"response_format": {"type": "structural_tag"}},  # (an engine's own type: the engine's to accept)
    ):
        assert parse_request(Endpoint.CHAT, chat(**extra)).body["model"] == "m"
    responses = orjson.dumps({"model": "m", "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "auto"})
    assert parse_request(Endpoint.RESPONSES, responses).endpoint is Endpoint.RESPONSES
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}  # (the Responses API's shape)
    responses = orjson.dumps({"model": "m", "input": "hi", "tools": [function]})
    assert parse_request(Endpoint.RESPONSES, responses).endpoint is Endpoint.RESPONSES


def test_valid_chat_passes_unknown_fields_through():
    req = parse_request(Endpoint.CHAT, chat(stream=True, stream_options={"include_usage": True}, foo=1))
    assert req.stream and req.include_usage
    assert req.body["foo"] == 1


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (chat(model=3), "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user"}]}', "messages[0].content"),
        (chat(temperature=3), "temperature"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(stop=[1]), "stop"),
        (chat(n=0), "n"),
        (chat(top_p=1.5), "top_p"),
        (b'{"model": "m", "messages": [{"role": ["user"], "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": {}, "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": {}}]}', "messages[0].content"),
        (chat(top_k=1e20), "top_k"),
        (chat(top_k=-2), "top_k"),
        (chat(seed=1.5), "seed"),
        # (llama.cpp answered a malformed `tools` 500: retried, and its instances ejected for a client's mistake.)
        (chat(tools="nope"), "tools"),
        (chat(tools=[{"function": {"name": "f"}}]), "tools[0]"),
        (chat(tools=[{"type": "function", "function": "f"}]), "tools[0].function"),
        (chat(tools=[{"type": "function"}]), "tools[0]"),  # (no function, no name: it passed, an outside run)
        (chat(tool_choice="sometimes"), "tool_choice"),
        (chat(tool_choice={"function": {"name": "f"}}), "tool_choice"),
        (chat(response_format="json"), "response_format"),
        (chat(response_format={"type": 1}), "response_format"),
    ],
)
def test_chat_errors_name_the_field(raw, param):
    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.CHAT, raw)
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("prompt", "generations"), [("text", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2), (["a"] * 5, 5)]
)
def test_completion_prompt_forms(prompt, generations):
    """Each form is valid; a batch (strings or token-id lists) is one generation a prompt, each `n` choices (what
    admission reserves `max_tokens` for)."""
    import orjson

    req = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    assert req.prompt_text()
    assert req.sequences() == generations
    assert parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt, "n": 3})).sequences() == (
        3 * generations
    )


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], {"x": 1}, [True], [[]], [[1], []], [[True]], [[1, 2.5]]])
def test_completion_bad_prompt(prompt):
    import orjson

    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    assert info.value.param == "prompt"


@pytest.mark.parametrize("prompt", [[-1, 5], [[3], [-2]]])
def test_completion_token_ids_are_from_zero(prompt):
    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    assert info.value.param == "prompt"


def test_one_array_of_token_ids_is_one_embedding_input_however_long():
    """The 2,048-item bound counts inputs: one array of 2,900 token ids is one input (it was refused, while the same
    ids wrapped in an outer array passed)."""
    for text in ([7] * 2900, [[7] * 2900], ["x"] * 2048, [[1, 2]] * 2048):
        assert parse_request(Endpoint.EMBEDDINGS, orjson.dumps({"model": "m", "input": text})).max_tokens == 0
    for text, param in (
        ([[7]] * 2049, "input"),
        (["x"] * 2049, "input"),
        ([-1, 5], "input"),
        ([[1], [-1]], "input[1]"),
    ):
        with pytest.raises(InvalidRequest) as info:
            parse_request(Endpoint.EMBEDDINGS, orjson.dumps({"model": "m", "input": text}))
        assert info.value.param == param, text


def test_assistant_tool_call_without_content_is_valid():
    import orjson

    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        ],
    }
    assert parse_request(Endpoint.CHAT, orjson.dumps(body)).model == "m"


def test_nesting_deeper_than_the_limit_names_the_top_level_field():
    import orjson

    from lockgate.wire import MAX_DEPTH

    def body(levels: int, where: str) -> bytes:
        # `levels` is the depth of the whole body: the object itself is level 1.
        value = b"[" * (levels - 1) + b"]" * (levels - 1)
        return chat()[:-1] + b',"%s":%s}' % (where.encode(), value)

    assert parse_request(Endpoint.CHAT, body(MAX_DEPTH, "x")).body["x"]
    for where in ("x", "tools"):
        with pytest.raises(InvalidRequest) as info:
            parse_request(Endpoint.CHAT, body(MAX_DEPTH + 1, where))
        assert info.value.param == where
    # Objects count as arrays do; brackets inside strings do not count.
    objects = chat()[:-1] + b',"x":' + b'{"a":' * (MAX_DEPTH - 1) + b"1" + b"}" * (MAX_DEPTH - 1) + b"}"
    assert parse_request(Endpoint.CHAT, objects).body["x"]
    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.CHAT, objects[:-1] + b',"y":' + b'{"a":' * MAX_DEPTH + b"1" + b"}" * MAX_DEPTH + b"}")
    assert info.value.param == "y"
    wide = {"model": "m", "messages": [{"role": "user", "content": "[{" * 500}] * 300}
    assert parse_request(Endpoint.CHAT, orjson.dumps(wide)).model == "m"
    deep_in_messages = b'{"model":"m","messages":[{"role":"user","content":"x","y":%s}]}' % (
        b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    )
    with pytest.raises(InvalidRequest) as info:
        parse_request(Endpoint.CHAT, deep_in_messages)
    assert info.value.param == "messages"


def test_a_flights_engine_request_streams_with_usage_and_keeps_the_prompt_computed():
    api = parse_request(Endpoint.CHAT, chat(max_tokens=7, temperature=0))
    api = dataclasses.replace(api, trace_headers=(("traceparent", "x"),))
    tokens = api.estimated_prompt_tokens()
    streamed = upstream_request(api, stream=True)
    assert streamed.stream and streamed.include_usage
    assert streamed.body == {**api.body, "stream": True}
    assert (streamed.model, streamed.max_tokens, streamed.trace_headers) == ("m", 7, (("traceparent", "x"),))
    assert streamed._prompt == api.prompt_text() and streamed._prompt_tokens == tokens
    assert api.body.get("stream") is None and not api.stream  # the client's request is left as it was
    assert upstream_request(api, stream=False) is api


def test_a_responses_prompt_is_its_instructions_and_items():
    body = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ],
        "max_output_tokens": 7,
    }
    import orjson

    api = parse_request(Endpoint.RESPONSES, orjson.dumps(body))
    assert (api.max_tokens, api.stream, api.include_usage) == (7, False, False)
    assert api.prompt_text() == 'be brief\nuser\nhello\n{"x": 1}\n42'
    assert not api.endpoint.chunked and api.endpoint.generates
    text = parse_request(Endpoint.RESPONSES, orjson.dumps({"model": "m", "input": "hi", "stream": True}))
    assert (text.prompt_text(), text.stream) == ("hi", True)
