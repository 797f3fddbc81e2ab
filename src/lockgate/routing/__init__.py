"""Routing: which instance serves a request.

`policies` (the `Policy` seam, the snapshot types, round-robin, least-load, power-of-two), `affinity`
(consistent hashing with bounded load), `cost` (score, cache-aware, predicted TTFT), `prefix` (the
bounded prefix index), `config` (the `routing:` options), `factory` (`make_policy`: an option to its
policy). Every policy is a synchronous choice over an
immutable snapshot.
"""
