"""An engine that goes silent — a hung GPU: its `/health` still answers, its streams stop — holds a request for
`upstream.stall_timeout_ms`, not forever. A stream that had begun ends with a 504-coded error event (never `[DONE]`)
and everything the request held is given back; one that had sent nothing to the client yet is tried on another
instance. The engine sees its connection closed, and the instance is reported failed (kind `stall`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean, counter
from tests.integration.fake_engines import hung_engine, next_post, raw_server

STALL = {"upstream": {"stall_timeout_ms": 100}}


def _request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, **extra}


async def test_a_stream_whose_engine_goes_silent_ends_with_a_stall_error(start_gateway, stack, tmp_path):
    gone = asyncio.Event()
    url = await hung_engine(stack, 2, gone)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}], **STALL)
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=_request()) as resp:
        assert resp.status == 200  # the stream had begun: the error comes as its last event
        raw = await resp.read()
    assert b'"content":"a"' in raw and b'"content":"b"' in raw and b"[DONE]" not in raw
    last = orjson.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_stalled"
    assert "upstream.stall_timeout_ms" in last["error"]["message"]
    await asyncio.wait_for(gone.wait(), 5)  # the engine saw its connection closed
    assert counter(gw.gateway.metrics.upstream_errors, instance="e", kind="stall") == 1
    assert_gateway_clean(gw.gateway)
    await gw.gateway.records.wait_flushed()
    (row,) = read_records(str(tmp_path / "usage.sqlite3"))
    assert row["status"] == "error"


@pytest.mark.parametrize("sends", ["keep-alives", "empty-events", "hollow-events"])
async def test_a_stream_that_brings_only_keep_alives_is_stalled_too(start_gateway, stack, sends):
    """Bytes keep coming, a byte at a time, and never an event (a proxy's keep-alive comments in front of a hung
    engine): the connection's own watch sees bytes; the stream's sees no token for `upstream.stall_timeout_ms`. So
    with events that carry nothing (`data: null`, `data: {}` every 10 ms: an outside run's broken engine held a
    stream, its slot and its engine connection for as long as its client waited), and with chunks that have choices
    but no token (an empty delta or content: they held it until the model's `timeout_ms`, by default forever)."""
    gone = asyncio.Event()
    url = await hung_engine(
        stack,
        1,
        gone,
        pings=sends == "keep-alives",
        empty_events=sends == "empty-events",
        hollow_events=sends == "hollow-events",
    )
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}], **STALL)
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/chat/completions", json=_request()) as resp:
        raw = await resp.read()
    assert b'"content":"a"' in raw and b"[DONE]" not in raw
    last = orjson.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_stalled" and "keep-alives" in last["error"]["message"]
    assert counter(gw.gateway.metrics.upstream_errors, instance="e", kind="stall") == 1
    assert_gateway_clean(gw.gateway)


