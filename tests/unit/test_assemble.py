from lockgate.assemble import Assembler
from lockgate.wire import Endpoint


def test_chat_chunks_add_up_to_a_message():
    a = Assembler(Endpoint.CHAT)
    a.feed({"id": "c1", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    a.feed({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    a.feed({"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]})
    a.feed({"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    body = a.result()
    assert body["object"] == "chat.completion" and body["id"] == "c1" and body["created"] == 5
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["completion_tokens"] == 2


def test_tool_call_deltas_merge_by_index():
    a = Assembler(Endpoint.CHAT)
    a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "t1",
                                "type": "function",
                                "function": {"name": "get", "arguments": '{"a"'},
                            }
                        ]
                    },
                }
            ]
        }
    )
    a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    message = a.result()["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    ]


def test_completions_and_several_choices():
    a = Assembler(Endpoint.COMPLETIONS)
    a.feed({"choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]})
    a.feed({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}], "usage": {"completion_tokens": 3}})
    body = a.result()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["aa", "b"]
    assert body["choices"][0]["finish_reason"] == "length"
