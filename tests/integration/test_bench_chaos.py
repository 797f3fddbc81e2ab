"""`lockgate bench chaos`, the short version that runs in CI: a few hundred seeded requests through fault
proxies (resets), with clients leaving and reading slowly; every check must pass. Plus the fault proxy on its
own, and the checks themselves catching violations."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import orjson
import pytest

from lockgate.bench import chaos
from lockgate.bench.chaosclient import Manner, Outcome
from lockgate.bench.faultproxy import FaultProxy
from lockgate.http import HttpPool, StalledError
from tests.integration.cancel_support import wait_sim_idle


async def test_short_chaos_run_passes_every_check() -> None:
    result = await chaos.run(chaos.Settings(requests=300, concurrency=24, warmup=32, seed=7, stall=0.05))
    text = chaos.report(result)
    assert result.ok, text
    manners = {o.manner for o in result.outcomes}
    assert manners == {Manner.READ, Manner.LEAVE, Manner.SLOW}, text
    # The chaos really happened: resets, frozen answers, clients leaving.
    assert result.resets >= 1 and result.stalls >= 1 and any(o.left for o in result.outcomes), text
    assert len(result.records) == result.accepted >= 300
    assert any(r["status"] == "cancelled" for r in result.records)
    print(text)


def test_the_checks_catch_each_kind_of_violation() -> None:
    usage = chaos.Usage(rss_kb=50_000, fds=40, upstream_connections=10)
    good = chaos.Result(
        chaos.Settings(),
        outcomes=[Outcome("c-0", Manner.READ, stream=True, status=200, complete=True)],
        records=[{"request_id": "lg-1", "client_request_id": "c-0", "status": "completed", "cancel_reason": None}],
        accepted=1,
        quiesce_s=0.01,
        baseline=usage,
        after=usage,
        exit_status=0,
    )
    assert all(ok for _, ok, _ in chaos.verdicts(good))

    def failed(**changes: Any) -> list[str]:
        return [what for what, ok, _ in chaos.verdicts(dataclasses.replace(good, **changes)) if not ok]

    assert failed(records=[]) == ["one usage record per accepted request"]
    assert failed(records=good.records * 2, accepted=2) == ["one usage record per accepted request"]
    assert failed(quiesce_s=None, not_quiet=["x"]) == [
        "quiescent (no request, flight, call, lease, slot, reservation, violation)"
    ]
    assert failed(outcomes=[Outcome("c-0", Manner.READ, True, status=503, complete=True)]) == [
        "no 500 and no 503 (the pool never ran dry)"
    ]
    assert failed(after=dataclasses.replace(usage, rss_kb=200_000))[0].startswith("RSS")
    assert failed(after=dataclasses.replace(usage, fds=60))[0].startswith("open descriptors")
    assert failed(after=dataclasses.replace(usage, fds=60, upstream_connections=30)) == []
    assert failed(exit_status=1) == ["stopped cleanly on SIGTERM"]


async def test_fault_proxy_resets_engine_requests_and_leaves_probes_alone(start_sim) -> None:
    sim = await start_sim()
    async with FaultProxy("127.0.0.1", sim.port, reset_fraction=1.0, max_offset=0) as proxy:
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy.url + "/health") as resp:
                assert resp.status == 200
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            try:
                async with http.post(proxy.url + "/v1/chat/completions", data=body) as resp:
                    raise AssertionError(f"answered {resp.status}")
            except aiohttp.ClientError:
                pass
        assert proxy.stats.requests == 1 and proxy.stats.resets_before_answer == 1
        proxy.reset_fraction = 0.0
        async with aiohttp.ClientSession() as http, http.post(proxy.url + "/v1/chat/completions", data=body) as resp:
            assert resp.status == 200 and (await resp.json())["choices"]


async def test_fault_proxy_freezes_an_answer_until_its_client_gives_up(start_sim) -> None:
    """A frozen answer: its head never comes; when the client closes, the engine's connection is closed too (the
    simulated engine sees its client gone and drops the request)."""
    sim = await start_sim()
    async with FaultProxy("127.0.0.1", sim.port, stall_fraction=1.0, max_offset=0) as proxy:
        pool = HttpPool(proxy.url)
        try:
            body = orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000, "stream": True}
            )
            with pytest.raises(StalledError):
                await pool.request("POST", "/v1/chat/completions", body, watch=0.05)
        finally:
            await pool.aclose()
        assert proxy.stats.stalls == 1
        await asyncio.wait_for(wait_sim_idle(sim), 10)
