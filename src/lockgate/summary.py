"""What a configuration serves, in lines for people: `check-config` and the `serve` banner.

Pure. Simulated instances (from `simulate:`) are listed with the models they serve, after the
instances a model lists itself, exactly as the gateway will add them (`embedded.py`). Credentials
never appear: a URL's user and password are replaced by `***`, and an `api_key` is only mentioned.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from .config import Config
from .embedded import simulator_names


def redact_url(url: str) -> str:
    """`url` with any user/password replaced by `***`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def describe_served(config: Config) -> list[str]:
    """Where it listens and keeps its usage records, then one line per model: its instances (name, URL, engine) and
    its routing policy; the cluster and the tenants."""
    simulated: dict[str, list[str]] = {}
    for name, entry in simulator_names(config):
        for served in entry.models:
            simulated.setdefault(served, []).append(f"{name} (simulated vllm)")
    listed = {m.name: m for m in config.models}
    listen = config.listen
    where = f"unix socket {listen.unix}" if listen.unix else f"{listen.host}:{listen.port}"
    lines = [f"listens on {where} (serve's --host / --port override it); usage records in {config.usage.path}"]
    for name in [*listed, *(m for m in simulated if m not in listed)]:
        model = listed.get(name)
        parts = []
        for spec in model.instances if model is not None else []:
            shown = redact_url(spec.url)
            if spec.basic_authorization is not None:  # the userinfo was taken out of the URL at validation
                scheme, _, rest = shown.partition("://")
                shown = f"{scheme}://***@{rest}"
            label = f"{spec.name} ({shown}, {spec.engine})" if spec.name else f"{shown} ({spec.engine})"
            parts.append(label + (" with api_key" if spec.api_key else ""))
        parts += simulated.get(name, [])
        policy = model.routing.policy if model is not None else "predicted_ttft"
        lines.append(f"model {name!r}: {len(parts)} instance(s), routing {policy}: {', '.join(parts)}")
    cluster = config.cluster
    if cluster is not None:
        endpoints = ", ".join(redact_url(url) for url in cluster.endpoints)
        node = cluster.node or "its advertised host:port"
        lines.append(
            f"cluster {cluster.name!r} on etcd {endpoints}: `lockgate serve` discovers the sidecars' engines (and "
            f"their models) there; `lockgate sidecar` publishes the instances above as node {node!r}"
        )
    if config.tenants:
        keys = sum(len(t.keys) for t in config.tenants)
        lines.append(f"{len(config.tenants)} tenant(s), {keys} API key(s)")
    else:
        lines.append("no API keys: the gateway is open (every request is tenant 'default')")
    if config.admin.keys:
        lines.append(f"{len(config.admin.keys)} admin key(s): /admin/* and /dashboard answer them")
    elif keys_configured(config):
        # (`serve` said it; `check-config` did not: the operator routes 403 with tenant keys and no admin key.)
        lines.append("no admin key: /admin/* and /dashboard are closed (403) while tenants have keys; set admin.keys")
    return lines


def keys_configured(config: Config) -> bool:
    """Whether clients need a key (a tenant has one)."""
    return any(t.keys for t in config.tenants)
