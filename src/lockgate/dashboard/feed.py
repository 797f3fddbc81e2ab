"""The dashboard feed: one sampler tick per interval, one snapshot per tick shared by every open dashboard.

Theory of operation
-------------------
`Feed` is an async context manager owning one task, the ticker. Each tick (`tick()`, synchronous) reads
the gateway's cumulative metrics and appends one `Sample` to the bounded `History` ring; that is all it
does while no dashboard is open (no snapshot is built, nothing is serialised). When at least one
`FeedClient` exists, the tick also builds one snapshot event (the bytes of one SSE event) and wakes the
subscribers, who all send those same bytes.

A subscription's first `next()` builds a snapshot of its own at once with the whole history (so a page
shows its plots immediately); later ones wait for the next tick and return the shared event, which
carries only the newest history rows. A subscriber that was slow (its previous event still unsent) just
gets the newest event when it asks again: events are never queued per client, so what a client holds is
at most one event plus what its transport buffers (`EventStream` skips an event rather than waiting
while the transport is paused).

`close()` (shutdown) makes every pending and future `next()` return None, so each stream ends at once;
`subscribe()` then returns None. `aclose()` also stops the ticker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from types import TracebackType

from ..tasks import cancel_and_wait
from .history import History, Sample, Totals, sample_between

log = logging.getLogger(__name__)

#: History rows carried by each tick's shared event: enough to cover a client that skipped a few events.
TAIL_ROWS = 10

#: Builds one SSE event from history rows; the flag says whether they are the whole history.
Render = Callable[[Sequence[Sample], bool], bytes]


class Feed:
    def __init__(
        self,
        *,
        read_totals: Callable[[], Totals],
        render: Render,
        history_size: int,
        max_clients: int,
        interval_s: float = 1.0,
    ) -> None:
        self._read_totals = read_totals
        self._render = render
        self.history = History(history_size)
        self.max_clients = max_clients
        self.interval_s = interval_s
        self._clients: set[FeedClient] = set()
        self._idle = asyncio.Event()  # set while no subscription is open
        self._idle.set()
        self._previous: Totals | None = None
        self._event = b""
        self._version = 0
        self._changed = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        #: Events built by ticks (only while someone listens), and events not sent to a slow client.
        self.events_built = 0
        self.events_skipped = 0

    async def __aenter__(self) -> Feed:
        self._previous = self._read_totals()
        self._task = asyncio.create_task(self._run(), name="lockgate-dashboard-feed")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End every stream and stop the ticker. Idempotent."""
        self.close()
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def close(self) -> None:
        """End every stream now (pending `next()` calls return None) and refuse new subscriptions."""
        self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def clients(self) -> int:
        return len(self._clients)

    def subscribe(self) -> FeedClient | None:
        """A new subscription, or None when the feed is closed or `max_clients` are open."""
        if self._closed or len(self._clients) >= self.max_clients:
            return None
        subscription = FeedClient(self)
        self._clients.add(subscription)
        self._idle.clear()
        return subscription

    async def wait_idle(self) -> None:
        """Wait until no subscription is open (every stream has ended)."""
        await self._idle.wait()

    def _unsubscribe(self, subscription: FeedClient) -> None:
        self._clients.discard(subscription)
        if not self._clients:
            self._idle.set()

    def tick(self) -> None:
        """Take one sample; build and publish one event if anyone listens."""
        now = self._read_totals()
        if self._previous is not None:
            self.history.add(sample_between(self._previous, now))
        self._previous = now
        if not self._clients or self._closed:
            return
        self._event = self._render(self.history.tail(TAIL_ROWS), False)
        self.events_built += 1
        self._version += 1
        self._wake()

    def statistics(self) -> dict[str, int]:
        return {
            "clients": len(self._clients),
            "history_samples": len(self.history),
            "history_capacity": self.history.capacity,
            "events_built": self.events_built,
            "events_skipped": self.events_skipped,
        }

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                self.tick()
            except Exception:  # a bug in a snapshot must not stop the sampling
                log.exception("dashboard tick failed")
            next_at += self.interval_s
            if next_at <= loop.time():  # fell behind (a blocked loop): do not tick in a burst to catch up
                next_at = loop.time() + self.interval_s


class FeedClient:
    """One open dashboard's place in the feed; a context manager that unsubscribes on exit."""

    __slots__ = ("_feed", "_version")

    def __init__(self, feed: Feed) -> None:
        self._feed = feed
        self._version: int | None = None

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._feed._unsubscribe(self)

    async def next(self) -> bytes | None:
        """The next event: a full snapshot the first time, then each tick's event (waiting for it).
        None once the feed is closed."""
        feed = self._feed
        if feed._closed:
            return None
        if self._version is None:
            self._version = feed._version
            return feed._render(feed.history.all(), True)
        while self._version == feed._version and not feed._closed:
            await feed._changed.wait()
        if feed._closed:
            return None
        self._version = feed._version
        return feed._event

    def skipped(self) -> None:
        """The caller did not send an event (its client was not reading); counted in the statistics."""
        self._feed.events_skipped += 1
