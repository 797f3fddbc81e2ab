"""Reload planning: what a new file changes, what needs a restart, what is refused (pure)."""

import dataclasses
from typing import Any

import pytest

from lockgate.admission.ratelimit import RateLimiter
from lockgate.admission.tenants import Tenant
from lockgate.config import ConfigError, InstanceConfig, parse_config
from lockgate.config_diff import diff_configs, plan_reload
from lockgate.reload import summary

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def config(models: list[dict[str, Any]], **extra: Any) -> Any:
    return parse_config({"models": models, **extra})


def test_diff_names_instances_models_and_tenants() -> None:
    old = config([{"name": "m", "instances": [{"url": A, "name": "a"}]}, {"name": "gone", "instances": [{"url": A}]}])
    new = config(
        [
            {"name": "m", "instances": [{"url": A, "name": "a"}, {"url": B, "name": "b"}]},
            {"name": "new", "instances": [{"url": B, "served_model": "x"}]},
        ],
        tenants=[{"name": "t", "keys": ["sha256:" + "0" * 64]}],
    )
    diff = diff_configs(old, new)
    assert diff.added_instances == (B,) and not diff.removed_instances and not diff.changed_instances
    assert (diff.added_models, diff.removed_models, diff.changed_models) == (("new",), ("gone",), ("m",))
    assert diff.tenants_changed
    assert diff.describe()["instances"] == {"added": ["b"], "removed": [], "replaced": [], "renamed": {}}
    assert diff_configs(new, new).applies_nothing
    # What SIGHUP prints and the log says names them too (it gave counts alone: an outside run).
    assert summary(diff) == (
        "instances added 1 (b), models added 1 (new), models removed 1 (gone), models changed 1 (m), tenants changed"
    )


def test_an_instance_with_other_settings_is_replaced_and_its_models_change() -> None:
    old = config(
        [{"name": "m", "instances": [{"url": A, "max_concurrency": 4}]}, {"name": "n", "instances": [{"url": B}]}]
    )
    new = config(
        [{"name": "m", "instances": [{"url": A, "max_concurrency": 8}]}, {"name": "n", "instances": [{"url": B}]}]
    )
    diff = diff_configs(old, new)
    assert diff.changed_instances == (A,) and diff.changed_models == ("m",)
    # The model a client names is a per-model setting: it changes the pool, not the engine.
    renamed = config(
        [
            {"name": "m", "instances": [{"url": A, "max_concurrency": 4, "served_model": "x"}]},
            {"name": "n", "instances": [{"url": B}]},
        ]
    )
    diff = diff_configs(old, renamed)
    assert not diff.changed_instances and diff.changed_models == ("m",)


def test_a_reload_that_moves_names_between_engines_says_so() -> None:
    """An outside run: `{A: s1, B: s2}` reloaded as `{A: sX, B: s1}` answered "replaced: [sX, s1]", with s2 gone and sX
    new nowhere in it. The instances are the engines (their URLs): both are replaced, and renamed."""
    old = config([{"name": "m", "instances": [{"url": A, "name": "s1"}, {"url": B, "name": "s2"}]}])
    new = config([{"name": "m", "instances": [{"url": A, "name": "sX"}, {"url": B, "name": "s1"}]}])
    diff = diff_configs(old, new)
    assert diff.describe()["instances"] == {
        "added": [],
        "removed": [],
        "replaced": ["sX", "s1"],
        "renamed": {"s1": "sX", "s2": "s1"},
    }
    assert summary(diff) == "instances replaced 2 (s1 -> sX, s2 -> s1), models changed 1 (m)"


def test_plan_keeps_sections_that_need_a_restart() -> None:
    old = config([{"name": "m", "instances": [{"url": A}]}], listen={"port": 8080})
    new = config([{"name": "m", "instances": [{"url": B}]}], listen={"port": 9090}, usage={"path": "other.db"})
    plan = plan_reload(old, new, old, {})
    assert plan.restart_required == ("listen", "usage")
    assert plan.served.listen.port == 8080 and plan.served.usage == old.usage
    assert plan.served.models[0].instances[0].url == B
    assert plan.applied_file.listen.port == 8080  # the next reload still reports the change


def test_plan_adds_the_running_simulators_to_models_only_they_serve() -> None:
    old = config([], simulate=[{"models": ["m"], "count": 1}])
    simulated = {"m": [InstanceConfig(url=A, engine="vllm", name="sim-1")]}
    served = old.model_copy(update={"models": [], "simulate": []})
    new = config(
        [{"name": "m", "retries": 3}, {"name": "real", "instances": [{"url": B}]}],
        simulate=[{"models": ["m"], "count": 1}],
    )
    plan = plan_reload(old, new, served, simulated)
    assert not plan.restart_required
    by_name = {m.name: m for m in plan.served.models}
    assert [i.name for i in by_name["m"].instances] == ["sim-1"] and by_name["m"].retries == 3
    assert [i.url for i in by_name["real"].instances] == [B]


