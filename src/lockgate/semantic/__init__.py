"""The semantic cache (optional `semantic` extra): answers for requests that mean the same.

`MiniLM` (embedder.py) embeds offline; `SemanticIndex` (index.py) stores vectors per exact scope;
`guard.py` keeps negations and numbers apart; `SemanticCache` (cache.py) is one model's cache.
Importing this package does not import the extra; constructing `MiniLM` does.
"""

from .cache import Probe, SemanticCache, probe_input
from .embedder import Embedder, MiniLM, SemanticUnavailable
from .guard import compatible, signature
from .index import SemanticHit, SemanticIndex

__all__ = [
    "Embedder",
    "MiniLM",
    "Probe",
    "SemanticCache",
    "SemanticHit",
    "SemanticIndex",
    "SemanticUnavailable",
    "compatible",
    "probe_input",
    "signature",
]
