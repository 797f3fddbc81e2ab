import pytest

from lockgate.config import ConfigError, parse_config

INST = [{"url": "http://x"}]


def test_dedup_defaults_and_keys():
    config = parse_config({"models": [{"name": "m", "instances": INST}]})
    assert config.models[0].dedup == "deterministic" and config.models[0].semantic is None
    assert config.result_cache.ttl_ms > 0 and config.result_cache.max_entries > 0
    config = parse_config(
        {
            "result_cache": {"max_entries": 10, "max_bytes": 1000, "ttl_ms": 0},
            "models": [{"name": "m", "instances": INST, "dedup": "always", "semantic": {"shadow": True}}],
        }
    )
    semantic = config.models[0].semantic
    assert semantic is not None
    assert semantic.shadow and semantic.threshold == 0.92


@pytest.mark.parametrize(
    ("model", "where"),
    [
        ({"dedup": "sometimes"}, "models[0].dedup"),
        ({"semantic": {"threshold": 1.5}}, "models[0].semantic.threshold"),
        ({"semantic": {"treshold": 0.9}}, "models[0].semantic.treshold: unknown key"),
    ],
)
def test_dedup_config_errors_name_the_key(model, where):
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [{"name": "m", "instances": INST, **model}]}, "c.yaml")
    assert where in str(info.value)
