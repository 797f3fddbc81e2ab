"""Response ids as a multi-tenant gateway's clients see them: the engine's id, bound to the tenant it was made for.

An engine that stores responses (OpenAI; vLLM with its store) continues (`previous_response_id`) or returns any
response it holds, whoever asks: behind one gateway every tenant's responses share its stores, and a tenant that
learnt another's id (a log, a shared screen) could read that conversation. So a gateway with tenants never shows a
client the engine's id: it shows `<engine id>_lg<tag><mac>`, the tag naming the instance that made the response (a
hash of its key) and the mac an HMAC-SHA256 (truncated to 96 bits) of the tenant's name, the engine's id and the tag
under the gateway's secret; it takes back only an id whose mac is the asking tenant's. Another tenant's id, or a
made-up one, is refused before any engine sees it (404, as an unknown one is), with no memory of past responses: it
holds after a restart, past any number of responses, and across `--workers` (the supervisor hands its workers one
secret) and replicas when they share the secret. The tag lets any of them find the response's engine again (a
follow-up pinned there, a stored-response route forwarded there) without having seen the response.

The secret is `LOCKGATE_RESPONSE_ID_SECRET` when set (replicas and restarts keep their clients' ids valid with it),
else random per process (a restart then turns earlier ids into 404s).

An open gateway (no tenants: one party, nothing to bind) shows `<engine id>_lg<tag>` (`ResponseIds(bound=False)`):
the tag alone, so that its workers and replicas, each with its own memory of where responses were made, pin a
follow-up to the engine that holds the previous response (elsewhere the engine answers 404), with no secret to share.
It takes back any id: one with a tag is pinned, one without (an engine's own) is routed as any request.

`take_references` applies this to what a response request names (`previous_response_id`; with tenants, refusing
names the gateway cannot bind: `conversation`, `item_reference`); `ResponseNaming`, to what its answer shows.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import GatewayError, InvalidRequest, NotFound, UpstreamStatusError, shown

#: The longest engine's response id the gateway keeps consistent (engines' ids are ~40 characters).
MAX_RESPONSE_ID_CHARS = 256

if TYPE_CHECKING:
    from .fleet.instance import Instance
    from .fleet.pool import Pool

#: The environment variable holding the secret (any string; at least 32 random bytes' worth is sensible).
SECRET_ENV = "LOCKGATE_RESPONSE_ID_SECRET"

_MARK = "_lg"
_TAG_HEX = 8  # the instance that made the response: a hash of its key (not secret, covered by the mac)
_MAC_HEX = 24  # 96 bits
_NO_HOME = "0" * _TAG_HEX
_HEX = frozenset("0123456789abcdef")
#: A response id longer than this is neither remembered nor taken as a `previous_response_id` (made-up ones of a
#: body's length would otherwise fill a pool's memory of responses' homes): an engine's longest, and what two tiers of
#: gateways add to it (a sidecar's suffix, then a central's, each at most `_MARK` + tag + mac). With only the engine's
#: 256, a central showed ids it then refused as follow-ups (an outside run: a 215-character engine id, 261 shown).
MAX_SHOWN_ID_CHARS = MAX_RESPONSE_ID_CHARS + 2 * (len(_MARK) + _TAG_HEX + _MAC_HEX)


def home_tag(instance_key: str) -> str:
    """The tag a shown id carries for the instance (by its key: the same in every process of one configuration)."""
    return hashlib.sha256(instance_key.encode()).hexdigest()[:_TAG_HEX]


class ResponseIds:
    """Sign an engine's response id for a tenant (`show`) and take a client's back (`take`); `bound=False`: an open
    gateway's, tagged with its home and taken from anyone (see the module docstring)."""

    __slots__ = ("_key", "bound", "drawn", "trusts_tags")

    def __init__(self, secret: str | None = None, *, bound: bool = True, trusts_tags: bool = True) -> None:
        """`trusts_tags=False` (unbound ids only): a tag taken back is not believed (`take` says no home), so only
        the gateway's memory of where a response was made, which keeps its tenant, finds it: a sidecar's, whose
        direct callers could name a central tenant's response by its engine id and the instance's public tag."""
        self.bound = bound
        self.trusts_tags = trusts_tags or bound
        #: The secret was drawn at random (none given, none in the environment): ids hold in this process only.
        self.drawn = False
        if secret is None:
            secret = os.environ.get(SECRET_ENV)
            if not secret:
                secret, self.drawn = os.urandom(32).hex(), True
        self._key = hashlib.sha256(b"lockgate response ids\0" + secret.encode()).digest()

    def _mac(self, tenant: str, engine_id: str, tag: str) -> bytes:
        message = tenant.encode() + b"\0" + engine_id.encode() + b"\0" + tag.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:_MAC_HEX].encode()

    def show(self, engine_id: str, tenant: str, home: str | None = None) -> str:
        """The id `tenant`'s client sees for the engine's response `engine_id`, made on the instance keyed `home`."""
        if not self.bound:
            return engine_id if home is None else f"{engine_id}{_MARK}{home_tag(home)}"
        tag = home_tag(home) if home is not None else _NO_HOME
        return f"{engine_id}{_MARK}{tag}{self._mac(tenant, engine_id, tag).decode()}"

    def take(self, shown: str, tenant: str) -> tuple[str, str | None] | None:
        """The engine's id behind `shown` and the tag of the instance that made it (None: not known), if `shown` was
        made for `tenant`; else None. Unbound: any id, its tag if it has one."""
        if not self.bound:
            engine_id, tag = _open(shown)
            return engine_id, tag if self.trusts_tags else None
        cut = len(shown) - _MAC_HEX - _TAG_HEX - len(_MARK)
        if cut <= 0 or shown[cut : cut + len(_MARK)] != _MARK:
            return None
        engine_id = shown[:cut]
        tag = shown[cut + len(_MARK) : cut + len(_MARK) + _TAG_HEX]
        mac = shown[cut + len(_MARK) + _TAG_HEX :].encode()  # (bytes: a non-ASCII str cannot be compared)
        if not hmac.compare_digest(mac, self._mac(tenant, engine_id, tag)):
            return None
        return engine_id, None if tag == _NO_HOME else tag


