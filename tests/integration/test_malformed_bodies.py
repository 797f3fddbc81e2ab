"""Malformed request bodies through a real gateway: a 400 in the OpenAI envelope naming the field, never a 500.

Each case here once answered 500 (a traceback in the log): a body nested deeper than the gateway can
re-serialise, a huge whole-number float in a de-duplicated request's fingerprint, a role that is not a string.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.records import read_records
from lockgate.wire import MAX_DEPTH
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean

MESSAGES = [{"role": "user", "content": "hi"}]


def nested(levels: int) -> bytes:
    """A JSON value `levels` deep (an array counts one level)."""
    return b"[" * levels + b"]" * levels


def with_field(endpoint: str, field: bytes) -> bytes:
    if endpoint == "/v1/chat/completions":
        return b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}],' + field + b"}"
    return b'{"model":"m","max_tokens":2,"prompt":"hi",' + field + b"}"


ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
CASES: list[tuple[bytes, str]] = [
    # Deep nesting, in a field nobody checks and in one the gateway reads (orjson parses 1024 levels; every
    # re-serialisation of the body failed from 254 levels on, fingerprints from 252; MAX_DEPTH is for the body).
    (b'"x":' + nested(300), "x"),
    (b'"x":' + nested(1020), "x"),
    (b'"x":' + nested(MAX_DEPTH), "x"),  # the body is one level more than the limit
    (b'"temperature":0,"x":' + nested(300), "x"),  # a de-duplicated request: the fingerprint's serialisation
    (b'"logit_bias":{"a":' + nested(MAX_DEPTH - 1) + b"}", "logit_bias"),
    # A whole-number float too big for an integer in the fingerprint of a deterministic request.
    (b'"temperature":0,"top_k":1e20', "top_k"),
    (b'"temperature":0,"top_k":-1e300', "top_k"),
    (b'"seed":1,"top_k":18446744073709551616', "top_k"),
]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=raw, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, orjson.loads(await resp.read())


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_malformed_bodies_are_400_naming_the_field(start_sim, start_gateway, http, tmp_path, endpoint):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    url = gw.url + endpoint
    for field, param in CASES:
        status, body = await post(http, url, with_field(endpoint, field))
        assert status == 400, (field[:40], body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    # Just inside the limit is served (the engine gets the field as it came), and so is a huge number in a
    # field the gateway does not know, de-duplicated or not.
    deepest = nested(MAX_DEPTH - 1)
    served = (b'"x":' + deepest, b'"temperature":0,"x":' + deepest, b'"temperature":0,"x":1e20', b'"seed":2,"x":-1e300')
    for field in served:
        status, body = await post(http, url, with_field(endpoint, field))
        assert status == 200, body
    # Rejected before they were accepted: like every invalid request, no usage record; each served one has one.
    assert sim.statistics()["requests_started"] == len(served)
    assert gw.gateway is not None
    assert_gateway_clean(gw.gateway)
    await gw.gateway.records.wait_flushed()
    assert [row["status"] for row in read_records(str(tmp_path / "usage.sqlite3"))] == ["completed"] * len(served)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": ["user"], "content": "hi"}, "messages[0].role"),
        ({"role": {}, "content": "hi"}, "messages[0].role"),
        ({"role": 1, "content": "hi"}, "messages[0].role"),
        ({"role": None, "content": "hi"}, "messages[0].role"),
        ({"role": "user", "content": {"text": "hi"}}, "messages[0].content"),
        ({"role": "user", "content": 3}, "messages[0].content"),
        ({"role": "user", "content": ["hi"]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": ["text"]}]}, "messages[0].content[0]"),
    ],
)
async def test_wrong_types_in_messages_are_400_naming_the_field(start_sim, start_gateway, http, message, param):
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    for temperature in (None, 0):  # sampled and de-duplicated requests
        body: dict[str, Any] = {"model": "m", "messages": [*MESSAGES, message][1:], "temperature": temperature}
        status, answer = await post(http, gw.url + "/v1/chat/completions", orjson.dumps(body))
        assert status == 400, answer
        assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert sim.statistics()["requests_started"] == 0


async def test_siblings_json_itself_refuses_are_400_invalid_json(start_sim, start_gateway, http):
    """Input orjson refuses (so nothing downstream ever sees it): one 400 each, in the envelope."""
    sim = await start_sim()
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    url = gw.url + "/v1/chat/completions"
    chat = with_field("/v1/chat/completions", b'"x":%s')
    for raw in [
        chat % b"NaN",
        chat % b"Infinity",
        chat % b"-1e400",  # beyond a double
        chat % b'"\\ud800"',  # a lone surrogate, escaped
        chat % b'"\xed\xa0\x80"',  # ... and as bytes (not UTF-8)
        chat % b'"\xff"',
        b"\xef\xbb\xbf" + chat % b"1",  # a byte-order mark
        b"[" + chat % b"1" + b"]",
        b'"a string"',
        b"null",
        b"",
    ]:
        status, body = await post(http, url, raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (raw[:60], body)
        assert body["error"]["code"] == "invalid_json"
    # Duplicate keys: the last one counts, as in most JSON parsers (and the engine gets only that one).
    status, body = await post(
        http, url, b'{"model":"nope","model":"m","max_tokens":1,"messages":' + b'[{"role":"user","content":"x"}]}'
    )
    assert status == 200, body
    assert sim.statistics()["requests_started"] == 1
