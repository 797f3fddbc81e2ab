"""Configuration of routing, fleet state and outlier ejection (the `routing`, `scrape` and `health` keys).

Kept apart from `config.py` so routing options grow here. A model's `routing` accepts the old short
form, a policy name (`routing: least_load`), or a mapping with the policy and its options:

    routing:
      policy: cache_aware            # round_robin | least_load | power_of_two | consistent_hash
                                     # | score | cache_aware | predicted_ttft (the default)
      cache_aware: {min_match: 0.5, balance_abs: 32, balance_rel: 1.5}
      prefix_index: {block_chars: 64, max_bytes: 33554432}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PolicyName = Literal[
    "round_robin", "least_load", "power_of_two", "consistent_hash", "score", "cache_aware", "predicted_ttft"
]
DEFAULT_POLICY: PolicyName = "predicted_ttft"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConsistentHashOptions(_Strict):
    #: Client request header carrying the session key; the body's `user` field is the fallback.
    header: str = "x-session-id"
    #: Bounded load: no instance takes more than `load_factor` x the mean in flight (+1).
    load_factor: Annotated[float, Field(ge=1.0)] = 1.25
    #: Points per instance on the hash ring.
    virtual_nodes: Annotated[int, Field(ge=1, le=1024)] = 64


class ScoreWeights(_Strict):
    """Weights of the `score` policy's terms; each term is normalised to 0..1 across candidates."""

    queue: Annotated[float, Field(ge=0)] = 2.0
    running: Annotated[float, Field(ge=0)] = 1.0
    kv: Annotated[float, Field(ge=0)] = 2.0
    ttft: Annotated[float, Field(ge=0)] = 1.0


class CacheAwareOptions(_Strict):
    #: Prefer the instance with the longest cached prefix when it covers at least this share of the prompt.
    min_match: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    #: Fall back to the least loaded instance when (max - min) requests in flight exceeds this ...
    balance_abs: Annotated[int, Field(ge=0)] = 32
    #: ... and max > balance_rel x min.
    balance_rel: Annotated[float, Field(ge=1.0)] = 1.5


class PrefixIndexOptions(_Strict):
    #: Prompt characters per hashed block (~4 characters a token).
    block_chars: Annotated[int, Field(ge=8, le=4096)] = 64
    #: Memory the prefix index of one model may use; least recently used blocks are evicted beyond it.
    max_bytes: Annotated[int, Field(ge=64 * 1024)] = 32 * 1024 * 1024


class PredictedTTFTOptions(_Strict):
    #: Prefill rate assumed for an instance until its own rate has been measured (prompt tokens/s).
    default_prefill_tps: Annotated[float, Field(gt=0)] = 8000.0
    #: An instance's measured prefill rate and time per token relax toward its peers' with this
    #: half-life while they take no new sample (0: never): one bad sample (a stall) must not price an
    #: instance out for good, since an instance that is never chosen is never measured again.
    measured_half_life_ms: Annotated[int, Field(ge=0)] = 2000
    #: Predictions within this share of the best (plus `near_tie_ms`) count as equal, and the (measured) instance
    #: holding the most of the prompt beyond a step's worth, then the emptier, wins among them: the estimates
    #: (measured rates, queue models) are not more exact than that, and letting their noise decide herds requests
    #: onto whichever instance measured fastest.
    near_tie: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    near_tie_ms: Annotated[float, Field(ge=0.0)] = 0.5


class RoutingConfig(_Strict):
    policy: PolicyName = DEFAULT_POLICY
    consistent_hash: ConsistentHashOptions = ConsistentHashOptions()
    score: ScoreWeights = ScoreWeights()
    cache_aware: CacheAwareOptions = CacheAwareOptions()
    predicted_ttft: PredictedTTFTOptions = PredictedTTFTOptions()
    prefix_index: PrefixIndexOptions = PrefixIndexOptions()
    #: Seed of the random choices (`power_of_two`), for reproducible runs.
    seed: int = 0
    #: Long prompts' turns, off by default (0). Else a prompt whose uncached part takes an instance at least this
    #: long to prefill (at its measured rate) is long: at most one long streamed prompt is outstanding per
    #: instance (sent, first token not back), and a long request waits in the gateway while every candidate has
    #: one, so that no request queues inside an engine behind two long prefills. Measured (`bench hol`, which
    #: runs it beside the default): short requests' TTFT p99 lower in most runs, their p50 higher (long prompts
    #: are spread over every instance), long ones' p99 lower in every run (docs/decisions.md).
    long_prefill_ms: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        # `routing: least_load` (the original form) means `routing: {policy: least_load}`.
        if isinstance(data, str):
            return {"policy": data}
        return data


class ScrapeConfig(_Strict):
    """Scraping each engine's Prometheus metrics (concurrently, each with a timeout)."""

    enabled: bool = True
    interval_ms: Annotated[int, Field(ge=10)] = 200
    timeout_ms: Annotated[int, Field(ge=5)] = 150
    #: Engine metrics older than this are not trusted; the gateway's own accounting is used instead.
    stale_after_ms: Annotated[int, Field(ge=10)] = 1000


class EjectionConfig(_Strict):
    """Passive outlier ejection: consecutive failures take an instance out with exponential backoff."""

    consecutive_failures: Annotated[int, Field(ge=1)] = 3
    base_ms: Annotated[int, Field(ge=1)] = 1000
    max_ms: Annotated[int, Field(ge=1)] = 60000
    #: At most this share of a pool's instances is ejected on passive signals at once (rounded down, so a
    #: pool of one is never ejected), and never its last routable one; 0 turns passive ejection off.
    max_ejection_percent: Annotated[int, Field(ge=0, le=100)] = 50
