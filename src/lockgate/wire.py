"""The OpenAI wire format at the edge: parse and validate request bodies.

Validation is hand-written over the parsed dict rather than a full schema model: it checks the fields
the gateway relies on or that would make an engine fail, names the offending field in the error, and
passes every other field through untouched (engines have many extensions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any

import orjson

from .errors import InvalidRequest

#: How deep a request body may nest (the body object is level 1): what the gateway can pass on. orjson parses
#: 1024 levels but serialises only 254, and the gateway re-serialises every body, to the engine and inside
#: the wrappers of fingerprints and semantic scopes (at most 2 levels more). Real requests (tool and
#: structured-output schemas) nest a few dozen levels.
MAX_DEPTH = 252

_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})
#: The roles of a response's input messages.
_INPUT_ROLES = frozenset({"system", "user", "assistant", "developer"})


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    #: The Responses API: typed stream events (`response.output_text.delta`, ..., `response.completed` with the
    #: usage), no `choices`.
    RESPONSES = "responses"

    @property
    def path(self) -> str:
        return _PATHS[self]

    @property
    def object_name(self) -> str:
        """The `object` of a whole (non-streamed) answer."""
        return _OBJECT_NAMES[self]

    @property
    def generates(self) -> bool:
        """Whether the endpoint generates tokens (streams, de-duplication, preemption); embeddings
        answer with one body."""
        return self is not Endpoint.EMBEDDINGS

    @property
    def chunked(self) -> bool:
        """Whether its answers are chat or text completion chunks (`choices`): what a flight assembles and replays
        (de-duplication) and what a preempted request resumes from. A response (the Responses API) is relayed as
        its engine sends it."""
        return self is Endpoint.CHAT or self is Endpoint.COMPLETIONS


_PATHS = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.EMBEDDINGS: "/v1/embeddings",
    Endpoint.RESPONSES: "/v1/responses",
}
_OBJECT_NAMES = {
    Endpoint.CHAT: "chat.completion",
    Endpoint.COMPLETIONS: "text_completion",
    Endpoint.EMBEDDINGS: "list",
    Endpoint.RESPONSES: "response",
}


@dataclass(slots=True)
class ApiRequest:
    """A validated client request. ``body`` is the client's JSON object, unmodified."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    #: W3C trace-context headers (`traceparent`, `tracestate`) to forward to the engine, once validated.
    trace_headers: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: Central replicas (cluster mode): the client's tenant and class, sent to sidecars only
    #: (`cluster/identity.py`).
    relay_headers: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: The prefix-cache salt the gateway sends the engine in place of the client's (`cache_salt`), set from the
    #: tenant (`admission.tenants.cache_salt_for`); None: the body's own, if any, goes as it is.
    cache_salt: str | None = field(default=None, compare=False)
    #: `prompt_text()` and `estimated_prompt_tokens()`, computed once (admission, routing and accounting
    #: all ask for them).
    _prompt: str | None = field(default=None, init=False, repr=False, compare=False)
    _prompt_tokens: int = field(default=0, init=False, repr=False, compare=False)

    def engine_cache_salt(self) -> str | None:
        """The prefix-cache salt of this request (whose cached blocks it may share): the gateway's, else the client's;
        told to engines that keep blocks apart by salt (`Dialect.cache_salt`), the others share their cache."""
        if self.cache_salt is not None:
            return self.cache_salt
        salt = self.body.get("cache_salt")
        return salt if isinstance(salt, str) else None

    def prompt_text(self) -> str:
        """The prompt as one string (for token estimates and prefix hashing)."""
        if self._prompt is None:
            self._prompt = self._join_prompt()
        return self._prompt

    def _join_prompt(self) -> str:
        if self.endpoint is Endpoint.RESPONSES:
            return _response_input_text(self.body)
        if self.endpoint is not Endpoint.CHAT:
            prompt = self.body["prompt" if self.endpoint is Endpoint.COMPLETIONS else "input"]
            if isinstance(prompt, str):
                return prompt
            if prompt and isinstance(prompt[0], str):
                return "".join(prompt)
            return " ".join(str(t) for t in prompt)
        parts: list[str] = []
        for message in self.body["messages"]:
            parts.append(str(message.get("role", "")))
            parts.append(_content_text(message.get("content")))
        return "\n".join(parts)

    def estimated_prompt_tokens(self) -> int:
        """A cheap estimate (~4 characters a token), good enough for accounting before the engine reports; a prompt
        of token ids is counted exactly."""
        if not self._prompt_tokens:
            self._prompt_tokens = self._token_ids_count() or max(1, len(self.prompt_text()) // 4)
        return self._prompt_tokens

    def least_prompt_tokens(self) -> int:
        """A lower bound of the prompt's tokens: token ids exactly, text at ~8 characters a token (half the
        estimate: a tokenizer's long words), for refusals that a retry could never pass."""
        if self._token_ids_count():
            return self.estimated_prompt_tokens()
        return max(1, self.estimated_prompt_tokens() // 2)

    def _token_ids_count(self) -> int:
        """How many token ids a completion's `prompt` or an embedding's `input` holds (0: it is text)."""
        if self.endpoint is Endpoint.CHAT or self.endpoint is Endpoint.RESPONSES:
            return 0
        prompt = self.body["prompt" if self.endpoint is Endpoint.COMPLETIONS else "input"]
        if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
            return 0
        return len(prompt) if isinstance(prompt[0], int) else sum(len(ids) for ids in prompt)

    def choices_per_prompt(self) -> int:
        """The request's `n` (1 unless it asks for more)."""
        n = self.body.get("n")
        return n if type(n) is int and n > 1 else 1

    def sequences(self) -> int:
        """How many generations the engine runs for it (`n`, or a completion's larger `best_of`, for each prompt of a
        batched completion): each may use `max_tokens`, and its usage counts them all."""
        body = self.body
        most = 1
        for key in ("n", "best_of"):
            value = body.get(key)
            if type(value) is int and value > most:
                most = value
        if self.endpoint is Endpoint.COMPLETIONS:
            prompt = body.get("prompt")
            # A list of strings or of token-id lists is a batch (one generation each); a list of ints is one prompt.
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                most *= len(prompt)
        return most

    def generable(self, tokens: int) -> int:
        """`tokens` at most what the engine may generate for it: `max_tokens` for each of its `sequences()` (an
        estimate of its engine's work is bounded by that)."""
        return tokens if self.max_tokens is None else min(tokens, self.max_tokens * self.sequences())

    def streamed_with_usage(self, body: dict[str, Any]) -> ApiRequest:
        """This request as a stream that reports its usage, sending `body` (a flight's engine request), with the
        prompt's text and estimate already computed carried over (`dataclasses.replace` would compute them again,
        and costs a generic copy per flight)."""
        out = ApiRequest(
            self.endpoint,
            body,
            self.model,
            True,
            True,
            self.max_tokens,
            self.trace_headers,
            self.relay_headers,
            self.cache_salt,
        )
        out._prompt, out._prompt_tokens = self._prompt, self._prompt_tokens
        return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict) and "text" in part)
    return ""


