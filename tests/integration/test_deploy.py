"""`deploy/`: the Prometheus rules file is what `lockgate slo --prometheus-rules` generates, and every
metric the rules and the Grafana dashboard reference exists in a running gateway's `/metrics` after some
traffic (streams, a duplicate served from the cache, a client leaving mid-stream), with the labels their
selectors match on."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from lockgate.server import GatewayServer
from lockgate.slo import SloConfig
from lockgate.slo.rules import rules_yaml
from tests.conftest import instance

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "lockgate-slo-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "lockgate.json"

#: `name{...}`: a selector, and the label names its matchers use.
_SELECTOR = re.compile(r"\b(lockgate_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
#: A metric name not followed by `:` (recording rules, `lockgate_slo:...`, are not metrics of the gateway).
_NAME = re.compile(r"\b(lockgate_[a-z0-9_]+)\b(?!:)")


def _exprs() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        exprs.extend(target["expr"] for target in panel.get("targets", []))
    exprs.extend(v["definition"] for v in dashboard["templating"]["list"] if "definition" in v)
    return exprs


def _labels(text: str) -> dict[str, set[str]]:
    """The label names each sample name of an exposition carries."""
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            if not rest:
                name = name.split(" ")[0]
            labels.setdefault(name, set()).update(re.findall(r'([a-zA-Z_]+)="', rest.rpartition("}")[0]))
    return labels


def _exported(text: str) -> set[str]:
    """Every sample name in a Prometheus text exposition, plus the samples a declared family will have
    (a labelled counter or histogram without children yet shows only its `# TYPE` line)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            if kind == "histogram":
                names.update(f"{name}_{suffix}" for suffix in ("bucket", "count", "sum"))
            elif kind == "counter":
                names.add(name if name.endswith("_total") else f"{name}_total")
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_the_rules_file_is_the_generated_one() -> None:
    assert RULES.read_text() == rules_yaml(SloConfig()), (
        "deploy/ is stale: run `lockgate slo --prometheus-rules deploy/prometheus/lockgate-slo-rules.yaml`"
    )


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]


async def test_every_referenced_metric_exists_in_a_running_gateway(start_sim: Any, start_gateway: Any) -> None:
    sim = await start_sim(tpot_ms=5.0, prefill_tps=1e6)
    gw: GatewayServer = await start_gateway([{"name": "m", "instances": [instance(sim, name="e0")]}])
    assert gw.gateway is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    async with aiohttp.ClientSession(gw.url) as http:
        for _ in range(2):  # the second one is served from the result cache
            async with http.post("/v1/chat/completions", data=orjson.dumps(body), headers={"x-priority": "P0"}) as r:
                assert r.status == 200
        stream = {**body, "stream": True, "max_tokens": 500, "temperature": 1}
        async with http.post("/v1/chat/completions", data=orjson.dumps(stream)) as r:
            await r.content.readline()  # then leave mid-stream: a cancellation
        async with asyncio.timeout(10):
            await gw.gateway.registry.wait_empty()
        await gw.gateway.fleet.scraper.scrape_all()
        async with http.get("/metrics") as r:
            text = await r.text()
    exported = _exported(text)
    referenced = {name for expr in _exprs() for name in _NAME.findall(expr)}
    assert len(referenced) > 25
    missing = referenced - exported
    assert not missing, f"not in /metrics: {sorted(missing)}"
    # The labels the selectors match on exist on the samples (where there are samples: a labelled family
    # without children yet, like rejections, has none to look at).
    labels = _labels(text)
    unknown = {
        (name, label)
        for expr in _exprs()
        for name, matchers in _SELECTOR.findall(expr)
        if name in labels
        for label in _MATCHER.findall(matchers)
        if label != "le" and label not in labels[name]
    }
    assert not unknown, f"labels not in /metrics: {sorted(unknown)}"
