"""Configuration of what operators see: `metrics:`, `admin:`, `access_log:` and `tracing:`.

Kept apart from `config.py` (which embeds these sections) so the feature owns its keys.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..admission.config import check_key_digests
from ..extras import install_hint, missing


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MetricsConfig(_Strict):
    #: Tenants (in configuration order) that get their own `tenant` label on the token counters; the others
    #: are counted under `other`.
    max_tenant_labels: Annotated[int, Field(ge=0, le=10000)] = 100


class AdminConfig(_Strict):
    """Who may use `/admin/*`, `/dashboard` (and, if asked, `/metrics`)."""

    #: Admin API keys as `sha256:<hex>` digests (`lockgate hash-key`), like tenant keys.
    keys: list[str] = []
    #: `/metrics` also requires an admin key (needs `keys`).
    metrics_require_key: bool = False

    @field_validator("keys")
    @classmethod
    def _hashed(cls, value: list[str]) -> list[str]:
        return check_key_digests(value)

    @model_validator(mode="after")
    def _metrics_need_keys(self) -> AdminConfig:
        if self.metrics_require_key and not self.keys:
            raise ValueError("metrics_require_key needs at least one admin key in admin.keys")
        return self


class AccessLogConfig(_Strict):
    """One JSON line per finished request (see `observe/access_log.py`)."""

    enabled: bool = False
    #: "-" for standard output, else a file (appended to).
    path: Annotated[str, Field(min_length=1)] = "-"
    #: Fraction of finished requests logged (0..1), decided per request.
    sample: Annotated[float, Field(ge=0, le=1)] = 1.0
    #: Also log the request's messages or prompt (off: they may hold personal data).
    include_prompts: bool = False


class TracingConfig(_Strict):
    """OpenTelemetry export of one span per request (needs the `otel` extra)."""

    otel: bool = False
    service_name: Annotated[str, Field(min_length=1)] = "lockgate"
    #: OTLP/HTTP traces endpoint; null: the exporter's default (`OTEL_EXPORTER_OTLP_*` environment variables).
    endpoint: str | None = None

    @model_validator(mode="after")
    def _sdk_present(self) -> TracingConfig:
        if self.otel and not sdk_installed():
            raise ValueError(f"otel needs the OpenTelemetry SDK: {install_hint('otel')}")
        return self


def sdk_installed() -> bool:
    """Whether the `otel` extra is installed (looked up without importing the SDK)."""
    return not missing("otel")
