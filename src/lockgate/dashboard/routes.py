"""The dashboard's HTTP routes: `/dashboard` (the page), `/dashboard/static/<file>`, `/dashboard/events` (SSE).

`Dashboard` is an async context manager owned by the gateway; it owns the `Feed` (the per-second sampler and the
snapshot events). `/dashboard/events` is a `text/event-stream` of `event: snapshot` events (JSON: see
`snapshot.py`), the first one at once with the whole history, then one per tick. It ends:

- when the client goes away: the edge server cancels the handler (the subscription is dropped in a `with`);
- on shutdown: `close()` ends every stream with `event: end` so that no dashboard keeps the drain waiting;
- when its credentials no longer open the admin routes (a reload rotated or removed the admin keys, or closed an open
  gateway with its first tenant keys): checked before each event, it ends with `event: end` (`"reason":
  "unauthorized"`), so that a revoked key does not go on reading the fleet, the tenants and the requests in flight;
- when the client stops reading: events are skipped while the transport is paused (nothing queues up per
  client), and the edge server cuts the connection after `limits.write_timeout_ms`.

At most `dashboard.max_clients` streams are open at once (503 beyond). No authentication here: whatever guards
`/admin/*` guards these routes too; the page sends the admin key as `Authorization: Bearer` (it streams with
`fetch()`, which can send headers, rather than `EventSource`, which cannot).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import orjson

from ..config import DashboardConfig
from ..edge.server import Reply, Request, Response, StreamResponse
from ..errors import GatewayError, NotFound, ShuttingDown, Unavailable
from .assets import STATIC_PREFIX, Assets
from .feed import Feed
from .history import Sample
from .snapshot import build_snapshot
from .sources import Observed, gather, read_totals

EVENT_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-store",
    "X-Accel-Buffering": "no",  # proxies that buffer responses (nginx) pass this stream through as it comes
    "X-Content-Type-Options": "nosniff",
}
END_EVENT = b'event: end\ndata: {"reason": "shutdown"}\n\n'
REVOKED_EVENT = b'event: end\ndata: {"reason": "unauthorized"}\n\n'


#: The ring's hard bound, whatever the configuration (a client's first event carries the whole ring).
MAX_SAMPLES = 3600


def history_samples(config: DashboardConfig) -> int:
    """How many samples cover `history_s` at one sample per `interval_ms`, at most MAX_SAMPLES."""
    return min(MAX_SAMPLES, -(-config.history_s * 1000 // config.interval_ms))


def encode_event(snapshot: object) -> bytes:
    """One SSE event named `snapshot` (orjson writes no newline, so the JSON is one `data:` line)."""
    return b"event: snapshot\ndata: " + orjson.dumps(snapshot) + b"\n\n"


class Dashboard:
    def __init__(self, gateway: Observed, config: DashboardConfig) -> None:
        self._gateway = gateway
        self.assets = Assets.load()
        self.feed = Feed(
            read_totals=lambda: read_totals(gateway),
            render=self._render,
            history_size=history_samples(config),
            max_clients=config.max_clients,
            interval_s=config.interval_ms / 1000,
        )

    async def __aenter__(self) -> Dashboard:
        await self.feed.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.feed.aclose()

    def close(self) -> None:
        """End every open stream now and refuse new ones (the gateway is shutting down)."""
        self.feed.close()

    def _render(self, samples: Sequence[Sample], full_history: bool) -> bytes:
        return encode_event(build_snapshot(gather(self._gateway), samples, full_history=full_history))

    # --- routes ----------------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        return self.assets.page_response(request)

    def static(self, request: Request) -> Response:
        name = request.path[len(STATIC_PREFIX) :]
        response = self.assets.static_response(request, name)
        if response is None:
            return _error(NotFound(f"Unknown path: {request.method} {request.path}"), {})
        return response

    async def events(
        self,
        request: Request,
        *,
        headers: Mapping[str, str] | None = None,
        allowed: Callable[[Request], bool] | None = None,
    ) -> Reply:
        """The SSE feed; `headers` are added to the response (the stream's or an error's). `allowed` says whether the
        request's credentials still open the feed, asked before each event after the first."""
        extra = dict(headers or {})
        subscription = self.feed.subscribe()
        if subscription is None:
            if self.feed.closed:
                return _error(ShuttingDown("The gateway is shutting down.", retry_after=1), extra)
            return _error(
                Unavailable(
                    f"Too many dashboards are open (dashboard.max_clients = {self.feed.max_clients}).",
                    code="too_many_dashboards",
                    retry_after=5,
                ),
                extra,
            )
        stream = StreamResponse(headers={**EVENT_HEADERS, **extra})
        with subscription:
            event = await subscription.next()  # built before the status line: a failure is still a 500
            try:
                await stream.prepare(request)
                end = END_EVENT
                while event is not None:
                    if not stream.write_nowait(event):
                        subscription.skipped()
                    event = await subscription.next()
                    if event is not None and allowed is not None and not allowed(request):
                        end = REVOKED_EVENT
                        break
                stream.write_nowait(end)
            except ConnectionError:
                pass  # the client has gone (the edge server is cancelling this handler, or is about to)
        return stream


def _error(error: GatewayError, headers: Mapping[str, str]) -> Response:
    return Response(
        status=error.http_status,
        body=error.body_bytes(),
        content_type="application/json",
        headers={**error.headers(), **headers},
    )
