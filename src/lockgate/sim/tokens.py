"""A deterministic toy tokenizer and chat template.

A token is a run of non-whitespace characters together with the whitespace in front of it, so
``"".join(tokenize(text)) == text.rstrip()``. This is enough to make prompt lengths, prefix caching and
continuation behave like a real engine without shipping a vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_TOKEN_RE = re.compile(r"\s*\S+")


class TemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or incompatible template flags)."""


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def detokenize(tokens: Iterable[str]) -> str:
    return "".join(tokens)


#: Text parts: chat's, and a response's input and output text (the Responses API).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, ``None``, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise TemplateError("text part must have a string 'text'")
                texts.append(text)
            else:
                raise TemplateError("only text content parts are supported")
        return "\n".join(texts)
    raise TemplateError("message content must be a string or a list of parts")


def render_chat(
    messages: Iterable[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render ``messages`` as ``<|role|>\\ncontent\\n`` blocks.

    With ``add_generation_prompt`` an open ``<|assistant|>\\n`` block is appended. With
    ``continue_final_message`` the final message (which must be the assistant's) is left open, so that
    generation continues it: rendering ``messages + [assistant: partial]`` this way yields exactly the
    original prompt followed by ``partial``. As in vLLM, the two flags cannot both be true.
    """
    if add_generation_prompt and continue_final_message:
        raise TemplateError("continue_final_message and add_generation_prompt cannot both be true")
    msgs = list(messages)
    if continue_final_message and (not msgs or msgs[-1].get("role") != "assistant"):
        raise TemplateError("continue_final_message requires the final message to be the assistant's")
    parts: list[str] = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, Mapping):
            raise TemplateError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise TemplateError("each message needs a string 'role'")
        text = content_text(msg.get("content"))
        if continue_final_message and i == len(msgs) - 1:
            parts.append(f"<|{role}|>\n{text}")
        else:
            parts.append(f"<|{role}|>\n{text}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
