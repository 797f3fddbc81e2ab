from typing import Any

from lockgate.assemble import ClientView, assemble
from lockgate.wire import Endpoint


def test_chat_chunks_add_up_to_a_message():
    events: list[dict[str, Any]] = [
        {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    body = assemble(Endpoint.CHAT, events, model="m")
    assert body["object"] == "chat.completion" and body["id"] == "c1" and body["created"] == 5
    assert body["model"] == "m"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["completion_tokens"] == 2


def test_tool_call_deltas_merge_by_index():
    first = {"index": 0, "id": "t1", "type": "function", "function": {"name": "get", "arguments": '{"a"'}}
    events = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    message = assemble(Endpoint.CHAT, events, model="m")["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    ]


def test_completions_and_several_choices():
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
    ]
    body = assemble(Endpoint.COMPLETIONS, events, model="m")
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["aa", "b"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_usage_counts_every_choices_tokens():
    """llama.cpp reports one choice's completion tokens for `n` > 1: the whole answer counts every choice's chunks
    (each at least a token), as OpenAI does; an engine's count above that stays as it is."""
    chunks = [{"choices": [{"index": i, "delta": {"content": "x"}}]} for _ in range(3) for i in (0, 1)]
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    body = assemble(Endpoint.CHAT, [*chunks, {"choices": [], "usage": usage}], model="m")
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    more = {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}  # several tokens a chunk
    assert assemble(Endpoint.CHAT, [*chunks, {"choices": [], "usage": more}], model="m")["usage"] == more
    assert assemble(Endpoint.CHAT, chunks, model="m")["usage"] is None  # none reported: none made up


def test_usage_on_a_finish_chunk_becomes_its_own_final_chunk():
    """llama.cpp puts a text completion's usage on its finish chunk; clients expect a separate chunk."""
    view = ClientView(model="m", include_usage=True)
    out = view.event(
        {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    )
    assert out is not None
    assert out["usage"] is None
    assert view.final() == {"id": "x", "model": "m", "choices": [], "usage": {"completion_tokens": 1}}


def test_the_final_usage_counts_every_choices_tokens() -> None:
    """llama.cpp reports one choice's tokens for `n` > 1: a streamed client's usage said 2 for two 2-token choices
    (4 sent), where the same request answered whole said 4 (`assemble`)."""
    view = ClientView(model="m", include_usage=True)
    view.event({"id": "x", "choices": [{"index": 0, "text": "a"}]})
    view.event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    final = view.final(pieces=4)
    assert final is not None and final["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert view.final(pieces=1) == {**final, "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_client_view_passes_an_event_that_needs_no_change_through_as_is() -> None:
    """The direct path then writes the engine's own bytes (pass-through): only when the event is exactly what
    the client would get (its model name, no response id imposed, `usage` as the client asked)."""
    chunk: dict[str, Any] = {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    assert ClientView(model="m", include_usage=False).event(chunk) is chunk
    renamed = ClientView(model="client-name", include_usage=False).event(chunk)
    assert renamed is not chunk and renamed is not None and renamed["model"] == "client-name"
    assert chunk["model"] == "m"  # the engine's event is never changed in place
    fresh_id = ClientView(model="m", include_usage=False, response_id="r").event(chunk)
    assert fresh_id is not chunk and fresh_id is not None and fresh_id["id"] == "r"
    asked = ClientView(model="m", include_usage=True).event(chunk)
    assert asked is not chunk and asked is not None and asked["usage"] is None
    with_null = {**chunk, "usage": None}
    assert ClientView(model="m", include_usage=True).event(with_null) is with_null
    not_asked = ClientView(model="m", include_usage=False).event(with_null)
    assert not_asked is not with_null and not_asked is not None and "usage" not in not_asked


def test_a_spliced_chunk_is_what_the_view_gives_and_leaves_the_view_the_same():
    """`ClientView.spliced` (the engine's bytes with only the trailing usage key changed) gives, wherever it
    answers, the payload `event()` gives, and leaves the view as `event()` would (its closing usage chunk
    included); it answers for the usual cases: a chunk without usage for a client that asked for it, and a null
    usage at the end for one that did not."""
    import orjson
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=8), st.sampled_from(['"', '"usage":null}', ',"usage":null', "m"]))
    choice = st.fixed_dictionaries({"index": st.just(0), "delta": st.fixed_dictionaries({"content": text})})
    event_strategy = st.fixed_dictionaries(
        {"id": text, "model": st.sampled_from(["m", "other"]), "choices": st.lists(choice, max_size=2)},
        optional={"usage": st.one_of(st.none(), st.just({"completion_tokens": 1})), "created": st.integers(0, 9)},
    )

    @settings(max_examples=1500, deadline=None)
    @given(event_strategy, st.booleans(), st.sampled_from([None, "own"]))
    def check(event: dict[str, Any], include_usage: bool, response_id: str | None) -> None:
        raw = orjson.dumps(event)
        spliced_view = ClientView(model="m", include_usage=include_usage, response_id=response_id)
        plain_view = ClientView(model="m", include_usage=include_usage, response_id=response_id)
        spliced = spliced_view.spliced(event, raw)
        if spliced is None:
            return
        out = plain_view.event(event)
        assert out is not None and orjson.loads(spliced) == out and spliced == orjson.dumps(out)
        final = {"completion_tokens": 3}
        spliced_view.usage = plain_view.usage = final
        assert spliced_view.final() == plain_view.final()

    check()
    view = ClientView(model="m", include_usage=True)
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert view.spliced(chunk, orjson.dumps(chunk)) == orjson.dumps({**chunk, "usage": None})
    view = ClientView(model="m", include_usage=False)
    assert view.spliced({**chunk, "usage": None}, orjson.dumps({**chunk, "usage": None})) == orjson.dumps(chunk)


def test_a_chat_answer_without_text_has_empty_content() -> None:
    """llama.cpp, streamed, holds back an incomplete UTF-8 character at the end: a one-token answer can come with no
    text. Its content was null, which a client that appends the message to its history then sent back and was
    refused ("content is required"); OpenAI's content is null only beside tool calls or a refusal."""
    role = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    end = {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    body = assemble(Endpoint.CHAT, [role, end], model="m")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ""}
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = {"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    assert assemble(Endpoint.CHAT, [role, tool], model="m")["choices"][0]["message"]["content"] is None


def _chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {"id": "x", "model": "up", "choices": [{"index": 0, "delta": delta, **choice}]}


def test_a_null_logprobs_list_before_the_first_tokens_is_joined_not_a_crash() -> None:
    """An outside run: an engine's role chunk with `logprobs: {"content": null}`, then lists, made every whole answer
    assembled from the stream a 500 (and a cached one: the hits within its lifetime too)."""
    token = {"token": "a", "logprob": -0.1, "top_logprobs": []}
    events = [
        _chunk({"role": "assistant", "content": ""}, logprobs={"content": None, "refusal": None}),
        _chunk({"content": "a"}, logprobs={"content": [token]}),
        _chunk({"content": "a"}, logprobs={"content": [token]}, finish_reason="stop"),
    ]
    choice = assemble(Endpoint.CHAT, events, model="m")["choices"][0]
    assert choice["logprobs"] == {"content": [token, token], "refusal": None}


def test_fields_the_gateway_does_not_know_are_kept_as_the_engine_sent_them() -> None:
    """vLLM streams a reasoning model's thinking as `reasoning` (`reasoning_content` before), a choice's `stop_reason`,
    llama.cpp its `timings`; OpenAI `service_tier`, messages' `annotations`. An assembled answer dropped them all."""
    events = [
        {**_chunk({"role": "assistant", "reasoning": "Let me"}), "service_tier": "default"},
        _chunk({"reasoning": " think."}),
        _chunk({"content": "4", "annotations": [{"type": "url_citation"}]}),
        {**_chunk({}, finish_reason="stop", stop_reason=None), "timings": {"predicted_n": 2}},
        {**_chunk({}, stop_reason=128001)},
        {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
    ]
    body = assemble(Endpoint.CHAT, events, model="m")
    assert body["service_tier"] == "default" and body["timings"] == {"predicted_n": 2}
    choice = body["choices"][0]
    assert choice["stop_reason"] == 128001 and choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["reasoning"] == "Let me think." and message["content"] == "4"
    assert message["annotations"] == [{"type": "url_citation"}]


def test_content_beside_tool_calls_is_null_even_after_an_empty_role_chunk() -> None:
    """vLLM opens a tool call's stream with `content: ""`: the whole answer said "" where the engine says null."""
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = [_chunk({"role": "assistant", "content": ""}), _chunk({"tool_calls": [call]}, finish_reason="tool_calls")]
    assert assemble(Endpoint.CHAT, events, model="m")["choices"][0]["message"]["content"] is None


def test_a_stream_without_usage_is_answered_whole_with_the_gateways_estimate() -> None:
    """An engine that puts no usage in its streams: the non-streaming clients of a shared call were told `usage: null`
    and recorded 0 tokens (the leader's record had the estimate)."""
    events = [_chunk({"role": "assistant", "content": "a"}), _chunk({"content": "b"}, finish_reason="stop")]
    assert assemble(Endpoint.CHAT, events, model="m")["usage"] is None  # nothing to go by
    usage = assemble(Endpoint.CHAT, events, model="m", prompt_tokens=6)["usage"]
    assert usage == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}


def test_the_closing_usage_chunk_keeps_the_chunks_own_fields() -> None:
    view = ClientView(model="m", include_usage=True)
    view.event({**_chunk({"content": "a"}), "service_tier": "flex", "system_fingerprint": "fp"})
    view.event({"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    final = view.final(1)
    assert final is not None and final["service_tier"] == "flex" and final["system_fingerprint"] == "fp"


def test_a_streamed_client_that_asked_for_usage_gets_the_estimate_from_an_engine_that_reports_none() -> None:
    """The streamed counterpart of the whole answer's estimate: the client asked for usage and got no usage chunk."""
    view = ClientView(model="m", include_usage=True, prompt_tokens=6)
    view.event(_chunk({"role": "assistant", "content": "a"}))
    view.event(_chunk({"content": "b"}, finish_reason="stop"))
    final = view.final(2)
    assert final is not None and final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    assert ClientView(model="m", include_usage=True).final(2) is None  # nothing seen, nothing said


def test_a_legacy_function_call_is_joined_piece_by_piece() -> None:
    """The regression run: the first version kept a streamed `function_call` as its last piece (name lost, only the
    last argument fragment) and counted no completion tokens."""
    events = [
        _chunk({"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": ""}}),
        _chunk({"function_call": {"arguments": '{"city": '}}),
        _chunk({"function_call": {"arguments": '"Paris"}'}}, finish_reason="function_call"),
        {**_chunk({"type": "text"}), "service_tier": "default"},  # a repeated non-text field is not joined
    ]
    body = assemble(Endpoint.CHAT, events, model="m", prompt_tokens=5)
    message = body["choices"][0]["message"]
    assert message["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert message["content"] is None and message["type"] == "text"
    assert body["usage"]["completion_tokens"] == 3


def test_a_token_count_no_engine_reports_is_read_as_unknown() -> None:
    """Counts an engine sends are taken as counts only in [0, 2**53]: 2**64 prompt tokens (which no record can
    store) or a negative one are an engine's bug, read as 0 (not reported)."""
    from lockgate.assemble import count_of

    assert [count_of(v) for v in (5, 0, 2**53, 2**53 + 1, 2**64, -1, True, 3.0, "7", None)] == [5, 0, 2**53] + [0] * 7


def test_usage_reported_per_choice_is_merged_as_openai_counts_it() -> None:
    """llama.cpp reports a completion's usage on each choice's finish chunk and a chat's on a usage-only chunk per
    choice, each for that choice alone; the last one read was taken as the answer's (an outside run: a completion
    of two prompts reported one prompt's tokens). Merged: every choice's completion tokens, each prompt's once."""
    from lockgate.assemble import ChoiceUsages

    def finish(index: int, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
        usage.update(total_tokens=prompt + completion, prompt_tokens_details={"cached_tokens": cached})
        return {"choices": [{"index": index, "text": "", "finish_reason": "length"}], "usage": usage}

    # Two prompts of 2 and 4 tokens, n=2: choices 0 and 1 are the first prompt's, 2 and 3 the second's.
    usages = ChoiceUsages(2)
    events = [finish(1, 2, 3, 1), finish(3, 4, 3, 3), finish(2, 4, 3, 3), finish(0, 2, 3, 1)]
    for event in events:
        usages.merge(event)
    assert events[0]["usage"]["prompt_tokens"] == 2  # one choice so far: as the engine said
    last = events[-1]["usage"]
    assert (last["prompt_tokens"], last["completion_tokens"], last["total_tokens"]) == (6, 12, 18)
    assert last["prompt_tokens_details"] == {"cached_tokens": 4}
    # A chat's usage-only chunks name no choice: one prompt, each chunk a choice's.
    chat = ChoiceUsages(2)
    chunks = [{"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 3}} for _ in range(2)]
    for chunk in chunks:
        chat.merge(chunk)
    assert chunks[-1]["usage"] == {"prompt_tokens": 31, "completion_tokens": 6, "total_tokens": 37}
    plain = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    chat.merge(plain)
    assert "usage" not in plain
