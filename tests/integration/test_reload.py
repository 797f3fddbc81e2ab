"""Reloading the configuration with traffic in flight (`POST /admin/reload`, in process).

The acceptance test of issue 16: 20 streams are in flight (held by the engine before their first
token) when a reload adds an instance and a tenant key; every stream completes in full, the new
instance receives new requests, the new key works at once; a file that cannot be used changes nothing
and the answer says why. Removed instances are closed once their last request ends.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lockgate.admission.tenants import hash_key
from lockgate.config import load_config
from lockgate.records import read_records
from lockgate.server import GatewayServer
from lockgate.sim import SimServer
from tests.integration.cancel_support import StreamReader, assert_gateway_clean

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
#: With tenant keys configured, the admin API (reload included) needs an admin key.
ADMIN_KEY = "sk-admin"


def write(path: Path, usage: Path, instances: list[SimServer], keys: dict[str, str], extra: str = "") -> None:
    lines = [
        "listen: {host: 127.0.0.1, port: 0}",
        f"usage: {{path: '{usage}'}}",
        "health: {interval_ms: 60000}",
        "models:",
        "  - name: m",
        "    routing: round_robin",
        "    dedup: 'off'",
        "    instances:",
        *(f"      - {{url: '{sim.url}', engine: vllm, name: {'AB'[n]}{extra}}}" for n, sim in enumerate(instances)),
        "tenants:",
        *(f"  - {{name: {name}, keys: ['{hash_key(key)}']}}" for name, key in keys.items()),
        f"admin: {{keys: ['{hash_key(ADMIN_KEY)}']}}",
    ]
    path.write_text("\n".join(lines) + "\n")


def chat(n: int, stream: bool = True, max_tokens: int = 20) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"story number {n}"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def queued(core: Any) -> int:
    """Requests waiting in a scheduler's queues."""
    return sum(core.queued(k) for k in range(len(core.classes)))


async def one_slot_on(
    http: aiohttp.ClientSession, server: GatewayServer, path: Path, usage: Path, sim: SimServer
) -> None:
    """Reload to model `m` on `sim` alone, with one slot (`max_concurrency: 1`)."""
    write(path, usage, [sim], {"a": KEY_A}, extra=", max_concurrency: 1")
    async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
        assert resp.status == 200


@pytest.fixture
async def gateway(stack: Any, start_sim: Any, tmp_path: Path) -> tuple[GatewayServer, Path, list[SimServer]]:
    sims = [await start_sim(prefill_tps=1e6, tpot_ms=1.0), await start_sim(prefill_tps=1e6, tpot_ms=1.0)]
    path = tmp_path / "gw.yaml"
    write(path, tmp_path / "usage.sqlite3", sims[:1], {"a": KEY_A})
    server = GatewayServer(load_config(path), config_path=path)
    await stack.enter_async_context(server)
    return server, path, sims