def _response_input_text(body: dict[str, Any]) -> str:
    """A response's prompt as one string: its `instructions`, then each input item (a message's role and text, a
    tool call's arguments or output)."""
    instructions = body.get("instructions")
    parts = [instructions] if isinstance(instructions, str) else []
    items = body["input"]
    if isinstance(items, str):
        parts.append(items)
        return "\n".join(parts)
    for item in items:
        if "role" in item:
            parts.append(str(item["role"]))
            parts.append(_content_text(item.get("content")))
        else:
            for key in ("arguments", "output", "text"):
                value = item.get(key)
                if isinstance(value, str):
                    parts.append(value)
    return "\n".join(parts)


def parse_request(endpoint: Endpoint, raw: bytes) -> ApiRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if len(raw) > 2 * MAX_DEPTH:  # shorter bodies cannot hold MAX_DEPTH + 1 pairs of brackets
        try:
            # Serialising it as deep as the gateway's deepest wrapper proves it can be passed on: at C speed,
            # ~60% of the `loads` above and an eighth of counting its brackets with `bytes.count`.
            orjson.dumps([[body]])
        except orjson.JSONEncodeError:
            _check_depth(body)  # names the field
            raise InvalidRequest("The request body cannot be passed on.", code="invalid_json") from None
    return validate(endpoint, body)


