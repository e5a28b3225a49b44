"""Where slabnet's plain transport and the loops' own disagreed, found by
running CPython's event loop tests (create_connection, create_server,
connect_accepted_socket and their Unix variants) with every protocol built
as ``SlabProtocol(app)``, then probing the transport calls those tests make.

Every test runs on the asyncio loop and on uvloop, on loopback sockets, and
bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from conftest import connect_slab as connect

WAKE = 5.0  # seconds any waiter may take to wake


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["write", "writelines", "writelines_empty"])
async def test_empty_write_after_write_eof_raises(
    listener: socket.socket, call: str
) -> None:
    # Both loops' write() checks for write_eof() before it looks at the
    # data: write(b"") (and so writelines() of nothing, or of empty
    # buffers) after write_eof() raises RuntimeError, as any write does.
    # slabnet returned early on an empty write and accepted it silently.
    transport, app, peer = await connect(listener)
    try:
        transport.write_eof()
        with pytest.raises(RuntimeError, match="write_eof"):
            if call == "write":
                transport.write(b"")
            elif call == "writelines":
                transport.writelines([b"", bytearray()])
            else:
                transport.writelines([])
        # The FIN still went out, after nothing.
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(WAKE):
            assert await loop.sock_recv(peer, 16) == b""
        transport.close()
        async with asyncio.timeout(WAKE):
            assert await app.lost is None
    finally:
        peer.close()


@pytest.mark.asyncio
async def test_empty_write_after_close_is_ignored(listener: socket.socket) -> None:
    # The other side of the same rule: after close() (no write_eof()) an
    # empty write is nothing, on both loops, before and after connection_lost
    # on the default loop.
    transport, app, peer = await connect(listener)
    try:
        transport.close()
        assert transport.write(b"") is None
        assert transport.writelines([]) is None
        async with asyncio.timeout(WAKE):
            assert await app.lost is None
    finally:
        peer.close()
