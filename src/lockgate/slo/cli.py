"""`lockgate slo`: evaluate the SLOs from a configuration's usage records or a running gateway's
`/admin/slo`, or write the matching Prometheus rules."""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import orjson

#: The admin key for `--url`, when not given with `--admin-key` (keeps it out of process listings).
ADMIN_KEY_ENV = "LOCKGATE_ADMIN_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", help="configuration file: its slo: section and usage.path (default: embedded)"
    )
    parser.add_argument("--url", help="ask a running gateway instead (GET <url>/admin/slo), e.g. http://127.0.0.1:8080")
    parser.add_argument("--admin-key", help=f"admin key for --url (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--json", action="store_true", help="print the evaluation as JSON (the /admin/slo shape)")
    parser.add_argument(
        "--prometheus-rules",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write Prometheus recording and alerting rules for the configured objectives (to FILE, default stdout)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config
    from ..embedded import default_config

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as exc:
        print(f"lockgate: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.prometheus_rules is not None:
        from .rules import rules_yaml

        text = rules_yaml(config.slo)
        if args.prometheus_rules == "-":
            sys.stdout.write(text)
        else:
            with open(args.prometheus_rules, "w") as fh:
                fh.write(text)
        return 0
    if args.url:
        try:
            evaluation = _fetch(args.url, args.admin_key or os.environ.get(ADMIN_KEY_ENV))
        except _FetchError as exc:
            print(f"lockgate: slo: {exc}", file=sys.stderr)
            return 1
    else:
        from .objectives import evaluate
        from .usage import UsageUnavailable, count_file

        try:
            counts = count_file(config.usage.path, config.slo, time.time())
        except UsageUnavailable as exc:
            print(f"lockgate: slo: {exc}", file=sys.stderr)
            return 1
        evaluation = evaluate(config.slo, counts)  # no engine_idle: the records know nothing of engine busyness
    if args.json:
        sys.stdout.write(orjson.dumps(evaluation, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(describe(evaluation))
    return exit_status(evaluation)


#: Exit status while at least one objective burns (1: could not evaluate; 2: invalid configuration).
EXIT_BURNING = 3


def exit_status(evaluation: dict[str, Any]) -> int:
    """0 when no objective burns (met or unknown), `EXIT_BURNING` otherwise: scripts and cron jobs can act on it."""
    burning = any(o.get("status") == "burning" for o in evaluation.get("objectives", ()))
    return EXIT_BURNING if burning else 0


class _FetchError(Exception):
    pass


def _fetch(url: str, admin_key: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/admin/slo")
    if admin_key:
        request.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        message = f"{request.full_url} answered {exc.code}: {_error_message(exc.read())}"
        if exc.code in (401, 403):  # (the gateway's words are for HTTP clients: say how this command sends one)
            given = "the admin key given was refused" if admin_key else "no admin key was given"
            message += f" ({given}: pass one with --admin-key, or in ${ADMIN_KEY_ENV})"
        raise _FetchError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        raise _FetchError(f"cannot reach {request.full_url}: {getattr(exc, 'reason', exc)}") from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _FetchError(f"{request.full_url} did not answer JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("objectives"), list):
        raise _FetchError(f"{request.full_url} did not answer an SLO evaluation")
    return data


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def describe(evaluation: dict[str, Any]) -> str:
    """The evaluation for a person: per objective its status, budget left, each window and firing alerts."""
    lines = []
    for o in evaluation["objectives"]:
        budget = o.get("budget_remaining")
        left = "unknown" if budget is None else f"{budget * 100:.1f}%"
        lines.append(
            f"{o['name']}: {o['objective']} (target {o['target']:g}): {o['status'].upper()}, budget left {left}"
        )
        parts = []
        for window, w in o["windows"].items():
            if w["events"] is None:
                parts.append(f"{window} unknown")
            elif not w["events"]:
                parts.append(f"{window} no events")
            else:
                parts.append(
                    f"{window} {w['bad']:g}/{w['events']:g} bad, SLI {w['sli'] * 100:.3f}%, burn {w['burn_rate']:g}x"
                )
        lines.append("  " + "; ".join(parts))
        for alert in o.get("alerts", []):
            if alert["firing"]:
                windows = " and ".join(alert["windows"])
                lines.append(f"  ALERT {alert['severity']}: burning over {alert['burn_rate']:g}x over {windows}")
    if evaluation.get("records_error"):
        lines.append(f"usage records: {evaluation['records_error']}")
    return "\n".join(lines) + "\n"