def _check_depth(body: dict[str, Any]) -> None:
    """InvalidRequest naming the top-level field under which `body` nests deeper than `MAX_DEPTH`."""
    for key, value in body.items():
        if value.__class__ is not dict and value.__class__ is not list:
            continue
        stack: list[tuple[Any, int]] = [(value, 2)]
        while stack:
            node, level = stack.pop()
            if level > MAX_DEPTH:
                raise _bad(key, f"`{key}` nests deeper than the {MAX_DEPTH} levels a request body may have.")
            for child in node.values() if node.__class__ is dict else node:
                if child.__class__ is dict or child.__class__ is list:
                    stack.append((child, level + 1))


def validate(endpoint: Endpoint, body: dict[str, Any]) -> ApiRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "`model` is required and must be a non-empty string.")
    if endpoint is Endpoint.EMBEDDINGS:
        return _validate_embeddings(model, body)
    if endpoint is Endpoint.RESPONSES:
        return _validate_response(model, body)
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    stream = _stream_flag(body)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "`stream_options` must be an object.")
        if not stream:
            raise _bad("stream_options", "`stream_options` is only allowed when `stream` is true.")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise _bad("stream_options.include_usage", "`include_usage` must be a boolean.")
        include_usage = flag
    _check_fields(body)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    return ApiRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
    )


def _stream_flag(body: dict[str, Any]) -> bool:
    """`stream`: a boolean, false when absent or null."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise _bad("stream", "`stream` must be a boolean.")
    return stream


def _check_fields(body: dict[str, Any]) -> None:
    """The optional fields' checks (`_FIELD_CHECKS`), for those present (a request carries a handful of them)."""
    for key in body:
        check = _FIELD_CHECKS.get(key)
        if check is not None:
            check(body)


#: The longest `cache_salt` taken from a client (it goes to the engine with every request, and into the gateway's).
MAX_CACHE_SALT = 256
#: How the salts the gateway makes begin (`admission.tenants.group_salt`): a client's `cache_salt` may not, or a client
#: of an open gateway (a sidecar reached directly) sharing engines with tenants could name a tenant's salt and read its
#: prefix cache (the salt is a digest of the tenant's name, and an open gateway passes a client's salt on as it is).
GATEWAY_SALT_PREFIX = "lg1-"

#: At most this many inputs in one embeddings request (OpenAI's own limit).
MAX_EMBEDDING_INPUTS = 2048


def _validate_embeddings(model: str, body: dict[str, Any]) -> ApiRequest:
    """`input`: a string, an array of strings, an array of token ids or an array of such arrays (none
    empty, at most `MAX_EMBEDDING_INPUTS`); `encoding_format`: float | base64; `dimensions` >= 1. An
    embedding generates no tokens (`max_tokens` 0) and is never streamed."""
    text = body.get("input")
    if isinstance(text, str):
        if not text:
            raise _bad("input", "`input` must not be an empty string.")
    elif not isinstance(text, list) or not text:
        raise _bad("input", "`input` is required: a string, an array of strings, or an array of token ids.")
    elif _token_ids(text):
        pass  # one input, however long (the engine holds it to its context)
    elif len(text) > MAX_EMBEDDING_INPUTS:
        raise _bad("input", f"`input` may hold at most {MAX_EMBEDDING_INPUTS} items.")
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        raise _bad("input", "Token ids in `input` must be integers from 0.")
    else:
        for index, item in enumerate(text):
            if isinstance(item, str):
                if item:
                    continue
            elif _token_ids(item):
                continue
            raise _bad(
                f"input[{index}]",
                f"`input[{index}]` must be a non-empty string or a non-empty array of token ids "
                "(all items of `input` of the same kind).",
            )
        if len({isinstance(item, str) for item in text}) > 1:
            raise _bad("input", "`input` must not mix strings and token arrays.")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise _bad("encoding_format", "`encoding_format` must be 'float' or 'base64'.")
    _opt_int(body, "dimensions", minimum=1)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "`user` must be a string.")
    if body.get("stream"):
        raise _bad("stream", "Embeddings are not streamed: `stream` must be false or absent.")
    return ApiRequest(
        endpoint=Endpoint.EMBEDDINGS, body=body, model=model, stream=False, include_usage=False, max_tokens=0
    )


