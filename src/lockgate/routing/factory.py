"""`make_policy`: a `routing:` option to its policy object.

Kept apart from `policies.py` so that the policy modules (`policies`, `affinity`, `cost`) only import
downward: `cost` and `affinity` build on `policies`' types, and this module alone knows all three.
"""

from __future__ import annotations

from .affinity import ConsistentHash
from .config import RoutingConfig
from .cost import CacheAware, PredictedTTFT, Score
from .policies import LeastLoad, Policy, PowerOfTwo, RoundRobin


def make_policy(config: RoutingConfig | str) -> Policy:
    if isinstance(config, str):
        config = RoutingConfig(policy=config)  # type: ignore[arg-type]
    name = config.policy
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(config.seed)
    if name == "consistent_hash":
        return ConsistentHash(config.consistent_hash)
    if name == "score":
        return Score(config.score)
    if name == "cache_aware":
        return CacheAware(config.cache_aware)
    if name == "predicted_ttft":
        return PredictedTTFT(config.predicted_ttft)
    raise ValueError(f"unknown routing policy {name!r}")
