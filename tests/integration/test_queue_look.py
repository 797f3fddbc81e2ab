"""A strict request's look at its engine's queue (`Lease.queue_ahead`): a scrape of the engine now, joined by
any other asker while it is under way (an engine is never asked twice at once), reused while fresh, and read
against what the gateway sent there within the last step."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from aiohttp import web

from lockgate.config import parse_config
from lockgate.fleet.fleet import Fleet
from lockgate.fleet.instance import Instance
from lockgate.fleet.scrape import MAX_SCRAPE_SHARE, MIN_COSTLY_PAGE, scrape_interval
from lockgate.metrics import GatewayMetrics


def age(engine: Instance, seconds: float) -> None:
    load = engine.engine_load
    assert load is not None
    engine.engine_load = dataclasses.replace(load, scraped_at=load.scraped_at - seconds)


async def test_a_look_at_an_engines_queue_is_one_scrape_for_all_askers_and_reads_its_queue(serve_app) -> None:
    scrapes = 0
    waiting = 3
    asked = asyncio.Event()
    answer = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        nonlocal scrapes
        scrapes += 1
        asked.set()
        await answer.wait()
        return web.Response(text=f"vllm:num_requests_running 8\nvllm:num_requests_waiting {waiting}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    url = await serve_app(app)
    config = parse_config(
        {
            "models": [{"name": "m", "instances": [{"url": url, "engine": "vllm"}]}],
            "scrape": {"interval_ms": 600000},  # the loop's own scrapes stay out of the way
            "health": {"interval_ms": 600000},
        }
    )
    async with Fleet(config, GatewayMetrics()) as fleet:
        [engine] = fleet.pools["m"].instances
        await asyncio.wait_for(asked.wait(), 5)  # the loop's first round is under way: held by the engine
        answer.set()
        assert await fleet.scraper.fetch(engine) is engine.engine_load  # joins the loop's scrape
        assert scrapes == 1
        answer.clear()
        asked.clear()
        old = fleet.lease(engine, "m", 8, 8)
        old._attempt.sent_at = time.monotonic() - 10.0  # sent long before: an engine with a free slot took it in
        young = fleet.lease(engine, "m", 8, 8)
        engine.own.tpot.add(1.0, time.monotonic())  # a slow step: the young lease stays young
        age(engine, 10.0)  # too old for a look: the engine is asked again
        looks = [asyncio.create_task(lease.queue_ahead()) for lease in (old, young, young)]
        await asyncio.wait_for(asked.wait(), 5)
        answer.set()
        # 3 waiting, 1 sent within the last step (the young lease): older ones wait for a slot.
        assert await asyncio.gather(*looks) == [True, True, True]
        assert scrapes == 2  # one scrape for the three askers
        waiting = 1
        load = engine.engine_load
        assert await fleet.scraper.fresh(engine, 60.0) is load  # a scrape is reused while fresh enough
        assert scrapes == 2
        age(engine, 10.0)
        assert await young.queue_ahead() is False  # 1 waiting: no more than arrived within the last step
        assert scrapes == 3
        old.release()
        young.release()
        engine.own.tpot = type(engine.own.tpot)()  # the step time not measured: it cannot be told
        assert await young.queue_ahead() is None


async def test_an_engine_whose_page_costs_more_than_its_interval_allows_is_scraped_less_often(serve_app) -> None:
    """An outside run's engine served a page of 90,000 series under the size bound: parsing it every 200 ms cost the
    gateway 21% of a core. The loop waits `scrape_interval` (the page's cost over `MAX_SCRAPE_SHARE`) before the next
    scrape of such an engine; a small page keeps the configured interval whatever a busy process measured it to cost
    (a first version deferred small pages after a pause of the loop, and another test's instance missed its scrape).
    A strict request's look at the engine's queue keeps to the same schedule (it scraped such an engine at once)."""
    big = "".join(f'vllm:num_requests_running{{k="{n}"}} 1\n' for n in range(60_000))
    pages = {"big": big, "small": "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"}
    urls = {}
    scrapes = dict.fromkeys(pages, 0)
    for name, text in pages.items():

        async def metrics(_: web.Request, text: str = text, name: str = name) -> web.Response:
            scrapes[name] += 1
            return web.Response(text=text)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        urls[name] = await serve_app(app)
    config = parse_config(
        {
            "models": [
                {"name": "m", "instances": [{"url": url, "engine": "vllm", "name": name} for name, url in urls.items()]}
            ],
            "scrape": {"interval_ms": 200},
            "health": {"interval_ms": 600000},
        }
    )
    assert scrape_interval(0.2, 0.0001) == 0.2 and scrape_interval(0.2, 0.04) == 0.04 / MAX_SCRAPE_SHARE
    async with Fleet(config, GatewayMetrics()) as fleet:
        scraper = fleet.scraper
        await scraper.scrape_all()  # (the loop's first round, or joined with it: one scrape of each engine)
        due = {instance.name: at - time.monotonic() for instance, at in scraper._due.items()}
        assert list(due) == ["big"] and due["big"] > 0.2  # (the page's cost, measured: at least 4 ms here)
        small = next(i for i in fleet.pools["m"].instances if i.name == "small")
        assert small.engine_load is not None and small.scrape_error is None
        assert len(big.encode()) >= MIN_COSTLY_PAGE > len(pages["small"])
        # A strict request's look (`fresh`) at the costly engine does not scrape it before it is due: it cannot tell.
        costly = next(i for i in fleet.pools["m"].instances if i.name == "big")
        before = scrapes["big"]
        assert await scraper.fresh(costly, 0.0) is None
        assert scrapes["big"] == before
        assert await scraper.fresh(small, 0.0) is small.engine_load  # (a small page is read again at once)