def _validate_response(model: str, body: dict[str, Any]) -> ApiRequest:
    """The Responses API: `input` (a string, or a non-empty array of items: messages with a `role`, or typed items
    such as `function_call_output`), `instructions` (a string), `max_output_tokens` >= 1, `stream` (a boolean),
    `previous_response_id` (a string); sampling fields as for chat. Its usage always comes with the response
    (`response.completed`): there is no `stream_options.include_usage`. `background` is refused: the gateway holds a
    request's slot, priority and deadline while its client waits, and a background response would run on past them
    (a P2 tenant's hundred background requests, each answered at once, would fill the engines unscheduled)."""
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise _bad("input", "`input` must not be an empty string.")
    elif not isinstance(items, list) or not items:
        raise _bad("input", "`input` is required: a string or a non-empty array of input items.")
    else:
        for index, item in enumerate(items):
            where = f"input[{index}]"
            if not isinstance(item, dict):
                raise _bad(where, f"`{where}` must be an object.")
            if "role" in item:
                _check_message(item, where, _INPUT_ROLES)
            elif not isinstance(item.get("type"), str):
                raise _bad(where, f"`{where}` must be a message (with a `role`) or an item with a `type`.")
    for key in ("instructions", "previous_response_id"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(key, f"`{key}` must be a string.")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise _bad("background", "`background` must be a boolean.")
    if background:
        raise _bad(
            "background",
            "Background responses are not relayed by this gateway: it schedules, limits and cancels a request while "
            "its client waits for it. Send the request without `background` (with `stream` to see its events as "
            "they come).",
        )
    stream = _stream_flag(body)
    _check_fields(body)
    return ApiRequest(
        endpoint=Endpoint.RESPONSES,
        body=body,
        model=model,
        stream=stream,
        include_usage=False,
        max_tokens=body.get("max_output_tokens"),
    )


def _token_ids(value: Any) -> bool:
    """A non-empty array of token ids: integers from 0 (JSON's `true` and `false` are not)."""
    if not isinstance(value, list) or not value:
        return False
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "`messages` is required and must be a non-empty array.")
    for index, message in enumerate(messages):
        # Names for error messages are built only on the error paths: agents send long conversations.
        if not isinstance(message, dict):
            raise _bad(f"messages[{index}]", f"`messages[{index}]` must be an object.")
        role = message.get("role")
        if role.__class__ is str and role in _ROLES and message.get("content").__class__ is str:
            continue
        _check_message(message, f"messages[{index}]", _ROLES)


def _check_message(message: dict[str, Any], where: str, roles: frozenset[str]) -> None:
    """A chat message or a response's input message (`where`: its place in the body, for the errors)."""
    role = message.get("role")
    if role.__class__ is not str or role not in roles:
        raise _bad(f"{where}.role", f"`{where}.role` must be one of {', '.join(sorted(roles))}; got {repr(role)[:80]}.")
    content = message.get("content")
    if content.__class__ is str:
        return
    if content is None:
        if role not in ("assistant", "tool", "function") or (
            role == "assistant" and "tool_calls" not in message and "function_call" not in message
        ):
            raise _bad(f"{where}.content", f"`{where}.content` is required.")
    elif isinstance(content, list):
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(
                    f"{where}.content[{part_index}]",
                    f"`{where}.content[{part_index}]` must be an object with a `type`.",
                )
    elif not isinstance(content, str):
        raise _bad(f"{where}.content", f"`{where}.content` must be a string or an array of parts.")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if _token_ids(prompt) or all(_token_ids(p) for p in prompt):
            return
    raise _bad(
        "prompt",
        "`prompt` is required: a string, an array of strings, an array of token ids (integers from 0) or an array of "
        "non-empty arrays of token ids.",
    )


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 16:
            raise _bad("stop", "`stop` may hold at most 16 sequences.")
        return
    raise _bad("stop", "`stop` must be a string or an array of strings.")


