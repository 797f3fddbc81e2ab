"""Cluster pieces without a network: the key layout and records, the `cluster:` section, and a sidecar's
pool taking the engine a central gateway named (or another one when it cannot)."""

from __future__ import annotations

import pytest

from lockgate.cluster.keys import (
    ENGINE_HEADER,
    EngineRecord,
    NodeRecord,
    decode_node,
    encode_node,
    node_key,
    nodes_prefix,
)
from lockgate.config import ConfigError, parse_config
from lockgate.fleet.instance import Instance
from lockgate.fleet.pool import Pool
from lockgate.metrics import GatewayMetrics
from lockgate.routing.factory import make_policy
from lockgate.wire import Endpoint, parse_request


def test_key_layout() -> None:
    assert nodes_prefix("prod") == "/lockgate/prod/nodes/"
    assert node_key("prod", "gpu-7") == "/lockgate/prod/nodes/gpu-7"


def test_node_record_round_trip() -> None:
    record = NodeRecord(
        node="gpu-7",
        url="http://10.0.0.7:8080",
        engines=(EngineRecord(id="unix:///run/e.sock", name="e0", models=("m", "n"), waiting=3, prefix_hits=5.0),),
        seq=9,
        published_at=1.5,
    )
    assert decode_node(encode_node(record)) == record


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'{"node": "n", "url": "http://h"}',
        b'{"node": "n", "url": "http://h", "engines": [{"id": "e", "name": "e", "models": "m"}]}',
        b'{"node": "bad\\nname", "url": "http://h", "engines": []}',
        b'{"node": "n", "url": "http://h", "engines": [{"id": "e", "name": "e", "models": [], "waiting": "x"}]}',
    ],
)
def test_unreadable_records_are_none(raw: bytes) -> None:
    assert decode_node(raw) is None


def test_cluster_section() -> None:
    config = parse_config({"cluster": {"endpoints": ["http://127.0.0.1:2379/"], "name": "prod"}})
    assert config.cluster is not None and config.cluster.endpoints == ["http://127.0.0.1:2379"]
    assert config.cluster.lease_ttl_ms <= 3000 and config.cluster.publish_interval_ms <= 100
    with pytest.raises(ConfigError, match=r"cluster\.endpoints"):
        parse_config({"cluster": {"endpoints": ["127.0.0.1:2379"]}})
    with pytest.raises(ConfigError, match=r"cluster\.name"):
        parse_config({"cluster": {"name": "a/b"}})
    with pytest.raises(ConfigError, match="at least one model"):
        parse_config({})


class Headers(dict[str, str]):
    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


def sidecar_pool() -> Pool:
    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "routing": "round_robin",
                    "instances": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:2"}],
                }
            ]
        }
    )
    [model] = config.models
    instances = [Instance(spec, None, spec.url) for spec in model.instances]  # type: ignore[arg-type]
    pool = Pool(model, instances, {i.key: "m" for i in instances}, make_policy(model.routing), metrics=GatewayMetrics())
    pool.pin_header = ENGINE_HEADER
    return pool


def test_a_sidecar_takes_the_named_engine_and_another_when_it_cannot() -> None:
    pool = sidecar_pool()
    api = parse_request(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    second = "http://127.0.0.1:2"
    route = pool.route_request(api, Headers({ENGINE_HEADER: second}))
    assert route.pin == second
    assert [pool.choose(route)[0].key for _ in range(3)] == [second] * 3
    pool.instances[1].healthy = False
    assert pool.choose(route)[0].key == "http://127.0.0.1:1"
    unknown = pool.route_request(api, Headers({ENGINE_HEADER: "http://elsewhere"}))
    assert pool.choose(unknown)[0].key == "http://127.0.0.1:1"


def test_a_gateway_outside_a_cluster_ignores_the_header() -> None:
    pool = sidecar_pool()
    pool.pin_header = None
    api = parse_request(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert pool.route_request(api, Headers({ENGINE_HEADER: "http://127.0.0.1:2"})).pin is None


def test_the_cluster_example_configs_are_valid() -> None:
    from pathlib import Path

    from lockgate.config import load_config

    here = Path(__file__).resolve().parents[2] / "examples" / "cluster"
    configs = {p.name: load_config(p) for p in sorted(here.glob("*.yaml"))}
    assert sorted(configs) == ["central-1.yaml", "central-2.yaml", "sidecar-1.yaml", "sidecar-2.yaml"]
    assert all(c.cluster is not None and c.cluster.name == "example" for c in configs.values())


def test_the_examples_can_run_side_by_side() -> None:
    """The cluster example and the llama.cpp example listen on ports of their own (both once took 8101/8102)."""
    import re
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "examples"

    def ports(*paths: Path) -> set[int]:
        pattern = r"(?:port[: ]+|127\.0\.0\.1:)(\d{4,5})"
        return {int(p) for path in paths for p in re.findall(pattern, path.read_text())}

    llamacpp, cluster = ports(here / "llamacpp.yaml"), ports(*(here / "cluster").glob("*"))
    assert {8080, 8101, 8102} <= llamacpp and {2379, 8010, 8020} <= cluster
    assert not llamacpp & cluster