def test_plan_refuses_tenants_that_need_other_classes() -> None:
    old = config([{"name": "m", "instances": [{"url": A}]}])
    classes = {"classes": [{"name": "gold", "strict": True}, {"name": "bronze"}]}
    new = config(
        [{"name": "m", "instances": [{"url": A}]}], scheduling=classes, tenants=[{"name": "t", "max_priority": "gold"}]
    )
    with pytest.raises(ConfigError, match="gold"):
        plan_reload(old, new, old, {})


def test_plan_keeps_the_semantic_cache_settings_until_a_restart() -> None:
    old = config([{"name": "m", "instances": [{"url": A}]}])
    new = config([{"name": "m", "instances": [{"url": A}], "semantic": {"threshold": 0.9}}])
    plan = plan_reload(old, new, old, {})
    assert plan.restart_required == ("models[m].semantic",)
    assert plan.served.models[0].semantic is None


def test_a_reload_that_turns_on_dedup_for_a_model_with_a_semantic_section_needs_a_restart() -> None:
    """An outside run: `dedup: off` with a `semantic:` section (no cache built at start), reloaded with dedup on:
    `restart_required: []`, and the semantic cache never existed. A model a reload adds gets none either."""
    semantic = {"threshold": 0.9}
    old = config([{"name": "m", "dedup": "off", "instances": [{"url": A}], "semantic": semantic}])
    new = config([{"name": "m", "dedup": "deterministic", "instances": [{"url": A}], "semantic": semantic}])
    assert plan_reload(old, new, old, {}).restart_required == ("models[m].semantic",)
    added = config(
        [*[m.model_dump() for m in old.models], {"name": "n", "instances": [{"url": A}], "semantic": semantic}]
    )
    assert plan_reload(old, added, old, {}).restart_required == ("models[n].semantic",)


def test_a_semantic_model_gone_from_the_file_but_still_simulated_keeps_its_cache_until_a_restart() -> None:
    """An outside run: a model's `models:` entry (its `semantic:` with it) deleted while `simulate:` still serves it:
    the reload said `restart_required: []` and the cache kept serving; reloading the file the gateway started with
    then reported `models[sem].semantic` as changed, at every reload after."""
    from lockgate.embedded import with_instances

    simulate = [{"models": ["sem"], "count": 1}]
    running = config([{"name": "sem", "instances": [], "semantic": {"threshold": 0.9}}], simulate=simulate)
    simulated = {"sem": [InstanceConfig(url=A, engine="vllm", name="sim-1")]}
    served = with_instances(running, simulated)
    dropped = config([], simulate=simulate)
    plan = plan_reload(running, dropped, served, simulated)
    assert plan.restart_required == ("models[sem].semantic",)
    assert [m.semantic for m in plan.served.models if m.name == "sem"] == [running.models[0].semantic]
    again = plan_reload(plan.applied_file, running, plan.served, simulated)  # the file it started with, again
    assert again.restart_required == ()


def test_rate_limits_take_new_capacities_and_keep_levels() -> None:
    tenant = Tenant(name="t", models=None, default_priority=1, max_priority=0, requests_per_minute=10)
    limiter = RateLimiter()
    reservation = limiter.admit(tenant, 5, 0.0)
    smaller = dataclasses.replace(tenant, requests_per_minute=3, tokens_per_minute=100)
    limiter.reconfigure([smaller], 0.0)
    state = limiter.state(smaller, 0.0)
    assert state.requests is not None and state.requests.capacity == 3 and state.requests.level == 3
    assert state.tokens is not None and state.tokens.level == 100  # a new limit starts full
    assert state.in_flight == 1  # the request in flight keeps its slot, and gives it back
    reservation.settle(0, 0.0)
    assert limiter.state(smaller, 0.0).in_flight == 0
    limiter.reconfigure([dataclasses.replace(smaller, requests_per_minute=None)], 0.0)
    assert limiter.state(smaller, 0.0).requests is None


def test_a_url_credential_survives_a_reload_and_changing_it_replaces_the_instance() -> None:
    """Userinfo is taken out of the URL at validation; the revalidation a reload does must keep it."""
    secret = "http://u:p%40ss@127.0.0.1:9001"
    old = config([{"name": "m", "instances": [{"url": secret}]}])
    plan = plan_reload(old, old, old, {})
    [spec] = plan.served.models[0].instances
    assert spec.url == A and spec.basic_authorization == old.models[0].instances[0].basic_authorization
    assert spec.basic_authorization is not None
    assert diff_configs(old, plan.served).applies_nothing
    rotated = config([{"name": "m", "instances": [{"url": secret.replace("p%40ss", "new")}]}])
    diff = diff_configs(old, plan_reload(old, rotated, old, {}).served)
    assert diff.changed_instances == (A,) and diff.changed_models == ("m",)
