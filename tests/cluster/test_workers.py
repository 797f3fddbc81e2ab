"""`lockgate serve --workers 2`: two processes on one port, each a replica of the cluster; SIGTERM to the
supervisor stops both, which exit cleanly. Without a `cluster:` section (or a fixed port) it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from lockgate.admin_api import summed
from lockgate.config import parse_config
from lockgate.server import GatewayServer
from lockgate.sim import SimConfig, SimServer
from lockgate.workers import START_GRACE_S, WorkersError, run_workers, worker_command
from tests.cluster.support import central_config, poll_until, sidecar_config, unique_cluster
from tests.etcd_support import EtcdServer, free_port


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


async def workers_behind_a_sidecar(
    etcd: EtcdServer,
    stack: contextlib.AsyncExitStack,
    tmp_path: Path,
    label: str,
    sim_config: SimConfig | None = None,
    extra_env: dict[str, str] | None = None,
    extra_config: dict[str, Any] | None = None,
) -> tuple[asyncio.subprocess.Process, str, Path, dict[str, Any]]:
    """A sidecar with a simulator (default: a fast one), and `lockgate serve --workers 2` as central replicas of its
    cluster: the supervisor's process, its URL, its config file and the config written there."""
    name = unique_cluster(label)
    sim = await stack.enter_async_context(SimServer(sim_config or SimConfig(models=("m",), fast=True)))
    await stack.enter_async_context(
        GatewayServer(
            parse_config(sidecar_config(etcd.url, name, [sim], str(tmp_path / "s.sqlite3"), f"node-{label}")),
            role="sidecar",
        )
    )
    port = free_port()
    config: dict[str, Any] = central_config(etcd.url, name, str(tmp_path / "c.sqlite3"))
    config["listen"] = {"host": "127.0.0.1", "port": port}
    config.update(extra_config or {})
    path = tmp_path / "central.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lockgate", "serve", "--config", str(path), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, env={**env(), **(extra_env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{port}", path, config


async def listening(proc: asyncio.subprocess.Process, count: int) -> list[bytes]:
    """Until `count` more workers of `proc` said they listen (30 s at most): what each said first."""
    assert proc.stdout is not None
    said = []
    async with asyncio.timeout(30):
        for _ in range(count):
            while b"lockgate listening on" not in (line := await proc.stdout.readline()):
                assert not proc.stdout.at_eof(), "a worker exited early"
            said.append(line)
    return said


async def terminated(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM to the supervisor: its exit status, once its workers' output has ended (30 s at most)."""
    assert proc.stdout is not None
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        await proc.stdout.read()
        return await proc.wait()


async def test_two_workers_share_a_port_as_replicas(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    proc, url, _, _ = await workers_behind_a_sidecar(etcd, stack, tmp_path, "w")
    try:
        # The first worker prints the banner (models, the curl to try, where the metrics are), the other one line:
        # a newcomer saw the whole banner once per worker.
        said = sorted(await listening(proc, 2))
        assert said[0].rstrip() == f"lockgate listening on {url}".encode()
        assert said[1].rstrip() == f"lockgate listening on {url} (worker 2 of 2)".encode()
        session = await stack.enter_async_context(aiohttp.ClientSession())

        async def both_replicas_ready() -> bool:
            async with session.get(url + "/admin/fleet") as resp:
                cluster = (await resp.json())["cluster"]
            return len(cluster["replicas"]) == 2 and [n["node"] for n in cluster["nodes"]] == ["node-w"]

        await poll_until(both_replicas_ready, what="two replicas that see the sidecar")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(6):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert await terminated(proc) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    names = await asyncio.to_thread(lambda: {p.name for p in tmp_path.glob("c.sqlite3.worker-*")})
    assert {"c.sqlite3.worker-0", "c.sqlite3.worker-1"} <= names  # one usage database per worker


def test_workers_need_a_cluster_and_a_port() -> None:
    alone = parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]})
    with pytest.raises(WorkersError, match="needs a configuration file with a `cluster:` section"):
        run_workers(alone, "alone.yaml", 2, host=None, port=None)
    clustered = parse_config({"cluster": {"name": "c"}, "listen": {"port": 0}})
    with pytest.raises(WorkersError, match="needs a TCP port"):
        run_workers(clustered, "c.yaml", 2, host=None, port=None)


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (Linux /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_workers_are_replaced_reloaded_together_and_never_outlive_their_supervisor(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """Outside runs: a worker killed took the whole gateway down; `POST /admin/reload` reloaded only the worker
    that took it (a revoked key went on working on the other); workers of a supervisor killed with SIGKILL went on
    serving the port."""
    proc, url, path, config = await workers_behind_a_sidecar(etcd, stack, tmp_path, "l")
    started = asyncio.get_running_loop().time()  # just after the workers were spawned
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    session = await stack.enter_async_context(aiohttp.ClientSession())

    async def statuses(n: int, **headers: str) -> list[int]:
        out = []
        for _ in range(n):  # a new connection each: the kernel spreads them over the workers
            async with session.post(
                url + "/v1/chat/completions", json=body, headers={"Connection": "close", **headers}
            ) as resp:
                await resp.read()
                out.append(resp.status)
        return out

    try:
        await listening(proc, 2)
        workers = children_of(proc.pid)
        assert len(workers) == 2

        async def all_ok() -> bool:
            return await statuses(6) == [200] * 6

        await poll_until(all_ok, what="both workers to see the sidecar's engines")

        # One worker killed after it started: it is started again, the gateway never stops serving.
        # The supervisor's rule is a time: a worker that ends within START_GRACE_S of the launch could not start. Let
        # that time pass (a known threshold, not a guess at a condition).
        await asyncio.sleep(max(0.0, started + START_GRACE_S + 0.5 - asyncio.get_running_loop().time()))
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await listening(proc, 1)  # its replacement
        assert proc.returncode is None
        # Its replacement killed at once (out of memory again, right after its restart): started again too, not
        # taken for a worker that cannot start (that stopped the whole gateway).
        [again] = set(children_of(proc.pid)) - set(workers)
        os.kill(again, signal.SIGKILL)
        await listening(proc, 1)
        assert proc.returncode is None
        replaced = children_of(proc.pid)
        assert len(replaced) == 2 and victim not in replaced and again not in replaced

        await poll_until(all_ok, what="both workers serving again")

        # A reload over HTTP reaches every worker: a key added closes the gateway on each.
        config["tenants"] = [{"name": "t", "keys": ["sha256:" + "ab" * 32]}]
        path.write_text(yaml.safe_dump(config))
        async with session.post(url + "/admin/reload", headers={"Connection": "close"}) as resp:
            answer = await resp.json()
        assert answer["reloaded"] is True and answer["all_workers"] is True, answer

        async def every_worker_closed() -> bool:
            return await statuses(8) == [401] * 8

        await poll_until(every_worker_closed, what="every worker to require a key")

        # The supervisor killed outright: its workers stop themselves.
        proc.kill()
        await proc.wait()

        async def workers_gone() -> bool:
            return not any(alive(pid) for pid in replaced)

        await poll_until(workers_gone, what="the orphaned workers to stop")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_workers_command_carries_the_supervisors_options() -> None:
    command = worker_command("c.yaml", host="0.0.0.0", port=9000, log_level="info")
    assert command[3:] == ["serve", "--config", "c.yaml", "--host", "0.0.0.0", "--port", "9000", "--log-level", "info"]
    assert "--log-level" not in worker_command("c.yaml", host=None, port=None, log_level=None)


async def test_operator_routes_answer_for_every_worker(
    etcd: EtcdServer, stack: contextlib.AsyncExitStack, tmp_path: Path
) -> None:
    """Outside runs: under `--workers`, `/metrics` and `/admin/*` answered for the worker the connection reached: a
    scrape saw one worker's counters, and a cancel by id reaching another worker than the request's got 404. Each
    worker is asked here through its own socket (which one the shared port picks is the kernel's choice)."""
    slow = SimConfig(models=("m",), tpot_ms=20.0, prefill_tps=1e6)
    proc, url, _, _ = await workers_behind_a_sidecar(
        etcd, stack, tmp_path, "o", sim_config=slow, extra_env={"TMPDIR": str(tmp_path)},
        extra_config={"slo": {"cache_ms": 100}},
    )  # fmt: skip
    try:
        await listening(proc, 2)
        [sockets] = await asyncio.to_thread(lambda: list(tmp_path.glob("lockgate-workers-*")))
        worker = {
            n: await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sockets / f"worker-{n}.sock")))
            )
            for n in (0, 1)
        }
        session = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        async def served() -> bool:
            async with session.post(url + "/v1/chat/completions", json=body, headers={"Connection": "close"}) as r:
                await r.read()
                return r.status == 200

        await poll_until(served, what="the workers to see the sidecar's engines")
        # A stream of 5,000 tokens at 20 ms each (100 s): in flight at one worker until cancelled.
        long = {**body, "max_tokens": 5000, "stream": True}
        stream = await session.post(url + "/v1/chat/completions", json=long)
        assert stream.status == 200
        await stream.content.readline()  # its first event: the request is in flight

        listed = {}
        for n in (0, 1):
            async with worker[n].get("http://w/admin/requests") as r:
                answer = await r.json()
            assert answer["workers_unreachable"] == []
            [listed[n]] = answer["requests"]  # the stream, whichever worker holds it
        assert listed[0]["id"] == listed[1]["id"] and listed[0]["worker"] == listed[1]["worker"]
        holder = listed[0]["worker"]
        # `/admin/flights`: every worker's statistics, and their sum (an outside run read one worker's as the sum).
        async with worker[0].get("http://w/admin/flights") as r:
            flights = await r.json()
        assert set(flights["statistics_by_worker"]) == {"0", "1"}
        assert flights["statistics"] == summed(list(flights["statistics_by_worker"].values()))
        assert holder in (0, 1)
        for n in (0, 1):
            async with worker[n].get("http://w/metrics") as r:
                text = await r.text()
            assert "lockgate_workers_unreachable 0.0" in text
            assert (
                'lockgate_client_connections{worker="0"}' in text and 'lockgate_client_connections{worker="1"}' in text
            )
            served_here = [
                line
                for line in text.splitlines()
                if line.startswith("lockgate_requests_total{") and "completed" in line
            ]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in served_here) >= 1
        # The worker that does not hold it cancels it (it asks the other).
        async with worker[1 - holder].delete(f"http://w/admin/requests/{listed[0]['id']}") as r:
            assert r.status == 200, await r.text()
            assert (await r.json()) == {"id": listed[0]["id"], "cancelled": True}
        async with asyncio.timeout(10):
            rest = await stream.content.read()
        assert b"cancelled" in rest or b"error" in rest
        stream.release()
        # An id no worker holds: 404, an encoded one too (it was forwarded decoded: a 500).
        for unknown in ("nope", "a%20b", "a%0d%0aX-Evil:%201"):
            async with worker[holder].delete(f"http://w/admin/requests/{unknown}") as r:
                assert r.status == 404, await r.text()
        # One that a stopped worker may hold: not "no such request", but 503 to retry.
        [stopped] = [pid for pid in children_of(proc.pid) if worker_index(pid) == 1 - holder]
        os.kill(stopped, signal.SIGSTOP)
        try:
            async with worker[holder].delete("http://w/admin/requests/nope") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "worker_unreachable"
        finally:
            os.kill(stopped, signal.SIGCONT)

        # `/admin/slo` reads every worker's records: both count the one cancelled request among the same ones.
        async def cancel_rate(n: int) -> dict[str, Any]:
            async with worker[n].get("http://w/admin/slo") as r:
                evaluation: dict[str, Any] = await r.json()
            objective = next(o for o in evaluation["objectives"] if o["name"] == "cancel_rate")
            counts: dict[str, Any] = objective["windows"]["5m"]
            return counts

        async def both_count_it() -> bool:
            counts = [await cancel_rate(n) for n in (0, 1)]
            return counts[0] == counts[1] and counts[0]["bad"] == 1

        await poll_until(both_count_it, what="every worker's records in each worker's /admin/slo")
        assert await terminated(proc) == 0
        assert not sockets.exists()  # the supervisor removes the workers' sockets
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def supervise(worker_script: str, drain_s: float = 10.0, **constants: float) -> subprocess.Popen[str]:
    """A supervisor of two stand-in workers (`worker_script`, its last argument the worker's index) in a process of
    its own, with `workers` module constants set (the timings of these tests) and `drain_s` as its `drain_ms`."""
    settings = "".join(f"workers.{name} = {value!r}\n" for name, value in constants.items())
    code = (
        "import sys\nfrom lockgate import workers\n"
        + settings
        + f"command = [sys.executable, '-c', {worker_script!r}]\n"
        f"sys.exit(workers._Supervisor(command, 2, drain_s={drain_s!r}).run())\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env())


def worker_index(pid: int) -> int | None:
    """The `--worker` index of process `pid` (None: not a worker)."""
    with open(f"/proc/{pid}/cmdline") as fh:
        args = fh.read().split("\0")
    return int(args[args.index("--worker") + 1]) if "--worker" in args else None


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def sleepers(pid: int) -> set[int]:
    """The children of `pid` running the stand-in that sleeps (a healthy worker)."""
    found = set()
    for child in children_of(pid):
        try:
            with open(f"/proc/{child}/cmdline") as fh:
                if "sleep" in fh.read():
                    found.add(child)
        except OSError:  # (it ended since `children_of` saw it: a worker just killed)
            continue
    return found


async def both_workers(proc: subprocess.Popen[str], mask: Callable[[int], int], signum: int, what: str) -> None:
    """Wait until the supervisor's two workers have `signum` in their `mask` (`ignored_signals`, `caught_signals`)."""

    async def ready() -> bool:
        workers = children_of(proc.pid)
        return len(workers) == 2 and all(mask(pid) & (1 << (signum - 1)) for pid in workers)

    await poll_until(ready, what=what)


def ignored_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("SigIgn:")).split()[1], 16)


