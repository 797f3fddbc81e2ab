"""Which requests may be coalesced or served from a cache (pure functions over the request).

`deterministic` (the default) admits only requests whose output is reproducible: temperature 0, or a
fixed seed. `always` admits every request (the operator accepts that sampled requests share one answer);
`off` admits none. A client opts out per request with `Cache-Control: no-cache` or `no-store`.
"""

from __future__ import annotations

from typing import Any, Literal

DedupMode = Literal["off", "deterministic", "always"]

_OPT_OUT = frozenset({"no-cache", "no-store"})


def is_deterministic(body: dict[str, Any]) -> bool:
    temperature = body.get("temperature")
    if temperature is not None and temperature == 0 and not isinstance(temperature, bool):
        return True
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def opted_out(cache_control: str | None) -> bool:
    if not cache_control:
        return False
    return any(part.split("=", 1)[0].strip().lower() in _OPT_OUT for part in cache_control.split(","))


def eligible(mode: str, body: dict[str, Any], cache_control: str | None) -> bool:
    if mode == "off":
        return False
    if mode == "deterministic" and not is_deterministic(body):
        return False
    return not opted_out(cache_control)
