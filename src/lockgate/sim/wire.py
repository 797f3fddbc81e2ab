"""The OpenAI wire format at the edge: request bodies in, response bodies and SSE chunks out.

Parsing is hand-written over plain dicts (no pydantic) because the ``--fast`` mode must cost as little CPU
per request as possible. Unknown fields are ignored, as vLLM does by default.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from .config import SimConfig
from .tokens import TemplateError, render_chat, tokenize


class WireError(Exception):
    """A request the sim refuses; rendered as an OpenAI error envelope with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.type, self.param)


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}})


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompt_tokens: list[str]
    stream: bool
    include_usage: bool
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    temperature: float
    priority: int


def _get(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise WireError(400, f"'{name}' has the wrong type", param=name)
    if not isinstance(v, types):
        raise WireError(400, f"'{name}' has the wrong type", param=name)
    return v


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise WireError(400, f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    return body


def parse_request(kind: str, body: dict[str, Any], config: SimConfig) -> GenRequest:
    model = body.get("model")
    if not isinstance(model, str):
        raise WireError(400, "'model' is required", param="model")
    if model not in config.models:
        raise WireError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    n = _get(body, "n", int, 1)
    if n != 1:
        raise WireError(400, "the simulator supports only n=1", param="n")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise WireError(400, "'messages' must be a non-empty list", param="messages")
        try:
            text = render_chat(
                messages,
                add_generation_prompt=bool(_get(body, "add_generation_prompt", bool, True)),
                continue_final_message=bool(_get(body, "continue_final_message", bool, False)),
            )
        except TemplateError as e:
            raise WireError(400, str(e), param="messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            msg = "'prompt' must be a string (batched or token prompts are not supported)"
            raise WireError(400, msg, param="prompt")
        text = prompt
    prompt_tokens = tokenize(text)
    if not prompt_tokens:
        raise WireError(400, "the prompt is empty", param="prompt" if kind != "chat" else "messages")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, config.default_max_tokens)
    if max_tokens < 1:
        raise WireError(400, "max_tokens must be at least 1", param="max_tokens")
    if len(prompt_tokens) + max_tokens > config.max_model_len:
        raise WireError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
            f"{len(prompt_tokens) + max_tokens} tokens ({len(prompt_tokens)} in the messages, "
            f"{max_tokens} in the completion).",
        )
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise WireError(400, "'stop' must be a string or a list of strings", param="stop")
    stream_options = body.get("stream_options") or {}
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
    return GenRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=include_usage,
        max_tokens=max_tokens,
        stop=stops,
        seed=_get(body, "seed", int, None),
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        priority=_get(body, "priority", int, 0),
    )


def new_response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    req: GenRequest, resp_id: str, created: int, text: str, finish_reason: str, usage_: dict[str, Any]
) -> bytes:
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return orjson.dumps(
        {"id": resp_id, "object": obj, "created": created, "model": req.model, "choices": [choice], "usage": usage_}
    )


class ChunkWriter:
    """Renders SSE chunks for one streaming response."""

    __slots__ = ("_head", "_kind", "_model")

    def __init__(self, req: GenRequest, resp_id: str) -> None:
        self._kind = req.kind
        self._model = req.model
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        self._head = {"id": resp_id, "object": obj, "created": int(time.time()), "model": req.model}

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": choices, **extra}) + b"\n\n"

    def role(self) -> bytes:
        """The first chat chunk, announcing the assistant role (completions send nothing)."""
        if self._kind != "chat":
            return b""
        return self._event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def token(self, text: str, finish_reason: str | None) -> bytes:
        if self._kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return self._event([choice])

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return self._event([], usage=usage_)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
