"""STARTTLS against a peer that is gone and an app that passes the wrong
thing, on the server side of ``writer.start_tls()`` and of asyncio's own
``loop.start_tls()`` over a slabnet transport: each ends as asyncio's
transports end it (at once, with its exception), and an upgrade refused
before it starts leaves the plain connection as it was.

Real loopback sockets; the client is a raw socket whose bytes the test
picks, and its ClientHello is a real one (an ``SSLObject``'s first flight).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, server_ctx
from test_asyncio_parity import until

WAKE = 5.0  # seconds any waiter may take to wake (a handshake timeout is 60)

Handler = Callable[[Any, Any], Awaitable[None]]


def client_hello(tls_ca: Any) -> bytes:
    """A TLS client's first flight."""
    obj = client_ctx(tls_ca).wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(),
                                      server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


@asynccontextmanager
async def served(opener: Any, handler: Handler) -> AsyncIterator[socket.socket]:
    """A raw client socket connected to ``opener.start_server(handler)``."""
    loop = asyncio.get_running_loop()
    server = await opener.start_server(handler, "127.0.0.1", 0)
    client = socket.socket()
    client.setblocking(False)
    try:
        async with asyncio.timeout(WAKE):
            await loop.sock_connect(client, server.sockets[0].getsockname())
        yield client
    finally:
        client.close()
        server.close()


async def settle(
    upgrade: Awaitable[None], writer: Any, outcome: asyncio.Future[BaseException | None]
) -> None:
    """Await ``upgrade`` in a handler: what it raised (None if nothing) is
    the outcome; the connection is closed after it."""
    try:
        await upgrade
    except Exception as exc:
        outcome.set_result(exc)
    else:
        outcome.set_result(None)
    finally:
        writer.close()


# ------------------------------------------------- the peer's FIN came first


@pytest.mark.parametrize("hello", [False, True], ids=["fin", "hello_then_fin"])
@pytest.mark.parametrize("opener", [asyncio, slabnet], ids=["asyncio", "slabnet"])
@pytest.mark.asyncio
async def test_a_fin_before_the_upgrade_fails_it_at_once(
    server_cert: Any, tls_ca: Any, opener: Any, hello: bool
) -> None:
    # The client sent STARTTLS (maybe its ClientHello right behind) and its
    # FIN before the server upgraded. The reader kept the connection open,
    # half-closed, so the FIN had gone to the stream: the new TLS layer
    # was never told, and the handshake waited for its timeout (60 s by
    # default) before HandshakeTimeoutError. asyncio's transports read the
    # FIN again when the upgrade resumes reading: ConnectionResetError at
    # once.
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()

    async def handler(reader: Any, writer: Any) -> None:
        async def upgrade() -> None:
            assert await reader.readline() == b"STARTTLS\r\n"
            await until(lambda: bool(reader._eof), "the FIN reached the stream")
            await writer.start_tls(server_ctx(server_cert), ssl_handshake_timeout=60)

        await settle(upgrade(), writer, outcome)

    async with served(opener, handler) as client:
        wire = b"STARTTLS\r\n" + (client_hello(tls_ca) if hello else b"")
        await loop.sock_sendall(client, wire)
        client.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(WAKE):
            raised = await outcome
    assert isinstance(raised, ConnectionResetError), raised


# ------------------------------------------------- asyncio's SSLProtocol over slabnet


@pytest.mark.parametrize("fault", ["garbage", "fin"])
@pytest.mark.asyncio
async def test_loop_start_tls_over_slabnet_fails_as_over_the_loops_transport(
    server_cert: Any, loop_name: str, fault: str
) -> None:
    # asyncio's SSLProtocol ends a failed handshake (and a shutdown that
    # times out) with transport._force_close(exc), which SlabTransport did
    # not have: a bad ClientHello made loop.start_tls() raise
    # AttributeError, and a handshake timeout raised it in a loop callback,
    # so start_tls() never returned and the connection stayed open. A FIN
    # that came before the upgrade was never told to the SSLProtocol.
    # uvloop's start_tls() takes only its own transports (the README).
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()
    transports: list[asyncio.BaseTransport] = []

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        async def upgrade() -> None:
            assert await reader.readline() == b"STARTTLS\r\n"
            if fault == "fin":
                await until(lambda: reader._eof, "the FIN reached the stream")
            transports.append(writer.transport)
            writer.write(b"220 go ahead\r\n")  # (sent once the SSLProtocol reads)
            protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
            await loop.start_tls(writer.transport, protocol, server_ctx(server_cert),
                                 server_side=True, ssl_handshake_timeout=60)

        await settle(upgrade(), writer, outcome)

    async with served(slabnet, handler) as client:
        await loop.sock_sendall(client, b"STARTTLS\r\n")
        if fault == "fin":
            client.shutdown(socket.SHUT_WR)
        else:
            async with asyncio.timeout(WAKE):
                assert await loop.sock_recv(client, 100) == b"220 go ahead\r\n"
            await loop.sock_sendall(client, b"\x16\x03\x01\x00\x05hello" * 4)
        async with asyncio.timeout(WAKE):
            raised = await outcome
    if loop_name == "uvloop":
        assert isinstance(raised, TypeError) and "not supported by start_tls" in str(raised)
        return
    if fault == "garbage":
        assert isinstance(raised, ssl.SSLError), raised
    else:
        assert isinstance(raised, ConnectionResetError), raised
    assert transports[0].is_closing()


