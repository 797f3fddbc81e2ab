"""The gateway's error tree, mapped once to OpenAI error bodies at the edge.

    GatewayError                      status  type
    ├── InvalidRequest                400     invalid_request_error   (param names the field)
    │   └── InvalidConfig             422     code=invalid_config     (a reload refused the file)
    ├── Unauthorized                  401     authentication_error
    ├── Forbidden                     403     permission_error         (a valid key without the right)
    ├── ModelNotFound                 404     invalid_request_error   code=model_not_found  [rejected]
    ├── NotFound                      404     invalid_request_error
    ├── MethodNotAllowed              405     invalid_request_error   code=method_not_allowed (Allow)
    ├── PayloadTooLarge               413     invalid_request_error
    ├── RateLimited                   429     rate_limit_exceeded      (Retry-After)  [rejected]
    │   ├── QueueFull                 429     code=queue_full
    │   └── RateLimitExceeded         429     (+ x-ratelimit-* headers; in admission/ratelimit.py)
    ├── Unavailable                   503     service_unavailable      (Retry-After)
    │   ├── QueueTimeout              503     code=queue_timeout                      [rejected]
    │   └── ShuttingDown              503
    ├── DeadlineExceeded              504     timeout
    ├── Cancelled                     499/503 cancelled                (admin cancel, preemption)
    └── UpstreamError                 502     upstream_error
        ├── UpstreamConnectError      502     (nothing was sent to the engine, or no answer)
        ├── UpstreamProtocolError     502     (the engine broke the stream or sent garbage)
        │   └── UpstreamStalled       504     code=upstream_stalled   (the engine sent nothing for
        │                                     `upstream.stall_timeout_ms` while a stream was awaited)
        └── UpstreamStatusError       any     (the engine's own status; its error in this envelope, a 4xx as
                                              invalid_request_error, code=context_length_exceeded when the
                                              prompt does not fit)

[rejected]: the gateway shed the request before it reached an engine; its usage record says
`rejected` rather than `error`.

Foreign exceptions (the HTTP client's, OSError, orjson) are translated where they enter, in `upstream.py` and
`wire.py`; handlers only ever see `GatewayError`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import orjson


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None
    #: The request was refused, not failed: load shedding or a limit of the gateway's, or an engine's 4xx (its usage
    #: record says `rejected`; a failure says `error`, and only those count against the success objective).
    rejected: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        final: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after
        #: Sending the request again cannot help (an operator cancelled it; it asks for more than a limit allows):
        #: `x-should-retry: false`, which the OpenAI SDKs honour before their own rule (they retry 429 and 5xx).
        self.final = final

    @property
    def http_status(self) -> int:
        return self.status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        if self.final:
            return {"x-should-retry": "false"}
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after + 0.4999)))}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class InvalidConfig(InvalidRequest):
    """`POST /admin/reload` read a configuration file it cannot use; the running one stays."""

    status = 422
    default_code = "invalid_config"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        # RFC 9110 11.6.1: a 401 says how to authenticate (operator routes give their own realm).
        return {**super().headers(), "WWW-Authenticate": 'Bearer realm="lockgate"'}


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    """A route the gateway serves, asked with a method it does not take there: 405 with `Allow`."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, method: str, path: str, allow: str) -> None:
        super().__init__(f"Method {method} is not allowed on {path}.")
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Allow": self.allow}


class ModelNotFound(NotFound):
    default_code = "model_not_found"
    #: (Raised after admission too: a reload removed the model of a queued request.)
    rejected = True


#: The most of a client's name (a model's, a response id) an error message repeats (a 100,000-character model name was
#: echoed whole, a 5,000-character response id too).
MAX_NAME_SHOWN = 200


def shown(name: str) -> str:
    """A client's name (of a model, a response) as an error message repeats it: at most `MAX_NAME_SHOWN` characters."""
    return name if len(name) <= MAX_NAME_SHOWN else name[:MAX_NAME_SHOWN] + "…"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"
    rejected = True


