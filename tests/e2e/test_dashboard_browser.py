"""The dashboard in a real browser: Debian's Chromium driven by Playwright (never `playwright install`).

A gateway in front of four simulated engines; the page must load without a console error, show the four
engines, reflect traffic sent with the `openai` SDK within 2 s (waiting on the page's state, not on a clock),
and its cancel button must end a running stream as an admin cancel. A screenshot is written to the test's
temporary directory and its path printed (run with `-s` to see it).

Without Chromium (or the `playwright` package) the test is skipped with a message; under `CI=true` it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

import openai
import pytest

from lockgate.records import read_records
from tests.conftest import instance

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SLOS = {
    "objectives": [
        {
            "name": "p0_success",
            "objective": "P0 success rate",
            "target": 0.999,
            "status": "met",
            "budget_remaining": 0.82,
            "windows": {},
        },
        {
            "name": "p0_ttft",
            "objective": "P0 TTFT p99 < 2 s",
            "target": 0.99,
            "status": "burning",
            "budget_remaining": 0.12,
            "windows": {},
        },
    ]
}
#: How soon the page must show what happened (its feed ticks every 250 ms here).
REFLECT_MS = 2000


def _require_browser() -> str:
    """The Chromium executable; skips (fails under CI=true) when it or Playwright is missing."""
    missing = []
    executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if executable is None:
        missing.append(f"Chromium ({CHROMIUM}; scripts/system-deps.sh installs it)")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (the dev extra)")
    if missing:
        message = "dashboard browser test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    assert executable is not None
    return executable


async def test_the_dashboard_in_a_browser_shows_the_fleet_reflects_traffic_and_cancels_a_stream(
    start_sim, start_gateway, tmp_path
) -> None:
    executable = _require_browser()
    from playwright.async_api import async_playwright

    sims = [await start_sim(tpot_ms=20.0, prefill_tps=1e6) for _ in range(4)]
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(s, name=f"engine-{i + 1}") for i, s in enumerate(sims)]}],
        dashboard={"interval_ms": 250},
    )
    assert gw.gateway is not None
    problems: list[str] = []
    async with (
        async_playwright() as pw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        browser = await pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 1300})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on(
                "requestfailed",  # but the page's own abort of its feed (it reconnects with a new key) is fine
                lambda r: None if r.failure == "net::ERR_ABORTED" else problems.append(f"failed: {r.url} {r.failure}"),
            )

            sent: dict[str, str | None] = {}  # the Authorization header of the page's requests, by path
            page.on("request", lambda r: sent.__setitem__(r.url.removeprefix(gw.url), r.headers.get("authorization")))

            await page.goto(gw.url + "/dashboard")
            # The admin key typed once is kept for the tab and sent as a header, never in a URL.
            await page.locator("#adminkey").fill("admin-secret")
            await page.locator("#keyform button[type=submit]").click()
            await page.wait_for_function("() => sessionStorage.getItem('lockgate.adminKey') === 'admin-secret'")
            rows = page.locator("tr[data-testid=instance]")
            await page.wait_for_function("() => document.querySelectorAll('tr[data-testid=instance]').length === 4")
            assert await rows.evaluate_all("rows => rows.map(r => r.dataset.name)") == [
                f"engine-{i}" for i in range(1, 5)
            ]
            assert await page.locator("#conn").text_content() == "live"
            # The gateway's own cached evaluation (what `GET /admin/slo` answers): its five objectives.
            await page.wait_for_function(
                "() => document.querySelectorAll('#slo [data-testid=objective]').length === 5", timeout=REFLECT_MS
            )
            gw.gateway.slo_provider = lambda: SLOS  # the panel shows whatever the provider returns
            await page.wait_for_function(
                "() => Array.from(document.querySelectorAll('#slo [data-testid=objective] .badge'))"
                ".map(b => b.textContent).join() === 'met,burning'",
                timeout=REFLECT_MS,
            )

            # Traffic: the finished count and the plots follow within REFLECT_MS.
            await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=3
                    )
                    for i in range(6)
                )
            )
            await page.wait_for_function(
                "() => document.getElementById('kpi-finished').textContent === '6 finished'", timeout=REFLECT_MS
            )
            await page.wait_for_function(
                "() => document.querySelector('#chart-rate path.line') !== null", timeout=REFLECT_MS
            )

            # A long stream appears in the table; its cancel button ends it as an admin cancel.
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "a long story"}],
                max_tokens=5000,
                stream=True,
                extra_headers={"x-request-id": "client-story-1"},
            )
            chunks = aiter(stream)
            await anext(chunks)  # it is streaming
            row = page.locator("tr[data-testid=request]")
            await row.wait_for(timeout=REFLECT_MS)
            [live] = [e.id for e in gw.gateway.registry.all()]
            assert await row.get_attribute("data-id") == live
            # The client's own id is shown under the gateway's (an outside run had to ask /admin/requests for it).
            await page.wait_for_function(
                "() => document.querySelector('tr[data-testid=request] .client-id')?.textContent === 'client-story-1'",
                timeout=REFLECT_MS,
            )
            await page.wait_for_function(
                "() => document.querySelector('tr[data-testid=request] td:nth-child(5)').textContent === 'streaming'",
                timeout=REFLECT_MS,
            )
            shot = tmp_path / "dashboard.png"  # with traffic behind it and a stream in flight
            await page.screenshot(path=str(shot), full_page=True)
            print(f"\ndashboard screenshot: {shot}")
            await row.locator("button[data-testid=cancel]").click()

            async def drain() -> None:
                async for _ in chunks:
                    pass

            assert sent[f"/admin/requests/{live}"] == "Bearer admin-secret"
            assert sent["/dashboard/events"] == "Bearer admin-secret"
            assert all("admin-secret" not in url for url in sent)
            with pytest.raises(openai.APIError) as ended:
                async with asyncio.timeout(10):  # bounds a failure only
                    await drain()
            assert "cancelled by an administrator" in str(ended.value)
            await page.wait_for_function(
                "() => document.querySelectorAll('tr[data-testid=request]').length === 0", timeout=REFLECT_MS
            )
            await page.wait_for_function(
                "() => document.querySelector('#cancellations [data-key=admin] dd').textContent === '1'",
                timeout=REFLECT_MS,
            )
            seen = list(problems)  # before closing the browser, which aborts the page's feed

            # When the gateway refuses the key (another branch adds admin auth), the page asks for one.
            refused = await browser.new_page()
            await refused.route(
                "**/dashboard/events",
                lambda route: route.fulfill(status=401, content_type="application/json", body=b'{"error": {}}'),
            )
            await refused.goto(gw.url + "/dashboard")
            await refused.wait_for_function(
                "() => document.getElementById('conn').textContent === 'admin key required'", timeout=REFLECT_MS
            )
            # Every dashboard slot taken (`dashboard.max_clients`: the gateway's 503): the page says so (an outside
            # run read "reconnecting", as if the gateway were down).
            crowded = await browser.new_page()
            full = b'{"error": {"message": "too many", "type": "service_unavailable", "code": "too_many_dashboards"}}'
            await crowded.route(
                "**/dashboard/events",
                lambda route: route.fulfill(status=503, content_type="application/json", body=full),
            )
            await crowded.goto(gw.url + "/dashboard")
            await crowded.wait_for_function(
                "() => document.getElementById('conn').textContent === 'too many dashboards open'", timeout=REFLECT_MS
            )
            # A gateway that says it stops (`event: end`, the drain): the page says it stopped, not "disconnected"
            # (an outside run saw "gateway stopping" replaced at once as the feed closed).
            stopped = await browser.new_page()
            ends: list[int] = []

            async def end_once(route: Any) -> None:
                ends.append(1)
                if len(ends) > 1:  # (its reconnection, once the gateway is gone)
                    await route.abort()
                    return
                body = b'event: end\ndata: {"reason": "shutdown"}\n\n'
                await route.fulfill(status=200, content_type="text/event-stream", body=body)

            await stopped.route("**/dashboard/events", end_once)
            await stopped.goto(gw.url + "/dashboard")
            await stopped.wait_for_function(
                "() => document.getElementById('conn').textContent === 'gateway stopped'", timeout=REFLECT_MS
            )
        finally:
            await browser.close()
    assert seen == []
    await gw.gateway.records.wait_flushed()
    cancelled: list[dict[str, Any]] = [r for r in read_records(str(tmp_path / "usage.sqlite3")) if r["cancel_reason"]]
    assert [(r["request_id"], r["status"], r["cancel_reason"]) for r in cancelled] == [(live, "cancelled", "admin")]
