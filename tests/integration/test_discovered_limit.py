"""The discovered concurrency limit as an engine's scrapes drive it, in a running gateway: engines whose `/metrics` page
the test writes (the queue they show is the signal under test)."""

from __future__ import annotations

import time

from tests.integration.test_engine_signals import paged_engine

_IDLE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"


async def test_an_instance_that_ended_no_generation_judges_its_queue_by_how_long_its_peers_generations_last(
    serve_app, start_gateway
) -> None:
    """An engine added (or restarted) during a flood takes the gateway's queued requests at once, beyond its slots: its
    queue could not count as a slot's until a generation had ended there (its own decode time unmeasured), while
    P0 arriving then was routed into that queue (a run with an 8-slot engine added to a flood: 0.6-1.6 s to hold its
    limit). How long a generation lasts is mostly the workload's: its peers' measure stands in for it, and their
    prefill rate for its own, as routing does."""
    pages = [{"text": _IDLE}, {"text": _IDLE}]
    urls = [await serve_app(paged_engine(page)) for page in pages]
    specs = [{"url": url, "engine": "vllm", "name": f"e{n}"} for n, url in enumerate(urls)]
    gw = await start_gateway([{"name": "m", "instances": specs}], scrape={"enabled": False})
    fleet = gw.gateway.fleet
    measured, fresh = (next(i for i in fleet.instances.values() if i.name == name) for name in ("e0", "e1"))
    ceiling = fresh.concurrency.limit
    pages[1]["text"] = "vllm:num_requests_waiting 6\nvllm:num_requests_running 2\n"
    await fleet.scraper.scrape_all()
    # Nothing measured anywhere: a queue before any generation ended may be the first long prompts' prefill.
    assert fresh.concurrency.limit == ceiling
    now = time.monotonic()
    measured.own.decode.add(2.0, now)  # its peer's generations hold a slot 2 s
    fresh.own.start(20_000, now)  # a long prompt sent there: 2.5 s of prefill at the default rate
    await fleet.scraper.scrape_all()
    assert fresh.concurrency.limit == ceiling  # that prefill explains the queue
    measured.own.prefill_tps.add(100_000.0, now)  # its peer prefills 100k tokens/s: 0.2 s of prefill there
    await fleet.scraper.scrape_all()
    assert fresh.concurrency.limit == 2  # held at what it runs
    assert fresh.own.decode.samples == fresh.own.prefill_tps.samples == 0
