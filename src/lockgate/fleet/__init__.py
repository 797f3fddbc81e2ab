"""The fleet: engine instances grouped into one pool per model, and what the gateway knows of them.

`fleet` (the `Fleet`: instances, their sessions, health and background probes), `pool` (one model's instances and
routing policy), `instance` (an engine process and a request's lease on it), `state` (the
gateway's own accounting merged with scraped engine metrics), `scrape` (engine `/metrics` in each
dialect), `ejection` (passive outlier ejection), `report` (`GET /admin/fleet`), `metrics` (per-instance
gauges).
"""
