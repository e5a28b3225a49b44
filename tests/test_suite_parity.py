"""Parity found by running CPython 3.11/3.13's test_asyncio/test_ssl.py and
test_sslproto.py and uvloop 0.23's tests/test_tcp.py and test_unix.py with
slabnet's streams swapped in, and stream versions of their protocol tests
(outside this repository). Each test here is written afresh for slabnet's
API.

Real loopback sockets, real TLS (trustme), on both loops.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, server_ctx

pytestmark = pytest.mark.timeout(30)

WAKE = 10.0  # seconds any waiter may take to wake after the event it waits for


async def shut(writer: Any, server: Any) -> None:
    """Close the client's writer and the server, each wait bounded."""
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAKE)
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAKE)


# ------------------------------------------------- STARTTLS with an empty server_hostname


@pytest.mark.asyncio
async def test_start_tls_takes_an_empty_server_hostname(server_cert: Any, tls_ca: Any) -> None:
    """``server_hostname=""`` means no name: no SNI and nothing to check, as
    with ``open_connection(ssl=..., server_hostname="")``. asyncio's and
    uvloop's SSL protocols read an empty name as none, so their
    ``writer.start_tls(ctx, server_hostname="")`` works (CPython's
    test_ssl.py passes ``''`` throughout); slabnet handed ``""`` to
    ``SSLContext.wrap_bio``, which refuses it with ValueError, and the
    upgrade failed."""
    names: list[str | None] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        assert await reader.readexactly(9) == b"STARTTLS\n"
        writer.write(b"GO\n")
        await writer.start_tls(server_ctx(server_cert))
        names.append(writer.get_extra_info("ssl_object").server_hostname)
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = client_ctx(tls_ca)
    ctx.check_hostname = False  # the certificate is still verified
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        writer.write(b"STARTTLS\n")
        assert await asyncio.wait_for(reader.readexactly(3), WAKE) == b"GO\n"
        await asyncio.wait_for(writer.start_tls(ctx, server_hostname=""), WAKE)
        assert writer.get_extra_info("ssl_object").server_hostname is None
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), WAKE) == b"ping"
        assert await asyncio.wait_for(reader.read(), WAKE) == b""
    finally:
        await shut(writer, server)
    assert names == [None]  # the server saw no SNI


@pytest.mark.parametrize("name", [None, ""])
@pytest.mark.asyncio
async def test_start_tls_refuses_to_check_no_name(
    server_cert: Any, tls_ca: Any, name: str | None
) -> None:
    """A client context that checks host names, and no name to check: asyncio's
    ``start_tls`` (both loops) completes the handshake and checks nothing,
    accepting a certificate issued for any host its CA signed. slabnet
    refuses before the upgrade begins, and the plain connection is left as
    it was."""

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(await reader.readexactly(5))
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = client_ctx(tls_ca)
    assert ctx.check_hostname
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        with pytest.raises(ValueError, match="server_hostname"):
            await asyncio.wait_for(writer.start_tls(ctx, server_hostname=name), WAKE)
        assert writer.get_extra_info("ssl_object") is None
        writer.write(b"plain")
        assert await asyncio.wait_for(reader.readexactly(5), WAKE) == b"plain"
        assert await asyncio.wait_for(reader.read(), WAKE) == b""
    finally:
        await shut(writer, server)


# ------------------------------------------------- close() right after a small write


@pytest.mark.parametrize("impl", ["asyncio", "slabnet"])
@pytest.mark.asyncio
async def test_close_hands_gathered_writes_to_the_kernel_at_once(
    listener: socket.socket, impl: str
) -> None:
    """``write(small); close()``: asyncio's ``write()`` has sent the bytes
    already; slabnet gathers small writes for one ``sendmsg`` at the end of
    the loop's turn, and ``close()`` waited for that flush too, so the close
    (and ``wait_closed()``) came turns later than asyncio's. In CPython
    3.12's test_streams.py a handler doing ``write(); close(); await
    wait_closed()`` was then still pending when uvloop's ``Server`` let the
    loop stop ("Task was destroyed but it is pending!"). ``close()`` now
    sends what was gathered at once: the peer can read it before the loop
    runs again, as with asyncio."""
    loop = asyncio.get_running_loop()
    module: Any = asyncio if impl == "asyncio" else slabnet
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(module.open_connection(*listener.getsockname()))
        peer, _ = await loop.sock_accept(listener)
        reader, writer = await opening
    try:
        writer.write(b"last words")
        writer.close()
        # No await since the write: the bytes must be in the kernel already.
        assert peer.recv(64, socket.MSG_DONTWAIT) == b"last words"
        await asyncio.wait_for(writer.wait_closed(), WAKE)
        peer.setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(peer, 64), WAKE) == b""  # then EOF
    finally:
        writer.close()
        peer.close()
