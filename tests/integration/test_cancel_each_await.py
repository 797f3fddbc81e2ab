"""Cancel the request at every `await` of its path in turn (httpcore `test_cancellations.py` style).

The awaits the gateway performs for a request — opening the upstream call, reading its body or each piece
of its stream, preparing the client response and each write to it — meet checkpoints (the `lockgate.awaitpoints` hook,
which the compiled build's native classes call where a patch could not reach). Run N ends
the request at the Nth checkpoint, for N = 1, 2, ... until a run passes every checkpoint untouched, with
each cause: the handler task is cancelled the way aiohttp cancels it when the client disconnects, the
deadline expires (the request's own `asyncio.Timeout` is rescheduled to now), or an admin cancels it.
After every run: every gauge is zero, the engine has nothing open, and the request has exactly one record
with a truthful status.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from lockgate import awaitpoints
from lockgate.exchange import Exchange
from lockgate.gateway import Gateway
from lockgate.records import read_records
from tests.conftest import instance
from tests.integration.cancel_support import assert_gateway_clean, body, wait_sim_idle


class Checkpoints:
    """Counts the request path's awaits (only in tasks owned by an exchange) and ends it at the Nth."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.cancel_at = 0
        self.cause = ""
        self.count = 0
        self.fired = False
        #: Every kind of await met (so that the test knows the hook saw the path's awaits).
        self.names: set[str] = set()

    def arm(self, cancel_at: int, cause: str) -> None:
        self.cancel_at, self.cause, self.count, self.fired = cancel_at, cause, 0, False

    def _exchange(self) -> Exchange | None:
        task = asyncio.current_task()
        for ex in self.gateway.registry.all():
            if ex._task is task:
                return ex
        return None

    async def hit(self) -> None:
        ex = self._exchange()
        if ex is None:
            return
        self.count += 1
        if self.count != self.cancel_at:
            return
        self.fired = True
        if self.cause == "client_disconnect":
            assert ex._task is not None
            ex._task.cancel()  # what aiohttp's handler cancellation does when the connection is lost
        elif self.cause == "timeout":
            assert ex.timeout is not None
            ex.timeout.reschedule(asyncio.get_running_loop().time())
            for _ in range(10):  # the timer (due now) fires within a loop iteration or two
                if ex.timeout.expired():
                    break
                await asyncio.sleep(0)
            assert ex.timeout.expired()
        else:
            assert ex.cancel(self.cause)
        # Many awaits complete without suspending (buffered data, a write into the transport buffer);
        # suspend here so that the cancellation lands at this very await, not at a later one.
        await asyncio.sleep(0)
        raise AssertionError("the cancellation did not land")  # pragma: no cover

    async def __call__(self, name: str, data: object) -> None:
        """The `awaitpoints` hook: the engine client's and the edge server's awaits, which are those of native
        classes in the compiled build (not patchable): `HttpPool.request` (sending, up to the response's head),
        `Response.read` (a whole body), `Response.wait` (a piece of a stream, read by the request's task),
        `Response.follow` (the rest of a stream, written from the engine connection's callbacks), and
        `StreamResponse.prepare`, `.write`, `.drained` and `.write_eof`."""
        self.names.add(name)
        await self.hit()


@pytest.mark.parametrize("cause", ["client_disconnect", "timeout", "admin"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_cancel_at_every_await(stream, cause, start_sim, start_gateway, tmp_path, stack) -> None:
    sim = await start_sim(prefill_tps=1e6, tpot_ms=0.5)
    gw = await start_gateway([{"name": "m", "instances": [instance(sim)]}])
    gateway = gw.gateway
    assert gateway is not None
    checkpoints = Checkpoints(gateway)
    stack.enter_context(awaitpoints.installed(checkpoints))
    outcomes: list[tuple[int, bool]] = []
    answers: list[tuple[int, bytes]] = []
    async with aiohttp.ClientSession() as http:
        for n in range(1, 40):
            checkpoints.arm(n, cause)
            async with asyncio.timeout(5):
                try:
                    async with http.post(
                        gw.url + "/v1/chat/completions",
                        json=body(stream, max_tokens=3),
                        headers={"x-lockgate-timeout-ms": "60000"},
                    ) as resp:
                        answers.append((resp.status, await resp.read()))
                except aiohttp.ClientError:
                    assert cause == "client_disconnect"  # the handler died: the connection is dropped
                await gateway.registry.wait_empty()
                await wait_sim_idle(sim)
                await gateway.records.wait_flushed()
            assert_gateway_clean(gateway)
            outcomes.append((checkpoints.count, checkpoints.fired))
            if not checkpoints.fired:
                break
        else:  # pragma: no cover
            raise AssertionError("the request path never completed untouched")
    rows = read_records(str(tmp_path / "usage.sqlite3"))
    assert len(rows) == len(outcomes) == len({r["request_id"] for r in rows})
    statuses = [(r["status"], r["cancel_reason"]) for r in rows]
    # The last run passes every checkpoint and completes. (A stream's last await follows the engine to its end:
    # `[DONE]` is written from the engine connection's callback, with no await after it.)
    completed = 1
    assert statuses == [("cancelled", cause)] * (len(rows) - completed) + [("completed", None)] * completed
    # Run N reached checkpoint N (ending an exchange may pass more), and the last run passed them all.
    assert all(count >= n for n, (count, _) in enumerate(outcomes[:-1], 1))
    assert outcomes[-1][1] is False and outcomes[-1][0] == len(outcomes) - 1 >= (3 if stream else 2)
    for status, raw in answers[-completed:]:
        assert status == 200 and (raw.endswith(b"data: [DONE]\n\n") if stream else b'"choices"' in raw)
    if cause != "client_disconnect":
        # The client always learns why: an error status before the first byte, else a final SSE error
        # event — never an empty 200, never [DONE].
        expected_status, code = (504, b'"deadline_exceeded"') if cause == "timeout" else (503, b'"cancelled"')
        for status, raw in answers[:-completed]:
            if status == 200:
                assert raw.startswith(b"data: ") and b"[DONE]" not in raw and code in raw.rsplit(b"data: ", 1)[1]
            else:
                assert status == expected_status and code in raw, (status, raw)
    # The hook met the path's awaits (it is how the compiled build's native classes are reached at all).
    expected = (
        {"HttpPool.request", "Response.wait", "Response.follow"} if stream else {"HttpPool.request", "Response.read"}
    )
    assert expected <= checkpoints.names, checkpoints.names
    delivered = [r["completion_tokens"] for r in rows]
    assert delivered == sorted(delivered) and delivered[-1] == 3