class QueueFull(RateLimited):
    """The priority class's queue for this model is full (Retry-After estimates the wait)."""

    default_code = "queue_full"


class Unavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    default_code = "no_healthy_instance"


class QueueTimeout(Unavailable):
    """The request waited in its class's queue longer than the class's queue deadline."""

    default_code = "queue_timeout"
    rejected = True


class ShuttingDown(Unavailable):
    default_code = "shutting_down"


class DeadlineExceeded(GatewayError):
    status = 504
    type = "timeout"
    default_code = "deadline_exceeded"


class Cancelled(GatewayError):
    """The gateway itself ended the request (admin cancel, shutdown drain, preemption limit)."""

    #: Why, when a request that did not ask for it meets it (an operator cancelled the flight it shares: `admin`):
    #: the request then ends `cancelled` for that reason, as its own cancel would, not as a failure.
    reason: str | None = None

    status = 503
    type = "cancelled"
    default_code = "cancelled"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    default_code = "upstream_error"
    #: True when the engine may not have seen the request at all, so another instance may be tried.
    retryable: bool = False


class UpstreamConnectError(UpstreamError):
    default_code = "upstream_unreachable"
    retryable = True


class UpstreamProtocolError(UpstreamError):
    default_code = "upstream_protocol_error"


class UpstreamTooLarge(UpstreamProtocolError):
    """The engine's answer crossed the gateway's bound (`upstream.max_response_bytes`): not tried elsewhere."""

    default_code = "upstream_response_too_large"


class UpstreamStalled(UpstreamProtocolError):
    """The engine sent nothing for `upstream.stall_timeout_ms` while its streamed answer was awaited (a hung engine
    holds its requests until then, not forever); the call was closed."""

    status = 504
    default_code = "upstream_stalled"


def another_may_answer(exc: UpstreamError) -> bool:
    """Whether an engine call that failed with `exc` may be tried on another instance: the engine may not have seen it
    (`retryable`), or its answer broke (a stream, a whole answer read midway), unless it broke on the gateway's own
    bound (`UpstreamTooLarge`: another engine's is as large) or the engine refused the request itself mid-stream (an
    error event with a 4xx status: `rejected`)."""
    if exc.retryable:
        return True
    return isinstance(exc, UpstreamProtocolError) and not isinstance(exc, UpstreamTooLarge) and not exc.rejected