async def test_a_warning_still_standing_is_not_said_again_at_each_reload(
    gateway: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside run's log held 181 copies of one start-up warning after as many reloads changing tenants: a
    warning is said when it comes about (at start, or at the reload that brings it), not again while it stands."""
    server, path, (sim_a, _) = gateway
    gw = server.gateway
    assert gw is not None
    assert any("/metrics needs no key" in w for w in gw.unsaid_warnings())  # what `lockgate serve` logs at start
    caplog.set_level(logging.WARNING, logger="lockgate.gateway")
    async with aiohttp.ClientSession() as http:
        for keys in ({"a": KEY_A, "b": KEY_B}, {"a": KEY_A}):
            write(path, tmp_path / "usage.sqlite3", [sim_a], keys)
            async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
                assert (await resp.json())["changes"]["tenants_changed"] is True
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_reload_with_twenty_streams_in_flight(gateway: Any, tmp_path: Path) -> None:
    server, path, (sim_a, sim_b) = gateway
    gw = server.gateway
    assert gw is not None
    url = server.url
    results: list[StreamReader] = []

    async with aiohttp.ClientSession() as http:

        async def stream(n: int) -> None:
            async with http.post(url + "/v1/chat/completions", json=chat(n), headers=auth(KEY_A)) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-lockgate-instance"] == "A"
                reader = StreamReader(resp)
                await reader.read_to_end()
                results.append(reader)

        async with asyncio.timeout(30):
            async with http.post(url + "/v1/chat/completions", json=chat(0, False), headers=auth(KEY_B)) as resp:
                assert resp.status == 401
            sim_a.control.hold_next = 20
            tasks = [asyncio.create_task(stream(n)) for n in range(20)]
            await sim_a.wait_held(20)
            assert len(gw.registry) == 20

            write(path, tmp_path / "usage.sqlite3", [sim_a, sim_b], {"a": KEY_A, "b": KEY_B})
            async with http.post(url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
                assert resp.headers["x-request-id"]
            assert answer["changes"]["instances"]["added"] == ["B"]
            assert answer["changes"]["models"]["changed"] == ["m"]
            assert answer["changes"]["tenants_changed"] is True
            assert len(gw.registry) == 20 and not any(t.done() for t in tasks)

            # The new key works at once, and new requests reach the new instance.
            served_by = []
            for n in range(4):
                async with http.post(
                    url + "/v1/chat/completions", json=chat(100 + n, False), headers=auth(KEY_B)
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    served_by.append(resp.headers["x-lockgate-instance"])
            assert "B" in served_by

            assert sim_a.release() == 20
            await asyncio.gather(*tasks)

    assert len(results) == 20
    assert all(r.done and r.tokens == 20 and not r.errors() for r in results)
    assert sim_b.statistics()["requests_finished"] >= 1
    assert_gateway_clean(gw)


async def test_an_invalid_file_changes_nothing_and_says_why(gateway: Any, tmp_path: Path) -> None:
    server, path, _ = gateway
    gw = server.gateway
    assert gw is not None
    before = gw.config
    path.write_text(path.read_text().replace("engine: vllm", "engine: vlm"))
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 422
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_config" and error["type"] == "invalid_request_error"
        assert "models[0].instances[0].engine" in error["message"]
        assert gw.config is before
        async with http.post(server.url + "/v1/chat/completions", json=chat(1, False), headers=auth(KEY_A)) as resp:
            assert resp.status == 200

        path.write_text("models: [\n")
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 422
            assert "not valid YAML" in (await resp.json())["error"]["message"]
        assert gw.config is before


async def test_a_removed_instance_finishes_its_requests_then_closes(gateway: Any, tmp_path: Path) -> None:
    server, path, (sim_a, sim_b) = gateway
    gw = server.gateway
    assert gw is not None
    usage = tmp_path / "usage.sqlite3"
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        write(path, usage, [sim_a, sim_b], {"a": KEY_A})
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 200
        instance_a = gw.fleet.instances[sim_a.url]
        sim_a.control.hold_next = 1
        sim_b.control.hold_next = 1
        statuses: list[int] = []

        async def one(n: int) -> None:
            async with http.post(server.url + "/v1/chat/completions", json=chat(n, False), headers=auth(KEY_A)) as resp:
                statuses.append(resp.status)
                await resp.read()

        tasks = [asyncio.create_task(one(n)) for n in range(2)]  # round robin: one on each instance
        await asyncio.gather(sim_a.wait_held(1), sim_b.wait_held(1))

        # Only B remains (now under the name C): A and the old B retire; the held requests keep them.
        path.write_text(path.read_text().replace(f"      - {{url: '{sim_a.url}', engine: vllm, name: A}}\n", ""))
        path.write_text(path.read_text().replace("name: B}", "name: C}"))
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            changes = (await resp.json())["changes"]
        assert changes["instances"] == {"added": [], "removed": ["A"], "replaced": ["C"], "renamed": {"B": "C"}}
        assert instance_a.retired and not instance_a.routable and instance_a.in_flight == 1
        assert list(gw.fleet.instances) == [sim_b.url]
        # Its instance gauges stay while its request runs, like its calls and permits (an outside run saw them gone).
        text = gw.metrics.render().decode()
        assert 'lockgate_instance_in_flight{instance="A"} 1.0' in text
        assert 'lockgate_upstream_calls_in_flight{instance="A"} 1.0' in text

        sim_a.release()
        sim_b.release()
        await asyncio.gather(*tasks)
        await gw.fleet.wait_retired()
        assert statuses == [200, 200]
        assert instance_a.session.closed
        assert 'lockgate_instance_in_flight{instance="A"}' not in gw.metrics.render().decode()
        # A health check of A that lands after it closed (an outside run saw its series come back) changes no series.
        gw.fleet._set_health(instance_a, False)
        assert 'lockgate_instance_healthy{instance="A"}' not in gw.metrics.render().decode()
        async with http.post(server.url + "/v1/chat/completions", json=chat(9, False), headers=auth(KEY_A)) as resp:
            assert resp.headers["x-lockgate-instance"] == "C"
    assert_gateway_clean(gw)


async def test_a_queued_request_goes_to_the_instance_that_replaced_its_own(gateway: Any, tmp_path: Path) -> None:
    server, path, (sim_a, _) = gateway
    gw = server.gateway
    assert gw is not None
    usage = tmp_path / "usage.sqlite3"
    scheduler = gw.admission.schedulers["m"]

    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        await one_slot_on(http, server, path, usage, sim_a)
        statuses: list[int] = []

        async def one(n: int) -> None:
            async with http.post(server.url + "/v1/chat/completions", json=chat(n, False), headers=auth(KEY_A)) as resp:
                statuses.append(resp.status)
                await resp.read()

        sim_a.control.hold_next = 1
        tasks = [asyncio.create_task(one(0))]
        await sim_a.wait_held(1)
        tasks.append(asyncio.create_task(one(1)))
        await scheduler.wait_until(lambda core: queued(core) == 1)

        # More room on A: the instance is replaced, the queued request starts at once on the new one.
        write(path, usage, [sim_a], {"a": KEY_A}, extra=", max_concurrency: 2")
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert (await resp.json())["changes"]["instances"]["replaced"] == ["A"]
        await tasks[1]
        sim_a.release()
        await tasks[0]
        assert statuses == [200, 200]
    await gw.fleet.wait_retired()
    assert_gateway_clean(gw)


async def one_held_on(
    http: aiohttp.ClientSession, server: GatewayServer, path: Path, usage: Path, sim: SimServer
) -> asyncio.Task[Any]:
    """Reload to `sim` alone with one slot, and start a request that the engine holds there (awaited: its response)."""
    await one_slot_on(http, server, path, usage, sim)
    sim.control.hold_next = 1
    held = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=chat(0, False), headers=auth(KEY_A)))
    await sim.wait_held(1)
    return held


async def fleet_in_flight(http: aiohttp.ClientSession, server: GatewayServer) -> dict[str, int]:
    """`/admin/fleet`'s in-flight count of each instance, by name."""
    async with http.get(server.url + "/admin/fleet", headers=auth(ADMIN_KEY)) as resp:
        return {row["name"]: row["in_flight"] for row in (await resp.json())["instances"]}


async def reloaded_instances(http: aiohttp.ClientSession, server: GatewayServer) -> dict[str, Any]:
    """Reload; what the answer says of the instances."""
    async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
        assert resp.status == 200
        return dict((await resp.json())["changes"]["instances"])


def in_flight_series(gw: Any, name: str) -> dict[str, str]:
    """The instance's in-flight, permit and open-call series as exported: metric name -> value."""
    lines = gw.metrics.render().decode().splitlines()
    wanted = ("lockgate_instance_in_flight{", "lockgate_permits_in_use{", "lockgate_upstream_calls_in_flight{")
    return {
        line.split("{")[0]: line.rsplit(" ", 1)[1]
        for line in lines
        if line.startswith(wanted) and f'instance="{name}"' in line
    }


async def test_requests_on_a_replaced_instance_count_on_its_replacement_until_they_end(
    gateway: Any, tmp_path: Path
) -> None:
    """An outside run: a reload that replaced both instances (a new `max_concurrency`, the same URLs) showed them idle
    in the in-flight and permit gauges, `/admin/fleet` and the dashboard while their streams ran on; and routing could
    send the engine a whole limit more. The requests of a replaced instance hold its replacement's slots (the same
    engine): they count there until they end."""
    server, path, (sim_a, _) = gateway
    gw = server.gateway
    assert gw is not None
    usage = tmp_path / "usage.sqlite3"

    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        held = await one_held_on(http, server, path, usage, sim_a)
        old = gw.fleet.instances[sim_a.url]
        write(path, usage, [sim_a], {"a": KEY_A}, extra=", max_concurrency: 2")
        assert (await reloaded_instances(http, server))["replaced"] == ["A"]
        new = gw.fleet.instances[sim_a.url]
        assert new is not old and old.retired and new.in_flight == 1 and new.leased == {"m": 1}
        assert in_flight_series(gw, "A") == {
            "lockgate_instance_in_flight": "1.0",
            "lockgate_permits_in_use": "1.0",
            "lockgate_upstream_calls_in_flight": "1.0",
        }
        assert await fleet_in_flight(http, server) == {"A": 1}
        # Replaced again while it runs (renamed too): it counts on the newest one, once.
        path.write_text(path.read_text().replace("name: A", "name: Z"))
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 200
        newest = gw.fleet.instances[sim_a.url]
        assert newest.in_flight == 1 and in_flight_series(gw, "Z")["lockgate_upstream_calls_in_flight"] == "1.0"
        assert in_flight_series(gw, "A") == {}  # (not counted twice, under its former name too)
        assert await fleet_in_flight(http, server) == {"Z": 1}
        sim_a.release()
        async with await held as resp:
            assert resp.status == 200
            await resp.read()
        await gw.fleet.wait_retired()
        assert (old.in_flight, new.in_flight, newest.in_flight) == (0, 0, 0) and newest.leased == {}
        assert in_flight_series(gw, "Z") == {
            "lockgate_instance_in_flight": "0.0",
            "lockgate_permits_in_use": "0.0",
            "lockgate_upstream_calls_in_flight": "0.0",
        }
    assert_gateway_clean(gw)


async def test_requests_of_an_instance_moved_or_removed_and_added_back_stay_in_sight(
    gateway: Any, tmp_path: Path
) -> None:
    """An outside run: a reload that gave instance A another URL (the same name) showed A idle while the old engine ran
    its streams (one series a name: the new A's hid them); one that removed B and a later one that added it back (the
    same URL) showed the new B idle while the engine ran the old B's. The first show under the name (and in
    `/admin/fleet`'s `retiring`); the second count on the instance that came back, as after a replacement."""
    server, path, (sim_a, sim_b) = gateway
    gw = server.gateway
    assert gw is not None
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        held = await one_held_on(http, server, path, tmp_path / "usage.sqlite3", sim_a)
        path.write_text(path.read_text().replace(sim_a.url, sim_b.url))  # A is now the other engine
        assert await reloaded_instances(http, server) == {
            "added": ["A"],
            "removed": ["A"],
            "replaced": [],
            "renamed": {},
        }
        one = {
            "lockgate_instance_in_flight": "1.0",
            "lockgate_permits_in_use": "1.0",
            "lockgate_upstream_calls_in_flight": "1.0",
        }
        assert in_flight_series(gw, "A") == one
        async with http.get(server.url + "/admin/fleet", headers=auth(ADMIN_KEY)) as resp:
            fleet = await resp.json()
        assert fleet["retiring"] == [{"name": "A", "url": sim_a.url, "in_flight": 1, "calls_open": 1}]
        # Back to the first engine while its request runs: the instance that came back counts it.
        path.write_text(path.read_text().replace(sim_b.url, sim_a.url))
        await reloaded_instances(http, server)
        assert gw.fleet.instances[sim_a.url].in_flight == 1 and in_flight_series(gw, "A") == one
        sim_a.release()
        async with await held as resp:
            assert resp.status == 200
            await resp.read()
        await gw.fleet.wait_retired()
        assert gw.fleet.instances[sim_a.url].in_flight == 0
        assert in_flight_series(gw, "A") == {key: "0.0" for key in one}
    assert_gateway_clean(gw)


async def test_the_embedded_default_has_nothing_to_reload(start_gateway: Any, start_sim: Any) -> None:
    sim = await start_sim()
    server = await start_gateway([{"name": "m", "instances": [{"url": sim.url, "engine": "vllm"}]}])
    async with aiohttp.ClientSession() as http, http.post(server.url + "/admin/reload") as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "nothing_to_reload"
    assert "--config" in error["message"]


async def test_a_queued_request_goes_to_a_new_engine_without_waiting_for_the_removed_ones(
    gateway: Any, tmp_path: Path
) -> None:
    """A reload swaps engine A for engine B while A runs a request and another waits for the pool's only slot: the
    waiting request starts on B at once (A's request no longer takes a slot of the pool's new capacity), and A's
    request, once ended, frees no slot beyond B's."""
    server, path, (sim_a, sim_b) = gateway
    gw = server.gateway
    assert gw is not None
    usage = tmp_path / "usage.sqlite3"
    scheduler = gw.admission.schedulers["m"]

    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        await one_slot_on(http, server, path, usage, sim_a)
        served: list[str] = []

        async def one(n: int) -> None:
            async with http.post(server.url + "/v1/chat/completions", json=chat(n, False), headers=auth(KEY_A)) as resp:
                assert resp.status == 200, await resp.text()
                served.append(resp.headers["x-lockgate-instance"])
                await resp.read()

        sim_a.control.hold_next = 1
        first = asyncio.create_task(one(0))
        await sim_a.wait_held(1)
        second = asyncio.create_task(one(1))
        await scheduler.wait_until(lambda core: queued(core) == 1)

        # A is swapped for B (another engine, the same single slot): the queued request goes to B now.
        path.write_text(path.read_text().replace(sim_a.url, sim_b.url).replace("name: A", "name: B"))
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            changed = (await resp.json())["changes"]["instances"]
            assert changed == {"added": ["B"], "removed": ["A"], "replaced": [], "renamed": {}}
        await second
        assert served == ["B"] and not first.done()
        assert scheduler.core.capacity == 2  # B's slot, and A's request's until it ends

        # While A's request runs, B still takes one request at a time.
        sim_b.control.hold_next = 1
        third = asyncio.create_task(one(2))
        await sim_b.wait_held(1)
        fourth = asyncio.create_task(one(3))
        await scheduler.wait_until(lambda core: queued(core) == 1)

        # A's request ends: its slot leaves with it (the request queued for B still waits).
        sim_a.release()
        await first
        await gw.fleet.wait_retired()
        assert scheduler.core.capacity == 1 and queued(scheduler.core) == 1 and not fourth.done()
        sim_b.release()
        await asyncio.gather(third, fourth)
        assert served == ["B", "A", "B", "B"]
    assert_gateway_clean(gw)


def queue_series(gw: Any, model: str) -> dict[str, str]:
    """The model's queue-depth and slots-in-use series as exported: sample (name and labels) -> value."""
    lines = gw.metrics.render().decode().splitlines()
    wanted = (f'lockgate_queue_depth{{model="{model}"', f'lockgate_queue_slots_in_use{{model="{model}"')
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in lines if line.startswith(wanted)}


