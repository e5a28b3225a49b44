"""TLS parity: behaviour that asyncio's SSL transport and uvloop's share and
slabnet did not, found by running CPython's and uvloop's own TLS test
suites with slabnet swapped in (outside this repository). Each test here
is written afresh for slabnet's API.

Real loopback sockets, real TLS (trustme), on both loops; raw peers
(``conftest.RawTLS`` or a plain socket) where the test must see the wire.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, server_ctx

pytestmark = pytest.mark.timeout(30)

WAKE = 10.0  # seconds any waiter may take to wake after the event it waits for


async def accept(listener: socket.socket) -> socket.socket:
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    return conn


async def read_to_end(sock: socket.socket) -> bytes:
    """Every byte until the other side's FIN (a reset counts as the end)."""
    loop = asyncio.get_running_loop()
    out = bytearray()
    try:
        while data := await asyncio.wait_for(loop.sock_recv(sock, 65536), WAKE):
            out += data
    except ConnectionResetError:
        pass
    return bytes(out)


# ------------------------------------------------- the peer's FIN without close_notify


@pytest.mark.asyncio
async def test_no_close_notify_goes_to_a_peer_that_sent_its_fin(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    """A peer that half-closes TCP without close_notify has left TLS: asyncio
    and uvloop then close without a close_notify of their own (sslproto's
    ``_do_shutdown`` skips ``unwrap()`` once ``eof_received`` ran), so the
    peer, still reading its socket, sees the FIN and nothing else. slabnet
    answered with a close_notify record the peer never asked for."""
    port = listener.getsockname()[1]
    opening = asyncio.ensure_future(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
    ))
    tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
    try:
        await tls.handshake()
        reader, writer = await opening
        await tls.send(tls.seal(b"last words"))
        tls.sock.shutdown(socket.SHUT_WR)  # FIN, no close_notify
        assert await asyncio.wait_for(reader.read(), WAKE) == b"last words"
        writer.close()
        await writer.wait_closed()
        assert await read_to_end(tls.sock) == b""
    finally:
        tls.sock.close()


# ------------------------------------------------- the shutdown timeout's message


@pytest.mark.asyncio
async def test_shutdown_timeout_says_what_asyncio_says(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    """A peer that never answers our close_notify: asyncio and uvloop end
    the connection with ``TimeoutError("SSL shutdown timed out")``, and code
    (uvloop's own tests among it) matches those words. slabnet's class was
    right but its message was its own."""
    port = listener.getsockname()[1]
    opening = asyncio.ensure_future(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost",
        ssl_shutdown_timeout=0.2,
    ))
    tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
    try:
        await tls.handshake()
        reader, writer = await opening
        writer.close()  # the peer reads nothing: no close_notify comes back
        with pytest.raises(TimeoutError, match="SSL shutdown timed out"):
            await asyncio.wait_for(reader.read(), WAKE)
        assert isinstance(reader.exception(), slabnet.ShutdownTimeoutError)
    finally:
        tls.sock.close()


# ------------------------------------------------- eof_received after our close()


class Recorder(slabnet.ChunkProtocol):
    def __init__(self, lost: asyncio.Future[None]) -> None:
        self.events: list[str] = []
        self.lost = lost
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.events.append("made")
        self.transport = transport

    def chunk_received(self, chunk: memoryview) -> None:
        self.events.append("chunk")

    def eof_received(self) -> bool | None:
        self.events.append("eof")
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append(f"lost {exc!r}")
        self.lost.set_result(None)


@pytest.mark.asyncio
async def test_eof_received_follows_close_when_the_peer_answers(
    server_cert: Any, tls_ca: Any
) -> None:
    """After the app's own ``close()``, the peer's close_notify ends its side
    of the connection: asyncio and uvloop call the protocol's
    ``eof_received()`` then, before ``connection_lost(None)``, and a protocol
    may wait for it (uvloop's tests do). slabnet went straight to
    ``connection_lost``."""
    loop = asyncio.get_running_loop()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await reader.read()  # to our close_notify, which the server answers
        writer.close()

    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    try:
        lost = loop.create_future()
        app = Recorder(lost)
        waiter = loop.create_future()
        port = server.sockets[0].getsockname()[1]
        raw, _ = await loop.create_connection(
            lambda: slabnet.SlabProtocol(
                app, loop=loop, ssl=client_ctx(tls_ca), server_hostname="localhost",
                handshake_waiter=waiter,
            ),
            "127.0.0.1", port,
        )
        try:
            await waiter
            assert isinstance(app.transport, slabnet.TLSTransport)
            app.transport.close()
            await asyncio.wait_for(lost, WAKE)
        finally:
            raw.abort()
        assert app.events == ["made", "eof", "lost None"]
    finally:
        server.close()
        await server.wait_closed()


# ------------------------------------------------- STARTTLS refused, bytes kept


@pytest.mark.parametrize(
    "bad", [{"ssl_handshake_timeout": 0}, {"ssl_shutdown_timeout": -1}],
    ids=["handshake_timeout", "shutdown_timeout"],
)
@pytest.mark.asyncio
async def test_refused_start_tls_keeps_what_the_reader_holds(
    listener: socket.socket, tls_ca: Any, bad: dict[str, float]
) -> None:
    """``writer.start_tls()`` with an argument asyncio refuses (ValueError)
    leaves the plain connection as it was, bytes the reader holds included:
    they are still the app's to read. slabnet took them out of the reader
    (for the TLS layer) before the arguments were checked, and dropped them."""
    loop = asyncio.get_running_loop()
    reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    conn = await accept(listener)
    try:
        await loop.sock_sendall(conn, b"hello")  # one segment: one read
        assert await asyncio.wait_for(reader.readexactly(1), WAKE) == b"h"
        with pytest.raises(ValueError, match="should be a positive number"):
            await writer.start_tls(client_ctx(tls_ca), server_hostname="localhost", **bad)
        assert not isinstance(writer.transport, slabnet.TLSTransport)
        conn.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(reader.read(), WAKE) == b"ello"
    finally:
        conn.close()
        writer.close()
        await writer.wait_closed()
