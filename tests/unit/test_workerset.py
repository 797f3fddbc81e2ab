"""`merge_metrics`: several workers' `/metrics` as one exposition, every sample labelled with its worker."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lockgate import workerset
from lockgate.workerset import merge_metrics


def exposition(requests: int, ttft: float) -> bytes:
    registry = CollectorRegistry()
    Counter("lockgate_requests", "Requests.", ["status"], registry=registry).labels("completed").inc(requests)
    Histogram("lockgate_ttft_seconds", "TTFT.", buckets=(0.1, 1.0), registry=registry).observe(ttft)
    Gauge("lockgate_client_connections", "Connections.", registry=registry).set(requests)
    return generate_latest(registry)


def test_every_workers_series_is_kept_with_its_worker_label_and_families_stay_whole() -> None:
    merged = merge_metrics({1: exposition(5, 0.5), 0: exposition(3, 0.05)}, unreachable=[2])
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}  # parses: families are whole
    counted = families["lockgate_requests"].samples
    requests = {s.labels["worker"]: s.value for s in counted if s.name == "lockgate_requests_total"}
    assert requests == {"0": 3.0, "1": 5.0}
    assert families["lockgate_requests"].type == "counter"
    buckets = {
        (s.labels["worker"], s.labels["le"]): s.value
        for s in families["lockgate_ttft_seconds"].samples
        if s.name == "lockgate_ttft_seconds_bucket"
    }
    assert buckets[("0", "0.1")] == 1.0 and buckets[("1", "0.1")] == 0.0 and buckets[("1", "1.0")] == 1.0
    assert [s.value for s in families["lockgate_workers_unreachable"].samples] == [1.0]
    assert merged.decode().count("# TYPE lockgate_requests_total counter") == 1


async def serve_worker(tmp_path: Any, n: int, path: str, handler: Any) -> web.AppRunner:
    """Worker `n`'s socket, answering GET `path` with `handler`; the caller cleans the runner up."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, workerset.socket_path(str(tmp_path), n)).start()
    return runner


async def test_a_worker_that_does_not_answer_or_answers_too_much_is_left_out(tmp_path: Any, monkeypatch: Any) -> None:
    """Asking the others is bounded: a worker without a socket (restarting) and one whose answer is over the cap are
    named as unreachable; the one that answers is heard."""
    monkeypatch.setattr(workerset, "MAX_ANSWER_BYTES", 1024)

    async def small(request: web.Request) -> web.Response:
        return web.Response(body=b'{"requests": [{"worker": 1}]}', content_type="application/json")

    async def large(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 4096)

    runners = [await serve_worker(tmp_path, n, "/admin/requests", handler) for n, handler in ((1, small), (2, large))]
    workers = workerset.WorkerSet(str(tmp_path), index=0, count=4)  # worker 3 has no socket
    try:
        answers, missing = await workers.others_json("/admin/requests", None)
    finally:
        await workers.aclose()
        for runner in runners:
            await runner.cleanup()
    assert answers == [(1, {"requests": [{"worker": 1}]})]
    assert missing == [2, 3]


async def test_a_worker_that_does_not_answer_in_time_is_logged_with_a_reason(
    tmp_path: Any, monkeypatch: Any, caplog: Any
) -> None:
    """An outside run (a worker stopped with SIGSTOP): the log line ended at its colon, a timeout's text being empty."""
    monkeypatch.setattr(workerset, "TIMEOUT_S", 0.2)
    never = asyncio.Event()

    async def hung(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    runner = await serve_worker(tmp_path, 1, "/admin/requests", hung)
    workers = workerset.WorkerSet(str(tmp_path), index=0, count=2)
    try:
        answers, missing = await workers.others_json("/admin/requests", None)
    finally:
        never.set()
        await workers.aclose()
        await runner.cleanup()
    assert answers == [] and missing == [1]
    assert "no answer from worker 1 to GET /admin/requests: none within 0.2 s" in caplog.text


async def test_scrapes_arriving_while_one_is_gathered_share_it(tmp_path: Any) -> None:
    """An outside run: 16 concurrent scrapes of a large fleet each gathered and parsed every worker's text, took
    seconds, and left live workers out (past the 2 s limit). Scrapes that arrive during a gathering now share it."""
    asked, release = asyncio.Event(), asyncio.Event()
    calls = 0

    async def metrics(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        asked.set()
        await release.wait()
        return web.Response(body=exposition(7, 0.5), content_type="text/plain")

    runner = await serve_worker(tmp_path, 1, "/metrics", metrics)
    workers = workerset.WorkerSet(str(tmp_path), index=0, count=2)
    try:
        scrapes = [asyncio.create_task(workers.scrape(exposition(1, 0.05), None)) for _ in range(5)]
        async with asyncio.timeout(10):
            await asked.wait()
            scrapes[0].cancel()  # a scraper that leaves does not end the gathering for the others
            release.set()
            bodies = await asyncio.gather(*scrapes[1:])
        assert calls == 1 and len(set(bodies)) == 1
        assert b'lockgate_requests_total{status="completed",worker="1"} 7.0' in bodies[0]
        # A scrape after it gathers anew.
        await workers.scrape(exposition(1, 0.05), None)
        assert calls == 2
    finally:
        await workers.aclose()
        await runner.cleanup()
