"""Request fingerprints: which requests would produce the same output.

A fingerprint is an xxh3-128 digest of a canonical form of everything that can change the output: the
tenant, the endpoint kind, the messages or prompt, and every other body field — unknown ones included,
so an engine extension we have never heard of keeps two requests apart (safe by default). Only fields
that cannot change the generated content are left out (`EXCLUDED`), so a streaming and a non-streaming
client share one upstream call.

The tenant is also written out in front of the digest (`scoped`): two tenants' requests never share a key, whatever
the hash does (xxh3 is fast, not built to resist a crafted collision; a collision inside one tenant can only serve
that tenant its own answers).

Canonical form: JSON with sorted keys; top-level `null` fields dropped (the same as absent); integral
floats written as integers (`0.0` == `0`) when they fit in 64 bits (a JSON integer beyond that already
parses as a float, so `1e20` and `100000000000000000000` stay equal); a single `stop` string written as a
one-element list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from ..wire import Endpoint

#: The integers orjson reads and writes: JSON integers outside this range parse as floats.
_INT_MIN = -(2**63)
_UINT_END = 2**64
#: Body fields that never change the generated content.
EXCLUDED = frozenset({"stream", "stream_options", "user"})
#: Body fields that hold the input (left out of the sampling scope).
INPUT_FIELDS = frozenset({"messages", "prompt"})


@dataclass(frozen=True, slots=True)
class Fingerprint:
    digest: bytes

    def hex(self) -> str:
        return self.digest.hex()


def canonical_params(body: dict[str, Any]) -> dict[str, Any]:
    """Every output-affecting parameter except the input, normalised."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in EXCLUDED or key in INPUT_FIELDS or value is None:
            continue
        if isinstance(value, float) and value.is_integer() and _INT_MIN <= value < _UINT_END:
            value = int(value)
        elif key == "stop" and isinstance(value, str):
            value = [value]
        params[key] = value
    return params


def _digest(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS))


def scoped(tenant: str, digest: bytes) -> bytes:
    """`digest` behind its tenant's name (length-prefixed): keys of two tenants always differ."""
    name = tenant.encode()
    return len(name).to_bytes(4, "big") + name + digest


def fingerprint(tenant: str, endpoint: Endpoint, body: dict[str, Any]) -> Fingerprint:
    """The identity of the generation this request asks for."""
    return Fingerprint(
        scoped(
            tenant,
            _digest(
                {
                    "endpoint": endpoint.value,
                    "params": canonical_params(body),
                    "messages": body.get("messages"),
                    "prompt": body.get("prompt"),
                }
            ),
        )
    )


def sampling_scope(tenant: str, endpoint: Endpoint, body: dict[str, Any]) -> Fingerprint:
    """Everything but the input: requests may share a semantic-cache answer only within one scope."""
    return Fingerprint(scoped(tenant, _digest({"endpoint": endpoint.value, "params": canonical_params(body)})))
