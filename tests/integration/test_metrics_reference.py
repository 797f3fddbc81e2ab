"""docs/metrics.md names every metric family a running gateway exports (the README sends operators there for
"every metric")."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import instance

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> set[str]:
    """The metric names in the reference, `a_{b,c}` patterns expanded."""
    names: set[str] = set()
    for name in re.findall(r"`(lockgate_[a-z_{},]+)`", DOC.read_text()):
        if "{" in name:
            head, rest = name.split("{", 1)
            options, tail = rest.split("}", 1)
            names.update(head + option + tail for option in options.split(","))
        else:
            names.add(name)
    return names


async def test_every_exported_family_is_in_the_reference(start_sim, start_gateway):
    sim = await start_sim()
    gw = await start_gateway(
        [{"name": "m", "instances": [instance(sim)]}],
        tenants=[{"name": "t", "keys": [], "requests_per_minute": 100, "tokens_per_minute": 10_000}],
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    # (a counter with no sample yet shows its `_created` series as a family of its own)
    families = {f.name.removesuffix("_created") for f in text_string_to_metric_families(text)}
    families = {name for name in families if name.startswith("lockgate_")}
    assert len(families) > 40
    names = documented()
    missing = sorted(f for f in families if f not in names and f + "_total" not in names)
    assert missing == [], f"not in docs/metrics.md: {missing}"
