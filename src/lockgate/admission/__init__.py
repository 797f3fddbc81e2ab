"""Admission: who may send what, and when it runs.

`tenants` (API keys, allowed models, priority caps), `ratelimit` (request and token buckets with
reservations), `scheduler` (the synchronous priority core), `gate` (its async shell and the
`Admission` entry point), `preemption` and `resume` (stopping a low-priority call for a P0 arrival and
continuing it later), `config` (the `scheduling:` and `tenants:` sections).
"""
