from pathlib import Path
from typing import Any

import pytest

from lockgate.admission.tenants import hash_key
from lockgate.config import ConfigError, load_config, parse_config
from lockgate.embedded import default_config, simulated_instances, with_instances
from lockgate.summary import describe_served, redact_url


def test_issue_example_shape_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        """
listen: {host: 127.0.0.1, port: 8080}
models:
  - name: demo-model
    instances:
      - {url: "http://127.0.0.1:8001", engine: vllm}
      - {url: "unix:///run/engine.sock", engine: vllm}
  - name: other
    instances:
      - {url: "http://127.0.0.1:8001", engine: vllm}
"""
    )
    config = load_config(path)
    assert [m.name for m in config.models] == ["demo-model", "other"]
    assert config.models[0].instances[1].url == "unix:///run/engine.sock"
    other = config.model("other")
    assert other is not None
    assert other.instances[0].key == config.models[0].instances[0].key


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"models": [{"name": "m", "instances": [{"url": "http://x", "engine": "vlm"}]}]},
            "models[0].instances[0].engine",
        ),
        ({"models": [{"name": "m", "instances": [{"url": "ftp://x"}]}]}, "models[0].instances[0].url"),
        ({"models": [{"name": "m", "instances": []}]}, "models[0].instances: model 'm' has no instances"),
        ({"models": [{"name": "m"}], "simulate": [{"models": ["other"]}]}, "no `simulate` entry serves it"),
        (
            {"models": [{"name": "m", "instances": [{"url": "http://x"}], "routng": "x"}]},
            "models[0].routng: unknown key",
        ),
        ({"listen": {"port": 99999}, "models": [{"name": "m", "instances": [{"url": "http://x"}]}]}, "listen.port"),
        ({}, "at least one model"),
        # (raised to max_body_bytes silently before: an outside run set 300 kB and saw 400 kB of bodies held)
        (
            {"limits": {"max_held_body_bytes": 300000}, "models": [{"name": "m", "instances": [{"url": "http://x"}]}]},
            "limits: max_held_body_bytes (300000) must be at least max_body_bytes (4194304)",
        ),
    ],
)
def test_errors_name_the_key(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("c.yaml")


def test_duplicate_model_names_rejected():
    inst = [{"url": "http://x"}]
    with pytest.raises(ConfigError, match="repeated: m"):
        parse_config({"models": [{"name": "m", "instances": inst}, {"name": "m", "instances": inst}]})


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_embedded_default_has_two_models_on_simulators():
    config = default_config()
    served = {m for entry in config.simulate for m in entry.models}
    assert served == {"demo-model", "demo-model-large"}
    assert sum(entry.count for entry in config.simulate) >= 3


def test_a_simulated_model_may_be_listed_without_instances():
    config = parse_config(
        {
            "models": [{"name": "demo-model", "retries": 3, "dedup": "off"}],
            "simulate": [{"models": ["demo-model", "other"], "count": 2}],
        }
    )
    urls = {"sim-1": "http://127.0.0.1:9001", "sim-2": "http://127.0.0.1:9002"}
    served = with_instances(config, simulated_instances(config, urls))
    demo = served.model("demo-model")
    assert demo is not None and demo.retries == 3 and demo.dedup == "off"
    assert [i.name for i in demo.instances] == ["sim-1", "sim-2"]
    other = served.model("other")
    assert other is not None and [i.url for i in other.instances] == list(urls.values())
    assert not served.simulate


def test_check_config_summary_lists_simulated_models_and_redacts_credentials():
    config = parse_config(
        {
            "models": [
                {
                    "name": "real",
                    "instances": [{"url": "https://user:secret@api.example.com/engine", "api_key": "sk-x"}],
                }
            ],
            "simulate": [{"models": ["demo-model"]}],
        }
    )
    text = "\n".join(describe_served(config))
    assert "secret" not in text and "sk-x" not in text and "user" not in text
    assert "https://***@api.example.com/engine" in text and "with api_key" in text
    assert "model 'demo-model': 1 instance(s), routing predicted_ttft: sim-1 (simulated vllm)" in text
    # Where it listens and keeps its records, after `${VAR}` substitution (a newcomer could not check them).
    assert text.startswith("listens on 127.0.0.1:8080 (serve's --host / --port override it); usage records in ")
    assert redact_url("http://127.0.0.1:8001") == "http://127.0.0.1:8001"


def test_check_config_says_whether_the_operator_routes_are_open() -> None:
    """A newcomer's run: with tenant keys and no admin key, `check-config` said OK and nothing more, while `serve` then
    closed /admin/* and /dashboard (403)."""
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    tenants = [{"name": "t", "keys": [hash_key("k")]}]
    closed = "\n".join(describe_served(parse_config({"models": models, "tenants": tenants})))
    assert "no admin key: /admin/* and /dashboard are closed (403) while tenants have keys" in closed
    admin = {"keys": [hash_key("a"), hash_key("b")]}
    opened = "\n".join(describe_served(parse_config({"models": models, "tenants": tenants, "admin": admin})))
    assert "2 admin key(s)" in opened and "closed" not in opened
    assert "admin" not in "\n".join(describe_served(parse_config({"models": models})))  # (open: nothing to say)


def test_userinfo_becomes_a_basic_credential_and_leaves_the_url():
    import base64

    data = {"models": [{"name": "m", "instances": [{"url": "http://us%40er:p%3As@127.0.0.1:9/v/", "engine": "vllm"}]}]}
    spec = parse_config(data).models[0].instances[0]
    assert spec.url == spec.key == "http://127.0.0.1:9/v"
    assert spec.basic_authorization == "Basic " + base64.b64encode(b"us@er:p:s").decode()
    assert "p:s" not in repr(spec) and "p%3As" not in repr(spec) and "Basic" not in repr(spec)
    keyed = {"models": [{"name": "m", "instances": [{"url": "http://h:1", "api_key": "sk-engine"}]}]}
    assert "sk-engine" not in repr(parse_config(keyed))
    plain = parse_config({"models": [{"name": "m", "instances": [{"url": "http://h:1"}]}]}).models[0].instances[0]
    assert (plain.url, plain.basic_authorization) == ("http://h:1", None)


def test_one_engine_cannot_log_in_two_ways():
    def listed(*urls: str) -> dict[str, object]:
        return {"models": [{"name": f"m{i}", "instances": [{"url": url}]} for i, url in enumerate(urls)]}

    parse_config(listed("http://a:b@h:1", "http://a:b@h:1"))
    with pytest.raises(ConfigError, match="different credentials") as info:
        parse_config(listed("http://a:b@h:1", "http://a:c@h:1"))
    assert ":b@" not in str(info.value) and ":c@" not in str(info.value)


def test_config_errors_never_quote_a_password(tmp_path, capsys):
    from lockgate.cli import main

    path = tmp_path / "c.yaml"
    path.write_text('models: [{name: m, instances: [{url: "ftp://admin:hunter2@h:1", engine: vllm}]}]\n')
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models[0].instances[0].url" in err and "ftp://***@h:1" in err
    assert "hunter2" not in err and "admin" not in err
    # A password with a character that should have been percent-encoded makes the URL unusable: still hidden.
    for password in ("pa/SUPERSECRET23", "pa#SUPERSECRET23", "pa?SUPERSECRET23"):
        path.write_text(f'models: [{{name: m, instances: [{{url: "http://u:{password}@127.0.0.1:1"}}]}}]\n')
        assert main(["check-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "models[0].instances[0].url" in err and "SUPERSECRET" not in err and "'pa'" not in err, err
    # An unencoded `@` is read as part of the password (the host follows the last one).
    path.write_text('models: [{name: m, instances: [{url: "http://u:p@SUPERSECRET23@127.0.0.1:1"}]}]\n')
    assert main(["check-config", str(path)]) == 0
    assert "SUPERSECRET" not in capsys.readouterr().out
    # A query or fragment cannot be part of an engine's base URL (the API's paths are appended to it).
    path.write_text('models: [{name: m, instances: [{url: "http://127.0.0.1:1/?api_key=SUPERSECRET"}]}]\n')
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "query" in err and "SUPERSECRET" not in err, err
    # PyYAML quotes the line it could not parse.
    path.write_text('u: "http://admin:hunter2@h:1" x\n')
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "hunter2" not in err


def test_a_tenant_naming_a_model_that_is_not_served_is_rejected():
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    with pytest.raises(ConfigError) as err:
        parse_config({"models": models, "tenants": [{"name": "t", "models": ["m", "typo"]}]})
    # The key it names, not "(top level): tenants[0]..." (a newcomer's run).
    assert str(err.value) == "config: tenants[0].models: no model named 'typo' (served: m)"
    parse_config({"models": models, "tenants": [{"name": "t", "models": ["m"]}]})  # a served one is fine
    simulated = {"simulate": [{"models": ["s"]}], "tenants": [{"name": "t", "models": ["s"]}]}
    parse_config(simulated)  # a simulated model is served


def test_a_tenant_name_must_be_printable():
    """It becomes a metric label, a record's field and a header a central relays: no control characters."""
    models = [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}]
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.name: .*printable"):
        parse_config({"models": models, "tenants": [{"name": "a\x1fb"}]})
    parse_config({"models": models, "tenants": [{"name": "acme corp"}]})


def test_a_single_mistake_is_one_line_naming_the_file_and_where(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("listen: {host: 127.0.0.1\nmodels: []\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:2:7: not valid YAML: ")
    assert "unicode string" not in message
    path.write_text("models:\n  - name: m\n    instances: [{url: 'http://x:1', engine: vlm}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: models[0].instances[0].engine: Input should be")
    assert "\n" not in str(info.value)


def test_check_config_says_what_the_cluster_section_does():
    config = parse_config(
        {"cluster": {"endpoints": ["http://u:pw@etcd-1:2379"], "name": "prod", "node": "gpu-7"}, "models": []}
    )
    (line,) = [line for line in describe_served(config) if line.startswith("cluster")]
    assert line.startswith("cluster 'prod' on etcd http://***@etcd-1:2379: `lockgate serve` discovers")
    assert "node 'gpu-7'" in line and "pw" not in line


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: a stray `tenants: []` further down dropped every tenant key (the
    gateway open to anyone, `check-config` saying so as if it were meant), a second `listen:` replaced the first."""
    path = tmp_path / "dup.yaml"
    path.write_text(
        "models:\n  - name: m\n    instances: [{url: 'http://127.0.0.1:1'}]\n"
        "tenants:\n  - {name: a, keys: ['sha256:" + "a" * 64 + "']}\n"
        "tenants: []\n"
    )
    with pytest.raises(
        ConfigError, match=r"dup.yaml:6:1: .*key 'tenants' appears twice in one mapping \(first at line 4\)"
    ):
        load_config(path)
    # Merge keys still override what they bring in (that is not a key given twice).
    path.write_text(
        "base: &base {url: 'http://127.0.0.1:1', max_concurrency: 2}\n"
        "models:\n  - name: m\n    instances: [{<<: *base, max_concurrency: 4}]\n"
    )
    with pytest.raises(ConfigError, match="base"):  # an unknown top-level key, not a duplicate
        load_config(path)


def test_dedup_off_unquoted(tmp_path):
    """`dedup: off` written as in the README is YAML 1.1's false: it was refused ("got False")."""
    path = tmp_path / "off.yaml"
    path.write_text("models:\n  - name: m\n    dedup: off\n    instances: [{url: 'http://127.0.0.1:1'}]\n")
    assert load_config(path).models[0].dedup == "off"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://127.0.0.1:notaport", "Port could not be cast"),
        ("http://", "needs a host"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:0", "needs a port in 1-65535"),
        # An OpenAI client's base URL: `/v1/...` is appended to it (a newcomer's run: health checks then answered 404).
        ("http://127.0.0.1:8000/v1", "without `/v1`"),
        ("http://127.0.0.1:8000/v1/", "without `/v1`"),
    ],
)
def test_an_instance_url_that_cannot_be_reached_is_a_config_error_naming_the_key(url: str, reason: str) -> None:
    """A newcomer's run: these passed `check-config` ("OK") and then failed `serve` with a ValueError naming no key."""
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "instances": [{"url": url}]}]})
    assert "models[0].instances[0].url" in str(err.value) and reason in str(err.value)


