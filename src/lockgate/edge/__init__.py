"""The HTTP edge: a lean HTTP/1.1 server on llhttp for the gateway's clients.

`HttpServer(handler, ...)` serves `handler(Request) -> Response | StreamResponse`; a client that disconnects
has its handler task cancelled at once. See `server.py` for the theory of operation.
"""

from .request import Headers, Request
from .response import Reply, Response, StreamResponse, json_response
from .server import Handler, HttpServer

__all__ = ["Handler", "Headers", "HttpServer", "Reply", "Request", "Response", "StreamResponse", "json_response"]
