"""`${VAR}` in configuration strings: values taken from the environment when the file is loaded.

Pure: `substitute(data, environ)` walks the parsed YAML (mappings, lists, strings; keys are left as
they are) and returns a copy in which every `${NAME}` in a string value is replaced by the variable's
value, and `${NAME:-fallback}` by the fallback when the variable is unset or empty. `$${` is an
escaped `${` (kept literally, without substitution). An unset variable without a fallback is an error
that names the variable and the key path (`models[0].instances[0].api_key`); the value itself never
appears in an error, since it is often a secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# `$${` first (an escape), then `${NAME}` / `${NAME:-fallback}`; anything else after a `$` is literal.
_PATTERN = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class UnsetVariable(ValueError):
    """A `${NAME}` whose variable is not set (and has no fallback)."""

    def __init__(self, name: str, where: str) -> None:
        super().__init__(f"{where}: environment variable ${{{name}}} is not set")
        self.name = name
        self.where = where


def substitute(data: Any, environ: Mapping[str, str], where: str = "") -> Any:
    """`data` with the environment substituted into its strings; raises `UnsetVariable`."""
    if isinstance(data, str):
        return _substitute_text(data, environ, where or "(top level)") if "$" in data else data
    if isinstance(data, dict):
        return {key: substitute(value, environ, f"{where}.{key}" if where else str(key)) for key, value in data.items()}
    if isinstance(data, list):
        return [substitute(value, environ, f"{where}[{index}]") for index, value in enumerate(data)]
    return data


def _substitute_text(text: str, environ: Mapping[str, str], where: str) -> str:
    def replace(match: re.Match[str]) -> str:
        name, fallback = match.group(1), match.group(2)
        if name is None:
            return "${"  # the escape `$${`
        value = environ.get(name)
        if value is None or (value == "" and fallback is not None):
            if fallback is None:
                raise UnsetVariable(name, where)
            return fallback
        return value

    return _PATTERN.sub(replace, text)
