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
from conftest import open_fds


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_cancelled_open_connection_leaves_no_descriptor(
    listener: socket.socket, tls: bool, tls_client_context: Any
) -> None:
    # uvloop's create_connection(), cancelled in the iteration where it calls
    # connection_made(), closes its transport without ever calling
    # connection_lost(): slabnet's duplicate descriptor stayed open until the
    # cyclic garbage collector found it (with a ResourceWarning), one per
    # cancelled connect (wait_for() around open_connection, a TaskGroup).
    # Cancel at every step of the connect; with the collector off, every
    # descriptor must still be closed.
    host, port = listener.getsockname()
    kw: dict[str, Any] = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
    loop = asyncio.get_running_loop()
    gc.collect()
    baseline = open_fds()
    gc.disable()
    try:
        for steps in range(10):
            task = asyncio.ensure_future(slabnet.open_connection(host, port, **kw))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                _, writer = await task
            except asyncio.CancelledError:
                pass
            else:  # (connected before the cancel)
                writer.transport.abort()
        deadline = loop.time() + 2
        while (left := open_fds() - baseline) > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert left <= 0, f"{left} descriptors left open by cancelled connects"
    finally:
        gc.enable()


@pytest.mark.xfail(
    strict=True,
    reason="write path (SlabTransport, being rewritten separately): a small write is"
    " held in the BufferPool until the end-of-iteration flush, drain() does not"
    " flush it, and abort() drops it although write() returned None (accepted)",
)
@pytest.mark.asyncio
async def test_abort_after_drain_keeps_what_write_accepted(listener: socket.socket) -> None:
    # A server that answers with an error and resets the connection: asyncio
    # has handed b"bye" to the kernel when drain() returns, so the peer gets
    # it before the RST; slabnet's peer got nothing.
    loop = asyncio.get_running_loop()
    _, writer = await slabnet.open_connection(*listener.getsockname())
    conn, _ = await loop.sock_accept(listener)
    try:
        writer.write(b"bye")
        await writer.drain()
        writer.transport.abort()
        got = b""
        async with asyncio.timeout(2):
            try:
                while data := await loop.sock_recv(conn, 100):
                    got += data
            except ConnectionResetError:
                pass
        assert got == b"bye"
    finally:
        conn.close()
