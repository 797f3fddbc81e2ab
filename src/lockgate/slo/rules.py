"""Prometheus recording and alerting rules for the configured objectives, over the gateway's `/metrics`.

The same objectives and burn-rate alerts as `objectives.py`, written in PromQL (`lockgate slo
--prometheus-rules`). Recording rules: `lockgate_slo:<objective>:error_ratio_rate<window>` (the share of bad
events over each window) and `lockgate_slo:<objective>:budget_remaining` (over the SLO period); alerting
rules: `LockgateSlo<Objective>Burn<Severity>`, one per objective and configured alert.

Differences from the usage-record evaluation, where the metrics cannot say the same thing:
- `p0_success` counts rejections with a 5xx as `lockgate_rejections_total{reason="queue_timeout"}` (the
  records know each rejection's status; the metrics only the admission's reasons).
- `p0_ttft` reads the threshold's bucket of `lockgate_time_to_first_token_seconds` and of
  `lockgate_unanswered_wait_seconds` (the streams that ended without a first token): a gateway adds its configured
  threshold to both histograms' bounds when it starts (a threshold changed by a reload needs a restart there).
- `engine_idle` samples `lockgate_instance_engine_running` at each rule evaluation (healthy instances
  with a known value), like the gateway's own sampler; an idle engine counts only while requests wait
  (`lockgate_queue_depth`, or an engine's own queue).
- `dedup_saving` counts the de-duplication outcomes (`lockgate_dedup_total`) of the requests that could be shared
  (not `bypass`: sampled, opted out, embeddings), the same requests as the records.
Labels come from the SLI metrics of issue 15 (`{model, priority, status}` on the request counter, `{model,
priority, stream}` on TTFT, `{model, priority, reason}` on cancellations; docs/metrics.md).
"""

from __future__ import annotations

from typing import Any

import yaml

from .config import SloConfig
from .objectives import budget, objectives, reachable


def _sum_rate(selector: str, window: str) -> str:
    return f"(sum(rate({selector}[{window}])) or vector(0))"


def _error_ratio(name: str, config: SloConfig, window: str) -> str:
    """The share of bad events of objective `name` over `window`, in PromQL."""
    p = config.klass
    if name == "p0_success":
        bad = _sum_rate(f'lockgate_requests_total{{priority="{p}",status=~"error|timeout|shutdown"}}', window)
        bad += " + " + _sum_rate(f'lockgate_rejections_total{{priority="{p}",reason="queue_timeout"}}', window)
        total = f'sum(rate(lockgate_requests_total{{priority="{p}",status!~"client_disconnect|admin"}}[{window}]))'
        return f"({bad}) / {total}"
    if name == "p0_ttft":
        labels = f'priority="{p}",stream="true"'
        le = repr(config.ttft_threshold_ms / 1000)  # as prometheus-client writes the bound (`floatToGoString`)
        first, gone = "lockgate_time_to_first_token_seconds", "lockgate_unanswered_wait_seconds"
        count = _sum_rate(f"{first}_count{{{labels}}}", window)
        within = _sum_rate(f'{first}_bucket{{{labels},le="{le}"}}', window)
        gone_bucket = _sum_rate(f'{gone}_bucket{{{labels},le="{le}"}}', window)
        gave_up = f"({_sum_rate(f'{gone}_count{{{labels}}}', window)} - {gone_bucket})"
        return f"({count} - {within} + {gave_up}) / ({count} + {gave_up})"
    if name == "engine_idle":
        return f"avg_over_time(lockgate_slo:engine_idle:ratio[{window}])"
    if name == "cancel_rate":
        bad = _sum_rate('lockgate_cancellations_total{reason!="preempted"}', window)
        return f'{bad} / sum(rate(lockgate_requests_total{{status!="rejected"}}[{window}]))'
    if name == "dedup_saving":
        bad = _sum_rate('lockgate_dedup_total{outcome="miss"}', window)
        return f'{bad} / sum(rate(lockgate_dedup_total{{outcome=~"miss|coalesced|hit|semantic"}}[{window}]))'
    raise ValueError(f"unknown objective {name!r}")


