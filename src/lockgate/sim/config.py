"""Configuration of one simulated engine instance (a frozen value, passed down; no globals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .scheduler import SchedulerConfig


@dataclass(frozen=True, slots=True)
class SimConfig:
    models: Sequence[str] = ("sim-model",)  # served names; the first one labels the metrics
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (see ``SimServer.port``)
    uds: str | None = None  # serve on this unix socket path instead of TCP
    fast: bool = False  # answer at once, no step loop and no delays (throughput benchmarks)
    seed: int = 0  # seeds the per-request random seeds of sampled (temperature > 0, no seed) requests
    prefill_tps: float = 8000.0
    tpot_ms: float = 10.0
    batch_growth: float = 0.02
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 4096
    block_size: int = 16
    default_max_tokens: int = 64
    max_model_len: int = 32768
    requests_seen_limit: int = 1000  # how many finished request records /sim/stats keeps
    tls_cert: str | None = None  # serve HTTPS with this PEM certificate (chain) ...
    tls_key: str | None = None  # ... and this key (when it is not in ``tls_cert``)
    # Failure knob: this many seconds after start the engine "crashes" (``SimServer.fail``): streams in
    # flight break, /health and every new generation answer 503. None: never.
    fail_after_s: float | None = None

    def __post_init__(self) -> None:
        models = (self.models,) if isinstance(self.models, str) else tuple(self.models)
        if not models:
            raise ValueError("a sim must serve at least one model name")
        object.__setattr__(self, "models", models)
        if self.fail_after_s is not None and self.fail_after_s < 0:
            raise ValueError("fail_after_s must be >= 0")

    @property
    def model_name(self) -> str:
        return self.models[0]

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            prefill_tps=self.prefill_tps,
            tpot_ms=self.tpot_ms,
            batch_growth=self.batch_growth,
        )
