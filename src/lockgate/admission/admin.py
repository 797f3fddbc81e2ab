"""Who may use the operator routes: `/admin/*`, `/dashboard` (and what is under it) and, if configured,
`/metrics`.

The rules, in order (`AdminGate.check`):
- admin keys configured (`admin.keys`, sha256 digests like tenant keys): the request must carry one as
  `Authorization: Bearer <key>`; a tenant's key gets 403, no key or an unknown key 401;
- no admin key but tenant keys configured: the routes are closed (403, saying to configure `admin.keys`).
  Answering loopback clients only was rejected: behind a reverse proxy on the same host every client is
  loopback, and in the sidecar shape tenants' clients may be too;
- neither (an open gateway, the embedded demo): the routes are open, as every other route is.

The key is accepted as `Authorization: Bearer <key>` (API clients) or as the password of HTTP Basic
authentication (`Basic base64(any-user:<key>)`, or the user name when the password is empty, as `curl -u KEY:`
sends it): a browser opening `/dashboard` cannot send a bearer token, but answers a 401 that carries
`WWW-Authenticate: Basic` with its own login prompt and then sends the credentials with every same-origin request
the page makes, `/dashboard/*` and `/admin/*` included.

Pure lookups, no I/O; errors never echo the key.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

from ..errors import Forbidden, Unauthorized
from ..observe.config import AdminConfig
from .tenants import TenantBook, hash_key

#: Path prefixes of the operator routes (existing and future ones: gated by prefix, not route by route).
PROTECTED_PREFIXES = ("/admin", "/dashboard")
METRICS_PATH = "/metrics"
#: Pages a person opens in a browser: their 401 asks for Basic credentials (the browser's login prompt).
BROWSER_PREFIX = "/dashboard"
_REALM = 'realm="lockgate admin"'


def challenge(path: str) -> str:
    """The `WWW-Authenticate` value of a 401 on an operator route."""
    if path.startswith(BROWSER_PREFIX):
        return f'Basic {_REALM}, charset="UTF-8"'
    return f"Bearer {_REALM}"


def presented_key(authorization: str) -> str | None:
    """The key in an `Authorization` header (Bearer, or Basic's password / user name), None if malformed."""
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if not credentials:
        return None
    scheme = scheme.lower()
    if scheme == "bearer":
        return credentials
    if scheme != "basic":
        return None
    try:
        decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, _, password = decoded.partition(":")
    return password or user or None


def cross_site(method: str, origin: str | None, fetch_site: str | None, hosts: tuple[str | None, ...]) -> bool:
    """Whether a request that changes something (not GET/HEAD) comes from another site's page: a browser that
    cached the dashboard's Basic credentials would otherwise send them with another site's form posted here (a
    reload, a cancel: cross-site request forgery). Browsers say where a request comes from: `Sec-Fetch-Site`
    (anything but `same-origin`, or `none` for one the user typed, is refused), else `Origin`, compared with the
    request's `hosts` (`Host`, and `X-Forwarded-Host` behind a proxy). API clients (curl, the SDKs) send neither
    and pass."""
    if method in ("GET", "HEAD"):
        return False
    if fetch_site is not None:
        return fetch_site.strip().lower() not in ("same-origin", "none")
    if origin is None:
        return False
    _, _, authority = origin.strip().partition("://")
    # "null" (a sandboxed page, a file) has no authority: not this gateway's own dashboard.
    return not authority or all(host is None or authority.lower() != host.strip().lower() for host in hosts)


class AdminGate:
    """`tenants` returns the tenant book in force (a reload replaces it: a gateway that gains tenant keys
    closes its operator routes at once)."""

    def __init__(self, config: AdminConfig, tenants: Callable[[], TenantBook]) -> None:
        self._digests = frozenset(config.keys)
        self._tenants = tenants
        self._metrics = config.metrics_require_key

    @property
    def open(self) -> bool:
        """Nothing to check: no admin key and an open gateway."""
        return not self._digests and self._tenants().open

    def protects(self, path: str) -> bool:
        """Whether `path` is an operator route (with `metrics_require_key`, `/metrics` is one)."""
        return path.startswith(PROTECTED_PREFIXES) or (self._metrics and path == METRICS_PATH)

    def check(self, authorization: str | None) -> None:
        """Raise `Unauthorized` (401) or `Forbidden` (403) unless the request may use an operator route."""
        if self.open:
            return
        if not self._digests:
            raise Forbidden(
                "The admin API is closed: tenant keys are configured but no admin key. Add one to `admin.keys` "
                "(`lockgate hash-key` prints its digest) and reload the configuration (SIGHUP).",
                code="admin_keys_not_configured",
            )
        if not authorization:
            raise Unauthorized(
                "This route needs an admin key. Send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        key = presented_key(authorization)
        if key is None:
            raise Unauthorized(
                "The Authorization header must be 'Bearer <key>' (or Basic with the key as password).",
                code="invalid_api_key",
            )
        if hash_key(key) in self._digests:
            return
        if not self._tenants().open and self._is_tenant_key(key):
            raise Forbidden("This route needs an admin key; a tenant's key is not one.")
        raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")

    def _is_tenant_key(self, key: str) -> bool:
        try:
            self._tenants().authenticate(f"Bearer {key}")
        except Unauthorized:
            return False
        return True
