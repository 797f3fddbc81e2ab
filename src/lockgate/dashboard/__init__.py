"""The live dashboard served by the gateway at `/dashboard` (see `routes.py` for the routes and their contract,
`feed.py` for the sampler and the SSE fan-out, `snapshot.py` for what the page is sent)."""

from .feed import Feed, FeedClient
from .history import History, Sample
from .routes import Dashboard
from .snapshot import build_snapshot
from .sources import GatewayState, SloProvider

__all__ = ["Dashboard", "Feed", "FeedClient", "GatewayState", "History", "Sample", "SloProvider", "build_snapshot"]
