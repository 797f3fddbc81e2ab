"""`--workers`: each worker takes its part of the limit of an engine it reaches on its own (`Instance.share`)."""

from __future__ import annotations

from pathlib import Path

from lockgate.config import parse_config
from lockgate.fleet.instance import part_of
from lockgate.gateway import Gateway
from lockgate.server import GatewayServer
from lockgate.workerset import WorkerSet


def test_the_parts_add_up_to_the_limit_each_at_least_one() -> None:
    for count in range(1, 6):
        for limit in range(1, 40):
            parts = [part_of(limit, index, count) for index in range(count)]
            assert sum(parts) == max(limit, count) and max(parts) - min(parts) <= 1, (limit, count, parts)


async def test_a_worker_schedules_over_its_part_of_each_engine() -> None:
    """An outside run: three workers each admitted up to an 8-slot engine's whole limit (24 there, 16 waiting in its
    queue), and a P0 behind other workers' P2 streams waited a whole generation (4.7 s). Each takes its part: the pool
    it schedules over, the slots it fills before it preempts, and the engine's load it judges the limit by."""
    models = [
        {
            "name": "m",
            "instances": [
                {"url": "http://127.0.0.1:9", "name": "a", "max_concurrency": 8},
                {"url": "http://127.0.0.1:10", "name": "b", "max_concurrency": 4},
            ],
        }
    ]
    gateway = Gateway(parse_config({"usage": {"path": ":memory:"}, "models": models}, "test"))
    fleet = gateway.fleet
    fleet._build(gateway.config)
    try:
        a, b = (next(i for i in fleet.instances.values() if i.name == name) for name in "ab")
        assert (a.max_concurrency, b.max_concurrency) == (8, 4)
        fleet.split_between(1, 3)
        assert (a.max_concurrency, b.max_concurrency) == (3, 1)  # 8 = 3 + 3 + 2, 4 = 2 + 1 + 1
        gateway.admission.resize(fleet.pools)
        assert gateway.admission.schedulers["m"].core.capacity == 4
        a.in_flight = 3  # its part full: the workers together hold the engine's limit (they share the load alike)
        assert a.engine_in_flight() == 8 and a.concurrency.limit == 8
        assert a.known_slots() == 3  # (stated: its slots; a P0 finds them taken by this worker's requests)
        a.in_flight = 0
        fleet.split_between(0, 1)  # one process: the whole limit
        assert (a.max_concurrency, b.max_concurrency) == (8, 4) and a.known_slots() == 8
    finally:
        await fleet.aclose()


async def test_a_workers_own_simulators_are_not_split(tmp_path: Path) -> None:
    """An outside run: under `--workers 3` with a `simulate:` entry, each worker started its own 4-slot simulator and
    still took a third of it, as of an engine the workers share: 12 requests ran in 4 waves where three simulators
    could run them at once. An instance this process runs for itself is all its own; a listed engine is still split."""
    config = parse_config(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "usage": {"path": str(tmp_path / "u.sqlite3")},
            "simulate": [{"models": ["sim"], "count": 1, "max_num_seqs": 4}],
            "models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:9", "name": "a", "max_concurrency": 8}]}],
        },
        "test",
    )
    async with GatewayServer(config, workers=WorkerSet(str(tmp_path), 0, 3)) as server:
        assert server.gateway is not None
        by_name = {i.name: i.max_concurrency for i in server.gateway.fleet.instances.values()}
        assert by_name == {"sim-1": 4, "a": 3}
        said = server.gateway._shared_engines()  # (the first worker's warning at start)
        assert len(said) == 1 and "instances a are reached" in said[0] and "sim-1" not in said[0]
