"""A lean HTTP/1.1 client for the hot path to engines: keep-alive pool, llhttp parsing, synchronous abort.

`HttpPool(url).request(method, path, body, headers)` returns a `Response` once its head arrived; its body is
read with `read()` or `chunks()`, and the connection is given back with `release()` or dropped with
`close()`. See `connection.py` and `pool.py` for the theory of operation, `errors.py` for the error tree.
"""

from .connection import Response
from .errors import ConnectError, DisconnectedError, HttpClientError, ProtocolError, ResponseTooLarge, StalledError
from .pool import HttpPool, PoolStatistics

__all__ = [
    "ConnectError",
    "DisconnectedError",
    "HttpClientError",
    "HttpPool",
    "PoolStatistics",
    "ProtocolError",
    "Response",
    "ResponseTooLarge",
    "StalledError",
]
