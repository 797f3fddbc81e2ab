"""The `slo:` configuration section: the design's SLO table as defaults, and the burn-rate alerts.

Every objective is a ratio of good events to valid events with a target share of good ones; its error
budget is `1 - target` (`slo/objectives.py` defines what the events of each objective are).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

_DURATION = re.compile(r"^([1-9][0-9]*)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> int:
    """`"5m"` -> 300. Raises ValueError on anything but `<positive integer><s|m|h|d>`."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h or 30d")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def _check_duration(value: str) -> str:
    duration_s(value)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BurnAlert(_Strict):
    """A multi-window burn-rate alert (Google SRE workbook, chapter 5): it fires while the error budget
    burns faster than `burn_rate` times the sustainable rate over both windows (the long one makes it
    significant, the short one makes it stop soon after the burning does)."""

    severity: Annotated[str, Field(min_length=1, max_length=32)]
    long_window: str
    short_window: str
    burn_rate: Annotated[float, Field(gt=0)]

    @field_validator("long_window", "short_window")
    @classmethod
    def _durations(cls, value: str) -> str:
        return _check_duration(value)


def _default_alerts() -> list[BurnAlert]:
    # The workbook's table for a 30-day period: 2% of the budget in 1 h pages; 5% in 6 h opens a ticket.
    return [
        BurnAlert(severity="page", long_window="1h", short_window="5m", burn_rate=14.4),
        BurnAlert(severity="ticket", long_window="6h", short_window="30m", burn_rate=6.0),
    ]


_Share = Annotated[float, Field(gt=0, lt=1)]


class SloConfig(_Strict):
    """The design's SLO table (section 8) as defaults."""

    #: The priority class the P0 objectives (success, TTFT) look at (null: the most urgent, the first of
    #: `scheduling.classes`; the configuration fills it in at load).
    priority: Annotated[str, Field(min_length=1)] | None = None

    @property
    def klass(self) -> str:
        """The class the P0 objectives look at (P0 for a section not loaded with a configuration)."""
        return self.priority or "P0"

    #: Share of that class's requests that succeed.
    success_target: _Share = 0.999
    #: Share of that class's streams whose first token comes within `ttft_threshold_ms` (p99 < 2 s).
    ttft_target: _Share = 0.99
    ttft_threshold_ms: Annotated[int, Field(ge=1)] = 2000
    #: Highest share of sampled time the engines may spend running nothing.
    engine_idle_max: _Share = 0.05
    #: Highest share of requests that may end cancelled.
    cancel_rate_max: _Share = 0.01
    #: Lowest share of requests served without an engine call of their own (coalesced or from a cache).
    dedup_saving_min: _Share = 0.15
    #: The SLO period: the error budget is what the period's window may spend.
    period: str = "30d"
    #: How long an evaluation is reused (the usage records are queried at most this often).
    cache_ms: Annotated[int, Field(ge=100, le=600_000)] = 5000
    #: How often the engines' busy signals are sampled for the idle objective.
    idle_sample_ms: Annotated[int, Field(ge=100, le=60_000)] = 5000
    alerts: list[BurnAlert] = Field(default_factory=_default_alerts)

    @field_validator("period")
    @classmethod
    def _period(cls, value: str) -> str:
        return _check_duration(value)

    def windows(self) -> dict[str, int]:
        """Every window evaluated, name -> seconds, shortest first: 5m, 1h, the period and the alerts' windows."""
        names = {"5m", "1h", self.period}
        for alert in self.alerts:
            names.update((alert.long_window, alert.short_window))
        return dict(sorted(((name, duration_s(name)) for name in names), key=lambda item: item[1]))
