"""Credentials in instance URLs (`http://user:password@host:port`).

The userinfo of an instance URL is the gateway's HTTP Basic credential for that engine (an explicit
`api_key` wins: it is sent as a Bearer token instead). It is taken out of the URL when the configuration
is validated, so the URL every other part of the gateway sees, shows and connects to has none: names,
metrics labels, `/admin/fleet`, the startup banner, usage rows and logs cannot leak it. Only
`InstanceConfig.model_dump()` puts it back (`join`), for the revalidation a reload does. `redact` hides
userinfo in text the gateway did not build itself (configuration errors quote the input).
"""

from __future__ import annotations

import base64
import re
from urllib.parse import unquote

#: A URL's userinfo: up to the last `@` of the URL (a password with an unencoded `/`, `?`, `#` or `@` is hidden too).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"]*@")
#: A URL's query and fragment (they may carry a key: `?api_key=`).
_QUERY = re.compile(r"(?P<url>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"?#]*)[?#][^\s'\"]*")


def split(url: str) -> tuple[str, str | None]:
    """`url` without its userinfo, and the userinfo as written (percent-encoded; None without one)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None
    end = len(rest)
    for delimiter in "/?#":
        index = rest.find(delimiter)
        if index != -1:
            end = min(end, index)
    userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return url, None
    return f"{scheme}://{host}{rest[end:]}", userinfo


def join(url: str, userinfo: str) -> str:
    """`url` with `userinfo` put back (the inverse of `split`)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{userinfo}@{rest}"


def basic_credential(userinfo: str) -> str:
    """The `Authorization` value (HTTP Basic) `userinfo` stands for: user and password percent-decoded, then
    sent as UTF-8 (RFC 7617)."""
    user, _, password = userinfo.partition(":")
    return "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by `***` (`http://***@host`): a user name alone
    may be a token too; and its query or fragment (`http://host/?***`)."""
    return _QUERY.sub(r"\g<url>?***", _USERINFO.sub(r"\g<scheme>***@", text))
