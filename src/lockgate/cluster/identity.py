"""Whose request a central replica relays: the client's tenant and priority class, carried to the sidecar.

A central replica authenticates the client, applies its tenant's limits and caps its priority class;
the sidecar then sees only the central (it presents `cluster.api_key`). So that the sidecar can schedule
(admission order, preemption) and record (usage records, per-tenant counters) by the client, the central
sends two headers on every request to a sidecar: `x-lockgate-tenant` (the tenant's name) and `x-priority`
(the class it admitted the request at), and, where its tenant keeps a prefix-cache group apart, `x-lockgate-cache-salt`
(the salt the engine is to be told: `admission.tenants.cache_salt_for`; the central speaks to a sidecar as to an
OpenAI server, whose body has no such field).

A sidecar believes them only from a caller that presents a central's key: `cluster.central_keys` lists
their sha256 digests. Anyone else's `x-lockgate-tenant` is ignored and their `x-priority` is capped by
their own tenant as usual, so a client that reaches a sidecar directly can neither take another
tenant's name nor a class above its own. (An open sidecar, with no tenant keys, lets every caller pick
its class anyway; it still takes tenant names only from centrals.)

At the sidecar a relayed tenant has no limits of its own (the centrals enforce them cluster-wide; one
sidecar sees only its share of the traffic) and may use any model and any class.

Bound: at most `MAX_TENANTS` distinct relayed tenant names are kept (each has rate-limiter state and
metric labels at the sidecar); beyond that, requests of new names are counted and recorded as tenant `other`
(and a name that is empty, longer than `MAX_NAME` or not printable as `default`). Each still shares results
(de-duplication, the caches) only with its own name's requests: a relayed tenant's `scope` is the name the central
sent, apart from every local tenant's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from ..admission.tenants import DEFAULT_TENANT, Tenant
from ..wire import MAX_CACHE_SALT

TENANT_HEADER = "x-lockgate-tenant"
CACHE_SALT_HEADER = "x-lockgate-cache-salt"
MAX_TENANTS = 1024
OVERFLOW_TENANT = "other"
#: Longest tenant name taken from the header (configured names are short identifiers).
MAX_NAME = 128
#: Prefix of relayed tenants' scopes: a control character, which no configured (local) tenant's name has.
_RELAYED = "\x1frelayed:"


class Relayed:
    """The sidecar's side: `tenant()` is the relayed tenant of a request from a central, else None."""

    def __init__(self, central_digests: Iterable[str], default_priority: int) -> None:
        self._digests = frozenset(central_digests)
        self._default_priority = default_priority
        self._tenants: dict[str, Tenant] = {}

    def tenant(self, authorization: str | None, name: str | None) -> Tenant | None:
        """The tenant the request is relayed for, if `authorization` is a central's key (else None: the
        caller is authenticated as any client). A central that names no tenant relays `default`."""
        if authorization is None or not self._digests:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return None
        if "sha256:" + hashlib.sha256(key.encode()).hexdigest() not in self._digests:
            return None
        scope = _RELAYED + (name or DEFAULT_TENANT)
        if not name or len(name) > MAX_NAME or not name.isprintable():
            name = DEFAULT_TENANT
        tenant = self._tenants.get(name)
        if tenant is None:
            if len(self._tenants) < MAX_TENANTS:
                tenant = self._tenants[name] = self._new(name, scope)
            else:
                tenant = self._tenants.get(OVERFLOW_TENANT) or self._tenants.setdefault(
                    OVERFLOW_TENANT, self._new(OVERFLOW_TENANT, _RELAYED + OVERFLOW_TENANT)
                )
        if tenant.scope != scope:
            tenant = dataclasses.replace(tenant, scope=scope)  # counted under another name, its results its own
        return tenant

    def _new(self, name: str, scope: str) -> Tenant:
        return Tenant(
            name=name, models=None, default_priority=self._default_priority, max_priority=0, scope=scope, relayed=True
        )


def relayed_cache_salt(value: str | None) -> str | None:
    """The salt a central sent with a relayed request (`CACHE_SALT_HEADER`), if it is one (printable, not too long)."""
    if value and len(value) <= 2 * MAX_CACHE_SALT and value.isprintable():
        return value
    return None
