"""An engine's error reaches the client in the OpenAI envelope, whatever the engine's own shape (an outside run: vLLM,
SGLang and llama.cpp put an integer in `code` and their own names in `type`, TGI a bare string, so a client parsing
the envelope got an integer or a string depending on where the error came from)."""

from __future__ import annotations

import orjson
import pytest

from lockgate.errors import UpstreamStatusError


def _client_sees(status: int, engine_body: object) -> dict[str, object]:
    raw = engine_body if isinstance(engine_body, bytes) else orjson.dumps(engine_body)
    error = UpstreamStatusError(status, raw, "application/json")
    body = orjson.loads(error.body_bytes())
    assert set(body) == {"error"}
    envelope: dict[str, object] = body["error"]
    assert isinstance(envelope["message"], str) and isinstance(envelope["type"], str)
    assert envelope["code"] is None or isinstance(envelope["code"], str)
    assert envelope["param"] is None or isinstance(envelope["param"], str)
    return envelope


@pytest.mark.parametrize(
    "engine_body",
    [
        # vLLM (and SGLang): the OpenAI keys, an integer code.
        {
            "error": {
                "message": "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        # vLLM's older and SGLang's top-level shape.
        {
            "object": "error",
            "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        # TGI: a bare string.
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 5000",
            "error_type": "validation",
        },
    ],
)
def test_a_prompt_too_long_for_the_context_is_openais_context_length_exceeded(engine_body: object) -> None:
    envelope = _client_sees(400, engine_body)
    assert envelope["type"] == "invalid_request_error" and envelope["code"] == "context_length_exceeded"
    assert "context length" in str(envelope["message"]) or "max_new_tokens" in str(envelope["message"])


def test_llama_cpps_context_error_keeps_its_own_details() -> None:
    envelope = _client_sees(
        400,
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 1531,
                "n_ctx": 512,
            }
        },
    )
    assert envelope == {
        "message": "the request exceeds the available context size, try increasing it",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
        "n_prompt_tokens": 1531,
        "n_ctx": 512,
    }


def test_other_engine_errors_keep_their_message_and_name_as_the_code() -> None:
    envelope = _client_sees(
        400, {"error": {"message": "bad grammar", "type": "BadRequestError", "param": "x", "code": 400}}
    )
    assert envelope == {
        "message": "bad grammar",
        "type": "invalid_request_error",
        "param": "x",
        "code": "BadRequestError",
    }
    envelope = _client_sees(501, {"error": {"code": 501, "message": "not supported", "type": "not_supported_error"}})
    assert envelope["type"] == "upstream_error" and envelope["code"] == "not_supported_error"
    envelope = _client_sees(500, b"Internal Server Error")
    assert envelope == {
        "message": "Internal Server Error",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_status",
    }
    assert _client_sees(429, {"error": "overloaded"})["type"] == "rate_limit_exceeded"


def test_an_error_in_openais_shape_already_is_left_as_it_is() -> None:
    """A hosted provider behind `engine: openai`: its type and code are what its clients know."""
    body = {"error": {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert _client_sees(429, body) == body["error"]
