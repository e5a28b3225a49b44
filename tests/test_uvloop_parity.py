"""Where slabnet's plain transport and the loops' own disagreed, found by
running uvloop's TCP and Unix socket tests with slabnet swapped in (its
streams for asyncio's, ``SlabProtocol(app)`` for the protocol factories).

Every test runs on the asyncio loop and on uvloop, on loopback sockets, and
bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

import slabnet
from conftest import connect_slab as connect
from conftest import wait_acked

WAKE = 5.0  # seconds any waiter may take to wake


async def a_few_iterations() -> None:
    """Long enough for the loop to have read what its socket holds."""
    for _ in range(10):
        await asyncio.sleep(0.002)


@pytest.mark.asyncio
async def test_abort_stops_reading(listener: socket.socket) -> None:
    # Both loops' transports say is_reading() False from close() or abort()
    # on: they read nothing more. slabnet's said True after abort() until
    # connection_lost, as if a pause_reading()/resume_reading() pair still
    # meant something.
    transport, app, peer = await connect(listener)
    try:
        assert transport.is_reading()
        transport.abort()
        assert transport.is_closing()
        assert not transport.is_reading()
        transport.resume_reading()  # (a no-op now, as on both loops)
        assert not transport.is_reading()
        async with asyncio.timeout(WAKE):
            await app.lost
        assert not transport.is_reading()
    finally:
        peer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["close", "abort"])
async def test_nothing_is_delivered_after_close_or_abort(
    listener: socket.socket, end: str
) -> None:
    # Bytes that came while the app had paused reading, then close() or
    # abort(): the loops never read them ("no more data will be received"
    # after close(), asyncio's docs say). On the asyncio loop slabnet had
    # already read them into its paused-read buffer (it pauses the socket
    # lazily) and handed them to chunk_received from connection_lost, after
    # the app had closed; on uvloop it did not. Now neither loop does.
    transport, app, peer = await connect(listener)
    try:
        transport.pause_reading()
        await a_few_iterations()
        await asyncio.get_running_loop().sock_sendall(peer, b"late")
        await wait_acked(peer)  # in our kernel's receive queue
        await a_few_iterations()
        getattr(transport, end)()
        async with asyncio.timeout(WAKE):
            await app.lost
        lost = None if end == "close" else slabnet.LocalAbortError
        assert app.events == ["made", ("lost", lost)]
    finally:
        peer.close()


@pytest.mark.asyncio
async def test_eof_waits_for_resume_reading(listener: socket.socket) -> None:
    # A paused transport reads nothing, EOF included: the loops tell the
    # protocol of the peer's FIN only after resume_reading(). On the asyncio
    # loop slabnet's next read while paused found the FIN and called
    # eof_received at once, and, since the app did not keep the connection
    # half-open, closed it: connection_lost came while the app still had
    # reading paused (on uvloop it came after resume_reading(), as the
    # loops' own).
    transport, app, peer = await connect(listener)
    try:
        transport.pause_reading()
        await a_few_iterations()
        peer.shutdown(socket.SHUT_WR)
        await a_few_iterations()
        await a_few_iterations()
        assert app.events == ["made"]
        assert not transport.is_closing()
        transport.resume_reading()
        async with asyncio.timeout(WAKE):
            await app.lost
        assert app.events == ["made", "eof", ("lost", None)]
    finally:
        peer.close()


@pytest.mark.asyncio
async def test_data_then_eof_while_paused_keep_their_order(listener: socket.socket) -> None:
    # (Kept working through the fix above.) Data, then the FIN, both while
    # paused: every byte comes first, then eof_received, after resume.
    transport, app, peer = await connect(listener)
    payload = bytes(range(256)) * 20
    try:
        transport.pause_reading()
        await a_few_iterations()
        await asyncio.get_running_loop().sock_sendall(peer, payload)
        peer.shutdown(socket.SHUT_WR)
        await a_few_iterations()
        assert app.events == ["made"]
        transport.resume_reading()
        async with asyncio.timeout(WAKE):
            await app.lost
        assert app.events[0] == "made" and app.events[-2:] == ["eof", ("lost", None)]
        assert b"".join(e for e in app.events if isinstance(e, bytes)) == payload
    finally:
        peer.close()
