"""A small asyncio client for etcd v3, over etcd's JSON gateway (`/v3/...`) with aiohttp.

Only what lockgate needs: leases (grant, keepalive, revoke), put, a prefix read, and a prefix watch.
Why not a gRPC client (`aetcd`): see docs/decisions.md, "Scale-out: etcd".

Error handling: every failure to reach etcd or to get a usable answer raises `StoreUnavailable`
(a lost lease raises its subclass `LeaseLost`); the callers' loops decide what to do (keep the last
known state, retry, resynchronise). Each unary call has the configured timeout; a watch has a connect
timeout only (a quiet watch is normal; the lease keepalive is how a process notices etcd is gone).

Resource handling: `Etcd` is an async context manager owning one aiohttp session; endpoints are
tried in order and the first that answers is kept until it fails.

Bound: one watch response is at most `MAX_WATCH_LINE` bytes (etcd's own request limit is 1.5 MiB); a
larger one ends the watch with `StoreUnavailable` and the caller resynchronises from a fresh read.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

MAX_WATCH_LINE = 4 * 1024 * 1024


class StoreUnavailable(Exception):
    """etcd could not be reached, or did not give a usable answer."""


class LeaseLost(StoreUnavailable):
    """The lease is gone (expired or revoked): grant a new one and write the keys again."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    #: Empty for deletes (a key deleted by its lease's expiry included).
    value: bytes
    revision: int


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any) -> bytes:
    return base64.b64decode(text) if isinstance(text, str) else b""


def prefix_end(prefix: str) -> bytes:
    """The end of the key range holding every key that starts with `prefix` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"


class Etcd:
    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 1.0, max_line: int = MAX_WATCH_LINE) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.max_line = max_line
        self._current = 0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Etcd:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s),
            # aiohttp refuses a line longer than twice this (ValueError): the watch line bound.
            read_bufsize=max(1, self.max_line // 2),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    # --- unary calls ---------------------------------------------------------------------------
    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the current endpoint, then to each other one; the first usable answer wins."""
        session = self._session
        if session is None:
            raise StoreUnavailable("the etcd client is closed")
        failure = "no endpoint tried"
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            url = self.endpoints[index] + path
            try:
                async with asyncio.timeout(self.timeout_s):
                    async with session.post(url, data=orjson.dumps(body)) as resp:
                        raw = await resp.read()
                data = orjson.loads(raw)
            except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
                failure = f"{url}: {_reason(exc)}"
                continue
            if not isinstance(data, dict):
                failure = f"{url}: unexpected answer"
                continue
            self._current = index
            error = data.get("error") or data.get("message")
            if error and "header" not in data and "result" not in data:
                if "lease not found" in str(error):
                    raise LeaseLost(str(error))
                raise StoreUnavailable(f"{url}: {error}")
            return data
        raise StoreUnavailable(failure)

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted, which may be longer than asked)."""
        data = await self._call("/v3/lease/grant", {"TTL": ttl_s})
        try:
            return int(data["ID"]), int(data["TTL"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreUnavailable(f"unexpected lease grant answer: {data!r}") from exc

    async def keepalive(self, lease: int) -> int:
        """Refresh the lease; returns its TTL. Raises `LeaseLost` if etcd no longer has it."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = data.get("result")
        ttl = int(result.get("TTL", 0)) if isinstance(result, dict) else 0
        if ttl <= 0:
            raise LeaseLost(f"lease {lease:x} expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write `key`; returns the store's revision after the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self._call("/v3/kv/put", body)
        return _revision(data)

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Write `key` only if it does not exist (one transaction); whether it was written."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        data = await self._call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return bool(data.get("succeeded"))

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under `prefix` and the revision they were read at (watch from the next one)."""
        data = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = []
        for item in data.get("kvs", ()):
            if isinstance(item, dict):
                kvs.append(
                    KeyValue(
                        _unb64(item.get("key")).decode(errors="replace"),
                        _unb64(item.get("value")),
                        int(item.get("mod_revision", 0)),
                    )
                )
        return _revision(data), kvs

    # --- watching ------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Every change under `prefix` from `start_revision` on, a batch (one etcd revision or more) at
        a time. Never ends normally: a closed stream, a cancelled watch (e.g. compacted history) or a
        malformed answer raise `StoreUnavailable`; the caller re-reads and watches again."""
        session = self._session
        if session is None:
            raise StoreUnavailable("the etcd client is closed")
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoint + "/v3/watch"
        try:
            async with session.post(url, data=orjson.dumps(body)) as resp:
                if resp.status != 200:
                    raise StoreUnavailable(f"{url}: HTTP {resp.status}")
                async for line in resp.content:
                    events = _watch_events(line)
                    if events:
                        yield events
        except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, OSError, ValueError) as exc:
            # HttpProcessingError: LineTooLong, a line past `max_line`.
            self._current = (self._current + 1) % len(self.endpoints)
            raise StoreUnavailable(f"{url}: watch broke: {_reason(exc)}") from exc
        self._current = (self._current + 1) % len(self.endpoints)
        raise StoreUnavailable(f"{url}: the watch stream ended")


def _revision(data: dict[str, Any]) -> int:
    header = data.get("header")
    try:
        return int(header["revision"]) if isinstance(header, dict) else 0
    except (KeyError, TypeError, ValueError):
        return 0


def _watch_events(line: bytes) -> list[WatchEvent]:
    """The events in one line of a watch stream (none for its creation or progress notices)."""
    line = line.strip()
    if not line:
        return []
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise StoreUnavailable(f"malformed watch answer: {line[:200]!r}") from exc
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, dict):
        raise StoreUnavailable(f"watch error: {data!r}"[:300])
    if result.get("canceled"):
        raise StoreUnavailable(f"watch cancelled by etcd: {result.get('cancel_reason', '')}")
    events = []
    for item in result.get("events", ()):
        kv = item.get("kv") if isinstance(item, dict) else None
        if not isinstance(kv, dict):
            continue
        kind: Literal["put", "delete"] = "delete" if item.get("type") == "DELETE" else "put"
        events.append(
            WatchEvent(
                kind,
                _unb64(kv.get("key")).decode(errors="replace"),
                _unb64(kv.get("value")),
                int(kv.get("mod_revision", 0)),
            )
        )
    return events


def _reason(exc: BaseException) -> str:
    """An error for a person (`/admin/fleet`'s `last_error`, the log): its kind and message, not its repr (aiohttp's
    nest the connection key's every field)."""
    text = str(exc)
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
