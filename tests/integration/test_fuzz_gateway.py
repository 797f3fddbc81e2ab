"""The standing guard against malformed input: hypothesis drives one real gateway (two simulated engines, a
tenant with a key, a de-duplicated model and a session-affinity one) over loopback with near-valid bodies of
every endpoint (chat, completions, embeddings), raw garbage, and odd values of every header lockgate reads.

Whatever comes in: never a 5xx of the gateway's own making (no traceback in the log), every error in the
OpenAI envelope, every answer framed; and afterwards the gateway is clean (nothing in flight, every leak gauge at
zero) and still serves. The examples are derandomized (the same inputs on every run) and bounded to a few
seconds; the client runs in a worker thread with blocking sockets, the gateway in the test's event loop.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from lockgate.admission.tenants import hash_key
from lockgate.records import read_records
from lockgate.wire import MAX_DEPTH
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean, total

KEY = "sk-fuzz"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MODELS = ("m", "h")
#: Statuses the gateway may answer for a bad or unlucky request; 5xx only as its documented outcomes.
ALLOWED = {200, 400, 401, 404, 405, 413, 429, 431, 504, 505}

# --- strategies ------------------------------------------------------------------------------------------------------

_odd_text = st.text(
    st.characters(codec=None, exclude_categories=()),  # every code point, lone surrogates included
    max_size=12,
)
_numbers = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e20, -1e20, 1e300, 5e-324, 1.5, 2.0**64, float("nan"), float("inf")]),
)
_leaf = st.one_of(st.none(), st.booleans(), _numbers, _odd_text)
_json = st.recursive(
    _leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_odd_text, kids, max_size=3), max_leaves=8
)
_ROLES = ["system", "user", "assistant", "tool", "developer"]
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(_ROLES), "content": st.text(max_size=20)},
    optional={"name": _json, "tool_calls": _json},
)
_weird_message = st.one_of(
    _message,
    st.fixed_dictionaries({"role": _json, "content": _json}),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), _json, max_size=3),
    _json,
)
#: Fields lockgate reads or passes through, with values from plausible to absurd.
_FIELDS = [
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "n", "seed", "stop", "logit_bias", "presence_penalty", "frequency_penalty", "user", "tools",
    "response_format", "logprobs", "best_of", "input", "encoding_format", "dimensions", "x-unknown",
]  # fmt: skip
_plausible = {
    "model": st.sampled_from(MODELS),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "max_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1]),
    "seed": st.integers(0, 5),
    "stop": st.sampled_from(["x", ["a", "b"]]),
    "n": st.integers(1, 2),
    "user": st.sampled_from(["u1", "u2"]),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.integers(1, 8),
}


@dataclass(frozen=True)
class Body:
    endpoint: str
    raw: bytes


def _encode(body: Any, ascii_only: bool) -> bytes:
    # The stdlib encoder writes NaN/Infinity tokens and \ud800 escapes; without ensure_ascii a lone surrogate
    # becomes bytes that are not UTF-8.
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw: st.DrawFn) -> Body:
    endpoint = draw(st.sampled_from(ENDPOINTS))
    body: dict[str, Any] = {"model": draw(st.sampled_from(MODELS)), "max_tokens": draw(st.integers(1, 6))}
    if draw(st.booleans()):
        body["stream"] = True
    if endpoint == ENDPOINTS[0]:
        body["messages"] = draw(st.lists(_message, min_size=1, max_size=3))
    elif endpoint == ENDPOINTS[2]:
        del body["max_tokens"]
        body.pop("stream", None)
        body["input"] = draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.text(min_size=1), max_size=3)))
    else:
        # Token-id prompts are valid OpenAI input, which the simulator refuses (its own 400): a few suffice.
        tokens = st.lists(st.integers(0, 50), min_size=1, max_size=5)
        body["prompt"] = draw(tokens if draw(st.integers(0, 5)) == 0 else st.text(min_size=1, max_size=30))
    # Half the bodies stay valid in every field the gateway reads: the odd values then come from headers.
    fields = draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)) if draw(st.booleans()) else []
    for field in fields:
        plausible = _plausible.get(field)
        if plausible is not None and draw(st.integers(0, 3)) > 0:
            body[field] = draw(plausible)
        elif field == "messages" and draw(st.booleans()):
            body[field] = draw(st.lists(_weird_message, max_size=3))
        else:
            body[field] = draw(_json)
    if body.get("stream") is True and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # an absurd budget elsewhere is the engine's to bound
    raw = _encode(body, draw(st.integers(0, 3)) > 0)
    splice = draw(st.sampled_from(["", "", "", "", "deep", "duplicate", "garbage"]))
    if splice == "deep":
        levels = draw(st.sampled_from([MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, 254, 255, 600, 1023, 1030]))
        raw = b'{"deep":' + b"[" * levels + b"]" * levels + b"," + raw[1:]
    elif splice == "duplicate":
        raw = b'{"model":' + _encode(draw(_json), True) + b"," + raw[1:]
    elif splice == "garbage":
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=8)) + raw[cut:]
    return Body(endpoint, raw)


_top_level = st.one_of(
    st.binary(max_size=64),
    _json.map(lambda v: _encode(v, True)),
    st.sampled_from([b"", b"null", b"[]", b'"{}"', b"{", b"}", b"\xef\xbb\xbf{}", b"{}" * 3, b"\x00"]),
).map(lambda raw: Body("", raw))

_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40)
_HEADERS: dict[str, st.SearchStrategy[str]] = {
    "authorization": st.one_of(
        st.just(f"Bearer {KEY}"), st.just(f"bearer   {KEY}  "), st.just("Bearer"), st.just("Basic abc"), _header_text
    ),
    "x-priority": st.one_of(st.sampled_from(["P0", "P1", "P2", "p1", " P2 ", "", "P9"]), _header_text),
    "x-request-id": st.one_of(_header_text, st.just("r" * 300)),
    "x-lockgate-timeout-ms": st.one_of(
        st.sampled_from(["0", "-1", "1", "5000", "1e3", "1_000", " 20 ", "99999999999999999999", "9" * 5000, "abc"]),
        _header_text,
    ),
    "cache-control": st.one_of(st.sampled_from(["no-cache", "no-store", "max-age=0, no-cache", ","]), _header_text),
    "content-type": st.one_of(st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1"]),
                              _header_text),
    "x-session-id": _header_text,
}  # fmt: skip
_content_length = st.sampled_from(["{n}", "+{n}", "0{n}", " {n} ", "{n}, {n}", "{n},{n}", "-1", "abc", "{n}.0", "0x10"])


@st.composite
def headers(draw: st.DrawFn) -> tuple[dict[str, str], str]:
    """Headers for a request (the right key mostly, so bodies reach validation), and the Content-Length form."""
    chosen = {"authorization": f"Bearer {KEY}"}
    for name in draw(st.lists(st.sampled_from(sorted(_HEADERS)), max_size=3, unique=True)):
        chosen[name] = draw(_HEADERS[name])
    length = draw(st.one_of(st.just("{n}"), _content_length)) if draw(st.integers(0, 3)) == 0 else "{n}"
    return chosen, length


# --- the client (a worker thread, blocking sockets) ------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes


def exchange(port: int, endpoint: str, raw: bytes, header_map: dict[str, str], length: str) -> Answer | None:
    """One request on its own connection (`Connection: close`); None if the server closed without an answer."""
    lines = [f"POST {endpoint or ENDPOINTS[0]} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in header_map.items()]
    lines.append(f"Content-Length: {length.format(n=len(raw))}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + raw)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
        except http.client.RemoteDisconnected:
            return None
        return Answer(response.status, response.getheader("content-type") or "", response.read())


def check(answer: Answer | None, what: object) -> None:
    # Every request here is complete as framed: the server answers each (a malformed one with 400 and a close).
    assert answer is not None, what
    assert answer.status in ALLOWED, (answer, what)
    if answer.status >= 400:
        assert answer.content_type == "application/json", (answer, what)
        error = orjson.loads(answer.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, (answer, what)
        assert isinstance(error["message"], str) and error["message"], (answer, what)
    elif answer.content_type.startswith("text/event-stream"):
        events = [line for line in answer.body.split(b"\n") if line.startswith(b"data: ")]
        assert events and (events[-1] == b"data: [DONE]" or b'"error"' in events[-1]), (answer, what)
    else:
        answer_body = orjson.loads(answer.body)
        assert answer_body.get("choices") or answer_body.get("data"), (answer, what)


def _settings(examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def fuzz(port: int) -> None:
    """Runs in a worker thread: every hypothesis test against the gateway at `port`."""

    @_settings(300)
    @given(body=bodies(), extra=headers())
    @example(body=Body(ENDPOINTS[0], b'{"model":"m","messages":[{"role":["user"],"content":"x"}]}'), extra=({}, "{n}"))
    @example(body=Body(ENDPOINTS[1], b'{"model":"m","temperature":0,"top_k":1e20,"prompt":"x"}'), extra=({}, "{n}"))
    def near_valid_bodies(body: Body, extra: tuple[dict[str, str], str]) -> None:
        header_map, length = extra
        header_map = {"authorization": f"Bearer {KEY}", **header_map}
        check(exchange(port, body.endpoint, body.raw, header_map, length), (body, extra))

    @_settings(80)
    @given(body=_top_level, endpoint=st.sampled_from(ENDPOINTS))
    def garbage_bodies(body: Body, endpoint: str) -> None:
        check(exchange(port, endpoint, body.raw, {"authorization": f"Bearer {KEY}"}, "{n}"), body)

    near_valid_bodies()
    garbage_bodies()


async def test_fuzzed_requests_get_answers_never_a_gateway_error(start_sim, start_gateway, caplog, tmp_path):
    caplog.set_level(logging.WARNING)
    sims = [await start_sim(("m", "h"), fast=True, max_model_len=512, seed=n) for n in range(2)]
    gw = await start_gateway(
        [
            {"name": "m", "instances": [instance(s) for s in sims]},
            {
                "name": "h",
                "routing": "consistent_hash",
                "dedup": "always",
                "cancel_policy": "finish_and_cache",
                "instances": [instance(s) for s in sims],
            },
        ],
        tenants=[{"name": "t", "keys": [hash_key(KEY)], "requests_per_minute": 10**6, "tokens_per_minute": 10**9}],
    )
    assert gw.gateway is not None
    port = int(gw.url.rpartition(":")[2])
    await asyncio.to_thread(fuzz, port)
    async with asyncio.timeout(10):  # bounds a failure only
        await gw.gateway.registry.wait_empty()
        flights = gw.gateway.dedup.flights
        await flights.wait_until(lambda: len(flights) == 0 and flights.statistics()["tasks"] == 0)
    assert_gateway_clean(gw.gateway)
    scheduling = gw.gateway.metrics.scheduling
    for gauge in (scheduling.queue_depth, scheduling.slots_in_use, scheduling.tenant_in_flight):
        assert total(gauge) == 0
    assert total(scheduling.tokens_reserved) == 0
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("lockgate")
    ] == []
    # Exactly one usage record per accepted request (those refused before acceptance count under model "").
    accepted = sum(
        sample.value
        for family in text_string_to_metric_families(gw.gateway.metrics.render().decode())
        if family.name == "lockgate_requests"
        for sample in family.samples
        if sample.name == "lockgate_requests_total" and sample.labels["model"]
    )
    await gw.gateway.records.wait_flushed()
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert accepted > 50 and len(rows) == accepted == len({r["request_id"] for r in rows})
    # Still serving.
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    answer = await asyncio.to_thread(exchange, port, ENDPOINTS[0], body, {"authorization": f"Bearer {KEY}"}, "{n}")
    assert answer is not None and answer.status == 200
