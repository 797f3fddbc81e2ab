"""Service-level objectives: the design's SLO table evaluated over rolling windows with error budgets and
multi-window burn-rate alerts (`objectives.py`), from the usage records (`usage.py`) and sampled engine
busy signals (`idle.py`); `service.py` keeps a cached evaluation for the gateway, `rules.py` writes the
same objectives as Prometheus rules, `cli.py` is `lockgate slo`."""

from .config import BurnAlert, SloConfig
from .objectives import OBJECTIVES, Counts, evaluate
from .service import SloService

__all__ = ["OBJECTIVES", "BurnAlert", "Counts", "SloConfig", "SloService", "evaluate"]
