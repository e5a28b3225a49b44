"""Connections that end in an error are freed with their last reference too.

``test_lifetime.py`` checks that a connection closed normally leaves nothing
for the cyclic garbage collector. These tests take the paths that end in an
error -- a send the kernel refuses, a failed or timed-out TLS handshake, a
record that does not decrypt, a refused connect, a reset the loop reads --
where slabnet keeps the error to deliver it later: an error whose traceback
holds slabnet's own frames, kept on the object those frames belong to, is a
cycle that holds the connection (its SSLObject, the data a failed send was
given) until a collection of the oldest generation; one whose traceback
holds the loop's read frame pins the read's buffer, a slab, while it lives.

Each test does one cycle of the path first (what a loop sets up once), then
turns the collector off, runs the path a few times and counts slabnet's
objects: reachable or in a cycle, the collector being off, they are all in
``gc.get_objects()``. The tests catch errors with ``try``/``except``, never
``pytest.raises``, whose ``ExceptionInfo`` local is a cycle of its own
(frame, info, error, traceback, frame).

Every test runs on the asyncio loop and on uvloop, on loopback sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import ssl
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

import slabnet
from conftest import connect_raw_tls, connect_slab, hard_close

WAKE = 5.0  # seconds any wait may take before the test fails
ROUNDS = 3  # cycles of a path with the collector off


def _alive() -> Counter[str]:
    """slabnet's objects, and the ``SSLObject``\\ s under its TLS engines.
    The loop's read slabs are left out: a per-loop cache with its own bound
    (``memory_stats()``, tests/test_slab.py)."""
    return Counter(
        type(o).__name__ for o in gc.get_objects()
        if (type(o) in _SLABNET_TYPES and type(o).__name__ != "_Slab")
        or type(o) is ssl.SSLObject
    )


def _classes(module: object) -> set[type]:
    return {c for c in vars(module).values() if isinstance(c, type)}


#: Every class defined in slabnet's modules.
_SLABNET_TYPES: frozenset[type] = frozenset().union(*(
    {c for c in _classes(m) if c.__module__ == m.__name__}
    for name, m in list(sys.modules.items()) if name.startswith("slabnet")
))


async def _left_by(path: Callable[[], Awaitable[None]]) -> Counter[str]:
    """What ``ROUNDS`` runs of ``path`` leave alive with the collector off,
    after a first run with it on. Leftovers get ``WAKE`` seconds to go (the
    other end of a connection may still be closing): the verdict does not
    depend on how long that takes."""
    await asyncio.wait_for(path(), WAKE)
    await asyncio.sleep(0)
    gc.collect()
    gc.disable()
    try:
        before = _alive()
        for _ in range(ROUNDS):
            await asyncio.wait_for(path(), WAKE)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAKE
        while (left := _alive() - before) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return left
    finally:
        gc.enable()


def _shut_down_sending(transport: asyncio.BaseTransport) -> None:
    """Make every later send on the connection fail with EPIPE, at once and
    whatever the kernel's buffers: shut its write side down under it."""
    fd = transport.get_extra_info("socket").fileno()
    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.shutdown(socket.SHUT_WR)


@contextlib.asynccontextmanager
async def _serving(
    handler: Callable[[slabnet.StreamReader, slabnet.StreamWriter], Awaitable[None]],
    ctx: ssl.SSLContext,
) -> AsyncIterator[asyncio.Server]:
    """A slabnet TLS server on loopback running ``handler``; closed on exit."""
    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


async def _no_handshake_may_pass(
    reader: slabnet.StreamReader, writer: slabnet.StreamWriter
) -> None:
    raise AssertionError("the handshake passed")


@pytest.mark.parametrize("size", [100_000, 100], ids=["direct", "gathered"])
@pytest.mark.asyncio
async def test_a_failed_send_leaves_no_cycle(listener: socket.socket, size: int) -> None:
    # The kernel refuses a send (EPIPE here; ECONNRESET after a peer's
    # reset): the error ends the connection. It was caught in the frame of
    # the send -- which holds the transport and the data being sent (a
    # large write's own buffer, or the queue of gathered writes) -- and
    # kept on the transport for connection_lost: a cycle, on main, that
    # held the unsent bytes of every such connection for the collector.
    async def path() -> None:
        tr, app, peer = await connect_slab(listener)
        try:
            _shut_down_sending(tr)
            tr.write(b"x" * size)  # (100 bytes: gathered, sent at the end of the iteration)
            exc = await asyncio.wait_for(app.lost, WAKE)
            assert isinstance(exc, BrokenPipeError), exc
        finally:
            peer.close()

    left = await _left_by(path)
    assert not left, f"a failed send left a cycle: {dict(left)}"


@pytest.mark.asyncio
async def test_a_failed_handshake_leaves_no_cycle_on_the_server(
    tls_server_context: ssl.SSLContext,
) -> None:
    # A client that does not trust the server's certificate says so with
    # an alert: the server's handshake fails with an ssl.SSLError, which
    # the engine keeps (BROKEN) and the TLS layer keeps for connection_lost.
    # Its traceback held both's frames: on main every such handshake -- a
    # public server sees them from scanners and misconfigured clients all
    # the time -- left its SSLObject for the collector.
    async with _serving(_no_handshake_may_pass, tls_server_context) as server:
        loop = asyncio.get_running_loop()

        async def path() -> None:
            distrust = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # (no CA: verification fails)
            async with connect_raw_tls(server.sockets[0].getsockname(), distrust) as peer:
                try:
                    await peer.handshake()
                except ssl.SSLCertVerificationError:
                    await peer.flush()  # the alert
                else:
                    raise AssertionError("the client trusted the certificate")
                # (Until the server ends the connection.)
                while await loop.sock_recv(peer.sock, 65536):
                    pass

        left = await _left_by(path)
    assert not left, f"a failed handshake left a cycle: {dict(left)}"


