"""`${VAR}` substitution in configuration strings."""

from pathlib import Path

import pytest

from lockgate.config import ConfigError, load_config
from lockgate.config_env import UnsetVariable, substitute


def test_variables_are_substituted_in_string_values_only() -> None:
    data = {"a": "${X}", "b": ["pre-${X}-${Y}", 3, None], "${X}": "key stays", "c": "no variable $HOME"}
    out = substitute(data, {"X": "1", "Y": "two"})
    assert out == {"a": "1", "b": ["pre-1-two", 3, None], "${X}": "key stays", "c": "no variable $HOME"}


def test_escape_and_fallback() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert substitute("$${SET}", env) == "${SET}"
    assert substitute("$$${SET}", env) == "$${SET}"  # a `$` before an escape stays
    assert substitute("${UNSET:-fallback}", env) == "fallback"
    assert substitute("${EMPTY:-fallback}", env) == "fallback"
    assert substitute("${EMPTY}", env) == ""
    assert substitute("${SET:-fallback}", env) == "v"


def test_an_unset_variable_names_itself_and_the_key() -> None:
    with pytest.raises(UnsetVariable) as info:
        substitute({"models": [{"instances": [{"api_key": "${FAKE_KEY}"}]}]}, {})
    assert str(info.value) == "models[0].instances[0].api_key: environment variable ${FAKE_KEY} is not set"


def test_load_config_substitutes_and_reports(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "listen: {port: '${PORT}'}\n"
        "models:\n  - name: m\n    instances:\n      - {url: 'http://127.0.0.1:9', api_key: '${FAKE_KEY}'}\n"
    )
    config = load_config(path, {"PORT": "8123", "FAKE_KEY": "sk-secret"})
    assert config.listen.port == 8123
    assert config.models[0].instances[0].api_key == "sk-secret"
    with pytest.raises(ConfigError) as info:
        load_config(path, {"PORT": "8123"})
    assert "models[0].instances[0].api_key" in str(info.value) and "${FAKE_KEY}" in str(info.value)
    assert str(info.value).startswith(str(path))