@pytest.mark.parametrize("temperature", [None, 0.0])
async def test_requests_queued_for_a_model_a_reload_removes_are_told_at_once(
    gateway: Any, tmp_path: Path, temperature: float | None
) -> None:
    """A reload removes model `gone` while one of its requests runs and another waits for its only slot: the waiting
    request is answered 404 `model_not_found` at once, saying a reload removed the model (it waited for the running
    request and then got 503 `no_healthy_instance`); the running one completes. At temperature 0 the requests may be
    de-duplicated: the queued one waits to lead a flight (`Slot.wait(unless)`), and is told as well, and so is an
    identical one waiting behind it (an outside run: it queued anew in the removed pool when the one ahead was told,
    until its queue deadline). The model added again by a later reload takes requests again."""
    server, path, (sim_a, sim_b) = gateway
    gw = server.gateway
    assert gw is not None
    usage = tmp_path / "usage.sqlite3"
    write(path, usage, [sim_b], {"a": KEY_A})
    both = path.read_text().replace(
        "tenants:",
        f"  - name: gone\n    instances: [{{url: '{sim_a.url}', max_concurrency: 1, served_model: m}}]\ntenants:",
    )
    path.write_text(both)

    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 200, await resp.text()
        scheduler = gw.admission.schedulers["gone"]

        async def one(n: int) -> tuple[int, Any]:
            body = {**chat(n, False), "model": "gone"}
            if temperature is not None:
                body["temperature"] = temperature
            async with http.post(server.url + "/v1/chat/completions", json=body, headers=auth(KEY_A)) as resp:
                return resp.status, await resp.json()

        sim_a.control.hold_next = 1
        running = asyncio.create_task(one(0))
        await sim_a.wait_held(1)
        waiting = asyncio.create_task(one(1))
        await scheduler.wait_until(lambda core: queued(core) == 1)
        twin = None
        if temperature is not None:  # an identical request waits behind the queued one, without a ticket
            twin = asyncio.create_task(one(1))
            await gw.dedup.waiting.wait_until(lambda: len(gw.dedup.waiting) == 2)

        write(path, usage, [sim_b], {"a": KEY_A})
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert (await resp.json())["changes"]["models"]["removed"] == ["gone"]
        status, answer = await waiting
        assert status == 404 and not running.done()
        assert answer["error"]["code"] == "model_not_found"
        assert "removed" in answer["error"]["message"] and "'gone'" in answer["error"]["message"]
        if twin is not None:
            status, answer = await twin
            assert status == 404 and answer["error"]["code"] == "model_not_found"
        # Its queue gauges stay while its request runs, and go with it (an outside run: exported at 0 for as long as
        # the model was not configured).
        assert sorted(queue_series(gw, "gone").values()) == ["0.0"] * 5 + ["1.0"]
        sim_a.release()
        assert (await running)[0] == 200
        await gw.fleet.wait_retired()
        assert queue_series(gw, "gone") == {}
        path.write_text(both)  # the model again
        async with http.post(server.url + "/admin/reload", headers=auth(ADMIN_KEY)) as resp:
            assert (await resp.json())["changes"]["models"]["added"] == ["gone"]
        assert len(queue_series(gw, "gone")) == 6
        assert (await one(2))[0] == 200
    await gw.fleet.wait_retired()
    assert_gateway_clean(gw)
    # Refused, not failed (it was recorded `error`, and counted against the success objective).
    await gw.records.wait_flushed()
    by_model = {r["model"]: r for r in read_records(str(usage)) if r["http_status"] == 404}
    assert by_model["gone"]["status"] == "rejected"