class ResponseNaming:
    """One response request's side of the ids (`POST /v1/responses`): the engine's ids as its client sees them (the
    one it follows up as the client sent it), where the responses it makes are remembered as made (their follow-ups
    go there), and the numbering of the events its client was given (the gateway's own error event follows it)."""

    __slots__ = ("_home", "_ids", "_pool", "_previous", "_tenant", "sequence_sent")

    def __init__(
        self,
        pool: Pool,
        tenant: str,
        home: Callable[[], Instance | None],
        ids: ResponseIds | None = None,
        previous: tuple[str, str] | None = None,
    ) -> None:
        """`home`: the instance serving the request (asked when an id is made or shown: a retry may move it); `ids`:
        the ids clients are shown (None: the engine's); `previous`: the engine's and the client's id of the response
        it follows up (`previous_response_id`), if any."""
        self._pool = pool
        self._tenant = tenant
        self._home = home
        self._ids = ids
        self._previous = previous
        #: The last `sequence_number` the client was given (-1: none).
        self.sequence_sent = -1

    @property
    def shows(self) -> bool:
        """Whether the client sees other ids than the engine's."""
        return self._ids is not None

    def made(self, engine_id: str) -> None:
        """The engine serving the request made the response `engine_id`: a follow-up naming it goes there
        (`Pool.remember_response`)."""
        instance = self._home()
        if instance is not None and len(engine_id) <= MAX_SHOWN_ID_CHARS:  # (at a central: a sidecar's shown id)
            self._pool.remember_response(engine_id, instance.key, self._tenant)

    def show(self, engine_id: str) -> str:
        """The engine's response id as the client sees it: the id it sent for the response it follows up, else one
        for its tenant and the instance serving it."""
        previous = self._previous
        if previous is not None and engine_id == previous[0]:
            return previous[1]
        if self._ids is None:
            return engine_id
        instance = self._home()
        return self._ids.show(engine_id, self._tenant, instance.key if instance is not None else None)

    def in_error(self, error: GatewayError) -> GatewayError:
        """An engine's error as the client sees it: the response followed up named by the id the client knows; the
        engine not finding that response is the gateway's own 404 (`previous_response_not_found`, as when the gateway
        refuses an id itself: one code for one condition, whoever found it missing)."""
        previous = self._previous
        if previous is None or previous[0] not in error.message:
            return error
        if isinstance(error, UpstreamStatusError) and error.upstream_status == 404:
            missing = unknown_previous(previous[1])
            missing.rejected = error.rejected  # (the request's fault, as the engine's 4xx was: not a failure)
            return missing
        error.message = error.message.replace(previous[0], previous[1])
        return error


