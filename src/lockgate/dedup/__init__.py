"""De-duplication: coalesced in-flight generations (flights) and a completed-result cache.

See `coalescer.py` (the decision and serving), `flight.py` (one shared upstream generation),
`flights.py` (their registry and task owner), `cache.py`, `fingerprint.py`, `eligibility.py`.
"""

from .cache import Result, ResultCache
from .coalescer import CACHE_HEADER, Coalescer
from .eligibility import eligible, is_deterministic, opted_out
from .fingerprint import Fingerprint, fingerprint, sampling_scope
from .flight import Flight, FlightState, Subscription
from .flights import Flights

__all__ = [
    "CACHE_HEADER",
    "Coalescer",
    "Fingerprint",
    "Flight",
    "FlightState",
    "Flights",
    "Result",
    "ResultCache",
    "Subscription",
    "eligible",
    "fingerprint",
    "is_deterministic",
    "opted_out",
    "sampling_scope",
]
