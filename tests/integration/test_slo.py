"""SLO evaluation end to end: a real gateway in front of a simulator serves P0 traffic, one request in a
hundred failing at the engine (the simulator's `fail_status`), and `lockgate slo` (from the usage records,
and from the running gateway with --url) and `GET /admin/slo` report the success objective as burning with
its budget numbers; without the failure, as met. Engine idle comes from the scraped busy signal."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from lockgate.cli import main
from lockgate.records import read_records
from lockgate.server import GatewayServer
from lockgate.sim import SimServer
from lockgate.slo import OBJECTIVES, SloConfig
from lockgate.slo.cli import EXIT_BURNING
from lockgate.slo.usage import count_file
from tests.conftest import instance
from tests.unit.test_slo import _UsageFile

REQUESTS = 100


def chat(n: int, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"q {n}"}], "max_tokens": 2, "stream": stream}


async def _run(
    start_sim: Any, start_gateway: Any, *, failures: int, status: int = 500
) -> tuple[SimServer, GatewayServer]:
    """`REQUESTS` P0 requests through a gateway (half of them streams), the first `failures` of them
    answered `status` by the engine (no retry: the failure reaches the client)."""
    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway(
        [{"name": "m", "retries": 0, "dedup": "off", "instances": [instance(sim, name="e0")]}],
        health={"interval_ms": 60000, "ejection": {"consecutive_failures": 100}},
    )
    headers = {"x-priority": "P0"}
    async with aiohttp.ClientSession(gw.url) as http:
        sim.control.fail_status = status
        for n in range(failures):
            async with http.post("/v1/chat/completions", data=orjson.dumps(chat(n)), headers=headers) as r:
                assert r.status == status
        sim.control.fail_status = None

        async def one(n: int) -> int:
            async with http.post("/v1/chat/completions", data=orjson.dumps(chat(n, n % 2 == 1)), headers=headers) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(n) for n in range(failures, REQUESTS)))
        assert set(statuses) == {200}
    assert gw.gateway is not None
    await gw.gateway.records.wait_flushed()
    return sim, gw


def _config_file(tmp_path: Path, gw: GatewayServer) -> Path:
    """A configuration naming the gateway's usage file (what an operator passes to `lockgate slo`)."""
    path = tmp_path / "lockgate.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "usage": {"path": str(tmp_path / "usage.sqlite3")},
                "models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:9", "engine": "vllm"}]}],
            }
        )
    )
    return path


def _objective(evaluation: dict[str, Any], name: str) -> dict[str, Any]:
    return next(o for o in evaluation["objectives"] if o["name"] == name)


