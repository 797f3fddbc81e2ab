"""`lockgate.http` over TLS, against an asyncio TLS server on loopback (both event loops, see conftest):
verification against a CA file, a rejected certificate, `verify: false`, SNI (the URL's host or an override),
a client certificate (mutual TLS), keep-alive reuse and streamed bodies."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import trustme

from lockgate.http import ConnectError, HttpPool

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"


@dataclass
class TlsServer:
    port: int
    #: The SNI name of each handshake (None: the client sent none).
    server_names: list[str | None] = field(default_factory=list)
    connections: int = 0
    #: The subject common name of each client certificate presented.
    client_certs: list[str] = field(default_factory=list)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@contextlib.asynccontextmanager
async def tls_server(ca: trustme.CA, *, require_client_cert: bool = False) -> AsyncIterator[TlsServer]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost", "engine.test").configure_cert(context)
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    server = TlsServer(0)

    def sni(_obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        server.server_names.append(name)

    context.sni_callback = sni

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        peer = writer.get_extra_info("peercert")
        if peer:
            server.client_certs.append(dict(x[0] for x in peer["subject"]).get("commonName", "?"))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(CHUNKED if b"/stream" in head else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connection, "127.0.0.1", 0, ssl=context)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()
        await listener.wait_closed()


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_verified_tls_keeps_its_connection_alive_and_streams(ca: trustme.CA) -> None:
    async with tls_server(ca) as server:
        pool = HttpPool(f"https://localhost:{server.port}", ssl_context=trusting(ca))
        try:
            for _ in range(3):
                response = await pool.request("GET", "/x")
                assert response.status == 200 and await response.read() == b"ok"
            response = await pool.request("GET", "/stream")
            assert b"".join([chunk async for chunk in response.chunks()]) == b"hello world"
        finally:
            await pool.aclose()
        assert server.connections == 1  # one handshake, reused
        assert server.server_names == ["localhost"]  # SNI: the URL's host by default


async def test_server_name_override_is_sent_and_verified(ca: trustme.CA) -> None:
    async with tls_server(ca) as server:
        pool = HttpPool(f"https://127.0.0.1:{server.port}", ssl_context=trusting(ca), server_name="engine.test")
        try:
            assert (await (await pool.request("GET", "/")).read()) == b"ok"
            wrong = HttpPool(f"https://127.0.0.1:{server.port}", ssl_context=trusting(ca), server_name="other.test")
            with pytest.raises(ConnectError, match=r"certificate .* was rejected.*other\.test"):
                await wrong.request("GET", "/")
            await wrong.aclose()
        finally:
            await pool.aclose()
        assert server.server_names[0] == "engine.test"


async def test_a_certificate_from_another_ca_is_rejected_unless_verification_is_off(ca: trustme.CA) -> None:
    async with tls_server(ca) as server:
        url = f"https://127.0.0.1:{server.port}"
        strict = HttpPool(url, ssl_context=trusting(trustme.CA()))
        with pytest.raises(ConnectError, match=r"certificate .* was rejected"):
            await strict.request("GET", "/")
        assert strict.statistics().slots == 0  # the failed handshake gave its slot back
        await strict.aclose()
        lax = ssl.create_default_context()
        lax.check_hostname = False
        lax.verify_mode = ssl.CERT_NONE
        unverified = HttpPool(url, ssl_context=lax)
        try:
            assert (await (await unverified.request("GET", "/")).read()) == b"ok"
        finally:
            await unverified.aclose()


async def test_client_certificate_for_mutual_tls(ca: trustme.CA) -> None:
    async with tls_server(ca, require_client_cert=True) as server:
        url = f"https://127.0.0.1:{server.port}"
        context = trusting(ca)
        ca.issue_cert("gateway@lockgate.test", common_name="lockgate").configure_cert(context)
        pool = HttpPool(url, ssl_context=context)
        try:
            assert (await (await pool.request("GET", "/")).read()) == b"ok"
        finally:
            await pool.aclose()
        assert server.client_certs == ["lockgate"]
