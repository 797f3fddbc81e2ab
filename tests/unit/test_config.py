import pytest

from lockgate.config import ConfigError, load_config, parse_config
from lockgate.embedded import default_config


def test_issue_example_shape_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        """
listen: {host: 127.0.0.1, port: 8080}
models:
  - name: demo-model
    instances:
      - {url: "http://127.0.0.1:8001", engine: vllm}
      - {url: "unix:///run/engine.sock", engine: vllm}
  - name: other
    instances:
      - {url: "http://127.0.0.1:8001", engine: vllm}
"""
    )
    config = load_config(path)
    assert [m.name for m in config.models] == ["demo-model", "other"]
    assert config.models[0].instances[1].url == "unix:///run/engine.sock"
    other = config.model("other")
    assert other is not None
    assert other.instances[0].key == config.models[0].instances[0].key


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"models": [{"name": "m", "instances": [{"url": "http://x", "engine": "vlm"}]}]},
            "models[0].instances[0].engine",
        ),
        ({"models": [{"name": "m", "instances": [{"url": "ftp://x"}]}]}, "models[0].instances[0].url"),
        ({"models": [{"name": "m", "instances": []}]}, "models[0].instances"),
        (
            {"models": [{"name": "m", "instances": [{"url": "http://x"}], "routng": "x"}]},
            "models[0].routng: unknown key",
        ),
        ({"listen": {"port": 99999}, "models": [{"name": "m", "instances": [{"url": "http://x"}]}]}, "listen.port"),
        ({}, "at least one model"),
    ],
)
def test_errors_name_the_key(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("c.yaml")


def test_duplicate_model_names_rejected():
    inst = [{"url": "http://x"}]
    with pytest.raises(ConfigError, match="repeated: m"):
        parse_config({"models": [{"name": "m", "instances": inst}, {"name": "m", "instances": inst}]})


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_embedded_default_has_two_models_on_simulators():
    config = default_config()
    served = {m for entry in config.simulate for m in entry.models}
    assert served == {"demo-model", "demo-model-large"}
    assert sum(entry.count for entry in config.simulate) >= 3