@pytest.mark.asyncio
async def test_a_broken_record_leaves_no_cycle(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext
) -> None:
    # After the handshake: a record that does not decrypt ends the read
    # side with the engine's ssl.SSLError (bad record mac), kept by the
    # engine, by the TLS layer and by the app's reader. On main its
    # traceback held the engine's read frames -- and the TLS layer's -- and
    # the connection waited for the collector.
    held: list[slabnet.StreamWriter] = []
    served = asyncio.Event()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        held.append(writer)  # (reads nothing: the error is raised in no frame of ours)
        served.set()

    async with _serving(handler, tls_server_context) as server:
        loop = asyncio.get_running_loop()

        async def path() -> None:
            try:
                address = server.sockets[0].getsockname()
                async with connect_raw_tls(address, tls_client_context) as peer:
                    await peer.handshake()
                    await served.wait()
                    await peer.send(b"\x17\x03\x03\x00\x20" + bytes(32))
                    try:
                        while await loop.sock_recv(peer.sock, 65536):
                            pass
                    except ConnectionResetError:
                        pass
            finally:
                held.clear()
                served.clear()

        left = await _left_by(path)
    assert not left, f"a broken record left a cycle: {dict(left)}"


@pytest.mark.parametrize("failure", ["certificate", "timeout"])
@pytest.mark.asyncio
async def test_a_failed_open_connection_leaves_no_cycle(
    listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext, failure: str,
) -> None:
    # open_connection() raises the handshake's error, which its waiter
    # holds, from a frame that held the waiter (and the connection's
    # protocol, which holds it too): on main a cycle for every failed
    # connect, with the connection's SSLObject in it.
    async with _serving(_no_handshake_may_pass, tls_server_context) as server:
        loop = asyncio.get_running_loop()

        async def path() -> None:
            if failure == "certificate":
                distrust = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # (no CA: verification fails)
                try:
                    await slabnet.open_connection(
                        *server.sockets[0].getsockname()[:2], ssl=distrust,
                        server_hostname="localhost",
                    )
                except ssl.SSLCertVerificationError:
                    return
                raise AssertionError("the client trusted the certificate")
            # A peer that accepts and never answers.
            opening = asyncio.ensure_future(slabnet.open_connection(
                *listener.getsockname(), ssl=tls_client_context, server_hostname="localhost",
                ssl_handshake_timeout=0.05,
            ))
            peer, _ = await loop.sock_accept(listener)
            try:
                await opening
            except slabnet.HandshakeTimeoutError:
                return
            finally:
                peer.close()
                del opening  # (the task holds the error too)
            raise AssertionError("the handshake passed")

        left = await _left_by(path)
    assert not left, f"a failed open_connection left a cycle: {dict(left)}"


@pytest.mark.asyncio
async def test_a_refused_tls_connect_leaves_no_cycle(tls_client_context: ssl.SSLContext) -> None:
    # uvloop makes the connection's protocol before it connects. On a
    # refused connect the TLS layer, never set up, kept waiting on the
    # opener's waiter, which nobody would complete: on main a cycle
    # (layer -> waiter -> its done-callback -> layer) per refused connect.
    with socket.socket() as closed:  # a port with nobody listening on it
        closed.bind(("127.0.0.1", 0))
        address = closed.getsockname()

        async def path() -> None:
            try:
                await slabnet.open_connection(
                    *address, ssl=tls_client_context, server_hostname="localhost"
                )
            except ConnectionRefusedError:
                return
            raise AssertionError("the connect passed")

        left = await _left_by(path)
    assert not left, f"a refused connect left a cycle: {dict(left)}"


@pytest.mark.asyncio
async def test_a_reset_connections_error_pins_no_read_buffer(listener: socket.socket) -> None:
    # The asyncio loop reads a peer's reset as an error of the read it was
    # making, into a buffer our get_buffer() gave it: a slab. That error,
    # the one connection_lost() delivers, had the read's frame (and the
    # slab's view) in its traceback: on main every reset connection pinned
    # a 64 KiB slab for as long as the app kept its error -- and a stream
    # reader keeps it, in a cycle with the reads that raise it.
    errors: list[BaseException | None] = []

    async def path() -> None:
        tr, app, peer = await connect_slab(listener)
        hard_close(peer)
        errors.append(await asyncio.wait_for(app.lost, WAKE))

    await path()  # (the loop's slab and its first buffer)
    errors.clear()
    before = slabnet.memory_stats().pinned_bytes
    for _ in range(ROUNDS):
        await path()
    assert all(isinstance(e, ConnectionResetError) for e in errors), errors
    pinned = slabnet.memory_stats().pinned_bytes - before
    assert pinned == 0, f"{len(errors)} kept errors pin {pinned} bytes of read buffers"
