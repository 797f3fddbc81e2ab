"""De-duplication: coalesced in-flight generations (flights) and a completed-result cache.

See `coalescer.py` (the decision and serving), `flight.py` (one shared upstream generation),
`flights.py` (their registry and task owner), `cache.py`, `fingerprint.py`, `eligibility.py`. Import from those
modules: the package re-exports nothing (the semantic cache, which the coalescer uses, stores `cache.Result`s: a
package that imported its coalescer would make that a cycle).
"""
