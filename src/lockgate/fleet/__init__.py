"""The fleet: engine instances grouped into one pool per model, and what the gateway knows of them.

`pool` (instances, leases, pools, the `Fleet` that owns sessions and background probes), `state` (the
gateway's own accounting merged with scraped engine metrics), `scrape` (engine `/metrics` in each
dialect), `ejection` (passive outlier ejection), `report` (`GET /admin/fleet`), `metrics` (per-instance
gauges).
"""
