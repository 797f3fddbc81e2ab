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


def test_odd_engine_bodies_still_give_a_bounded_envelope_with_the_engines_words() -> None:
    """A second outside run against a fake engine: a 1 MiB message reached the client whole, FastAPI's `detail` and a
    numeric message were lost, invalid UTF-8 inside JSON gave the raw JSON as the message, a 500 mentioning the
    context was called `context_length_exceeded`."""
    huge = _client_sees(
        400, {"error": {"message": "x" * (1 << 20), "type": "BadRequestError", "code": 400, "blob": "y" * 1000}}
    )
    assert huge["message"] == "x" * 500 and "blob" not in huge
    shaped = _client_sees(400, {"error": {"message": "z" * (1 << 20), "type": "invalid_request_error", "code": None}})
    assert shaped["message"] == "z" * 500
    assert _client_sees(422, {"detail": "Field required: messages"})["message"] == "Field required: messages"
    detail = [{"loc": ["body", "messages"], "msg": "field required", "type": "missing"}, {"msg": "bad", "loc": "x"}]
    assert _client_sees(422, {"detail": detail})["message"] == "body.messages: field required; bad"
    assert _client_sees(400, {"error": {"message": 123, "code": 400}})["message"] == "123"
    odd = _client_sees(400, b'{"error": {"message": "bad \xff\xfe", "code": 400}}')
    assert odd["message"] == "bad \ufffd\ufffd"
    fault = _client_sees(500, {"error": {"message": "failed: context length mismatch in kernel", "code": 500}})
    assert fault["code"] != "context_length_exceeded" and fault["type"] == "upstream_error"


@pytest.mark.parametrize("status", [401, 403, 407])
def test_an_engine_refusing_the_gateways_credentials_is_a_502_not_the_clients_401(status: int) -> None:
    """An engine's (a hosted provider's) 401 told a client with a valid key that its key was wrong."""
    body = orjson.dumps({"error": {"message": "Incorrect API key", "type": "x", "code": "invalid_api_key"}})
    error = UpstreamStatusError(status, body, None)
    assert error.http_status == 502 and not error.rejected  # the service's failure, not the request's
    envelope = orjson.loads(error.body_bytes())["error"]
    assert envelope["type"] == "upstream_error" and envelope["code"] == "upstream_credentials_refused"
    assert "refused the gateway's credentials" in envelope["message"] and "Incorrect API key" in envelope["message"]


def test_a_status_that_is_not_one_is_a_502() -> None:
    assert UpstreamStatusError(600, b"?", None).http_status == 502
    assert UpstreamStatusError(599, b"?", None).http_status == 599