def test_a_plaintext_central_key_is_refused_without_echoing_it() -> None:
    """A newcomer's run: `cluster.central_keys` quoted the plaintext key in its error (tenants' and admin's did not)."""
    cluster = {"endpoints": ["http://127.0.0.1:2379"], "name": "c", "central_keys": ["my-plaintext-secret"]}
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}], "cluster": cluster})
    assert "cluster.central_keys" in str(err.value) and "my-plaintext-secret" not in str(err.value)


def test_a_sidecars_advertised_url_is_checked_as_an_instance_url() -> None:
    """The regression run: `advertise_url: http://127.0.0.1:99999` passed check-config; every central then refused the
    published URL (a warning at the publication rate) and the model answered 404."""
    cluster = {"endpoints": ["http://127.0.0.1:2379"], "name": "c", "advertise_url": "http://127.0.0.1:99999"}
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}], "cluster": cluster})
    assert "cluster.advertise_url" in str(err.value) and "Port out of range" in str(err.value)


def test_an_etcd_endpoint_without_a_scheme_is_named_once() -> None:
    """An outside run: the message said what it got twice ("(got '127.0.0.1:2379') (got ['127.0.0.1:2379'])")."""
    cluster = {"endpoints": ["127.0.0.1:2379"], "name": "c"}
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:1"}]}], "cluster": cluster})
    assert str(err.value).count("(got ") == 1 and "(got '127.0.0.1:2379')" in str(err.value)


