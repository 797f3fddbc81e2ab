"""Passive ejection never empties a pool (issue 14 item 4): engines that reset connections are ejected
only while the rest of every pool they serve can take the traffic; with none routable, the pool panics
over the instances that still pass their health checks."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import instance

EJECTION = {"consecutive_failures": 1, "base_ms": 60000, "max_ms": 60000}


def chat(model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str | None, bytes]:
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        return resp.status, resp.headers.get("x-lockgate-instance"), await resp.read()


async def fleet_view(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/fleet") as resp:
        return {i["name"]: i for i in (await resp.json())["instances"]}


async def two_instance_gateway(start_gateway, a, b):
    """Instances `a` and `b` of model `m`, round robin, no retries, passive ejection after `EJECTION`."""
    return await start_gateway(
        [
            {
                "name": "m",
                "routing": "round_robin",
                "retries": 0,
                "instances": [instance(a, name="a"), instance(b, name="b")],
            }
        ],
        health={"interval_ms": 60000, "ejection": EJECTION},
        scrape={"enabled": False},
    )


async def test_resetting_engines_never_eject_the_whole_pool(start_sim, start_gateway, http):
    a, b = await start_sim(), await start_sim()
    gw = await two_instance_gateway(start_gateway, a, b)
    for sim in (a, b):
        sim.control.update({"reset_after_tokens": 2})  # every answer breaks mid-way
    outcomes = [await post(http, gw.url, chat()) for _ in range(6)]
    assert [status for status, _, _ in outcomes] == [502] * 6  # the engines' failure, never 503
    fleet = gw.gateway.fleet
    ejected = [i.name for i in fleet.instances.values() if i.ejection.ejected]
    assert len(ejected) == 1  # the first to fail; the other is all the pool has left
    [kept] = [i for i in fleet.instances.values() if not i.ejection.ejected]
    assert kept.ejection.held_back >= 4
    described = await fleet_view(http, gw.url)
    assert described[kept.name]["routable"] is True and described[kept.name]["ejection"]["held_back"] >= 4
    assert b'lockgate_instance_ejections_held_back_total{instance="' + kept.name.encode() in gw.gateway.metrics.render()
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
    # The engines recover: the remaining instance serves at once.
    for sim in (a, b):
        sim.control.update({"reset_after_tokens": None})
    status, name, _ = await post(http, gw.url, chat())
    assert status == 200 and name == kept.name


async def test_a_single_instance_is_never_ejected_on_passive_signals(start_sim, start_gateway, http):
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "retries": 0, "instances": [instance(sim, name="only")]}],
        health={"interval_ms": 60000, "ejection": {**EJECTION, "max_ejection_percent": 100}},
        scrape={"enabled": False},
    )
    sim.control.update({"reset_after_tokens": 1})
    for _ in range(3):
        assert (await post(http, gw.url, chat()))[0] == 502
    sim.control.update({"reset_after_tokens": None})
    assert (await post(http, gw.url, chat()))[:2] == (200, "only")
    assert not gw.gateway.fleet.instances[sim.url].ejection.ejected


async def test_an_engine_shared_by_two_models_stays_while_one_of_them_needs_it(start_sim, start_gateway, http):
    shared, other = await start_sim(models=("m", "n")), await start_sim()
    gw = await start_gateway(
        [
            {
                "name": "m",
                "routing": "round_robin",
                "retries": 0,
                "instances": [instance(shared, name="shared"), instance(other, name="other")],
            },
            {"name": "n", "retries": 0, "instances": [instance(shared, name="shared")]},
        ],
        health={"interval_ms": 60000, "ejection": EJECTION},
        scrape={"enabled": False},
    )
    shared.control.update({"reset_after_tokens": 1})
    for _ in range(3):
        assert (await post(http, gw.url, chat("n")))[0] == 502
    instance_ = gw.gateway.fleet.instances[shared.url]
    # Model m could spare it, model n could not: it stays in both.
    assert not instance_.ejection.ejected and instance_.ejection.held_back == 3
    shared.control.update({"reset_after_tokens": None})
    assert (await post(http, gw.url, chat("n")))[:2] == (200, "shared")
    names = {(await post(http, gw.url, chat("m")))[1] for _ in range(2)}
    assert names == {"shared", "other"}


async def test_a_pool_with_nothing_routable_panics_over_the_instances_that_pass_their_checks(
    start_sim, start_gateway, http
):
    a, b = await start_sim(), await start_sim()
    gw = await two_instance_gateway(start_gateway, a, b)
    fleet = gw.gateway.fleet
    a.control.update({"reset_after_tokens": 1})
    assert (await post(http, gw.url, chat()))[0] == 502  # round robin: a first
    assert fleet.instances[a.url].ejection.ejected
    a.control.update({"reset_after_tokens": None})
    # Now b fails its health check: the only instance passing checks is the ejected one.
    b.control.update({"healthy": False})
    await fleet.probe_all()
    assert not fleet.instances[b.url].healthy and fleet.instances[a.url].healthy
    assert fleet.pools["m"].panicking()
    for _ in range(2):
        assert (await post(http, gw.url, chat()))[:2] == (200, "a")
    assert b'lockgate_routing_panics_total{model="m"} 2.0' in gw.gateway.metrics.render()
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
    # Nothing passes its checks: 503, as before.
    a.control.update({"healthy": False})
    await fleet.probe_all()
    status, _, raw = await post(http, gw.url, chat())
    assert status == 503 and orjson.loads(raw)["error"]["code"] == "no_healthy_instance"
