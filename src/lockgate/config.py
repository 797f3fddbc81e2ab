"""Configuration: one YAML file, validated at load.

Config is loaded once and passed down (a reload builds a new one; see `reload.py`); nothing reads it from
a global. Errors name the offending key by its path (``models[0].instances[1].engine``) and say why.
String values may take `${VAR}` from the environment (`config_env.py`).
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from . import extras
from .admission.config import SchedulingConfig, TenantConfig, check_admission
from .cluster.config import ClusterConfig
from .config_env import UnsetVariable, substitute
from .observe.config import AccessLogConfig, AdminConfig, MetricsConfig, TracingConfig
from .routing.config import EjectionConfig, RoutingConfig, ScrapeConfig
from .routing.config import PolicyName as PolicyName
from .slo.config import SloConfig
from .urlcheck import http_url_problem
from .userinfo import basic_credential, join, redact, split

EngineName = Literal["vllm", "sglang", "tgi", "llamacpp", "openai"]
CancelPolicy = Literal["immediate", "finish_and_cache", "cache_partial"]
DedupMode = Literal["off", "deterministic", "always"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    #: Serve on a unix socket instead of host/port.
    unix: str | None = None


class LimitsConfig(_Strict):
    max_body_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    #: Request line and headers (larger: 431).
    max_header_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024
    #: An idle keep-alive client connection is closed after this long.
    keepalive_timeout_ms: Annotated[int, Field(ge=100)] = 75_000
    #: A client has this long to send a request's headers (and between body chunks): slow clients are cut off.
    header_timeout_ms: Annotated[int, Field(ge=100)] = 30_000
    #: ... and this long to send a whole body after its headers (a body trickled a byte at a time): 408.
    body_timeout_ms: Annotated[int, Field(ge=100)] = 60_000
    #: Client connections open at once; one more is answered 503 and closed.
    max_connections: Annotated[int, Field(ge=1)] = 8192
    #: Bytes of request bodies the gateway holds at once: being received, or received and not yet answered (queued,
    #: routed, in an engine call). A body that would take them past it is answered 503 (whatever the number of
    #: clients: what they can make the gateway hold). At least `max_body_bytes` (one largest body always fits).
    max_held_body_bytes: Annotated[int, Field(ge=1024)] = 512 * 1024 * 1024
    #: A client that leaves the gateway's send buffer toward it full for this long (it stopped reading) is
    #: treated as gone: its connection is closed and its engine request aborted.
    write_timeout_ms: Annotated[int, Field(ge=100)] = 60_000
    #: The kernel's send buffer toward each client (`SO_SNDBUF`; 0: the kernel's own, which grows to megabytes). The
    #: write timeout starts only once the buffers toward a client are full: left to grow, ~3 MB queued toward a client
    #: that had stopped reading, and its engine generated ~14,000 tokens, before it was noticed.
    send_buffer_bytes: Annotated[int, Field(ge=0)] = 256 * 1024

    @model_validator(mode="after")
    def _one_largest_body_fits(self) -> LimitsConfig:
        # (It was raised to `max_body_bytes` silently: an outside run set 300 kB and saw 400 kB held.)
        if self.max_held_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_held_body_bytes ({self.max_held_body_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}): one largest body must fit; lower max_body_bytes too"
            )
        return self


class TlsConfig(_Strict):
    """TLS toward an `https://` instance. The certificate is verified against `ca_file` (default: the system's
    trust store) and the name the client asks for (SNI), which is the URL's host unless `server_name` says
    otherwise; `verify: false` accepts any certificate (encryption without authentication)."""

    ca_file: str | None = None
    verify: bool = True
    #: SNI and the name the certificate must carry, when the URL's host is not it (an IP address, a tunnel).
    server_name: Annotated[str, Field(min_length=1)] | None = None
    #: A client certificate (mutual TLS), PEM; `key_file` when the key is not in `cert_file`.
    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _check_files(self) -> TlsConfig:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file")
        self.client_context()  # a missing or unreadable file is a configuration error, reported at load
        return self

    def client_context(self) -> ssl.SSLContext:
        """A new client context with these options; raises ValueError naming the file that cannot be used."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot use ca_file {self.ca_file!r}: {exc.strerror or exc}") from None
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot use cert_file/key_file: {exc.strerror or exc}") from None
        return context