async def test_a_client_wanting_the_whole_answer_gets_504_and_a_silent_engine_is_left_for_another(
    start_gateway, start_sim, stack
):
    """Nothing reached the client yet: the request goes on to the healthy instance. With nowhere else to go (a model
    that the hung engine serves alone), the client gets 504."""
    gone = asyncio.Event()
    url = await hung_engine(stack, 0, gone)
    sim = await start_sim()
    hung = {"url": url, "engine": "llamacpp", "name": "hung"}  # read as a stream whatever the client asked
    gw = await start_gateway(
        [
            {"name": "m", "routing": "round_robin", "instances": [hung, instance(sim, name="sim")]},
            {"name": "alone", "instances": [{**hung, "served_model": "m"}]},
        ],
        **STALL,
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # round robin: one of the two starts on the hung engine
            async with http.post(gw.url + "/v1/chat/completions", json=_request()) as resp:
                assert resp.status == 200
                raw = await resp.read()
            assert raw.endswith(b"data: [DONE]\n\n") and b"error" not in raw
        assert counter(gw.gateway.metrics.upstream_errors, instance="hung", kind="stall") >= 1
        async with http.post(gw.url + "/v1/chat/completions", json=_request(model="alone", stream=False)) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["code"] == "upstream_stalled" and error["type"] == "upstream_error"
    assert_gateway_clean(gw.gateway)


async def test_a_non_streaming_call_that_never_begins_its_answer_is_closed_as_hung(start_gateway, stack, tmp_path):
    """Nothing can be watched on a non-streaming engine call (its answer comes whole, at its end): one that has not
    begun its answer within `upstream.answer_timeout_ms` is closed the same way (504 `upstream_stalled`, charged to
    the instance), whatever the client's patience; the model's own deadline (none) is not what ends it."""
    gone = asyncio.Event()
    url = await hung_engine(stack, 0, gone, whole=True)
    gw = await start_gateway(
        [{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}],
        upstream={"answer_timeout_ms": 100},
    )
    assert gw.gateway.config.models[0].timeout_ms is None
    async with aiohttp.ClientSession() as http:
        body = _request(stream=False, temperature=1.0)
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["code"] == "upstream_stalled" and "answer_timeout_ms" in error["message"]
    async with asyncio.timeout(5):
        await gone.wait()
    assert counter(gw.gateway.metrics.upstream_errors, instance="e", kind="stall") == 1
    assert_gateway_clean(gw.gateway)


async def test_a_health_check_that_times_out_says_so(start_gateway, stack, caplog):
    """An engine whose /health hangs: the log and /admin/fleet said "health check failed: " and nothing more."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers
        writer.close()

    url = await raw_server(stack, serve)
    gw = await start_gateway(
        [{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "e"}]}],
        health={"interval_ms": 60000, "timeout_ms": 50},
    )
    fleet = gw.gateway.fleet
    await fleet.probe_all()
    (instance,) = fleet.instances.values()
    assert instance.last_error == "health check failed: no answer within 0.05 s"
    assert "instance e is now unhealthy: health check failed: no answer within 0.05 s" in caplog.text


async def test_a_shared_call_stuck_on_its_engine_takes_no_new_joiners(start_gateway, stack, monkeypatch):
    """A client that retries an identical deterministic request after its own timeout joined the shared call stuck
    on a hung engine (an outside run: every retry hung, the other engine idle). Past `STUCK_S` with nothing from
    its engine, the call takes no more clients: the retry makes a call of its own."""
    from lockgate.dedup import flights

    monkeypatch.setattr(flights, "STUCK_S", 0.0)  # (every call without its first event is past it)
    gone, arrived = asyncio.Event(), asyncio.Event()
    url = await hung_engine(stack, 0, gone, arrived)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}])
    shared = gw.gateway.dedup.flights
    async with aiohttp.ClientSession() as http:
        body = _request(temperature=0)  # de-duplicated
        calls = []
        for n in (1, 2):
            calls.append(asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body)))
            async with asyncio.timeout(5):
                await arrived.wait()  # the engine got a call of its own for each
            arrived.clear()
            assert shared.started == n
        assert shared.closed_to_joiners == 1
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


async def _silent_then_answering(stack: contextlib.AsyncExitStack, paths: list[str], *, recovers: bool) -> str:
    """A fake engine whose `/health` always answers and whose first generation hangs (its head, then nothing). After
    that, every request path is recorded in `paths`; a recovered engine (`recovers`) answers each with one token,
    one still hung does not answer at all."""
    hung_once = False

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hung_once
        try:
            while True:
                head = await next_post(reader, writer)
                if hung_once:
                    paths.append(head.split(b" ")[1].decode())
                if hung_once and recovers:
                    answer = orjson.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(answer), answer)
                    )
                    continue
                hung_once = True
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                assert await reader.read() == b""  # nothing, until the gateway closes the connection
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await raw_server(stack, serve)


async def _eject_the_silent_one(start_gateway, start_sim, url: str) -> Any:
    """A gateway over the fake engine (`hung`) and a simulator, the fake one ejected after the stream it went silent
    in (that client's request was served by the simulator)."""
    sim = await start_sim()
    gw = await start_gateway(
        [
            {
                "name": "m",
                "routing": "round_robin",
                "instances": [{"url": url, "engine": "vllm", "name": "hung"}, instance(sim, name="sim")],
            }
        ],
        upstream={"stall_timeout_ms": 100},
        health={
            "interval_ms": 60_000,
            "answer_probe_timeout_ms": 100,
            "ejection": {"consecutive_failures": 1, "base_ms": 20, "max_ms": 40},
        },
    )
    fleet = gw.gateway.fleet
    (hung,) = [i for i in fleet.instances.values() if i.name == "hung"]
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # round robin: one of the two starts on the silent engine, and is served by the other
            async with http.post(gw.url + "/v1/chat/completions", json=_request()) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert counter(gw.gateway.metrics.upstream_errors, instance="hung", kind="stall") == 1
    return gw, hung


async def test_an_engine_that_went_silent_stays_out_until_it_answers(start_gateway, start_sim, stack):
    """Its `/health` passed all along: a health probe alone brought it back at its first backoff's end, to hang the
    next requests for `upstream.stall_timeout_ms` each (an outside run). Now it returns only once it answers a
    one-token request; until then its backoff doubles (an engine that never served since its return does not start
    over)."""
    paths: list[str] = []
    url = await _silent_then_answering(stack, paths, recovers=False)
    gw, hung = await _eject_the_silent_one(start_gateway, start_sim, url)
    async with asyncio.timeout(10):
        await gw.gateway.fleet.wait_until(lambda _: hung.ejection.ejections >= 3)  # two answer probes failed
    assert hung.ejection.ejected and hung.ejection.silent
    assert paths[:2] == ["/v1/completions", "/v1/completions"]  # nothing but the probes reached it
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/admin/fleet") as resp:
        described = {i["name"]: i for i in (await resp.json())["instances"]}
    assert described["hung"]["ejection"]["ejected"] and described["hung"]["ejection"]["awaits_answer"]
    assert "no answer to a one-token request within 0.1 s" in (hung.last_error or "")
    assert_gateway_clean(gw.gateway)


async def test_an_engine_that_went_silent_returns_once_it_answers(start_gateway, start_sim, stack, caplog):
    paths: list[str] = []
    url = await _silent_then_answering(stack, paths, recovers=True)
    gw, hung = await _eject_the_silent_one(start_gateway, start_sim, url)
    async with asyncio.timeout(10):
        await gw.gateway.fleet.wait_until(lambda _: not hung.ejection.ejected)
    assert paths == ["/v1/completions"] and not hung.ejection.silent
    assert "instance hung returns: it answered a one-token request" in caplog.text


async def test_the_simulator_passes_the_answer_probe(start_gateway, start_sim, stack):
    """A one-token answer passes; so does a refusal of the request itself (an embedding model, a name the engine does
    not know: a review found an embeddings-only instance kept out for good), not a 5xx."""
    from lockgate.fleet.answers import answers

    async def failing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        writer.close()

    sim = await start_sim()
    broken = {"url": await raw_server(stack, failing), "engine": "vllm", "name": "broken"}
    gw = await start_gateway([{"name": "m", "instances": [instance(sim, name="sim"), broken]}])
    instances = {i.name: i for i in gw.gateway.fleet.instances.values()}
    assert await answers(instances["sim"], "m", 5.0), instances["sim"].last_error
    assert await answers(instances["sim"], "no-such-model", 5.0)  # a 404: it answers
    assert not await answers(instances["broken"], "m", 5.0)
    assert "HTTP 503 to a one-token request" in (instances["broken"].last_error or "")


async def test_an_answer_probe_reads_no_more_than_its_bound(start_gateway, stack):
    """An engine answering the probe with more than a side call's bound (64 KiB) fails it; nothing past the bound is
    held."""
    from lockgate.fleet.answers import answers
    from lockgate.fleet.bounded import MAX_SIDE_BODY_BYTES

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await next_post(reader, writer)
            body = b'{"choices": [{"text": "' + b"x" * MAX_SIDE_BODY_BYTES + b'"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # (the gateway's health check, closed at the end; or the probe, closed at the bound)
        finally:
            writer.close()

    url = await raw_server(stack, huge)
    gw = await start_gateway([{"name": "m", "instances": [{"url": url, "engine": "vllm", "name": "big"}]}])
    (big,) = gw.gateway.fleet.instances.values()
    assert not await answers(big, "m", 5.0)
    assert (big.last_error or "").startswith("answer probe failed")
