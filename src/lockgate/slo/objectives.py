"""SLO evaluation, pure: counts of good and bad events per window in, the `/admin/slo` answer out.

Theory of operation: every objective is a ratio SLI, `good / valid events`, with a target share of good
events; the error budget is `1 - target`. Over a window, the burn rate is the share of bad events divided
by the budget (1: the budget lasts exactly the period; 14.4 over an hour: 2% of a 30-day budget gone in
that hour). An alert (`config.alerts`) fires while both its windows burn faster than its rate. The budget
left is `1 - burn rate` over the period's window, clipped to 0..1. Status: `unknown` with no events in any
window, `burning` while an alert fires or the period's budget is spent, `met` otherwise.

What the events of each objective are (the usage records, `slo/usage.py`, and the idle sampler,
`slo/idle.py`, count them; `slo/rules.py` says the same in PromQL):
- `p0_success`: requests of the configured class, except those their client (or an admin) ended; bad:
  `error`, a `timeout` or `shutdown` cancellation, or a rejection with a 5xx status (queue timeout, no instance).
  A request the engine refused with a 4xx is a rejection (`errors.UpstreamStatusError`), like one the gateway's
  own checks refuse: the client's mistake, not the service's failure.
- `p0_ttft`: streams of that class that sent a first token, however they ended, and those that ended without one
  after waiting longer than the threshold (their client gave up: a stuck engine must not read as met); bad: the
  first token later than the threshold, or none. Rejections do not count.
- `engine_idle`: engine samples (each engine with a fresh busy signal, once per sample); bad: it ran nothing.
- `cancel_rate`: finished requests (not rejected); bad: cancelled.
- `dedup_saving`: finished requests (not rejected) that could be shared (de-duplication eligible: a flight's leader,
  coalesced, a cache or semantic hit; not a sampled request under `dedup: deterministic`, nor one opted out),
  whatever their end: a stream its client abandoned spent the engine's work if it led its call, and none if it
  joined one; good: served without an engine call of their own. What `lockgate_dedup_total` counts without
  `bypass`, so the Prometheus rule reads the same. (Counting every request, a fresh install serving sampled chat,
  which no default shares, burned it from its first request: `lockgate slo` exited 3 on day one.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import SloConfig

OBJECTIVES = ("p0_success", "p0_ttft", "engine_idle", "cancel_rate", "dedup_saving")


@dataclass(frozen=True, slots=True)
class Counts:
    """Valid events in a window, and how many of them were bad."""

    events: float
    bad: float


@dataclass(frozen=True, slots=True)
class Objective:
    name: str
    #: Human text, e.g. "P0 success >= 99.9%".
    text: str
    #: Target share of good events.
    target: float


def objectives(config: SloConfig) -> list[Objective]:
    """The configured objectives, in the design's order."""
    p = config.klass
    return [
        Objective("p0_success", f"{p} success >= {_pct(config.success_target)}", config.success_target),
        Objective(
            "p0_ttft",
            f"{p} TTFT p{_pct(config.ttft_target, sign=False)} < {config.ttft_threshold_ms / 1000:g} s (streams)",
            config.ttft_target,
        ),
        Objective("engine_idle", f"engine idle < {_pct(config.engine_idle_max)}", 1 - config.engine_idle_max),
        Objective("cancel_rate", f"cancel rate < {_pct(config.cancel_rate_max)}", 1 - config.cancel_rate_max),
        Objective(
            "dedup_saving",
            f"de-duplication saving >= {_pct(config.dedup_saving_min)} of shareable requests",
            config.dedup_saving_min,
        ),
    ]


def _pct(share: float, *, sign: bool = True) -> str:
    return f"{round(share * 100, 4):g}" + ("%" if sign else "")


def budget(target: float) -> float:
    """The error budget of a target share, rounded against float noise (1 - 0.999 = 0.0010000000000000009)."""
    return round(1 - target, 12)


def reachable(rate: float, target: float) -> float:
    """An alert's burn `rate` for an objective of `target`: as configured, unless no window could ever burn that fast
    (the bad share is at most 1, so the burn rate at most 1 / budget: de-duplication's saving, a budget of 0.85, made
    both default alerts, 14.4x and 6x, ones that never fire); then halfway between 1 (the budget lasts the period) and
    that highest rate."""
    allowed = budget(target)
    if rate * allowed < 1:
        return rate
    return round((1 + 1 / allowed) / 2, 6)


def burn_rate(counts: Counts | None, target: float) -> float | None:
    """Bad share / error budget over a window; None without events."""
    if counts is None or counts.events <= 0:
        return None
    return (counts.bad / counts.events) / budget(target)


def evaluate(config: SloConfig, counts: Mapping[str, Mapping[str, Counts]]) -> dict[str, Any]:
    """The `/admin/slo` answer from `counts[objective][window]` (a window missing: unknown there).

    Shape: `{"objectives": [{"name", "objective", "target", "status", "budget_remaining", "windows":
    {window: {"events", "bad", "sli", "burn_rate"}}, "alerts": [{"severity", "windows", "burn_rate",
    "firing"}]}], "period": window name}`."""
    windows = config.windows()
    out = []
    for objective in objectives(config):
        by_window = counts.get(objective.name, {})
        rates = {w: burn_rate(by_window.get(w), objective.target) for w in windows}
        alerts = []
        for alert in config.alerts:
            long_rate, short_rate = rates[alert.long_window], rates[alert.short_window]
            rate = reachable(alert.burn_rate, objective.target)
            firing = long_rate is not None and short_rate is not None and long_rate > rate and short_rate > rate
            alerts.append(
                {
                    "severity": alert.severity,
                    "windows": [alert.long_window, alert.short_window],
                    "burn_rate": rate,
                    "firing": firing,
                }
            )
        period_rate = rates[config.period]
        remaining = None if period_rate is None else min(1.0, max(0.0, 1.0 - period_rate))
        if all(rate is None for rate in rates.values()):
            status = "unknown"
        elif any(a["firing"] for a in alerts) or remaining == 0.0:
            status = "burning"
        else:
            status = "met"
        out.append(
            {
                "name": objective.name,
                "objective": objective.text,
                "target": objective.target,
                "status": status,
                "budget_remaining": None if remaining is None else round(remaining, 6),
                "windows": {w: _window(by_window.get(w), rates[w]) for w in windows},
                "alerts": alerts,
            }
        )
    return {"period": config.period, "objectives": out}


def _window(counts: Counts | None, rate: float | None) -> dict[str, Any]:
    if counts is None:
        return {"events": None, "bad": None, "sli": None, "burn_rate": None}
    sli = None if counts.events <= 0 else round(1 - counts.bad / counts.events, 6)
    return {
        "events": _number(counts.events),
        "bad": _number(counts.bad),
        "sli": sli,
        "burn_rate": None if rate is None else round(rate, 4),
    }


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 3)