class InstanceConfig(_Strict):
    #: Where the engine listens. Userinfo (`http://user:password@host`) is taken out at validation: the URL
    #: kept here has none, and the credential becomes `basic_authorization`.
    url: str
    engine: EngineName = "openai"
    #: Display name; defaults to the URL (without userinfo).
    name: str | None = None
    #: Model name the engine knows this model by (defaults to the gateway's model name).
    served_model: str | None = None
    #: The most requests this instance is sent at once (a ceiling: below it the limit adapts to what the
    #: engine runs, see fleet/capacity.py; null: `upstream.max_connections`).
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    #: Bearer token the gateway sends to this engine (never the client's); kept out of `repr`.
    api_key: str | None = Field(default=None, repr=False)
    #: Tokens its prefix (KV) cache holds, so that routing models its evictions; null: what the engine
    #: reports (vLLM `cache_config_info`), else unknown.
    cache_tokens: Annotated[int, Field(ge=1)] | None = None
    #: TLS options of an `https://` instance (an `https://` instance without them verifies against the
    #: system's trust store).
    tls: TlsConfig | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if value.startswith("unix://"):
            if len(value) <= len("unix://"):
                raise ValueError("unix:// URL needs a socket path, e.g. unix:///run/engine.sock")
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http://, https:// or unix://")
        problem = http_url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value.rstrip("/")

    #: The URL's userinfo as written (compared by `==`, so a reload sees a changed credential).
    _userinfo: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _take_userinfo(self) -> InstanceConfig:
        url, userinfo = split(self.url)
        if userinfo is not None:
            object.__setattr__(self, "url", url)  # the model is frozen; this runs once, inside validation
            self._userinfo = userinfo
        return self

    @field_serializer("url")
    def _url_as_written(self, url: str) -> str:
        # `model_dump()` feeds revalidation (a reload): the credential must survive the round trip.
        return url if self._userinfo is None else join(url, self._userinfo)

    @property
    def basic_authorization(self) -> str | None:
        """`Authorization` value (HTTP Basic) from the URL's userinfo, if it had one."""
        return None if self._userinfo is None else basic_credential(self._userinfo)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The credentials the gateway sends this engine, as they could appear in its answers (its key; its URL's
        password as written, decoded, and inside the Basic credential): what `credentials.Credentials` scrubs."""
        found = [self.api_key or ""]
        if self._userinfo is not None:
            password = self._userinfo.partition(":")[2]
            found += [password, unquote(password), (self.basic_authorization or "").removeprefix("Basic ")]
        return tuple(s for s in found if s)

    @model_validator(mode="after")
    def _check_tls(self) -> InstanceConfig:
        if self.tls is not None and not self.url.startswith("https://"):
            raise ValueError("tls applies to https:// instances only")
        return self

    @property
    def key(self) -> str:
        """Identity of the engine process: one instance serving several models shares state."""
        return self.url

    @property
    def display_name(self) -> str:
        """Its name in headers, metrics, records and logs: `name`, else its URL."""
        return self.name or self.url

    def concurrency_ceiling(self, upstream: UpstreamConfig) -> int:
        """The most requests this instance is ever sent at once."""
        return self.max_concurrency or upstream.max_connections

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context for an `https://` instance (None for http:// and unix://)."""
        if not self.url.startswith("https://"):
            return None
        return (self.tls or TlsConfig()).client_context()


class SemanticConfig(_Strict):
    """A model's semantic cache (needs the `semantic` extra): serve the answer of a request that means
    the same (same tenant, sampling parameters and conversation; last message similar enough)."""

    #: Cosine similarity (0..1] the last messages must reach.
    threshold: Annotated[float, Field(gt=0, le=1)] = 0.92
    #: Record would-be hits (metric `lockgate_dedup_total{outcome="semantic_shadow"}`) without serving them.
    shadow: bool = False
    max_entries: Annotated[int, Field(ge=0)] = 10000
    #: Bytes of cached results held (per model); least recently used go first.
    max_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    ttl_ms: Annotated[int, Field(ge=0)] = 300000

    @model_validator(mode="after")
    def _extra_present(self) -> SemanticConfig:
        absent = extras.missing("semantic")
        if absent:
            raise ValueError(
                f"the semantic cache needs the 'semantic' extra ({', '.join(absent)} missing): "
                + extras.install_hint("semantic")
            )
        return self


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1)]
    #: May be empty only for a model a `simulate:` entry serves (its simulated instances are added).
    instances: list[InstanceConfig] = []
    #: A policy name, or a mapping with the policy and its options (see `routing/config.py`).
    routing: RoutingConfig = RoutingConfig()
    #: End-to-end deadline for this model's requests (a client may lower it per request, `x-lockgate-timeout-ms`):
    #: 504 past it. None by default: a reasoning model's stream may run for long; a hung engine is bounded by
    #: `upstream.stall_timeout_ms` / `answer_timeout_ms` instead.
    timeout_ms: Annotated[int, Field(ge=1)] | None = None
    cancel_policy: CancelPolicy = "immediate"
    #: Extra attempts on another instance, only before the first byte reached the client.
    retries: Annotated[int, Field(ge=0, le=5)] = 1
    #: Coalesce identical requests and serve completed results from the cache: never, only reproducible
    #: requests (temperature 0 or a fixed seed), or every request.
    dedup: DedupMode = "deterministic"
    #: Off unless set.
    semantic: SemanticConfig | None = None

    @field_validator("dedup", mode="before")
    @classmethod
    def _dedup_off(cls, value: object) -> object:
        # `dedup: off` unquoted is YAML 1.1's false (PyYAML reads it so): it means what it says.
        return "off" if value is False else value


