"""Plain TCP streams under a hostile peer or an unlucky caller: regressions
found by auditing the streams API against asyncio's on both loops.

Every test runs on the asyncio loop and on uvloop, on loopback sockets."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, open_fds, server_ctx


def _live_connections() -> int:
    """slabnet connection objects still alive after a full collection."""
    gc.collect()
    names = {"SlabTransport", "TLSTransport"}
    return sum(type(o).__name__ in names for o in gc.get_objects())


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_cancelled_open_connection_leaves_nothing_behind(
    listener: socket.socket, tls: bool, tls_client_context: Any
) -> None:
    # uvloop's create_connection(), cancelled in the iteration where it calls
    # connection_made(), closes its transport without ever calling
    # connection_lost(): the connection was never ended. Over TLS its
    # handshake timer kept it alive (engine, BIOs, transports) until the
    # timeout, one per cancelled connect (wait_for() around open_connection,
    # a TaskGroup); when slabnet sent on a duplicate descriptor, that stayed
    # open too. Cancel at every step of the connect: every descriptor must
    # be closed and no connection left alive.
    host, port = listener.getsockname()
    kw: dict[str, Any] = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
    loop = asyncio.get_running_loop()
    gc.collect()
    baseline = open_fds()
    live = _live_connections()
    for steps in range(10):
        task = asyncio.ensure_future(slabnet.open_connection(host, port, **kw))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            pair = await task
        except asyncio.CancelledError:
            pass
        else:  # (connected before the cancel)
            pair[1].transport.abort()
            del pair
        del task  # (a task keeps its result)
    deadline = loop.time() + 2
    while (left := open_fds() - baseline) > 0 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert left <= 0, f"{left} descriptors left open by cancelled connects"
    await asyncio.sleep(0.05)  # (callbacks the aborts scheduled)
    assert _live_connections() <= live, "cancelled connects left connections alive"


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_abort_after_drain_keeps_what_write_accepted(
    listener: socket.socket, tls: bool, server_cert: Any, tls_client_context: Any
) -> None:
    # A client that sends its last words and resets the connection: asyncio
    # has handed b"bye" to the kernel (over TLS: encrypted and handed) when
    # drain() returns, so the peer gets it before the RST; slabnet's peer
    # got nothing (the write waited for the end-of-iteration flush, and
    # abort() dropped it).
    loop = asyncio.get_running_loop()
    kw: dict[str, Any] = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
    opening = asyncio.ensure_future(slabnet.open_connection(*listener.getsockname(), **kw))
    conn, _ = await loop.sock_accept(listener)
    peer = RawTLS(conn, server_ctx(server_cert), server_side=True) if tls else None
    try:
        if peer is not None:
            await asyncio.wait_for(peer.handshake(), 2)
        _, writer = await asyncio.wait_for(opening, 2)
        writer.write(b"bye")
        await writer.drain()
        writer.transport.abort()
        async with asyncio.timeout(2):
            if peer is not None:
                got = await peer.recv_plain(3)
            else:
                got = b""
                try:
                    while data := await loop.sock_recv(conn, 100):
                        got += data
                except ConnectionResetError:
                    pass
        assert got == b"bye"
    finally:
        conn.close()
