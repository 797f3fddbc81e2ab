"""A key this process owns in etcd, written under a lease that it keeps alive.

`Registration.run()` is one loop: grant a lease and write the key; then rewrite the key every
`republish_s` (a sidecar's state, every 100 ms) when its value changed, and refresh the lease every third
of its TTL. An unchanged value is not written again: the lease keeps it, and every write is a raft
entry in etcd and an event for every watcher of the cluster (a central replica's record, whose demand
is empty without rate-limited tenants, was rewritten ten times a second for nothing). When etcd
cannot be reached it retries every `retry_s`; when the lease is gone (etcd was away longer than the
TTL) it grants a new one and writes the key again. Nothing else is needed to come back after an etcd
restart or a network cut.

`connected` is True from the first successful write until a call fails; `confirmed_at` is when etcd
last answered (monotonic). `aclose()` revokes the lease, so a process that stops cleanly leaves the
cluster at once instead of after its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from .store import Etcd, LeaseLost, StoreUnavailable

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        etcd: Etcd,
        key: str,
        value: Callable[[], bytes],
        *,
        ttl_s: float,
        republish_s: float | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.key = key
        self._value = value
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.republish_s = republish_s
        self.retry_s = min(0.25, self.ttl_s / 4)
        self._on_change = on_change
        self.lease: int | None = None
        self.connected = False
        self.confirmed_at: float | None = None
        self.writes = 0
        #: Lease refreshes so far.
        self.refreshes = 0
        #: The value last written under the current lease (None: the key must be written).
        self._written: bytes | None = None
        self.last_error: str | None = None
        #: Said that etcd cannot be reached (so that reaching it is said too).
        self._warned = False
        #: Awaited before a lease is granted for the key, until it returns (it raises `StoreUnavailable` while etcd is
        #: out of reach, and anything else to stop): `Publisher`'s claim of its node name, made before the first
        #: publication and again after a lease was lost (etcd lost its keys, or was away past the TTL). It may take
        #: the key itself (`adopt`). `claimed`: made for the current lease.
        self.claim: Callable[[], Awaitable[None]] | None = None
        self.claimed = False

    def adopt(self, lease: int, written: bytes) -> None:
        """Keep the key that `written` was stored at under `lease` (a sidecar that created it itself: `Publisher`)."""
        self.lease, self._written, self.claimed = lease, written, True

    async def run(self) -> None:
        """Keep the key in etcd until cancelled."""
        loop = asyncio.get_running_loop()
        next_write = next_refresh = loop.time()
        while True:
            try:
                now = loop.time()
                answered = False  # only an answer from etcd confirms (an unchanged value asks nothing)
                if self.claim is not None and not self.claimed:
                    await self.claim()
                    self.claimed = True
                    if self.lease is not None:  # (the check took the key itself)
                        continue
                if self.lease is None:
                    self.lease, granted = await self.etcd.grant(self.ttl_s)
                    self._written = None
                    answered = True
                    next_refresh = now + granted / 3
                    next_write = now
                if (self.republish_s is not None and now >= next_write) or self._written is None:
                    value = self._value()
                    if value != self._written:
                        await self.etcd.put(self.key, value, lease=self.lease)
                        self._written = value
                        self.writes += 1
                        answered = True
                    next_write = max(next_write + (self.republish_s or 0.0), now)
                if now >= next_refresh:
                    await self.etcd.keepalive(self.lease)
                    self.refreshes += 1
                    answered = True
                    next_refresh = now + self.ttl_s / 3
                if answered:
                    self._confirmed()
                wake = next_refresh if self.republish_s is None else min(next_refresh, next_write)
                delay = wake - loop.time()
            except LeaseLost as exc:
                log.info("etcd lease for %s lost (%s): granting a new one", self.key, exc)
                self.lease = None
                self.claimed = False
                self.last_error = str(exc)
                continue
            except StoreUnavailable as exc:
                self._failed(str(exc))
                delay = self.retry_s
            await asyncio.sleep(max(0.0, delay))

    def _confirmed(self) -> None:
        self.confirmed_at = time.monotonic()
        self.last_error = None
        if not self.connected:
            self.connected = True
            if self._warned:
                self._warned = False
                log.warning("etcd reached: %s registered", self.key)
            else:
                log.info("etcd: %s registered", self.key)
            if self._on_change is not None:
                self._on_change(True)

    def _failed(self, error: str) -> None:
        self.last_error = error
        if self.connected:
            log.warning("etcd unreachable (%s); retrying every %.2fs", error, self.retry_s)
        elif not self._warned:  # (never reached: a wrong endpoint, or etcd down at the start, said nothing at all)
            log.warning(
                "etcd not reached (%s); %s not registered yet, retrying every %.2fs", error, self.key, self.retry_s
            )
        self._warned = True
        if self.connected:
            self.connected = False
            if self._on_change is not None:
                self._on_change(False)

    async def aclose(self, last: bytes | None = None) -> None:
        """Revoke the lease (its keys go at once); best effort, bounded by the client's timeout. `last`: a value
        written first, so that readers see it before the key goes (a sidecar's record saying it stopped)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(StoreUnavailable):
                if last is not None and last != self._written:
                    await self.etcd.put(self.key, last, lease=lease)
                await self.etcd.revoke(lease)