async def test_a_reload_reaching_workers_still_starting_does_not_end_them() -> None:
    """An outside run: SIGHUP half a second after the launch ended a worker still starting (the default action of
    SIGHUP before its handler is installed), and with it, every worker. Workers now start with SIGHUP ignored."""
    proc = supervise("import time\ntime.sleep(60)\n")  # stand-ins that never handle SIGHUP
    try:
        await both_workers(proc, ignored_signals, signal.SIGHUP, "two workers that ignore SIGHUP")
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGTERM)
        # Ended by the SIGTERM forwarded after the SIGHUP (as asked: status 0), not by the SIGHUP (-1).
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        stop(proc)


async def test_a_worker_that_cannot_start_again_is_retried_while_the_others_serve() -> None:
    """An outside run: a broken configuration file on disk and one worker's crash stopped the gateway in 0.9 s (five
    restarts failing at once, then every worker stopped, the healthy one too). Now restarts back off, and a worker
    past its restarts is retried while another serves; a worker ended by its own SIGTERM (status 0) is restarted."""
    script = "import sys, time\nif sys.argv[-1] == '0':\n    time.sleep(60)\nsys.exit(3)\n"  # worker 1 cannot start
    proc = supervise(script, MAX_RESTARTS=2, RETRY_S=0.05, START_GRACE_S=0.0)
    assert proc.stderr is not None
    try:
        said: list[str] = []
        async with asyncio.timeout(30):
            while sum("the other workers go on serving" in line for line in said) < 2:
                line = await asyncio.to_thread(proc.stderr.readline)
                assert line, f"the supervisor stopped: {said}"
                said.append(line)
        assert any("starting it again in 0 s" in line for line in said)
        assert any("starting it again in 0.05 s" in line for line in said)  # backed off (up to RETRY_S)
        [healthy] = sleepers(proc.pid)
        assert proc.poll() is None
        os.kill(healthy, signal.SIGTERM)  # a signal of its own (a lockgate worker ends it with status 0)

        async def replaced() -> bool:
            return bool(sleepers(proc.pid) - {healthy})

        await poll_until(replaced, what="the worker ended by its own SIGTERM to be started again")
    finally:
        stop(proc)


