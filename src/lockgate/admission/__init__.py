"""Admission: who may send what, and when it runs.

`tenants` (API keys, allowed models, priority caps), `ratelimit` (request and token buckets with
reservations), `scheduler` (the synchronous priority core), `gate` (its async shell and the
`Admission` entry point), `preemption` (stopping a low-priority call for a P0 arrival and how it continues later:
the request path that does it is `lockgate.resume`), `config` (the `scheduling:` and `tenants:` sections).
"""