@pytest.mark.asyncio
async def test_loop_start_tls_over_slabnet_reports_an_untrusted_server(
    listener: socket.socket, tls_ca: Any, loop_name: str
) -> None:
    # The client side of the same (nats-py upgrades so): a certificate that
    # fails verification raised AttributeError, not SSLCertVerificationError.
    import trustme

    loop = asyncio.get_running_loop()
    stranger = trustme.CA().issue_cert("localhost")  # (not signed by tls_ca)
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(slabnet.open_connection(*listener.getsockname()))
        peer, _ = await loop.sock_accept(listener)
        reader, writer = await opening
    peer.setblocking(False)

    async def serve() -> None:
        obj = server_ctx(stranger).wrap_bio(incoming := ssl.MemoryBIO(),
                                            outgoing := ssl.MemoryBIO(), server_side=True)
        while True:
            try:
                obj.do_handshake()
                return
            except ssl.SSLWantReadError:
                await loop.sock_sendall(peer, outgoing.read())
                data = await loop.sock_recv(peer, 65536)
                if not data:
                    return
                incoming.write(data)

    serving = asyncio.create_task(serve())
    try:
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
        async with asyncio.timeout(WAKE):
            with pytest.raises(Exception) as info:
                await loop.start_tls(writer.transport, protocol, client_ctx(tls_ca),
                                     server_hostname="localhost")
        if loop_name == "uvloop":
            assert isinstance(info.value, TypeError)
            return
        assert isinstance(info.value, ssl.SSLCertVerificationError), info.value
        assert writer.transport.is_closing()
    finally:
        writer.close()
        peer.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


class Collecting(asyncio.Protocol):
    """What the session that ``loop.start_tls()`` made delivers."""

    def __init__(self) -> None:
        self.got = bytearray()

    def data_received(self, data: bytes) -> None:
        self.got += data


@pytest.mark.parametrize("name", ["localhost", "wrong.example"], ids=["ok", "mismatch"])
@pytest.mark.asyncio
async def test_loop_start_tls_runs_inside_a_slabnet_tls_session(
    server_cert: Any, tls_ca: Any, loop_name: str, name: str
) -> None:
    # loop.start_tls() on a slabnet TLS transport: the asyncio loop takes
    # its own TLS transports there (TLS inside TLS, as a client reaches a
    # TLS destination through a TLS proxy), and slabnet's plain ones, but
    # refused slabnet's TLS transport with TypeError ("transport ... is not
    # supported by start_tls()"). A failed inner handshake ends the
    # connection with its error, as on the plain transport. uvloop's
    # start_tls() takes only uvloop's transports (the README).
    loop = asyncio.get_running_loop()
    peer: asyncio.Future[tuple[Any, Any]] = loop.create_future()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            await writer.start_tls(server_ctx(server_cert))  # the inner session
            peer.set_result((reader, writer))
        except Exception as exc:
            peer.set_exception(exc)
            writer.close()

    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    async with asyncio.timeout(WAKE):
        reader, writer = await slabnet.open_connection(
            *server.sockets[0].getsockname(), ssl=client_ctx(tls_ca), server_hostname="localhost")
    try:
        app = Collecting()
        upgrade = loop.start_tls(writer.transport, app, client_ctx(tls_ca), server_hostname=name)
        async with asyncio.timeout(WAKE):
            if loop_name == "uvloop":
                with pytest.raises(TypeError, match="not supported by start_tls"):
                    await upgrade
                return
            if name != "localhost":
                with pytest.raises(ssl.SSLCertVerificationError):
                    await upgrade
                assert writer.transport.is_closing()
                with pytest.raises((ssl.SSLError, ConnectionResetError)):
                    await peer  # (the client's alert, or none: asyncio's before 3.13)
                return
            inner = await upgrade
            peer_reader, peer_writer = await peer
            inner.write(b"ping" * 100_000)
            assert await peer_reader.readexactly(400_000) == b"ping" * 100_000
            peer_writer.write(b"pong")
            await until(lambda: app.got == b"pong", "the inner session's reply")
            assert writer.transport.get_protocol() is not app  # (its SSLProtocol)
            assert inner.get_protocol() is app
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


# ------------------------------------------------- an upgrade refused before it starts