def _check_tools(body: dict[str, Any]) -> None:
    """`tools`: an array of objects, each with a string `type` (chat's `{"type": "function", "function": {...}}`, the
    Responses API's typed tools). An engine that cannot parse them may answer 500 (llama.cpp: "Failed to parse
    tools"), which reads as the engine failing: retried elsewhere, and its instances ejected for a client's mistake."""
    tools = body["tools"]
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad("tools", "`tools` must be an array of tool objects.")
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _bad(f"tools[{index}]", f"`tools[{index}]` must be an object with a string `type`.")
        function = tool.get("function")
        if function is not None and not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise _bad(f"tools[{index}].function", f"`tools[{index}].function` must be an object with a string `name`.")
        if tool["type"] == "function" and function is None and not isinstance(tool.get("name"), str):
            # (chat's function is in `function`, the Responses API's is the tool itself: a nameless one passed)
            raise _bad(f"tools[{index}]", f"`tools[{index}]`: a function tool needs a string `name`.")


def _check_tool_choice(body: dict[str, Any]) -> None:
    """`tool_choice`: "none", "auto", "required", or an object with a string `type` naming a tool."""
    choice = body["tool_choice"]
    if choice is None or choice in ("none", "auto", "required"):
        return
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        return
    raise _bad("tool_choice", "`tool_choice` must be 'none', 'auto', 'required' or an object naming a tool.")


def _check_response_format(body: dict[str, Any]) -> None:
    """`response_format`: an object with a string `type` (which types an engine supports is the engine's to say)."""
    form = body["response_format"]
    if form is not None and not (isinstance(form, dict) and isinstance(form.get("type"), str)):
        raise _bad("response_format", "`response_format` must be an object with a string `type`.")


def _check_n(body: dict[str, Any]) -> None:
    n = _opt_int(body, "n", minimum=1)
    if n is not None and n > 128:
        raise _bad("n", "`n` must be at most 128.")


def _opt_int(body: dict[str, Any], key: str, *, minimum: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(key, f"`{key}` must be an integer.")
    if minimum is not None and value < minimum:
        raise _bad(key, f"`{key}` must be at least {minimum}.")
    return value


def _check_cache_salt(body: dict[str, Any]) -> None:
    salt = body["cache_salt"]
    if salt is not None and (not isinstance(salt, str) or not salt or not salt.isascii() or not salt.isprintable()):
        # (printable ASCII: a central passes it to its sidecar in a header)
        raise _bad("cache_salt", "`cache_salt` must be a non-empty string of printable ASCII characters.")
    if salt is not None and len(salt) > MAX_CACHE_SALT:
        raise _bad("cache_salt", f"`cache_salt` may be at most {MAX_CACHE_SALT} characters.")
    if salt is not None and salt.startswith(GATEWAY_SALT_PREFIX):
        raise _bad("cache_salt", f"`cache_salt` values beginning with '{GATEWAY_SALT_PREFIX}' are the gateway's own.")


def _opt_number(body: dict[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _bad(key, f"`{key}` must be a number.")
    if not low <= value <= high:
        raise _bad(key, f"`{key}` must be between {low:g} and {high:g}.")


_FIELD_CHECKS: dict[str, Callable[[dict[str, Any]], object]] = {
    "max_tokens": partial(_opt_int, key="max_tokens", minimum=1),
    "max_completion_tokens": partial(_opt_int, key="max_completion_tokens", minimum=1),
    "max_output_tokens": partial(_opt_int, key="max_output_tokens", minimum=1),
    "temperature": partial(_opt_number, key="temperature", low=0.0, high=2.0),
    "top_p": partial(_opt_number, key="top_p", low=0.0, high=1.0),
    "presence_penalty": partial(_opt_number, key="presence_penalty", low=-2.0, high=2.0),
    "frequency_penalty": partial(_opt_number, key="frequency_penalty", low=-2.0, high=2.0),
    "n": _check_n,
    "seed": partial(_opt_int, key="seed", minimum=None),
    # vLLM's and SGLang's extension (-1: off).
    "top_k": partial(_opt_int, key="top_k", minimum=-1),
    "stop": lambda body: _check_stop(body["stop"]),
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt.
    "cache_salt": _check_cache_salt,
    "tools": _check_tools,
    "tool_choice": _check_tool_choice,
    "response_format": _check_response_format,
}