def take_references(body: dict[str, Any], tenant: str, ids: ResponseIds, pool: Pool) -> tuple[str, str] | None:
    """The earlier responses a response request names, as the engine knows them. A follow-up
    (`previous_response_id`) continues only its own tenant's responses: the id its client was shown is replaced by the
    engine's, and the instance it names is remembered as the response's home (the follow-up is pinned there, even by
    a process that never saw the response); another tenant's id, or one made up, is 404 (as an unknown one is at the
    engine, which would otherwise put that tenant's conversation in front of this request). With tenants, names the
    gateway cannot bind to one (a `conversation`, an input item of type `item_reference`: an engine that serves them
    looks them up in a store every tenant shares) are refused. Returns the engine's id and the client's, if the body
    names a previous response."""
    if ids.bound:
        _refuse_unbound_names(body)
    previous = body.get("previous_response_id")
    if not isinstance(previous, str):
        return None
    # (No id this gateway or an engine made is so long: refused before it reaches any memory.)
    taken = ids.take(previous, tenant) if len(previous) <= MAX_SHOWN_ID_CHARS else None
    home = pool.response_home(taken[0]) if taken is not None else None
    if taken is None or (home is not None and home[1] != tenant):
        # (The memory's tenant counts where ids are not bound: at a sidecar, a direct caller naming a response a
        # central made for one of its tenants, as the stored routes already refused.)
        raise unknown_previous(previous)
    engine_id, tag = taken
    if tag is not None and home is None:
        key = tagged_member(pool, tag)
        if key is not None:
            pool.remember_response(engine_id, key, tenant)
    body["previous_response_id"] = engine_id
    return engine_id, previous


def unknown_previous(shown_id: str) -> NotFound:
    """The 404 for a `previous_response_id` that names no response the client may follow up."""
    return NotFound(
        f"Previous response with id '{shown(shown_id)}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _refuse_unbound_names(body: dict[str, Any]) -> None:
    """A `conversation` or an `item_reference` input item: 400 (see `take_references`)."""
    if body.get("conversation") is not None:
        raise InvalidRequest(
            "`conversation` is not accepted by this gateway: it serves several tenants and cannot keep one tenant's "
            "conversation from another's; send the conversation's items in `input`, or use `previous_response_id`.",
            param="conversation",
        )
    items = body["input"]
    if isinstance(items, list):
        for index, item in enumerate(items):
            kind = item.get("type")
            # (any spelling of it: an engine that read the type case-insensitively would resolve the reference)
            if isinstance(kind, str) and kind.strip().lower() == "item_reference":
                raise InvalidRequest(
                    f"`input[{index}]`: item references are not accepted by this gateway: it serves several tenants "
                    "and cannot keep one tenant's items from another's; send the item itself.",
                    param=f"input[{index}]",
                )


def tagged_member(pool: Pool, tag: str) -> str | None:
    """The key of the member a shown id's tag names (`home_tag`), if any: one now, or one that left lately (a sidecar
    restarting: a follow-up to its response is told to retry, `Pool.left_lately`; a replica that never saw the
    response answered 404 while the one that made it answered 503)."""
    keys = [i.key for i in pool.instances] + pool.left_lately_keys()
    return next((key for key in keys if home_tag(key) == tag), None)


def _open(shown: str) -> tuple[str, str | None]:
    """An open gateway's id: the engine's and the tag after it, if it has one (else as it came: the engine's own)."""
    cut = len(shown) - _TAG_HEX - len(_MARK)
    tag = shown[cut + len(_MARK) :]
    if cut <= 0 or shown[cut : cut + len(_MARK)] != _MARK or not all(c in _HEX for c in tag):
        return shown, None
    return shown[:cut], tag
