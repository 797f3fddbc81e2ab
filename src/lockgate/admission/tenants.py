"""Tenants: who a request belongs to (from its API key), what it may use, and at which priority.

Keys are stored only as sha256 digests; a presented key is hashed and looked up. The key itself is
never stored, logged or put in an error message. With no key configured anywhere the gateway is
open and every request belongs to the tenant named "default" (configured or not).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from ..errors import InvalidRequest, ModelNotFound, Unauthorized, shown
from ..wire import GATEWAY_SALT_PREFIX
from .config import SchedulingConfig, TenantConfig

DEFAULT_TENANT = "default"
PRIORITY_HEADER = "x-priority"


def hash_key(key: str) -> str:
    """The config form of an API key: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    models: frozenset[str] | None
    default_priority: int
    #: Index of the most urgent class allowed (0 = the most urgent class).
    max_priority: int
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    assumed_max_tokens: int = 1024
    #: Whose results its requests may share (de-duplication, the caches): its name unless set. A tenant relayed by a
    #: central has its own (`cluster/identity.py`): several relayed names may be counted under one label (`other`).
    scope: str | None = None
    #: The prefix-cache salt of its requests (`cache_salt_for`); None: the client's own, if any (an open gateway's
    #: tenant; one relayed by a central comes with the salt the central chose, `cluster/identity.py`).
    cache_salt: str | None = None
    #: Relayed by a central (`cluster/identity.py`): authenticated there, as were its limits and its salt.
    relayed: bool = False

    @property
    def cache_scope(self) -> str:
        return self.name if self.scope is None else self.scope

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def group_salt(tenant: str, group: str | None = None) -> str:
    """The prefix-cache salt of `tenant`'s cache group: the one it names, else its own (the two kinds of name kept
    apart: a group named like a tenant is not that tenant's cache). A digest, so engines' logs do not carry names."""
    name = f"group:{group}" if group is not None else f"tenant:{tenant}"
    return GATEWAY_SALT_PREFIX + hashlib.sha256(b"lockgate cache group\0" + name.encode()).hexdigest()[:32]


def cache_salt_for(tenant: Tenant, client_salt: object) -> str | None:
    """The salt sent to the engine for a request of `tenant` whose body says `client_salt`: the tenant's group salt,
    with the client's own after it (a client may keep its users apart further, never join another group); None
    where the client's goes as it is (`Tenant.cache_salt`)."""
    if tenant.cache_salt is None:
        return None
    if isinstance(client_salt, str) and client_salt:
        return f"{tenant.cache_salt}.{client_salt}"
    return tenant.cache_salt


class TenantBook:
    """Tenants by key digest; pure lookups, no I/O."""

    def __init__(self, tenants: list[TenantConfig], scheduling: SchedulingConfig) -> None:
        self._scheduling = scheduling
        self._by_hash: dict[str, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        for spec in tenants:
            tenant = self._resolve(spec)
            self.tenants[tenant.name] = tenant
            for digest in spec.keys:
                self._by_hash[digest] = tenant
        self.open = not self._by_hash
        self.default = self.tenants.get(DEFAULT_TENANT) or self._resolve(TenantConfig(name=DEFAULT_TENANT))
        if self.open:  # one caller, whoever it is: nothing to keep apart (a client's own salt still goes)
            self.default = dataclasses.replace(self.default, cache_salt=None)

    def _resolve(self, spec: TenantConfig) -> Tenant:
        sched = self._scheduling

        def index(name: str | None, fallback: int) -> int:
            found = sched.class_index(name) if name is not None else None
            return fallback if found is None else found

        max_priority = index(spec.max_priority, 0)
        default = max(index(spec.default_priority, sched.default_index), max_priority)
        return Tenant(
            name=spec.name,
            models=None if spec.models is None else frozenset(spec.models),
            default_priority=default,
            max_priority=max_priority,
            requests_per_minute=spec.requests_per_minute,
            tokens_per_minute=spec.tokens_per_minute,
            max_concurrent=spec.max_concurrent,
            assumed_max_tokens=spec.assumed_max_tokens,
            cache_salt=group_salt(spec.name, spec.cache_group),
        )

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a request's `Authorization` header; `Unauthorized` if it has none."""
        if self.open:
            return self.default
        if not authorization:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("The Authorization header must be 'Bearer <key>'.", code="invalid_api_key")
        tenant = self._by_hash.get(hash_key(key))
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def check_model(self, tenant: Tenant, model: str) -> None:
        if not tenant.may_use(model):
            raise ModelNotFound(
                f"The model '{shown(model)}' does not exist or you do not have access to it.", param="model"
            )

    def priority(self, tenant: Tenant, header: str | None) -> int:
        """The class index for a request: its `x-priority` header (a class name), or the tenant's
        default; never more urgent than the tenant's maximum."""
        if header is None or not header.strip():
            return tenant.default_priority
        index = self._scheduling.class_index(header)
        if index is None:
            names = ", ".join(c.name for c in self._scheduling.classes)
            raise InvalidRequest(
                f"Header {PRIORITY_HEADER} must be one of: {names}.", param=PRIORITY_HEADER, code="invalid_priority"
            )
        return max(index, tenant.max_priority)