async def test_one_percent_of_p0_failing_burns_the_success_budget(
    start_sim: Any, start_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, gw = await _run(start_sim, start_gateway, failures=1)
    config = _config_file(tmp_path, gw)

    # From the usage records, as JSON; the exit status says an objective burns.
    assert main(["slo", "--config", str(config), "--json"]) == EXIT_BURNING
    evaluation = orjson.loads(capsys.readouterr().out)
    success = _objective(evaluation, "p0_success")
    assert success["status"] == "burning" and success["target"] == 0.999
    assert success["budget_remaining"] == 0.0  # 1% bad of a 0.1% budget: 10 budgets spent
    for window in ("5m", "1h", "30d"):
        assert success["windows"][window] == {"events": 100, "bad": 1, "sli": 0.99, "burn_rate": 10.0}
    firing = {a["severity"]: a["firing"] for a in success["alerts"]}
    assert firing == {"page": False, "ticket": True}  # 10x: under the page's 14.4x, over the ticket's 6x
    assert _objective(evaluation, "p0_ttft")["windows"]["1h"]["events"] == 50  # the completed streams
    assert _objective(evaluation, "p0_ttft")["status"] == "met"
    assert _objective(evaluation, "engine_idle")["status"] == "unknown"  # the records know nothing of it

    # For a person: the status and the budget numbers.
    assert main(["slo", "--config", str(config)]) == EXIT_BURNING
    text = capsys.readouterr().out
    assert "p0_success: P0 success >= 99.9% (target 0.999): BURNING, budget left 0.0%" in text
    assert "1h 1/100 bad, SLI 99.000%, burn 10x" in text and "ALERT ticket" in text

    # The running gateway says the same, at /admin/slo and through `lockgate slo --url`.
    async with aiohttp.ClientSession(gw.url) as http, http.get("/admin/slo") as r:
        assert r.status == 200
        live = await r.json()
    assert _objective(live, "p0_success") == success
    assert await asyncio.to_thread(main, ["slo", "--url", gw.url]) == EXIT_BURNING
    assert "BURNING, budget left 0.0%" in capsys.readouterr().out


async def test_without_failures_the_success_objective_is_met(
    start_sim: Any, start_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, gw = await _run(start_sim, start_gateway, failures=0)
    status = main(["slo", "--config", str(_config_file(tmp_path, gw)), "--json"])
    evaluation = orjson.loads(capsys.readouterr().out)
    burning = [o["name"] for o in evaluation["objectives"] if o["status"] == "burning"]
    # Nothing burns (with de-duplication off nothing could be shared: that objective has no events, `unknown`; it
    # burned on every sampled request, a fresh install's `lockgate slo` exiting 3 on day one).
    assert burning == [] and status == 0 and _objective(evaluation, "dedup_saving")["status"] == "unknown"
    success = _objective(evaluation, "p0_success")
    assert success["status"] == "met" and success["budget_remaining"] == 1.0
    assert success["windows"]["30d"] == {"events": 100, "bad": 0, "sli": 1.0, "burn_rate": 0.0}
    assert not any(a["firing"] for a in success["alerts"])


async def test_an_engines_refusal_of_a_request_is_not_a_failure_of_the_service(
    start_sim: Any, start_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The engine refuses a request for its content (400: too long a prompt, an unsupported parameter): the client's
    # mistake, like one the gateway itself refuses. A client allowed P0 could otherwise page the operator at will.
    _, gw = await _run(start_sim, start_gateway, failures=3, status=400)
    (refused,) = {r["status"] for r in read_records(str(tmp_path / "usage.sqlite3")) if r["http_status"] == 400}
    assert refused == "rejected"
    main(["slo", "--config", str(_config_file(tmp_path, gw)), "--json"])
    evaluation = orjson.loads(capsys.readouterr().out)
    success = _objective(evaluation, "p0_success")
    assert _objective(evaluation, "dedup_saving")["status"] == "unknown"  # de-duplication off: nothing shareable
    assert success["status"] == "met" and success["windows"]["1h"] == {
        "events": 100,
        "bad": 0,
        "sli": 1.0,
        "burn_rate": 0.0,
    }
    async with aiohttp.ClientSession(gw.url) as http, http.get("/metrics") as r:
        metrics = await r.text()
    assert 'lockgate_requests_total{model="m",priority="P0",status="rejected"} 3.0' in metrics
    # The de-duplication outcomes count the same requests as the records: the refused ones are not `bypass`es (they
    # were, counted before the engine answered, so that the rule's saving differed from `/admin/slo`'s).
    assert 'lockgate_dedup_total{outcome="bypass"} 97.0' in metrics


async def test_engine_idle_comes_from_the_scraped_busy_signal(start_sim: Any, start_gateway: Any) -> None:
    sim = await start_sim(tpot_ms=20.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway([{"name": "m", "instances": [instance(sim, name="e0")]}])
    assert gw.gateway is not None
    slo, scraper = gw.gateway.slo, gw.gateway.fleet.scraper
    await scraper.scrape_all()
    slo.sample()  # idle, and nothing waits for it: not counted
    long_stream = {**chat(0, stream=True), "max_tokens": 2000}
    async with (
        aiohttp.ClientSession(gw.url) as http,
        http.post("/v1/chat/completions", data=orjson.dumps(long_stream)) as r,
    ):
        await r.content.readline()  # the first token came: the engine runs the request
        await scraper.scrape_all()
        slo.sample()  # busy
        slo.sample()  # busy
    # Leaving mid-stream aborts it at the engine.
    evaluation = await slo.evaluate()
    idle = _objective(evaluation, "engine_idle")
    # Samples also come from the service's own timer. The idle ones are not counted: nothing was waiting for the
    # engine (an idle fleet without demand wastes nothing); the two busy ones are.
    window = idle["windows"]["5m"]
    assert window["events"] >= 2 and window["bad"] == 0
    assert idle["windows"]["30d"]["events"] is None  # beyond the in-memory samples: unknown
    assert idle["budget_remaining"] is None


async def test_admin_slo_with_unreadable_records_reports_unknown(start_sim: Any, stack: Any) -> None:
    from lockgate.config import parse_config

    sim = await start_sim()
    config = parse_config(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "usage": {"path": ":memory:"},
            "models": [{"name": "m", "instances": [instance(sim)]}],
        }
    )
    gw = await stack.enter_async_context(GatewayServer(config, port=0))
    async with aiohttp.ClientSession(gw.url) as http, http.get("/admin/slo") as r:
        assert r.status == 200
        evaluation = await r.json()
    assert "no usage records" in evaluation["records_error"]
    assert _objective(evaluation, "p0_success")["status"] == "unknown"


async def test_evaluations_are_cached_and_reach_the_dashboard(start_sim: Any, start_gateway: Any) -> None:
    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        dashboard={"interval_ms": 100},
        slo={"cache_ms": 60000},
    )
    assert gw.gateway is not None
    async with aiohttp.ClientSession(gw.url) as http:
        for _ in range(3):
            async with http.get("/admin/slo") as r:
                assert r.status == 200
        assert gw.gateway.slo.evaluations == 1  # the records were read once
        # The dashboard's SLO panel gets the cached evaluation in its snapshots.
        async with http.get("/dashboard/events") as feed:
            async with asyncio.timeout(10):  # bounds a failure only: snapshots come every 100 ms
                async for line in feed.content:
                    if line.startswith(b"data:"):
                        snap = orjson.loads(line[5:])
                        if snap.get("slo"):
                            break
    assert [o["name"] for o in snap["slo"]["objectives"]] == list(OBJECTIVES)
    assert gw.gateway.slo.evaluations == 1


async def test_an_evaluation_cancelled_mid_read_leaves_the_evaluator_usable(start_sim: Any, start_gateway: Any) -> None:
    _, gw = await _run(start_sim, start_gateway, failures=1)
    assert gw.gateway is not None
    slo = gw.gateway.slo
    reading = asyncio.create_task(slo.evaluate())
    await asyncio.sleep(0)  # one step: it is now waiting for its worker thread
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    evaluation = await slo.evaluate()  # its thread waits for the first one's, then reads on the same connection
    assert _objective(evaluation, "p0_success")["windows"]["5m"]["bad"] == 1


async def test_lockgate_slo_url_sends_the_admin_key(
    start_sim: Any, start_gateway: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lockgate.admission.tenants import hash_key

    sim = await start_sim()
    gw: GatewayServer = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "acme", "keys": [hash_key("tenant-key")]}],
        admin={"keys": [hash_key("admin-key")]},
    )
    assert await asyncio.to_thread(main, ["slo", "--url", gw.url]) == 1
    said = capsys.readouterr().err
    # The fix this command takes, not only the gateway's words for HTTP clients (a newcomer's run).
    assert f"{gw.url}/admin/slo answered 401: " in said and "no admin key was given: pass one with --admin-key" in said
    assert await asyncio.to_thread(main, ["slo", "--url", gw.url, "--admin-key", "tenant-key"]) == 1
    said = capsys.readouterr().err
    assert "answered 403" in said and "the admin key given was refused" in said and "$LOCKGATE_ADMIN_KEY" in said
    monkeypatch.setenv("LOCKGATE_ADMIN_KEY", "admin-key")
    assert await asyncio.to_thread(main, ["slo", "--url", gw.url, "--json"]) == 0
    assert [o["name"] for o in orjson.loads(capsys.readouterr().out)["objectives"]] == list(OBJECTIVES)