class UpstreamStatusError(UpstreamError):
    """The engine answered with an error status: passed on, with its error in the OpenAI envelope (`body`). A 401,
    403 or 407 is the engine refusing the gateway's own credentials, not the client's: 502 (as is a status that is
    not one, past 599)."""

    def __init__(self, status: int, body: bytes, content_type: str | None, retry_after: str | None = None) -> None:
        parsed = _parse(body)
        message = _message(body, parsed) or f"upstream answered HTTP {status}"
        self.credentials_refused = status in (401, 403, 407)
        if self.credentials_refused:
            message = f"The engine refused the gateway's credentials (HTTP {status}): {message}"
        super().__init__(message, code="upstream_status")
        self.upstream_status = status
        self.upstream_body = body
        self._parsed = parsed
        self.content_type = content_type
        #: The engine's `Retry-After` (seconds, or an HTTP date), passed on: behind a rate-limited provider, a client
        #: that is not told backs off by its SDK's default (0.5-1 s) and hammers it.
        self.upstream_retry_after = retry_after if retry_after and _header_value(retry_after) else None
        # A 500/502/503 from a broken or overloaded engine (vLLM answers 500 once its engine core died) may succeed
        # elsewhere; a 4xx will not: the engine refused the request itself (its content: too long a prompt, an
        # unsupported parameter), which is not a failure of the service either (`slo/usage.py`).
        # So may a refusal of the gateway's credentials: another instance may hold its own (and this one is ejected
        # as for a 5xx, `Fleet.report_failure`).
        # A 501 is an engine that does not do what was asked (an embeddings request to a llama.cpp started without
        # `--embedding`): another may.
        self.retryable = status in (500, 501, 502, 503) or self.credentials_refused
        self.rejected = 400 <= status < 500 and not self.credentials_refused

    @property
    def http_status(self) -> int:
        status = self.upstream_status
        return 502 if self.credentials_refused or not 400 <= status <= 599 else status

    def headers(self) -> dict[str, str]:
        if self.upstream_retry_after is None:
            return super().headers()
        return {"Retry-After": self.upstream_retry_after}

    def body(self) -> dict[str, Any]:
        """The OpenAI error envelope, whatever the engine's shape (`{"error": {...}}` with an integer `code` from vLLM,
        SGLang and llama.cpp, vLLM's older top-level `{"object": "error", ...}`, TGI's `{"error": "..."}`, FastAPI's
        `{"detail": ...}`, plain text): its message (cut to `MAX_ENGINE_MESSAGE`); `invalid_request_error` for a 4xx
        (the request's fault), `upstream_error` otherwise; its `param` if it names one; a string `code`:
        `context_length_exceeded` when a 4xx says the prompt does not fit (what OpenAI answers and clients test to
        trim a conversation), else its own string code or type. The engine's other small fields (llama.cpp's
        `n_prompt_tokens`, `n_ctx`) are kept. An error in OpenAI's shape already (string type and code: a hosted
        provider's) keeps its type and code."""
        parsed = self._parsed
        engine: dict[str, Any] = {}
        if isinstance(parsed, dict):
            err = parsed.get("error")
            engine = err if isinstance(err, dict) else parsed if parsed.get("object") == "error" else {}
        extra = {k: v for k, v in engine.items() if k not in _ENVELOPE and k != "object" and _small(v)}
        code = _cut(engine.get("code"))
        if self.credentials_refused:
            kind, code = self.type, "upstream_credentials_refused"
        elif engine is not parsed and _openai_shaped(engine):
            kind = engine["type"][:MAX_ENGINE_MESSAGE]  # (a hosted provider's, `engine: openai`, or alike)
        else:
            kind = self._type()
            name = engine.get("type", parsed.get("error_type") if isinstance(parsed, dict) else None)
            if self.rejected and (_CONTEXT_LENGTH.search(self.message) or name == "exceed_context_size_error"):
                code = "context_length_exceeded"
            elif code is None:
                code = _cut(name) or self.code
        return {
            "error": {**extra, "message": self.message, "type": kind, "param": _cut(engine.get("param")), "code": code}
        }

    def _type(self) -> str:
        if self.upstream_status == 429:
            return RateLimited.type
        return InvalidRequest.type if self.rejected else self.type

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())


_ENVELOPE = ("message", "type", "param", "code")


def drop_tracebacks(exc: BaseException) -> None:
    """Forget the tracebacks of a handled error and of the errors it chains (`__cause__`, `__context__`). A traceback
    keeps every frame the error went through, with their locals (the request, its body, its engine call); an error
    that something the frames hold also holds (a future it was set on, a response that stored it) makes a reference
    cycle of all of it, freed only by a full garbage collection. Once a request's fate is decided from an error, its
    message is all that is needed."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _openai_shaped(error: dict[str, Any]) -> bool:
    return (
        isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and all(error.get(key) is None or isinstance(error[key], str) for key in ("param", "code"))
    )


def _cut(value: Any) -> str | None:
    """A string field of an engine's error as passed on (cut to `MAX_ENGINE_MESSAGE`); None for anything else."""
    return value[:MAX_ENGINE_MESSAGE] if isinstance(value, str) else None


def _small(value: Any) -> bool:
    """An engine's extra error field worth passing on: a scalar, a short string."""
    return value is None or isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 200)


#: Engines' ways of saying that a prompt (with its output) does not fit the model's context: vLLM's "This model's
#: maximum context length is N tokens", SGLang's "longer than the model's context length", llama.cpp's "exceeds the
#: available context size", TGI's "`inputs` tokens + `max_new_tokens` must be <= N".
_CONTEXT_LENGTH = re.compile(r"context length|context size|context window|`inputs` tokens \+ `max_new_tokens`", re.I)