_RUNNING = "lockgate_instance_engine_running"
_HEALTHY = "on (instance) lockgate_instance_healthy == 1"
#: Something waits somewhere in the fleet: at a gateway's admission or inside an engine (fleet-wide: the
#: per-instance series carry no model label; the gateway's own sampler matches engines to their models).
_DEMAND = "((sum(lockgate_queue_depth) or vector(0)) + (sum(lockgate_instance_engine_waiting > 0) or vector(0)) > 0)"
_IDLE_WANTED = f"((count({_RUNNING} == 0 and {_HEALTHY}) and on () {_DEMAND}) or vector(0))"
_BUSY = f"(count({_RUNNING} > 0 and {_HEALTHY}) or vector(0))"
#: Among healthy engines with a known busy signal, the share idle while requests waited, at one evaluation
#: (an idle engine with nothing waiting is not an event).
_IDLE_NOW = f"{_IDLE_WANTED} / ({_BUSY} + {_IDLE_WANTED})"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def prometheus_rules(config: SloConfig) -> dict[str, Any]:
    """The rules file as data (`rules_yaml` writes it)."""
    windows = list(config.windows())
    recording: list[dict[str, Any]] = [{"record": "lockgate_slo:engine_idle:ratio", "expr": _IDLE_NOW}]
    alerting: list[dict[str, Any]] = []
    for objective in objectives(config):
        name = objective.name
        allowed = budget(objective.target)
        for window in windows:
            recording.append(
                {"record": f"lockgate_slo:{name}:error_ratio_rate{window}", "expr": _error_ratio(name, config, window)}
            )
        recording.append(
            {
                "record": f"lockgate_slo:{name}:budget_remaining",
                "expr": (
                    f"clamp_min(clamp_max(1 - lockgate_slo:{name}:error_ratio_rate{config.period} / {allowed!r}, 1), 0)"
                ),
            }
        )
        for alert in config.alerts:
            rate = reachable(alert.burn_rate, objective.target)
            threshold = f"({rate!r} * {allowed!r})"
            alerting.append(
                {
                    "alert": f"LockgateSlo{_camel(name)}Burn{_camel(alert.severity)}",
                    "expr": (
                        f"lockgate_slo:{name}:error_ratio_rate{alert.long_window} > {threshold}\n"
                        f"and\nlockgate_slo:{name}:error_ratio_rate{alert.short_window} > {threshold}"
                    ),
                    "labels": {"severity": alert.severity, "slo": name},
                    "annotations": {
                        "summary": f"lockgate SLO {objective.text}: error budget burning over {rate:g}x",
                        "description": (
                            f"Over both {alert.long_window} and {alert.short_window}, {name} spends its error budget "
                            f"({allowed:g} of events) more than {rate:g} times faster than the "
                            f"{config.period} period allows. `lockgate slo` or GET /admin/slo shows the numbers."
                        ),
                    },
                }
            )
    return {
        "groups": [
            {"name": "lockgate-slo-recording", "interval": "30s", "rules": recording},
            {"name": "lockgate-slo-alerts", "rules": alerting},
        ]
    }


def rules_yaml(config: SloConfig) -> str:
    """The rules file: Prometheus' `rule_files` format, with a header saying where it came from."""
    header = (
        "# Prometheus rules for lockgate's SLOs, generated by `lockgate slo --prometheus-rules` from the `slo:`\n"
        "# configuration section. Scrape lockgate with `honor_labels: true`: its per-engine series carry an\n"
        "# `instance` label of their own (the engine), which must not be replaced by the scrape target's.\n"
    )
    body: str = yaml.safe_dump(prometheus_rules(config), sort_keys=False, width=1000, default_flow_style=False)
    return header + body