class UpstreamConfig(_Strict):
    connect_timeout_ms: Annotated[int, Field(ge=1)] = 2000
    #: Connections kept per instance (keep-alive pool size).
    max_connections: Annotated[int, Field(ge=1)] = 256
    #: An engine's answer the gateway holds whole (a non-streaming body, or a stream assembled for a
    #: non-streaming client) may not be larger than this: 502 beyond it.
    max_response_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    #: One SSE event (or line) from an engine may not be larger than this: the stream breaks (502) beyond it.
    max_event_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    #: A streamed engine call that waits this long for the engine's next byte (the answer's head, or its next event)
    #: is closed as hung: 504 `upstream_stalled` (tried on another instance if nothing reached the client yet), and
    #: the instance is reported failed. 0: never. A non-streaming call, whose answer comes whole at its end, is
    #: bounded by `answer_timeout_ms` instead.
    stall_timeout_ms: Annotated[int, Field(ge=0)] = 120_000
    #: A non-streaming engine call (its answer comes whole, at its end: nothing to watch before) that has not begun
    #: its answer this long is closed as hung, the same way (504 `upstream_stalled`). 0: never. A longer answer than
    #: this needs a stream (or this raised).
    answer_timeout_ms: Annotated[int, Field(ge=0)] = 600_000


class HealthConfig(_Strict):
    interval_ms: Annotated[int, Field(ge=10)] = 1000
    timeout_ms: Annotated[int, Field(ge=10)] = 1000
    #: An instance ejected after an engine went silent in a call (`upstream.stall_timeout_ms`) returns only once it
    #: answers a one-token request within this long (its health check alone passed all along).
    answer_probe_timeout_ms: Annotated[int, Field(ge=10)] = 10_000
    ejection: EjectionConfig = EjectionConfig()


class UsageConfig(_Strict):
    #: SQLite file for usage records; ":memory:" keeps them in memory (tests, demos).
    path: str = "lockgate-usage.sqlite3"
    batch_size: Annotated[int, Field(ge=1)] = 256
    #: Records held in memory before new ones spill to ``<path>.spill.jsonl``.
    queue_size: Annotated[int, Field(ge=1)] = 10000

    @field_validator("path")
    @classmethod
    def _directory_exists(cls, value: str) -> str:
        # (`check-config` said OK to a path in a directory that does not exist, which `serve` then could not open.)
        if value != ":memory:" and not value.startswith("file:"):
            directory = Path(value).parent
            if not directory.is_dir():
                raise ValueError(f"the directory of {value!r} ({directory}) does not exist")
        return value


class ShutdownConfig(_Strict):
    #: How long running requests may keep streaming after SIGTERM before they are aborted.
    drain_ms: Annotated[int, Field(ge=0)] = 10000


class ResultCacheConfig(_Strict):
    """The completed-result cache shared by every model (de-duplication)."""

    max_entries: Annotated[int, Field(ge=0)] = 4096
    max_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    #: How long a completed result is served; 0 turns the cache off (flights still coalesce).
    ttl_ms: Annotated[int, Field(ge=0)] = 10000
    #: A result larger than this is not cached (its clients are still served).
    max_entry_bytes: Annotated[int, Field(ge=0)] = 4 * 1024 * 1024


class FlightsConfig(_Strict):
    """The buffers of a flight (one engine call shared by identical requests, de-duplication)."""

    #: The flight stops reading its engine while its slowest client is this far behind (backpressure).
    max_lag_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    #: Replay history kept for late joiners: past this size the flight takes no new clients (an identical
    #: request starts its own engine call), keeps only what its clients have not read yet, and its result is
    #: not cached.
    max_history_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024