async def test_a_worker_killed_soon_after_the_launch_is_started_again() -> None:
    """An outside run: a worker SIGKILLed while it served, within the launch's grace, stopped every worker (taken for
    one that cannot start). A worker ended by a signal crashed: it is started again; only one that exits on its own
    within the grace could not start."""
    proc = supervise("import time\ntime.sleep(60)\n", START_GRACE_S=600.0)
    try:

        async def two() -> bool:
            return len(sleepers(proc.pid)) == 2

        await poll_until(two, what="two workers")
        victim = min(sleepers(proc.pid))
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            workers = sleepers(proc.pid)
            return len(workers) == 2 and victim not in workers

        await poll_until(replaced, what="the killed worker started again")
        assert proc.poll() is None
    finally:
        stop(proc)


async def test_workers_that_all_cannot_start_again_stop_the_supervisor() -> None:
    proc = supervise("import sys\nsys.exit(3)\n", MAX_RESTARTS=2, RETRY_S=0.05, START_GRACE_S=0.0)
    try:
        assert await asyncio.to_thread(proc.wait, 30) == 3
        assert proc.stderr is not None and "no worker is running: stopping" in proc.stderr.read()
    finally:
        stop(proc)


def test_workers_share_one_response_id_secret_even_when_an_empty_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LOCKGATE_RESPONSE_ID_SECRET=` (set, empty) counts as unset: the supervisor hands its workers one secret (an
    outside run's empty value reached each worker, which drew its own: 10 of 10 follow-ups failed across them)."""
    import shutil

    from lockgate import response_ids, workers

    for value, kept in (("", False), ("mine", True)):
        monkeypatch.setenv(response_ids.SECRET_ENV, value)
        supervisor = workers._Supervisor(["true"], 2)
        try:
            secret = supervisor._env[response_ids.SECRET_ENV]
            assert secret and (secret == "mine") == kept
        finally:
            shutil.rmtree(supervisor._sockets, ignore_errors=True)


async def test_workers_that_do_not_stop_are_killed_after_the_drain() -> None:
    """An outside run: a worker stopped (SIGSTOP) when the supervisor got SIGTERM kept it waiting for good (50 s, until
    the worker was continued): the stop signal was only sent again. A worker still running `KILL_GRACE_S` after the
    drain is killed, and the supervisor says which."""
    ignoring = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    proc = supervise(ignoring, drain_s=0.2, KILL_GRACE_S=0.3)
    try:
        await both_workers(proc, ignored_signals, signal.SIGTERM, "two workers that ignore SIGTERM")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) != 0  # (killed workers: their status is -9)
        assert proc.stderr is not None
        said = proc.stderr.read()
        assert "workers 0, 1 still running 0.5 s after the stop signal: killing them" in said, said
    finally:
        stop(proc)


async def test_a_draining_worker_gets_the_stop_signal_once() -> None:
    """A second SIGTERM hurries a lockgate worker's drain (its running requests are stopped at once). Once one worker
    had ended, the supervisor sent the stop signal again every second to the others, cutting their drains short (and
    one that had given its handler back ended with the signal's status). Each worker gets it once; here, one that
    drains for 2 s counts what it got (its exit status: the SIGTERMs beyond the first)."""
    script = (
        "import signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: got.append(1))\n"
        "while not got:\n    time.sleep(0.01)\n"
        "if sys.argv[-1] == '1':\n    time.sleep(2)\n"  # worker 1 drains; worker 0 ends at once
        "sys.exit(len(got) - 1)\n"
    )
    proc = supervise(script, drain_s=30.0)
    try:
        await both_workers(proc, caught_signals, signal.SIGTERM, "two workers that handle SIGTERM")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        stop(proc)


def caught_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("SigCgt:")).split()[1], 16)