def _header_value(value: str) -> bool:
    """A header value safe to send on: short, printable ASCII (no line breaks)."""
    return len(value) <= 64 and value.isascii() and value.isprintable()


def _parse(body: bytes) -> Any:
    """An engine's error body as JSON (invalid UTF-8 in it replaced), or None when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return orjson.loads(body.decode("utf-8", "replace"))
    except orjson.JSONDecodeError:
        return None


def _message(body: bytes, parsed: Any) -> str | None:
    if parsed is None:
        message = body.decode("utf-8", "replace").strip()
    else:
        message = (_message_of(parsed) if isinstance(parsed, dict) else None) or ""
    return message[:MAX_ENGINE_MESSAGE] or None


def message_from_body(body: bytes) -> str | None:
    """The message of an engine's error body (its text when it is not JSON), cut to `MAX_ENGINE_MESSAGE`."""
    return _message(body, _parse(body))


def _message_of(parsed: dict[str, Any]) -> str | None:
    """The message of an error body: OpenAI's `{"error": {"message": ...}}`, `{"error": "..."}` (TGI), a top-level
    `message` (vLLM's older `{"object": "error", ...}`) or FastAPI's `detail` (a string, or validation errors)."""
    err = parsed.get("error")
    if isinstance(err, dict):
        message = err.get("message")
        if isinstance(message, str):
            return message
        if isinstance(message, int | float) and not isinstance(message, bool):
            return str(message)
    if isinstance(err, str):
        return err
    if isinstance(parsed.get("message"), str):
        return str(parsed["message"])
    detail = parsed.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        return "; ".join(_problem(d) for d in detail if isinstance(d, dict) and isinstance(d.get("msg"), str)) or None
    return None


def _problem(detail: dict[str, Any]) -> str:
    """One of FastAPI's validation errors: `body.messages: field required`."""
    loc = detail.get("loc")
    where = ".".join(map(str, loc)) + ": " if isinstance(loc, list) and loc else ""
    return where + str(detail["msg"])


#: The most of an engine's error message kept in the gateway's own error (the event itself is bounded by
#: `upstream.max_event_bytes`).
MAX_ENGINE_MESSAGE = 500


def stream_error(event: dict[str, Any]) -> tuple[str, int | None] | None:
    """An engine's error reported inside a stream, as an event, and its status if it names one; None for any other
    event. vLLM and SGLang end a generation that failed after its stream began with such an event (`{"error":
    {...}}`, older vLLM `{"object": "error", ...}`) followed by `[DONE]`; llama.cpp and TGI send `{"error": ...}`; a
    response's stream (the Responses API) has `{"type": "error", "code": ..., "message": ...}`."""
    err = event.get("error")
    if not err and event.get("object") != "error" and event.get("type") != "error":
        return None  # (an engine may carry `"error": null` on its usual chunks)
    message = (_message_of(event) or "the engine reported an error")[:MAX_ENGINE_MESSAGE]
    code = err.get("code") if isinstance(err, dict) else event.get("code")
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else None
    return message, status


def edge_error_body(status: int, message: str, code: str | None = None) -> bytes:
    """The body of an error the edge server answers itself (malformed HTTP, limits), in the OpenAI envelope with
    the code that names the limit (`HttpServer`'s `error_body`)."""
    if status == 413:
        return PayloadTooLarge(message).body_bytes()
    if status == 503:
        return Unavailable(message, code=code or "service_unavailable").body_bytes()
    if status < 500 or status in (501, 505):
        codes = {
            408: "request_timeout",
            415: "unsupported_content_encoding",
            431: "headers_too_large",
            501: "unsupported_transfer_encoding",
            505: "http_version_not_supported",
        }
        return InvalidRequest(message, code=codes.get(status, "bad_http_request")).body_bytes()
    return GatewayError(message).body_bytes()
