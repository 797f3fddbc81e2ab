from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.sim.generator import VOCAB, StopMatcher, TokenStream, generate
from lockgate.sim.tokens import TemplateError, render_chat, tokenize

texts = st.text(alphabet="ab .\n\t\u00e9", max_size=40)


@given(texts)
def test_tokenize_round_trips_text_minus_trailing_whitespace(text: str) -> None:
    toks = tokenize(text)
    assert "".join(toks) == text.rstrip()
    assert all(t.strip() for t in toks)


def test_render_chat_template_and_parts() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    assert render_chat(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\nthere\n<|assistant|>\n"
    assert render_chat(msgs, add_generation_prompt=False).endswith("there\n")
    cont = render_chat([*msgs, {"role": "assistant", "content": " abc"}], False, continue_final_message=True)
    assert cont == render_chat(msgs) + " abc"
    with pytest.raises(TemplateError):
        render_chat([*msgs, {"role": "assistant", "content": "x"}], True, continue_final_message=True)
    with pytest.raises(TemplateError):
        render_chat(msgs, False, continue_final_message=True)  # last message is not the assistant's
    with pytest.raises(TemplateError):
        render_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def _run(prompt: str, seed: int, n: int, stop: tuple[str, ...] = ()) -> list[str]:
    s = TokenStream(tokenize(prompt), seed, n, stop)
    out = []
    while not s.finished:
        out.append(s.next().token)
    return out


def test_deterministic_and_seed_dependent() -> None:
    a = _run("hello there world", 7, 30)
    assert a == _run("hello there world", 7, 30)
    assert a != _run("hello there world", 8, 30)
    assert len(a) == 30 and all(t in VOCAB for t in a)
    assert generate(tokenize("hello there world"), 7, 30).text == "".join(a)


@settings(max_examples=150, deadline=None)
@given(prompt=texts, seed=st.integers(0, 2**63), n=st.integers(1, 40), data=st.data())
def test_continuation_property(prompt: str, seed: int, n: int, data: st.DataObject) -> None:
    """N tokens from P == k tokens from P, then N-k tokens from P + first k (what preemption relies on)."""
    full = _run(prompt, seed, n)
    k = data.draw(st.integers(0, n - 1))
    head = full[:k]
    tail = _run(prompt + "".join(head), seed, n - k)
    assert head + tail == full


def test_chat_continuation_property() -> None:
    msgs = [{"role": "user", "content": "tell me a story"}]
    full = _run(render_chat(msgs), 3, 20)
    partial = "".join(full[:8])
    cont = render_chat([*msgs, {"role": "assistant", "content": partial}], False, True)
    assert full[:8] + _run(cont, 3, 12) == full
    # the prompt length grows by exactly the generated tokens
    assert len(tokenize(cont)) == len(tokenize(render_chat(msgs))) + 8


def test_stop_strings_truncate_and_hold_back() -> None:
    full = "".join(_run("p q r", 1, 40))
    words = tokenize(full)
    stop = words[5] + words[6]  # spans two tokens
    comp = generate(tokenize("p q r"), 1, 40, (stop,))
    assert comp.finish_reason == "stop"
    assert comp.text == full[: full.index(stop)]
    # streamed deltas concatenate to the same text, never containing a piece of the stop string early
    assert "".join(t.delta for t in comp.tokens) == comp.text
    assert generate(tokenize("p q r"), 1, 5, ("not-there",)).finish_reason == "length"


@given(st.lists(st.sampled_from(["ab", "a", "b", " ", "ba"]), max_size=12), st.sampled_from(["ab", "bab", "a b"]))
def test_stop_matcher_against_reference(pieces: list[str], stop: str) -> None:
    m = StopMatcher([stop])
    text, out, stopped = "", "", False
    for p in pieces:
        text += p
        delta, stopped = m.feed(text)
        out += delta
        if stopped:
            break
    if not stopped:
        out += m.flush(text)
    if stop in text:
        assert stopped and out == text[: text.index(stop)]
    else:
        assert not stopped and out == text
