"""Configuration of tenants, API keys, priority classes and the scheduler (`tenants:`, `scheduling:`).

Kept apart from `config.py` (which embeds these sections) so the admission feature owns its keys.
See docs/tenants-and-priorities.md for the reference.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def check_key_digests(value: list[str]) -> list[str]:
    """API keys in configuration are `sha256:<64 hex>` digests (tenant and admin keys alike)."""
    for index, key in enumerate(value):
        if not _KEY_HASH.match(key):
            # Never echo the value: it may be a plaintext key pasted by mistake.
            raise ValueError(
                f"keys[{index}] must be a sha256 digest 'sha256:<64 hex>' (run `lockgate hash-key`), "
                "not a plaintext key"
            )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriorityClassConfig(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=32)]
    #: Share of the capacity left by strict classes (relative to the other non-strict classes).
    weight: Annotated[float, Field(gt=0)] = 1.0
    #: Served before every non-strict class whenever it has work (P0 by default).
    strict: bool = False
    #: Requests that may wait in this class's queue per model pool; beyond it: 429.
    max_queue: Annotated[int, Field(ge=0)] = 1024
    #: Slots this class may hold at once per model pool (null: any free slot).
    max_running: Annotated[int, Field(ge=1)] | None = None
    #: Longest wait in the queue before the request is shed with 503 (null: only its own deadline).
    queue_timeout_ms: Annotated[int, Field(ge=1)] | None = None
    #: A strict-class arrival finding no free slot may stop (preempt) this class's running requests,
    #: which are re-queued and resumed later (null: only the last, least urgent class). Strict
    #: classes are never preemptible.
    preemptible: bool | None = None


def _default_classes() -> list[PriorityClassConfig]:
    return [
        PriorityClassConfig(name="P0", weight=0.6, strict=True, max_queue=256, queue_timeout_ms=10_000),
        PriorityClassConfig(name="P1", weight=0.3, max_queue=1024, queue_timeout_ms=30_000),
        PriorityClassConfig(name="P2", weight=0.1, max_queue=4096, queue_timeout_ms=120_000),
    ]


class PreemptionConfig(_Strict):
    """Preemption with resumption (see docs/tenants-and-priorities.md)."""

    enabled: bool = True
    #: A request stopped this many times is no longer preemptible.
    max_per_request: Annotated[int, Field(ge=1)] = 8


class SchedulingConfig(_Strict):
    #: Priority classes, most urgent first (names are what clients send in `x-priority`).
    classes: Annotated[list[PriorityClassConfig], Field(min_length=1)] = Field(default_factory=_default_classes)
    #: Class of requests without `x-priority` (null: the middle class, P1 by default).
    default_priority: str | None = None
    #: Fraction of each pool's slots kept free for strict classes (P0), so that they start at once
    #: without preemption; at least one slot is always left to the others.
    strict_headroom: Annotated[float, Field(ge=0.0, le=0.9)] = 0.0
    #: Adaptive strict reserve: for this long after strict (P0) traffic was last seen, the other classes
    #: leave its recent peak concurrency free (at most half the pool, never its last slot), so that P0
    #: starts at once under any flood without preempting anyone; 0 turns it off.
    strict_reserve_window_ms: Annotated[int, Field(ge=0)] = 30_000
    #: Send the class index as the engine's priority field where the dialect has one (vLLM
    #: `priority`). Off by default: a vLLM running its default FCFS policy rejects every request
    #: with a non-zero priority, so turn it on only for engines started with
    #: `--scheduling-policy priority` (the simulators accept it; the embedded default turns it on).
    engine_priority: bool = False
    preemption: PreemptionConfig = PreemptionConfig()

    @field_validator("classes")
    @classmethod
    def _unique(cls, value: list[PriorityClassConfig]) -> list[PriorityClassConfig]:
        names = [c.name.lower() for c in value]
        if len(set(names)) != len(names):
            raise ValueError("priority class names must be unique (case-insensitive)")
        for klass in value:
            if klass.strict and klass.preemptible:
                raise ValueError(f"class {klass.name}: a strict class cannot be preemptible")
        return value

    def preemptible_classes(self) -> frozenset[int]:
        """Indexes of the classes whose running requests may be preempted."""
        if not self.preemption.enabled:
            return frozenset()
        last = len(self.classes) - 1
        return frozenset(
            i
            for i, c in enumerate(self.classes)
            if not c.strict and (c.preemptible if c.preemptible is not None else i == last)
        )

    def class_index(self, name: str) -> int | None:
        lowered = name.strip().lower()
        for index, klass in enumerate(self.classes):
            if klass.name.lower() == lowered:
                return index
        return None

    @property
    def default_index(self) -> int:
        if self.default_priority is None:
            return len(self.classes) // 2
        index = self.class_index(self.default_priority)
        assert index is not None  # checked by check_admission
        return index


class TenantConfig(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    #: API keys of this tenant, as `sha256:<hex>` digests (`lockgate hash-key` prints one).
    keys: list[str] = []
    #: Models this tenant may use (null: all).
    models: list[str] | None = None
    #: Class of this tenant's requests without `x-priority` (null: scheduling.default_priority).
    default_priority: str | None = None
    #: Most urgent class this tenant may ask for; more urgent requests are lowered to it.
    max_priority: str | None = None
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    #: Prompt + completion tokens per minute; `max_tokens` is reserved at admission, the unused
    #: part refunded when the request ends.
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    #: Completion tokens reserved for a request that sets no `max_tokens`.
    assumed_max_tokens: Annotated[int, Field(ge=1)] = 1024
    #: Tenants naming the same group share engines' prefix caches (null: the tenant's own): a request reuses cached
    #: blocks of its group's prompts only, so one tenant cannot probe another's prompts through cache hits
    #: (`cached_tokens`, time to first token). Sent to vLLM as `cache_salt`.
    cache_group: Annotated[str, Field(min_length=1, max_length=64)] | None = None

    @field_validator("keys")
    @classmethod
    def _hashed(cls, value: list[str]) -> list[str]:
        return check_key_digests(value)

    @field_validator("name")
    @classmethod
    def _printable(cls, value: str) -> str:
        # It becomes a metric label, a usage record's field and, relayed by a central, a request header.
        if not value.isprintable():
            raise ValueError("a tenant name must be printable (no control characters)")
        return value


def check_admission(tenants: list[TenantConfig], scheduling: SchedulingConfig) -> None:
    """Cross-section checks (raises ValueError naming the key)."""
    names = [t.name for t in tenants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"tenant names must be unique; repeated: {', '.join(dupes)}")
    seen: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.keys:
            if key in seen:
                raise ValueError(f"tenants {seen[key]} and {tenant.name} share an API key")
            seen[key] = tenant.name
    if scheduling.default_priority is not None and scheduling.class_index(scheduling.default_priority) is None:
        raise ValueError(f"scheduling.default_priority: no class named {scheduling.default_priority!r}")
    for index, tenant in enumerate(tenants):
        for field in ("default_priority", "max_priority"):
            value = getattr(tenant, field)
            if value is not None and scheduling.class_index(value) is None:
                raise ValueError(f"tenants[{index}].{field}: no priority class named {value!r}")