def test_one_engine_listed_under_two_models_with_different_limits_is_a_config_error() -> None:
    """The regression run: `max_concurrency: 2` on the second listing of a shared URL was silently ignored (the first
    listing's, unset, was taken: 256), which also disabled the routing ceiling the limit is for."""
    first = {"name": "a", "instances": [{"url": "http://127.0.0.1:1"}]}
    limited: dict[str, Any] = {"url": "http://127.0.0.1:1", "max_concurrency": 2}
    with pytest.raises(ConfigError, match=r"different max_concurrency \(unset and 2\)"):
        parse_config({"models": [first, {"name": "b", "instances": [limited]}]})
    same = {"name": "b", "instances": [{"url": "http://127.0.0.1:1"}]}
    parse_config({"models": [first, same]})  # the same (unset) on both: one engine, fine


def test_an_instance_name_names_one_engine() -> None:
    """A newcomer's run: two engines named `sim-1` (and a simulator the `simulate:` section names so) passed
    `check-config`, and their requests, headers and metrics carried one name: `lockgate_instance_*{instance="sim-1"}`
    was one series for three engines."""
    one = {"url": "http://127.0.0.1:1", "name": "e"}
    two = {"url": "http://127.0.0.1:2", "name": "e"}
    with pytest.raises(ConfigError, match=r"instance name 'e' is given to two engines"):
        parse_config({"models": [{"name": "m", "instances": [one, two]}]})
    with pytest.raises(ConfigError, match=r"instance name 'e' is given to two engines"):
        parse_config({"models": [{"name": "a", "instances": [one]}, {"name": "b", "instances": [two]}]})
    with pytest.raises(ConfigError, match=r"listed under two names \('e' and 'f'\)"):
        parse_config(
            {"models": [{"name": "a", "instances": [one]}, {"name": "b", "instances": [{**one, "name": "f"}]}]}
        )
    sims = {"simulate": [{"models": ["m"], "count": 2}]}
    with pytest.raises(ConfigError, match=r"'sim-2' is the name of a simulator"):
        parse_config({"models": [{"name": "m", "instances": [{**one, "name": "sim-2"}]}], **sims})
    parse_config({"models": [{"name": "m", "instances": [{**one, "name": "sim-3"}]}], **sims})
    # One engine listed under two models by one name (or none): fine.
    parse_config({"models": [{"name": "a", "instances": [one]}, {"name": "b", "instances": [one]}]})
    unnamed = {"url": "http://127.0.0.1:1"}
    parse_config({"models": [{"name": "a", "instances": [unnamed]}, {"name": "b", "instances": [unnamed]}]})
    parse_config({"models": [{"name": "a", "instances": [one]}, {"name": "b", "instances": [unnamed]}]})
    with pytest.raises(ConfigError, match=r"two names \('http://127.0.0.1:1' and 'e'\)"):  # (the first names it)
        parse_config({"models": [{"name": "a", "instances": [unnamed]}, {"name": "b", "instances": [one]}]})


