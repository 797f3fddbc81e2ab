"""SLO evaluation, pure: burn rates, budgets, multi-window alerts, statuses; the `slo:` section; the idle
sampler's ring; long windows from per-bucket aggregates of the usage records; the Prometheus rules."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from lockgate import records
from lockgate.config import ConfigError, parse_config
from lockgate.fleet.state import EngineLoad
from lockgate.metrics import GatewayMetrics
from lockgate.slo import OBJECTIVES, Counts, SloConfig, evaluate
from lockgate.slo.cli import EXIT_BURNING, exit_status
from lockgate.slo.config import duration_s
from lockgate.slo.idle import MAX_HORIZON_S, IdleSamples, busy_and_idle, waiting_for
from lockgate.slo.rules import prometheus_rules, rules_yaml
from lockgate.slo.usage import (
    BucketedWindows,
    UsageUnavailable,
    connect_readonly,
    count_file,
    count_windows,
    record_files,
)

WINDOWS = ("5m", "30m", "1h", "6h", "30d")


def _success(config: SloConfig, **by_window: Counts) -> dict[str, Any]:
    evaluation = evaluate(config, {"p0_success": by_window})
    return next(o for o in evaluation["objectives"] if o["name"] == "p0_success")


def test_defaults_are_the_designs_table() -> None:
    evaluation = evaluate(SloConfig(), {})
    assert [(o["name"], o["objective"], o["target"]) for o in evaluation["objectives"]] == [
        ("p0_success", "P0 success >= 99.9%", 0.999),
        ("p0_ttft", "P0 TTFT p99 < 2 s (streams)", 0.99),
        ("engine_idle", "engine idle < 5%", 0.95),
        ("cancel_rate", "cancel rate < 1%", 0.99),
        ("dedup_saving", "de-duplication saving >= 15% of shareable requests", 0.15),
    ]
    assert tuple(o["name"] for o in evaluation["objectives"]) == OBJECTIVES
    assert list(SloConfig().windows()) == list(WINDOWS)
    # Nothing counted anywhere: unknown, no budget figure.
    assert {o["status"] for o in evaluation["objectives"]} == {"unknown"}
    assert {o["budget_remaining"] for o in evaluation["objectives"]} == {None}


def test_a_fast_burn_pages_and_a_slow_one_opens_a_ticket() -> None:
    config = SloConfig()
    quiet = Counts(events=100_000, bad=0)
    # 2% bad in the last hour and 5 minutes: 20x the 0.1% budget, over the page's 14.4x.
    fast = _success(config, **{"5m": Counts(1000, 20), "30m": Counts(5000, 100), "1h": Counts(10_000, 200),
                               "6h": Counts(60_000, 200), "30d": Counts(1_000_000, 200)})  # fmt: skip
    assert {a["severity"]: a["firing"] for a in fast["alerts"]} == {"page": True, "ticket": False}
    assert fast["status"] == "burning" and fast["budget_remaining"] == 0.8  # 200 of the 1,000 bad allowed
    assert fast["windows"]["1h"] == {"events": 10_000, "bad": 200, "sli": 0.98, "burn_rate": 20.0}
    # The page stops as soon as the short window recovers, though the hour still burns.
    recovered = _success(config, **{"5m": quiet, "1h": Counts(10_000, 200)})
    assert not any(a["firing"] for a in recovered["alerts"])
    # 0.7% over 6 h and 30 min: 7x, a ticket.
    slow = _success(config, **{"30m": Counts(10_000, 70), "6h": Counts(100_000, 700), "30d": Counts(10**7, 700)})
    assert {a["severity"]: a["firing"] for a in slow["alerts"]} == {"page": False, "ticket": True}
    assert slow["budget_remaining"] == pytest.approx(0.93)


def test_an_alert_no_window_could_reach_burns_at_a_reachable_rate() -> None:
    """An outside run: de-duplication's saving (a target of 15%: a budget of 0.85) had both default alerts, 14.4x and
    6x, over a bad share that is at most 1, so neither could ever fire, in the evaluator and the Prometheus rules
    alike. Such an alert burns halfway between 1 and the highest rate (1 / 0.85): a saving under 7.5% over both."""
    config = SloConfig()
    nothing = Counts(1000, 1000)  # no request shared anything
    counts = {w: nothing for w in WINDOWS}
    saving = next(o for o in evaluate(config, {"dedup_saving": counts})["objectives"] if o["name"] == "dedup_saving")
    assert [(a["burn_rate"], a["firing"]) for a in saving["alerts"]] == [(1.088235, True), (1.088235, True)]
    half = {w: Counts(1000, 900) for w in WINDOWS}  # 10% saved: under target, above the alerts' 7.5%
    saving = next(o for o in evaluate(config, {"dedup_saving": half})["objectives"] if o["name"] == "dedup_saving")
    assert not any(a["firing"] for a in saving["alerts"])
    rules = prometheus_rules(config)["groups"][1]["rules"]
    exprs = [r["expr"] for r in rules if r["labels"]["slo"] == "dedup_saving"]
    assert exprs and all("(1.088235 * 0.85)" in e for e in exprs), exprs
    # An objective whose budget the rate fits keeps it as configured.
    assert [a["burn_rate"] for a in _success(config, **counts)["alerts"]] == [14.4, 6.0]


def test_status_met_burning_unknown() -> None:
    config = SloConfig()
    met = _success(config, **{"30d": Counts(10_000, 5)})  # half the budget spent, no alert
    assert met["status"] == "met" and met["budget_remaining"] == 0.5
    spent = _success(config, **{"30d": Counts(10_000, 10)})  # all of it: burning even without an alert
    assert spent["status"] == "burning" and spent["budget_remaining"] == 0.0
    empty = _success(config, **{"30d": Counts(0, 0)})
    assert empty["status"] == "unknown" and empty["windows"]["30d"] == {
        "events": 0,
        "bad": 0,
        "sli": None,
        "burn_rate": None,
    }
    assert empty["windows"]["5m"] == {"events": None, "bad": None, "sli": None, "burn_rate": None}


def test_the_slo_section_is_validated() -> None:
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    config = parse_config({"models": models, "slo": {"success_target": 0.99, "alerts": []}})
    assert config.slo.success_target == 0.99 and list(config.slo.windows()) == ["5m", "1h", "30d"]
    bad = [
        ({"priority": "P9"}, "slo.priority: 'P9' is not a priority class (P0, P1, P2)"),
        ({"period": "a month"}, "slo.period: 'a month' is not a duration like 30s, 5m, 1h or 30d"),
        ({"success_target": 1.0}, "slo.success_target: Input should be less than 1"),
        (
            {"alerts": [{"severity": "page", "long_window": "1h", "short_window": "5", "burn_rate": 14.4}]},
            "short_window",
        ),
        ({"colour": "red"}, "slo.colour: unknown key"),
    ]
    for section, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_config({"models": models, "slo": section})
    assert duration_s("30d") == 30 * 86400 and duration_s("90s") == 90
    # Unset, the class is the most urgent one, whatever its name.
    classes = {"classes": [{"name": "gold", "strict": True}, {"name": "bronze"}]}
    assert parse_config({"models": models, "scheduling": classes}).slo.priority == "gold"


def test_idle_samples_are_bounded_and_windowed() -> None:
    samples = IdleSamples(horizon_s=60, interval_s=1)
    for t in range(1000):
        samples.add(float(t), busy=1, idle=t % 2)
    assert len(samples) == 61  # the ring holds the horizon, not the history
    counts = samples.counts(999.0, {"10s": 10, "1m": 60, "1h": 3600})
    assert counts["10s"] == Counts(events=11 + 6, bad=6)  # samples at 989..999: 11 busy, 6 (the odd ones) idle
    assert "1h" not in counts  # beyond the horizon: unknown
    assert IdleSamples(horizon_s=10**9, interval_s=5).horizon_s == MAX_HORIZON_S


def test_busy_and_idle_counts_engines_with_a_fresh_signal_in_service() -> None:
    keys = iter(range(100))

    def engine(running: float | None, scraped_at: float = 100.0, healthy: bool = True) -> Any:
        load = EngineLoad(scraped_at=scraped_at, running=running)
        return SimpleNamespace(key=f"e{next(keys)}", engine_load=load, healthy=healthy, retired=False)

    fleet = [
        engine(3),  # busy
        engine(0),  # idle
        engine(0, scraped_at=90.0),  # stale: not counted
        engine(None),  # exports no running count (an OpenAI-compatible server): not counted
        engine(0, healthy=False),  # out of service: not counted
        SimpleNamespace(key="never", engine_load=None, healthy=True, retired=False),  # never scraped
    ]
    wanted = {f"e{n}" for n in range(len(fleet))} | {"never"}
    assert busy_and_idle(fleet, now=100.5, stale_after_s=1.0, wanted=wanted) == (1, 1)
    # Nothing waited for the idle engine's model: it wasted nothing and is not counted.
    assert busy_and_idle(fleet, now=100.5, stale_after_s=1.0, wanted=set()) == (1, 0)


def test_an_engine_is_wanted_when_its_model_has_requests_waiting() -> None:
    def engine(key: str, waiting: float | None, scraped_at: float = 100.0) -> Any:
        return SimpleNamespace(key=key, engine_load=EngineLoad(scraped_at=scraped_at, waiting=waiting))

    queued_at_admission = SimpleNamespace(model="a", instances=[engine("a0", 0), engine("a1", None)])
    queued_in_an_engine = SimpleNamespace(model="b", instances=[engine("b0", 2), engine("b1", 0)])
    stale_engine_queue = SimpleNamespace(model="c", instances=[engine("c0", 5, scraped_at=90.0)])
    nothing_waits = SimpleNamespace(model="d", instances=[engine("d0", 0), engine("d1", None)])
    pools: list[Any] = [queued_at_admission, queued_in_an_engine, stale_engine_queue, nothing_waits]
    queued = {"a": 3}.get
    wanted = waiting_for(pools, lambda model: queued(model, 0), now=100.5, stale_after_s=1.0)
    assert wanted == {"a0", "a1", "b0", "b1"}


def test_prometheus_rules_match_the_objectives_and_alerts() -> None:
    config = SloConfig()
    text = rules_yaml(config)
    assert yaml.safe_load(text) == prometheus_rules(config)
    recording, alerting = prometheus_rules(config)["groups"]
    records = {r["record"] for r in recording["rules"]}
    for name in OBJECTIVES:
        assert {f"lockgate_slo:{name}:error_ratio_rate{w}" for w in WINDOWS} <= records
        assert f"lockgate_slo:{name}:budget_remaining" in records
    alerts = {a["alert"]: a for a in alerting["rules"]}
    assert len(alerts) == len(OBJECTIVES) * 2
    page = alerts["LockgateSloP0SuccessBurnPage"]
    assert page["labels"] == {"severity": "page", "slo": "p0_success"}
    assert page["expr"] == (
        "lockgate_slo:p0_success:error_ratio_rate1h > (14.4 * 0.001)\n"
        "and\nlockgate_slo:p0_success:error_ratio_rate5m > (14.4 * 0.001)"
    )
    ttft = next(r["expr"] for r in recording["rules"] if r["record"] == "lockgate_slo:p0_ttft:error_ratio_rate5m")
    assert 'le="2.0"' in ttft and 'priority="P0",stream="true"' in ttft
    # The streams that ended without a first token after waiting past the threshold are bad events too.
    assert 'lockgate_unanswered_wait_seconds_bucket{priority="P0",stream="true",le="2.0"}' in ttft
    # Another class and threshold follow the configuration.
    custom = prometheus_rules(SloConfig(priority="gold", ttft_threshold_ms=500))
    exprs = " ".join(r["expr"] for r in custom["groups"][0]["rules"])
    assert 'priority="gold"' in exprs and 'le="0.5"' in exprs and 'priority="P0"' not in exprs


def test_the_ttft_threshold_is_a_bound_of_the_histograms_the_rules_read() -> None:
    """An outside run: with `ttft_threshold_ms: 1500` the rules read `le="1.5"`, a bucket the TTFT histogram did not
    have (0.005 ... 1.0, 2.0, ...): the alert could never fire, and nothing said so."""
    config = SloConfig(ttft_threshold_ms=1500)
    metrics = GatewayMetrics(ttft_bounds=(config.ttft_threshold_ms / 1000,))
    metrics.ttft.labels("m", "P0", "true").observe(1.2)
    metrics.unanswered.labels("m", "P0", "true").observe(1.7)
    exposed = generate_latest(metrics.registry).decode()
    rule = next(
        r["expr"]
        for r in prometheus_rules(config)["groups"][0]["rules"]
        if r["record"] == "lockgate_slo:p0_ttft:error_ratio_rate5m"
    )
    for name, within in (("lockgate_time_to_first_token_seconds", 1.0), ("lockgate_unanswered_wait_seconds", 0.0)):
        assert f'{name}_bucket{{le="1.5",model="m",priority="P0",stream="true"}} {within}' in exposed
        assert f'{name}_bucket{{priority="P0",stream="true",le="1.5"}}' in rule


class _UsageFile:
    """A usage database written directly (the writer's schema and index), one P0 record at a time."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA synchronous=OFF")  # a test file: no fsync per insert
        self.db.execute(records._schema())
        self.db.execute("CREATE INDEX usage_finished_at ON usage (finished_at)")
        self.count = 0

    def add(
        self,
        finished_at: float,
        status: str = "completed",
        n: int = 1,
        served_by: str = "upstream",
        *,
        stream: bool = False,
        waited: float = 1.0,
        first_token_after: float | None = None,
        endpoint: str = "chat",
    ) -> None:
        """`n` records of requests that ended at `finished_at` after `waited` seconds, their first token
        `first_token_after` seconds in (None: none)."""
        started_at = finished_at - waited
        first_at = None if first_token_after is None else started_at + first_token_after
        for _ in range(n):
            self.count += 1
            record = records.UsageRecord(
                request_id=f"r{self.count:08d}", tenant="t", model="m", endpoint=endpoint, stream=stream,
                priority="P0", status=status, started_at=started_at, finished_at=finished_at,
                served_by=served_by, first_token_at=first_at,
            )  # fmt: skip
            marks = ", ".join("?" * len(records._COLUMNS))
            self.db.execute(f"INSERT INTO usage ({', '.join(records._COLUMNS)}) VALUES ({marks})", records._ROW(record))


def test_long_windows_re_read_only_recent_buckets_and_agree_with_exact_counts(tmp_path: Any) -> None:
    path = str(tmp_path / "usage.sqlite3")
    add = _UsageFile(path).add
    now = 300.0 * 6_000_000 + 7  # a wall-clock time 7 s into a 5-minute bucket
    for hour in range(48):  # two days: one success every hour, an error every 6th hour
        add(now - hour * 3600 - 100, "completed" if hour % 6 else "error")
    config = SloConfig(priority="P0")
    long = {"6h": 6 * 3600, "30d": 30 * 86400}
    windows = BucketedWindows(config, long, bucket_s=300, settle_s=900)
    db = connect_readonly(path)
    windows.refresh(db, now)

    def agree(at: float) -> None:
        exact = count_windows(db, config, at, long)
        assert windows.counts(at)["p0_success"] == exact["p0_success"]

    agree(now)
    assert windows.counts(now)["p0_success"]["30d"] == Counts(events=48, bad=8)
    # New records, and one of a request that ended 10 minutes before the last refresh but was written after it.
    add(now + 200, "error", n=3)
    add(now - 600, "completed")
    # A record older than the settle time (15 min) written now is not re-read: the refresh reads recent buckets only.
    add(now - 3 * 3600 - 100, "completed")
    windows.refresh(db, now + 300)
    counts = windows.counts(now + 300)["p0_success"]
    assert counts["6h"] == Counts(events=6 + 3 + 1, bad=1 + 3)  # 6 hourly ones, the 3 new errors, the late one
    assert len(windows) <= 30 * 86400 // 300 + 2


def test_dedup_saving_counts_shareable_requests_whatever_their_end_as_lockgate_dedup_total_does(tmp_path: Any) -> None:
    """An outside run: the records counted completed requests only (1 saved of 5: met) where the Prometheus rule over
    `lockgate_dedup_total` counted every request de-duplication served, abandoned streams too (1 of 9: burning). And a
    newcomer's: sampled requests, which no default shares, counted as unsaved, so a fresh install serving chat burned
    the objective from its first request (`lockgate slo` exited 3): only requests that could be shared count."""
    path = str(tmp_path / "usage.sqlite3")
    add = _UsageFile(path).add
    add(100.0, served_by="coalesced")
    add(100.0, n=4, served_by="miss")  # distinct prompts, each leading its own engine call
    add(100.0, "cancelled", n=4, served_by="miss")  # streams their clients abandoned: each led its own call
    add(100.0, n=5)  # sampled (`upstream`): nothing could share them
    add(100.0, "rejected", n=3)  # refused before de-duplication: not counted
    add(100.0, n=2, endpoint="responses.retrieve")  # a stored response's routes: no generation to save
    add(100.0, "cancelled", endpoint="responses.delete")
    counts = count_windows(connect_readonly(path), SloConfig(), 101.0, {"5m": 300})
    assert counts["dedup_saving"]["5m"] == Counts(events=9, bad=8)
    assert counts["cancel_rate"]["5m"] == Counts(events=14, bad=4)


def test_ttft_counts_streams_that_sent_a_first_token_and_those_that_gave_up_waiting_past_the_threshold(
    tmp_path: Any,
) -> None:
    """An outside run: five P0 streams waited 7.2 s on a stuck engine and their clients left; p0_ttft still read met
    (completed streams only), and the Prometheus rule, over every first token, counted other streams than this."""
    path = str(tmp_path / "usage.sqlite3")
    add = _UsageFile(path).add
    add(100.0, stream=True, first_token_after=0.5)  # good
    add(100.0, stream=True, first_token_after=3.0)  # late
    add(100.0, "cancelled", stream=True, first_token_after=0.2)  # its client left after a fast first token: good
    add(100.0, "error", stream=True, waited=4.0, first_token_after=2.5)  # failed after a late first token
    add(100.0, "cancelled", stream=True, waited=7.2, n=5)  # gave up on a stuck engine: bad
    add(100.0, "cancelled", stream=True, waited=0.5)  # left before the threshold: no TTFT event
    add(100.0, "rejected", stream=True, waited=3.0)  # refused (a queue timeout): p0_success's, not a TTFT
    add(100.0, first_token_after=3.0)  # a whole answer: not a stream
    counts = count_windows(connect_readonly(path), SloConfig(), 101.0, {"5m": 300})
    assert counts["p0_ttft"]["5m"] == Counts(events=9, bad=7)


def test_lockgate_slo_config_reads_every_workers_records(tmp_path: Any) -> None:
    """Under `--workers` each worker writes `<usage.path>.worker-<i>` and no file has the configured name: `lockgate
    slo --config` found no records (every record objective unknown). It reads them all, and only them."""
    base = str(tmp_path / "usage.sqlite3")
    with pytest.raises(UsageUnavailable, match="no usage records"):
        count_file(base, SloConfig(), 101.0)
    _UsageFile(base + ".worker-0").add(100.0, "error")
    _UsageFile(base + ".worker-1").add(100.0, n=3)
    _UsageFile(base + ".worker-1.old").add(100.0, n=5)  # not a worker's file
    assert record_files(base) == [base + ".worker-0", base + ".worker-1"]
    assert count_file(base, SloConfig(), 101.0)["p0_success"]["5m"] == Counts(events=4, bad=1)


def test_the_exit_status_says_whether_an_objective_burns() -> None:
    def evaluation(*statuses: str) -> dict[str, Any]:
        return {"objectives": [{"name": f"o{n}", "status": s} for n, s in enumerate(statuses)]}

    assert exit_status(evaluation("met", "unknown")) == 0
    assert exit_status(evaluation()) == 0
    assert exit_status(evaluation("met", "burning")) == EXIT_BURNING != 0


def test_a_long_window_counts_the_last_minutes_as_the_short_ones_do(tmp_path: Any) -> None:
    """An outside run: right after a burst of requests, the 6 h and 30 d windows (refreshed at most once a minute)
    counted fewer events than the last hour in the same answer (110 against 113). They take their last quarter hour
    from the short windows' buckets, re-read at every evaluation."""
    from lockgate.slo.service import _Records

    path = str(tmp_path / "usage.sqlite3")
    usage = _UsageFile(path)
    wall = 300.0 * 6_000_000 + 7
    usage.add(wall - 7200, n=5)  # two hours ago
    windows = {"5m": 300, "1h": 3600, "6h": 6 * 3600, "30d": 30 * 86400}
    config = SloConfig(priority="P0")
    source = _Records(config, windows, connect_readonly(path))
    first = source.counts(0.0, wall)
    assert first["cancel_rate"]["6h"].events == 5 and first["cancel_rate"]["1h"].events == 0
    usage.add(wall + 5, n=3)  # a burst, read 10 s later: the long windows are not refreshed yet (60 s)
    usage.add(wall + 5, "cancelled", n=1)
    later = source.counts(10.0, wall + 10)["cancel_rate"]
    assert later["1h"] == Counts(events=4, bad=1)
    assert later["6h"] == later["30d"] == Counts(events=9, bad=1)
    exact = count_windows(connect_readonly(path), config, wall + 10, windows)["cancel_rate"]
    assert later == exact
