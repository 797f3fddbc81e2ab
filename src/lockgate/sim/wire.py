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
    kind: str  # "chat", "completion" or "responses"
    model: str
    prompt_tokens: list[str]
    stream: bool
    include_usage: bool
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    temperature: float
    priority: int
    #: A response's request body (the Responses API), for the store (`sim/stored.py`); None otherwise.
    body: dict[str, Any] | None = None
    #: The client set no token limit: the answer ends at the simulator's own length as at an end-of-sequence token
    #: (`finish_reason: stop`, a response `completed`), not `length` (a response `incomplete`, which the openai
    #: SDK's stream helper takes for a failure).
    natural_end: bool = False
    #: vLLM's `cache_salt`: the request shares prefix-cache blocks only with requests of the same salt.
    cache_salt: str | None = None


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
    # What vLLM would answer and the simulator cannot: said, not ignored (an outside run took a 200 without them).
    if body.get("suffix") is not None:
        raise WireError(400, "suffix is not currently supported", param="suffix")  # (vLLM's own words)
    for field in ("echo", "logprobs", "top_logprobs"):
        if body.get(field) not in (None, False):
            raise WireError(400, f"the simulator does not support '{field}'", param=field)
    # It never calls a tool: `tools` with `tool_choice` "auto" (or none) may be answered in text, as a model may; a
    # choice that demands a call cannot be honoured (an outside run got text for `"required"`).
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        msg = "the simulator does not call tools: 'tool_choice' may only be 'auto' or 'none'"
        raise WireError(400, msg, param="tool_choice")
    messages: Any
    if kind == "responses":
        messages = _response_messages(body)
        if _get(body, "stream_options", dict, None) is not None:
            raise WireError(400, "'stream_options' is not a field of a response request", param="stream_options")
    else:
        messages = body.get("messages")
    if kind != "completion":
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
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
            text = " ".join(str(t) for t in prompt)  # token ids: one token each
        elif isinstance(prompt, str):
            text = prompt
        else:
            msg = "'prompt' must be a string or an array of token ids (batched prompts are not supported)"
            raise WireError(400, msg, param="prompt")
    prompt_tokens = tokenize(text)
    if not prompt_tokens:
        raise WireError(400, "the prompt is empty", param="prompt" if kind != "chat" else "messages")
    max_tokens = _get(body, "max_output_tokens" if kind == "responses" else "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    natural_end = max_tokens is None
    if max_tokens is None:
        max_tokens = config.default_max_tokens
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
        body=body if kind == "responses" else None,
        natural_end=natural_end,
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise WireError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return salt


def _response_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A response request's `instructions` and `input` as chat messages (the chat template renders them): a string
    is the user's message; message items keep their role; a tool's output is a `tool` message; other items (a
    function call, reasoning) say nothing to the template."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise WireError(400, "'input' must be a string or a non-empty list", param="input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if not isinstance(item, dict):
            raise WireError(400, "each input item must be an object", param="input")
        if "role" in item:
            messages.append(item)
        elif item.get("type") == "function_call_output":
            messages.append({"role": "tool", "content": str(item.get("output", ""))})
    if not messages:
        raise WireError(400, "'input' has no message", param="input")
    return messages


def new_response_id(kind: str) -> str:
    if kind == "responses":
        return "resp_" + secrets.token_hex(12)
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
    if req.kind == "responses":
        return orjson.dumps(response_object(req.model, resp_id, created, text, finish_reason, usage_, previous_of(req)))
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


def response_object(
    model: str,
    resp_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    usage_: dict[str, Any] | None,
    previous: str | None = None,
) -> dict[str, Any]:
    """A response (the Responses API), `in_progress` until `finish_reason` says how it ended (`length`: incomplete at
    `max_output_tokens`); `text` None: no output yet. `usage_` in the chat form, converted. `previous`: the response it
    follows up (echoed, as OpenAI and vLLM do)."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    output = [] if text is None else [_message_item(resp_id, text, "completed")]
    obj: dict[str, Any] = {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "previous_response_id": previous,
        "usage": None,
    }
    if usage_ is not None:
        obj["usage"] = {
            "input_tokens": usage_["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage_["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage_["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage_["total_tokens"],
        }
    return obj


def previous_of(req: GenRequest) -> str | None:
    """The response a response request follows up, if any."""
    previous = req.body.get("previous_response_id") if req.body is not None else None
    return previous if isinstance(previous, str) else None


def _item_id(resp_id: str) -> str:
    """The id of a response's one message item (`resp_X` -> `msg_X`)."""
    return "msg_" + resp_id[5:]


def _message_item(resp_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": _item_id(resp_id), "status": status, "role": "assistant", "content": content}


class ResponseEventWriter:
    """Renders a response's SSE events (the Responses API), with `ChunkWriter`'s interface: `role()` opens the
    response and its message, `token()` is one `response.output_text.delta`, `end()` closes the text, the item and
    the response (`response.completed`, or `response.incomplete` at `max_output_tokens`) with the usage."""

    __slots__ = ("_finish", "_id", "_item_id", "_model", "_previous", "_seq", "_text", "created")

    @property
    def text(self) -> str:
        """The output so far."""
        return "".join(self._text)

    def __init__(self, req: GenRequest, resp_id: str) -> None:
        self._id = resp_id
        self._item_id = _item_id(resp_id)
        self._model = req.model
        self._previous = previous_of(req)
        self.created = int(time.time())
        self._seq = 0
        self._text: list[str] = []
        self._finish = "stop"

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def role(self) -> bytes:
        opened = response_object(self._model, self._id, self.created, None, None, None, self._previous)
        return b"".join(
            (
                self._event("response.created", response=opened),
                self._event("response.in_progress", response=opened),
                self._event(
                    "response.output_item.added", output_index=0, item=_message_item(self._id, "", "in_progress")
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self._item_id,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            )
        )

    def token(self, text: str, finish_reason: str | None) -> bytes:
        if finish_reason is not None:
            self._finish = finish_reason
        if not text:
            return b""
        self._text.append(text)
        return self._event(
            "response.output_text.delta", item_id=self._item_id, output_index=0, content_index=0, delta=text
        )

    def end(self, usage_: dict[str, Any], include_usage: bool = True) -> bytes:
        """(A response always carries its usage: `include_usage` is the chat writer's.)"""
        text = "".join(self._text)
        whole = response_object(self._model, self._id, self.created, text, self._finish, usage_, self._previous)
        part = {"type": "output_text", "text": text, "annotations": []}
        return b"".join(
            (
                self._event(
                    "response.output_text.done", item_id=self._item_id, output_index=0, content_index=0, text=text
                ),
                self._event(
                    "response.content_part.done", item_id=self._item_id, output_index=0, content_index=0, part=part
                ),
                self._event("response.output_item.done", output_index=0, item=whole["output"][0]),
                self._event("response." + whole["status"], response=whole),
            )
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

    def end(self, usage_: dict[str, Any], include_usage: bool) -> bytes:
        """The stream's end: the usage chunk if the client asked for it, then `[DONE]`."""
        return (self.usage(usage_) if include_usage else b"") + self.done()


def writer_for(req: GenRequest, resp_id: str) -> ChunkWriter | ResponseEventWriter:
    return ResponseEventWriter(req, resp_id) if req.kind == "responses" else ChunkWriter(req, resp_id)
