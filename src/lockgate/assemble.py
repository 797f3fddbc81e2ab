"""Assemble streamed chunks into the non-streaming response they add up to.

Used when the gateway streams from the engine on a client's behalf: for engines that only notice a
disconnect on streams (llama.cpp keeps generating a non-streaming request after its client left), and
for one upstream generation shared by streaming and non-streaming clients. Pure and synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .wire import Endpoint


@dataclass(slots=True)
class _Choice:
    index: int
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    saw_content: bool = False
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)
    has_logprobs: bool = False
    finish_reason: str | None = None


class Assembler:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self._head:
            self._head = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for raw in chunk.get("choices") or ():
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = _Choice(index)
            if raw.get("finish_reason"):
                choice.finish_reason = raw["finish_reason"]
            logprobs = raw.get("logprobs")
            if isinstance(logprobs, dict):
                choice.has_logprobs = True
                choice.logprobs.extend(logprobs.get("content") or logprobs.get("tokens") or ())
            if self.endpoint is Endpoint.COMPLETIONS:
                text = raw.get("text")
                if text:
                    choice.content.append(text)
                continue
            delta = raw.get("delta") or {}
            if delta.get("role"):
                choice.role = delta["role"]
            if delta.get("content") is not None:
                choice.saw_content = True
                choice.content.append(delta["content"])
            if delta.get("reasoning_content"):
                choice.reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                _merge_tool_call(choice.tool_calls, call)

    def result(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self._head.get("id", ""),
            "object": self.endpoint.object_name,
            "created": self._head.get("created", 0),
            "model": self._head.get("model", ""),
            "choices": [self._choice(c) for _, c in sorted(self._choices.items())],
        }
        if "system_fingerprint" in self._head:
            body["system_fingerprint"] = self._head["system_fingerprint"]
        if self.usage is not None:
            body["usage"] = self.usage
        return body

    def _choice(self, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.content)
        if self.endpoint is Endpoint.COMPLETIONS:
            out: dict[str, Any] = {"index": choice.index, "text": text}
        else:
            message: dict[str, Any] = {
                "role": choice.role,
                "content": text if choice.saw_content or not choice.tool_calls else None,
            }
            if choice.reasoning:
                message["reasoning_content"] = "".join(choice.reasoning)
            if choice.tool_calls:
                message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
            out = {"index": choice.index, "message": message}
        out["logprobs"] = {"content": choice.logprobs} if choice.has_logprobs else None
        out["finish_reason"] = choice.finish_reason
        return out


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", len(calls))
    call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] += function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]