@pytest.mark.parametrize("context", ["none", "client_context"])
@pytest.mark.asyncio
async def test_an_upgrade_refused_leaves_the_plain_connection_as_it_was(
    tls_ca: Any, context: str
) -> None:
    # start_tls(None) raised AttributeError from inside the TLS layer,
    # after the connection had changed hands: it was closed, and the bytes
    # the reader held were lost. asyncio raises TypeError before anything
    # changes. A client context on the server side (ssl.SSLError from
    # OpenSSL) is refused as early now.
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[tuple[BaseException, bytes]] = loop.create_future()
    bad = None if context == "none" else client_ctx(tls_ca)

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            assert await reader.readline() == b"STARTTLS\r\n"
            await until(lambda: reader._size >= 5, "the pipelined bytes arrived")
            try:
                await writer.start_tls(bad)  # type: ignore[arg-type]
            except Exception as exc:
                writer.write(b"still plain\n")
                await writer.drain()
                outcome.set_result((exc, await reader.readexactly(5)))
        except Exception as exc:
            outcome.set_exception(exc)
        finally:
            writer.close()

    async with served(slabnet, handler) as client:
        await loop.sock_sendall(client, b"STARTTLS\r\nhello")
        async with asyncio.timeout(WAKE):
            raised, kept = await outcome
            assert await loop.sock_recv(client, 100) == b"still plain\n"
    if context == "none":
        assert isinstance(raised, TypeError)
        assert str(raised) == "sslcontext is expected to be an instance of ssl.SSLContext, got None"
    else:
        assert isinstance(raised, ssl.SSLError)
    assert kept == b"hello"


# ------------------------------------------------- the STARTTLS recipe from before 3.11


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_the_stream_starttls_recipe_with_loop_start_tls(
    server_cert: Any, tls_ca: Any, loop_name: str, side: str
) -> None:
    """Before ``StreamWriter.start_tls()`` (3.11), streams were upgraded so:
    ``tr = await loop.start_tls(writer.transport,
    writer.transport.get_protocol(), ctx)``, then ``writer._transport = tr``
    (SMTP servers and clients, proxies). asyncio's SSLProtocol hands the
    stream's protocol the decrypted bytes with ``data_received()``, which
    slabnet's had not: the handshake completed, and the first TLS data
    failed the connection with AttributeError. The peer is asyncio's own
    ``start_tls()``, on the other side. uvloop's start_tls() takes only its
    own transports (the README)."""
    loop = asyncio.get_running_loop()
    ours = slabnet if side == "server" else asyncio
    theirs = asyncio if side == "server" else slabnet
    answer: asyncio.Future[bytes] = loop.create_future()

    async def recipe(reader: Any, writer: Any, ctx: ssl.SSLContext, **kw: Any) -> bytes:
        transport = await loop.start_tls(
            writer.transport, writer.transport.get_protocol(), ctx, **kw)
        writer._transport = transport
        writer.write(b"from the recipe\r\n")
        line = await reader.readline()
        eof = await reader.read()  # the peer's close_notify: EOF, no warning
        assert eof == b"", eof
        writer.close()
        return bytes(line)

    async def upgraded(reader: Any, writer: Any) -> None:
        """The other side, with asyncio's own ``writer.start_tls()``."""
        assert await reader.readline() == b"from the recipe\r\n"
        writer.write(b"from start_tls\r\n")
        await writer.drain()
        writer.close()

    async def handler(reader: Any, writer: Any) -> None:
        try:
            assert await reader.readline() == b"STARTTLS\r\n"
            writer.write(b"220 go ahead\r\n")
            await writer.drain()
            if side == "server":
                # slabnet's writer, the recipe.
                answer.set_result(await recipe(
                    reader, writer, server_ctx(server_cert), server_side=True))
            else:
                await writer.start_tls(server_ctx(server_cert))
                await upgraded(reader, writer)
        except BaseException as exc:
            if not answer.done():
                answer.set_exception(exc)
            writer.close()

    server = await ours.start_server(handler, "127.0.0.1", 0)
    try:
        async with asyncio.timeout(WAKE):
            reader, writer = await theirs.open_connection(*server.sockets[0].getsockname())
            writer.write(b"STARTTLS\r\n")
            assert await reader.readline() == b"220 go ahead\r\n"
            if side == "client":
                outcome = asyncio.ensure_future(recipe(
                    reader, writer, client_ctx(tls_ca), server_hostname="localhost"))
            else:
                outcome = asyncio.ensure_future(answer)
                upgrade = writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
                if loop_name == "uvloop":
                    upgrade.close()  # (the server's upgrade fails first)
                else:
                    await upgrade
                    await upgraded(reader, writer)
            if loop_name == "uvloop":
                with pytest.raises(TypeError, match="not supported by start_tls"):
                    await outcome
                return
            assert await outcome == b"from start_tls\r\n"
    finally:
        writer.close()
        server.close()