def test_a_usage_path_in_a_directory_that_does_not_exist_is_refused_at_load(tmp_path: Path) -> None:
    """A newcomer's run: `check-config` said OK, then `serve` could not open the database."""
    base = {"models": [{"name": "m", "instances": [{"url": "http://127.0.0.1:9"}]}]}
    with pytest.raises(ConfigError, match=r"usage\.path: the directory of"):
        parse_config({**base, "usage": {"path": str(tmp_path / "missing" / "usage.sqlite3")}})
    assert parse_config({**base, "usage": {"path": str(tmp_path / "usage.sqlite3")}}).usage.path.endswith("sqlite3")
    assert parse_config({**base, "usage": {"path": ":memory:"}}).usage.path == ":memory:"


def test_the_examples_are_valid_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configuration under examples/ loads (a newcomer starts from `examples/minimal.yaml`)."""
    from pathlib import Path

    from lockgate.config import load_config

    monkeypatch.delenv("LOCKGATE_EXAMPLE_DATA", raising=False)
    examples = Path(__file__).resolve().parents[2] / "examples"
    loaded = {p.name: load_config(p) for p in sorted(examples.rglob("*.yaml"))}
    assert {"minimal.yaml", "llamacpp.yaml", "central-1.yaml", "sidecar-1.yaml"} <= set(loaded)
    minimal = loaded["minimal.yaml"]
    assert minimal.simulate and len(minimal.tenants) == 1 and minimal.admin.keys
