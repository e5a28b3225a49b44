"""Cancellation at every await of the streams API, plain and TLS, on both
loops: regressions found by cancelling each operation after 0, 1, 2, ...
loop iterations and comparing with asyncio's streams.

Real loopback sockets, real TLS (trustme certificates), raw peers whose
bytes the test picks (``conftest.RawTLS``). Tests step by loop iterations
or wait for explicit events; none depends on a sleep being long enough.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, server_ctx

WAKE = 5.0  # seconds any wait may take before the test fails
STEPS = 16  # loop iterations: more than any handshake below takes on loopback


async def peer_sees_the_end(sock: socket.socket) -> None:
    """Read (and drop) until the connection ends: FIN or RST."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        try:
            while await loop.sock_recv(sock, 65536):
                pass
        except ConnectionResetError:
            pass


async def stop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it is done."""
    task.cancel()
    await asyncio.wait([task])


async def open_with_peer(
    listener: socket.socket, tls: bool, server_cert: Any, tls_ca: Any
) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, socket.socket, RawTLS | None]:
    """A slabnet client connected to a raw peer accepted on ``listener``:
    over TLS the peer is a ``RawTLS`` server whose handshake is done."""
    loop = asyncio.get_running_loop()
    kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    opening = asyncio.ensure_future(slabnet.open_connection(*listener.getsockname(), **kw))
    conn, _ = await loop.sock_accept(listener)
    conn.setblocking(False)
    peer = RawTLS(conn, server_ctx(server_cert), server_side=True) if tls else None
    try:
        async with asyncio.timeout(WAKE):
            if peer is not None:
                await peer.handshake()
            reader, writer = await opening
    except BaseException:
        conn.close()
        opening.cancel()
        raise
    return reader, writer, conn, peer


# ------------------------------------------------- STARTTLS cancelled at each step


@pytest.mark.parametrize("api", ["writer", "transport"])
@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_start_tls_cancelled_at_any_step_ends_the_connection(
    listener: socket.socket, server_cert: Any, tls_ca: Any, side: str, api: str
) -> None:
    """asyncio's start_tls closes the transport whenever its await of the
    handshake raises, also when the handshake had just completed and the
    cancellation came before the caller resumed. slabnet aborted only a
    handshake still in progress: cancelled in that iteration, start_tls()
    raised CancelledError on a connection that stayed open, upgraded, and
    that the caller believed abandoned. (``SlabTransport.start_tls`` alike.)"""
    loop = asyncio.get_running_loop()
    done_but_cancelled = 0
    for steps in range(STEPS):
        if side == "client":
            reader, writer = await slabnet.open_connection(*listener.getsockname())
            conn, _ = await loop.sock_accept(listener)
            peer = RawTLS(conn, server_ctx(server_cert), server_side=True)
            ctx, hostname = client_ctx(tls_ca), "localhost"
        else:
            accepted: asyncio.Future[Any] = loop.create_future()

            async def handler(r: slabnet.StreamReader, w: slabnet.StreamWriter) -> None:
                accepted.set_result((r, w))

            server = await slabnet.start_server(handler, "127.0.0.1", 0)
            conn = socket.create_connection(server.sockets[0].getsockname())
            reader, writer = await asyncio.wait_for(accepted, WAKE)
            server.close()
            peer = RawTLS(conn, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
            ctx, hostname = server_ctx(server_cert), None
        handshake = asyncio.ensure_future(peer.handshake())
        plain = writer.transport
        assert isinstance(plain, slabnet.SlabTransport)
        try:
            if api == "writer":
                upgrading = writer.start_tls(ctx, server_hostname=hostname)
            else:
                upgrading = plain.start_tls(
                    ctx, server_side=side == "server", server_hostname=hostname
                )
            upgrade = asyncio.ensure_future(upgrading)
            for _ in range(steps):
                await asyncio.sleep(0)
            if upgrade.done():
                await upgrade  # it completed: the connection is the caller's
                break
            tls = plain.get_protocol()  # (the TLS layer, once start_tls ran)
            shaken = isinstance(tls, slabnet.TLSTransport) and tls.get_extra_info("cipher") is not None
            upgrade.cancel()
            with pytest.raises(asyncio.CancelledError):
                await upgrade
            done_but_cancelled += shaken
            if steps:  # (at step 0 start_tls never ran: nothing to end)
                assert plain.is_closing(), f"step {steps}: a cancelled start_tls left it open"
                assert writer.is_closing()
                await stop(handshake)  # (one reader of the socket at a time)
                await peer_sees_the_end(conn)
        finally:
            await stop(handshake)  # (before its socket's descriptor is reused)
            writer.transport.abort()
            plain.abort()
            conn.close()
    else:
        raise AssertionError(f"start_tls never completed in {STEPS} steps")
    # The iteration that matters was stepped through: the handshake was
    # done, the caller not yet resumed.
    assert done_but_cancelled, "no step cancelled a completed handshake"


# ------------------------------------------------- wait_closed() cancelled


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_a_cancelled_wait_closed_cancels_only_itself(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """``wait_closed()`` awaited the connection's one close future itself,
    as asyncio's does, so cancelling it (a timeout around it) cancelled
    that future: every later ``wait_closed()`` raised CancelledError at
    once, in a task nobody had cancelled, and before the connection was
    closed. Now each await is cancelled alone, and a later one returns once
    the connection is closed."""
    loop = asyncio.get_running_loop()
    for steps in range(4):
        reader, writer, conn, peer = await open_with_peer(listener, tls, server_cert, tls_ca)
        try:
            async with asyncio.timeout(WAKE):
                # Waits for a close nobody has asked for yet.
                waiting = asyncio.ensure_future(writer.wait_closed())
                for _ in range(steps):
                    await asyncio.sleep(0)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                again = asyncio.ensure_future(writer.wait_closed())
                await asyncio.sleep(0)
                assert not again.done(), f"step {steps}: {again!r} before close()"
                writer.close()
                if peer is not None:  # (over TLS the close waits for the peer's close_notify)
                    await peer.recv_plain(0)
                    await peer.send(peer.close_notify())
                await again  # returns, once closed
                assert writer.transport.get_protocol() is None  # (connection_lost ran)
        finally:
            conn.close()
            writer.transport.abort()


# ------------------------------------------------- drain() cancelled by a timeout


@pytest.mark.parametrize("how", ["timeout", "wait_for"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_drain_cancelled_by_a_timeout_at_any_step_loses_nothing(
    server_cert: Any, tls_ca: Any, tls: bool, how: str
) -> None:
    """A drain() waiting on a peer that does not read, cancelled by
    ``asyncio.timeout()`` (the deadline moved to now: it fires in the next
    iteration) or around ``asyncio.wait_for()`` after 0, 1, 2, ...
    iterations, while a second task drains too: as with asyncio, only the
    cancelled one raises; the other returns once the peer reads, a later
    drain(), close() and wait_closed() work, every byte arrives once, and
    nothing reaches the loop's exception handler."""
    loop = asyncio.get_running_loop()
    contexts: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: contexts.append(context))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (inherited)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    blob = bytes(range(256)) * 4096  # far more than both kernels hold
    try:
        for steps in range(8):
            reader, writer, conn, peer = await open_with_peer(listener, tls, server_cert, tls_ca)
            try:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                writer.write(blob)
                _, high = writer.transport.get_write_buffer_limits()
                assert writer.transport.get_write_buffer_size() > high
                deadlines: list[asyncio.Timeout] = []

                async def drain_with_deadline() -> None:
                    if how == "timeout":
                        async with asyncio.timeout(None) as deadline:
                            deadlines.append(deadline)
                            await writer.drain()
                    else:
                        await asyncio.wait_for(writer.drain(), 3600)

                cancelled = asyncio.ensure_future(drain_with_deadline())
                other = asyncio.ensure_future(writer.drain())
                for _ in range(steps):
                    await asyncio.sleep(0)
                if deadlines:
                    deadlines[0].reschedule(loop.time() - 1)
                else:
                    cancelled.cancel()
                await asyncio.wait([cancelled], timeout=WAKE)
                with pytest.raises(TimeoutError if deadlines else asyncio.CancelledError):
                    await cancelled
                assert not other.done(), f"step {steps}: {other!r}"
                writer.write(b"tail")
                later = asyncio.ensure_future(writer.drain())
                expected = blob + b"tail"
                got = bytearray()
                async with asyncio.timeout(WAKE):
                    while len(got) < len(expected):
                        if peer is not None:
                            got += await peer.recv_plain(min(65536, len(expected) - len(got)))
                        else:
                            got += await loop.sock_recv(conn, 65536)
                    await other
                    await later
                    writer.close()
                    if peer is not None:
                        await peer.recv_plain(0)
                        await peer.send(peer.close_notify())
                    await writer.wait_closed()
                assert got == expected, f"step {steps}"
            finally:
                conn.close()
                writer.transport.abort()
    finally:
        listener.close()
        loop.set_exception_handler(None)
    assert contexts == []