async def test_p0_streams_given_up_on_a_stuck_engine_are_bad_ttft_events(start_sim: Any, start_gateway: Any) -> None:
    """An outside run: P0 streams waited 7.2 s on a stuck engine, their clients left, and p0_ttft read "met" (only
    completed streams counted; the histogram the Prometheus rule reads never saw them). An embeddings answer is not a
    first token either (it pulled the whole answers' TTFT series down)."""
    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway(
        [{"name": "m", "dedup": "off", "instances": [instance(sim)]}], slo={"ttft_threshold_ms": 200}
    )
    assert gw.gateway is not None
    headers = {"x-priority": "P0"}
    async with aiohttp.ClientSession(gw.url) as http:
        async with http.post("/v1/chat/completions", data=orjson.dumps(chat(0, True)), headers=headers) as r:
            await r.read()
        async with http.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers=headers) as r:
            assert r.status == 200
        sim.control.hold_next = 1
        stuck = asyncio.create_task(
            http.post("/v1/chat/completions", data=orjson.dumps(chat(1, True)), headers=headers)
        )
        async with asyncio.timeout(10):
            await sim.wait_held(1)
            await asyncio.sleep(0.3)  # the client waits past the 200 ms threshold (what is under test), then leaves
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
            await gw.gateway.registry.wait_empty()
            await gw.gateway.records.wait_flushed()
        async with http.get("/metrics") as r:
            exposed = await r.text()
    evaluation = await gw.gateway.slo.evaluate()
    assert _objective(evaluation, "p0_ttft")["windows"]["5m"] == {"events": 2, "bad": 1, "sli": 0.5, "burn_rate": 50.0}
    labels = 'model="m",priority="P0",stream="true"'
    assert f'lockgate_unanswered_wait_seconds_bucket{{le="0.2",{labels}}} 0.0' in exposed
    assert f"lockgate_unanswered_wait_seconds_count{{{labels}}} 1.0" in exposed
    assert f"lockgate_time_to_first_token_seconds_count{{{labels}}} 1.0" in exposed
    assert 'lockgate_time_to_first_token_seconds_count{model="m",priority="P0",stream="false"}' not in exposed


async def test_admin_slo_reads_the_same_records_as_lockgate_slo_config(
    start_sim: Any, start_gateway: Any, tmp_path: Path
) -> None:
    """An outside run: `lockgate slo --config` counted `<usage.path>` and every `<usage.path>.worker-<i>` while
    `/admin/slo` read its own file only (a gateway run once with `--workers` showed 0 events there, 860 in the CLI)."""
    earlier = _UsageFile(str(tmp_path / "usage.sqlite3.worker-1"))  # a run with --workers before this one
    earlier.add(time.time() - 10, "error", n=2)
    sim = await start_sim(tpot_ms=0.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    assert gw.gateway is not None
    body, headers = orjson.dumps(chat(0)), {"x-priority": "P0"}
    async with (
        aiohttp.ClientSession(gw.url) as http,
        http.post("/v1/chat/completions", data=body, headers=headers) as r,
    ):
        assert r.status == 200
    await gw.gateway.records.wait_flushed()
    evaluation = await gw.gateway.slo.evaluate()
    assert _objective(evaluation, "p0_success")["windows"]["5m"]["events"] == 3
    cli = count_file(str(tmp_path / "usage.sqlite3"), SloConfig(), time.time())
    assert cli["p0_success"]["5m"].events == 3