class DashboardConfig(_Strict):
    """The live dashboard at `/dashboard` (see `lockgate.dashboard`)."""

    enabled: bool = True
    #: Seconds of samples kept for the plots: a ring of history_s * 1000 / interval_ms samples (at most 3,600).
    history_s: Annotated[int, Field(ge=10, le=3600)] = 600
    #: Dashboards open at once (`/dashboard/events` streams); more get 503.
    max_clients: Annotated[int, Field(ge=1, le=1000)] = 16
    #: How often a sample is taken and a snapshot sent.
    interval_ms: Annotated[int, Field(ge=100, le=60000)] = 1000


class SimFleetEntry(_Strict):
    """An engine simulator started inside the gateway process (the embedded default)."""

    models: Annotated[list[str], Field(min_length=1)]
    count: Annotated[int, Field(ge=1, le=64)] = 1
    fast: bool = False
    prefill_tps: Annotated[float, Field(gt=0)] = 8000.0
    tpot_ms: Annotated[float, Field(ge=0)] = 10.0
    max_num_seqs: Annotated[int, Field(ge=1)] = 64
    kv_blocks: Annotated[int, Field(ge=16)] = 2048


class Config(_Strict):
    listen: ListenConfig = ListenConfig()
    limits: LimitsConfig = LimitsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    usage: UsageConfig = UsageConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    result_cache: ResultCacheConfig = ResultCacheConfig()
    dashboard: DashboardConfig = DashboardConfig()
    flights: FlightsConfig = FlightsConfig()
    #: Simulated engines to start in-process; their instances are added to the models they serve.
    simulate: list[SimFleetEntry] = []
    models: list[ModelConfig] = []
    #: Priority classes and the per-pool scheduler (see docs/tenants-and-priorities.md).
    scheduling: SchedulingConfig = SchedulingConfig()
    #: Tenants and their API keys; with no keys configured the gateway is open (tenant "default").
    tenants: list[TenantConfig] = []
    #: etcd and this process's cluster (`lockgate sidecar` publishes, `lockgate serve` discovers); absent = alone.
    cluster: ClusterConfig | None = None
    metrics: MetricsConfig = MetricsConfig()
    #: Admin API keys; see README "Admin access".
    admin: AdminConfig = AdminConfig()
    access_log: AccessLogConfig = AccessLogConfig()
    tracing: TracingConfig = TracingConfig()
    #: Service-level objectives (`GET /admin/slo`, `lockgate slo`); defaults: the design's table.
    slo: SloConfig = SloConfig()

    @model_validator(mode="after")
    def _check_admission(self) -> Config:
        check_admission(self.tenants, self.scheduling)
        tenant_keys = {key for tenant in self.tenants for key in tenant.keys}
        if tenant_keys.intersection(self.admin.keys):
            raise ValueError("admin.keys: a key is also a tenant's key; use different keys")
        return self

    @model_validator(mode="after")
    def _check_slo(self) -> Config:
        """`slo.priority` names a class; unset, it is the most urgent one (the first)."""
        if self.slo.priority is None:
            slo = self.slo.model_copy(update={"priority": self.scheduling.classes[0].name})
            return self.model_copy(update={"slo": slo})
        if self.scheduling.class_index(self.slo.priority) is None:
            names = ", ".join(c.name for c in self.scheduling.classes)
            raise ValueError(f"slo.priority: {self.slo.priority!r} is not a priority class ({names})")
        return self

    @model_validator(mode="after")
    def _check_models(self) -> Config:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        if not self.models and not self.simulate and self.cluster is None:
            raise ValueError("configure at least one model (or a `simulate` fleet, or a `cluster` to discover them)")
        simulated = {name for entry in self.simulate for name in entry.models}
        for index, model in enumerate(self.models):
            if not model.instances and model.name not in simulated and self.cluster is None:
                raise ValueError(
                    f"models[{index}].instances: model {model.name!r} has no instances and no `simulate` entry "
                    "serves it"
                )
            urls = [i.url for i in model.instances]
            if len(set(urls)) != len(urls):
                raise ValueError(f"models[{index}] ({model.name}) lists the same instance URL twice")
        listed: dict[str, InstanceConfig] = {}
        named: dict[str, str] = {}  # an instance's name -> its URL
        simulators = sum(entry.count for entry in self.simulate)
        for model in self.models:
            for spec in model.instances:
                # One URL is one engine (one connection pool): it cannot log in two ways, and it has one limit (the
                # first listing's was taken silently) and one name (the name tells engines apart in responses'
                # headers, metrics and usage records: two engines of one name shared one series).
                first = listed.setdefault(spec.url, spec)
                name = first.display_name  # (the first listing names it; a later one may leave its name out)
                if spec.name is not None and spec.name != name:
                    raise ValueError(
                        f"instance {redact(spec.url)} is listed under two names ({name!r} and {spec.name!r}): one URL "
                        "is one engine, with one name; give its first listing the name, and the others the same or none"
                    )
                if named.setdefault(name, spec.url) != spec.url:
                    raise ValueError(
                        f"instance name {name!r} is given to two engines ({redact(named[name])} and "
                        f"{redact(spec.url)}): names tell engines apart in headers, metrics and usage records"
                    )
                if name.startswith("sim-") and name[4:].isdigit() and 1 <= int(name[4:]) <= simulators:
                    raise ValueError(
                        f"instance name {name!r} is the name of a simulator the `simulate:` section starts "
                        f"(sim-1 to sim-{simulators}); give the instance another"
                    )
                if (first.api_key, first.basic_authorization) != (spec.api_key, spec.basic_authorization):
                    raise ValueError(f"instance {spec.url} is listed with different credentials")
                if first.max_concurrency != spec.max_concurrency:
                    shown = " and ".join(
                        "unset" if v is None else str(v) for v in (first.max_concurrency, spec.max_concurrency)
                    )
                    raise ValueError(
                        f"instance {redact(spec.url)} is listed with different max_concurrency ({shown}): one URL is "
                        "one engine, with one limit; give every listing the same"
                    )
        if self.cluster is None:  # (a cluster's gateways learn models from etcd: any name may come)
            served = set(names) | simulated
            for index, tenant in enumerate(self.tenants):
                unknown = sorted(set(tenant.models or ()) - served)
                if unknown:
                    raise ValueError(
                        f"tenants[{index}].models: no model named {', '.join(map(repr, unknown))} "
                        f"(served: {', '.join(sorted(served))})"
                    )
        return self

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key and the reason."""


def parse_config(data: Any, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, source)) from None


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read, substitute `${VAR}` from `environ` (default: the process environment), validate."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    try:
        data = substitute(data, os.environ if environ is None else environ)
    except UnsetVariable as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return parse_config(data, str(path))


class _UniqueKeys(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no type information
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML says keys are unique, and PyYAML keeps
    the last silently, so a stray `tenants: []` further down a file dropped every tenant key (the gateway then
    open to anyone) and a second `listen:` replaced the first, with no word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, Any] = {}
        for key_node, _ in node.value:
            # Plain keys as written (a merge key `<<` brings keys that the mapping's own may override, as YAML says).
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            first = seen.get(key_node.value)
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{key_node.value}' appears twice in one mapping (first at line {first.line + 1})",
                    key_node.start_mark,
                )
            seen[key_node.value] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line: the file, where in it and what PyYAML found (not the offending line, which PyYAML quotes and which
    may hold an instance URL with a password; nor its `<unicode string>` for the file's name)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not isinstance(problem, str):
        return redact(f"{path}: not valid YAML: {' '.join(str(exc).split())}")
    context = getattr(exc, "context", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}"
    return redact(f"{where}: not valid YAML: {problem}" + (f" ({context})" if isinstance(context, str) else ""))


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """A pydantic error naming each key path and the reason (never echoing a secret): one line for one problem."""
    if exc.error_count() == 1:
        return redact(f"{source}: " + _problems(exc)[0])
    lines = [f"{source}: {exc.error_count()} problems:", *(f"  {problem}" for problem in _problems(exc))]
    return redact("\n".join(lines))  # the input quoted may be an instance URL with a password


def _problems(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        where = _loc(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if not where:
            # A check across keys names the key itself (`tenants[0].models: ...`); others concern the whole file.
            lines.append(message if _KEY_PATH.match(message) else f"(top level): {message}")
            continue
        if err["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and indentation)"
        elif any(isinstance(part, str) and (part == "api_key" or part.endswith("keys")) for part in err["loc"]):
            pass  # never echo what may be a secret (`keys`, `central_keys`, `api_key`)
        elif "(got " in message:
            pass  # (a check that names the value itself)
        elif "input" in err and err["type"] != "missing" and not isinstance(err["input"], dict):
            message = f"{message} (got {err['input']!r})"
        lines.append(f"{where}: {message}")
    return lines


#: A message that starts with the key path it is about.
_KEY_PATH = re.compile(r"[a-z_]+(\[\d+\])*(\.[a-z_]+(\[\d+\])*)*: ")


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
