"""An app's ``pause_reading()`` over slabnet's TLS, against asyncio's own
TLS transport on the same loop (both loops): no ``data_received()`` after
the pause until ``resume_reading()``.

slabnet delivered the rest of a socket read (its 16 KiB chunks) even after
the app paused during it, and the read that completed the handshake even to
an app that paused in ``connection_made()``. An app that paused to hand the
connection over (``set_protocol()``) got those bytes in the old protocol,
and the new one never saw them. (slabnet's own streams still take a whole
read: they buffer it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, server_ctx, wait_acked

WAKE = 10.0
DATA = os.urandom(4 << 20)


class Old(asyncio.Protocol):
    """Pauses in its first ``data_received`` and hands the connection to
    ``New`` a moment later."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.got = bytearray()
        self.after_pause = 0  # calls after its pause: none may come
        self.paused = False
        self.new: New | None = None
        self.handed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.paused:
            self.after_pause += 1
            return
        self.got += data
        self.paused = True
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(0.1, self.hand_over)

    def hand_over(self) -> None:
        self.new = New()
        self.transport.set_protocol(self.new)
        self.transport.resume_reading()
        self.handed.set_result(None)


class New(asyncio.Protocol):
    def __init__(self) -> None:
        self.got = bytearray()
        self.lost = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.got += data

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


class PausedAtStart(asyncio.Protocol):
    """Pauses in ``connection_made`` and resumes 0.1 s later."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.got = bytearray()
        self.transport: Any = None
        self.paused = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.paused = True
        transport.pause_reading()
        asyncio.get_running_loop().call_later(0.1, self.resume)

    def resume(self) -> None:
        self.events.append("resume")
        self.paused = False
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.paused:
            self.events.append("data while paused")
        self.got += data


async def connect(impl: str, factory: Any, port: int, tls_ca: Any) -> None:
    loop = asyncio.get_running_loop()
    ctx = client_ctx(tls_ca)
    if impl == "slabnet":
        await loop.create_connection(
            lambda: slabnet.SlabProtocol(factory(), ssl=ctx, server_hostname="localhost"),
            "127.0.0.1", port,
        )
    else:
        await loop.create_connection(factory, "127.0.0.1", port, ssl=ctx,
                                     server_hostname="localhost")


@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_no_data_after_a_pause_and_set_protocol_hands_over_every_byte(
    impl: str, tls_ca: Any, server_cert: Any
) -> None:
    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(DATA)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(send, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    made: list[Old] = []
    try:
        await connect(impl, lambda: made.append(Old()) or made[-1],
                      server.sockets[0].getsockname()[1], tls_ca)
        old = made[0]
        await asyncio.wait_for(old.handed, WAKE)
        assert old.new is not None
        await asyncio.wait_for(old.new.lost, WAKE)
        assert old.after_pause == 0
        whole = bytes(old.got) + bytes(old.new.got)
        assert hashlib.sha256(whole).digest() == hashlib.sha256(DATA).digest()
    finally:
        for old in made:
            old.transport.abort()
        server.close()


@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_a_pause_in_connection_made_holds_the_data_of_the_handshake_read(
    impl: str, tls_ca: Any, server_cert: Any
) -> None:
    """A server's app: the client's Finished and the data it sends at once
    come in one read, the one that completes the handshake; nothing of it
    may reach an app that paused in ``connection_made``."""
    loop = asyncio.get_running_loop()
    ctx = server_ctx(server_cert)
    made: list[PausedAtStart] = []

    def factory() -> Any:
        made.append(PausedAtStart())
        if impl == "slabnet":
            return slabnet.SlabProtocol(made[-1], ssl=ctx, server_side=True)
        return made[-1]

    server = await loop.create_server(
        factory, "127.0.0.1", 0, ssl=None if impl == "slabnet" else ctx
    )
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", server.sockets[0].getsockname()[1], ssl=client_ctx(tls_ca),
            server_hostname="localhost",
        )
        writer.write(b"x" * 100_000)
        async with asyncio.timeout(WAKE):
            while not made or len(made[0].got) < 100_000:
                await asyncio.sleep(0.01)
        assert made[0].events == ["resume"]
        writer.close()
    finally:
        for app in made:
            app.transport.abort()
        server.close()


@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_a_stream_handler_that_pauses_at_once_hands_over_the_handshake_read(
    impl: str, tls_ca: Any, server_cert: Any
) -> None:
    """A server's ``client_connected_cb`` that runs inside
    ``connection_made`` -- a plain function, or a coroutine under an eager
    task factory (3.12) -- pauses reading and, a moment later, hands the
    connection to another protocol. The client's Finished and 1 MiB sent at
    once arrive together: none of it may land in the stream's reader, which
    nobody reads any more. (slabnet's TLS layer delivered the handshake's
    read whole to the stream although it had paused before any delivery:
    up to one read stayed in the old reader.)"""
    lib = slabnet if impl == "slabnet" else asyncio
    loop = asyncio.get_running_loop()
    handed: asyncio.Future[tuple[Any, New]] = loop.create_future()
    data = DATA[: 1 << 20]
    kept: list[Any] = []

    def handler(reader: Any, writer: Any) -> None:
        kept.append(writer)  # (from 3.13 on, a dropped writer closes its connection)
        writer.transport.pause_reading()

        def hand_over() -> None:
            new = New()
            writer.transport.set_protocol(new)
            writer.transport.resume_reading()
            handed.set_result((reader, new))

        loop.call_later(0.1, hand_over)

    server = await lib.start_server(handler, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", server.sockets[0].getsockname()[1], ssl=client_ctx(tls_ca),
            server_hostname="localhost",
        )
        writer.write(data)
        await writer.drain()
        reader, new = await asyncio.wait_for(handed, WAKE)
        async with asyncio.timeout(WAKE):
            while len(new.got) < len(data):
                await asyncio.sleep(0.01)
        assert reader._buffer == b""
        assert hashlib.sha256(new.got).digest() == hashlib.sha256(data).digest()
        writer.close()
    finally:
        for w in kept:
            w.transport.abort()
        server.close()


class PausesEachTime(asyncio.Protocol):
    """Pauses in every ``data_received`` and resumes in the next callback;
    writes down what comes, and when the connection ends."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.got = bytearray()
        self.eof = False
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got += data
        self.transport.pause_reading()
        asyncio.get_running_loop().call_soon(self.transport.resume_reading)

    def eof_received(self) -> None:
        self.eof = True

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@contextlib.asynccontextmanager
async def raw_peer_of(
    impl: str, side: str, app_type: type[Any], tls_ca: Any, server_cert: Any
) -> AsyncIterator[tuple[Any, RawTLS]]:
    """An ``app_type`` app on ``side`` of a TLS connection, under slabnet's
    ``SlabProtocol`` or the loop's own TLS (``impl``), and its peer, a
    ``RawTLS`` on a plain socket, both handshakes done: (app, peer). On
    exit the app's transport is aborted and the sockets closed."""
    loop = asyncio.get_running_loop()
    apps: list[Any] = []
    sctx, cctx = server_ctx(server_cert), client_ctx(tls_ca)

    def factory() -> Any:
        apps.append(app_type())
        if impl == "asyncio":
            return apps[-1]
        if side == "server":
            return slabnet.SlabProtocol(apps[-1], ssl=sctx, server_side=True)
        return slabnet.SlabProtocol(apps[-1], ssl=cctx, server_hostname="localhost")

    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    server = None
    peer_sock: socket.socket | None = None
    try:
        async with asyncio.timeout(WAKE):
            if side == "client":
                opening = asyncio.ensure_future(loop.create_connection(
                    factory, *listener.getsockname(),
                    **({} if impl == "slabnet" else {"ssl": cctx, "server_hostname": "localhost"})))
                peer_sock, _ = await loop.sock_accept(listener)
                peer = RawTLS(peer_sock, sctx, server_side=True)
                await peer.handshake()
                await opening
            else:
                server = await loop.create_server(
                    factory, "127.0.0.1", 0, ssl=None if impl == "slabnet" else sctx)
                peer_sock = socket.socket()
                peer_sock.setblocking(False)
                await loop.sock_connect(peer_sock, server.sockets[0].getsockname())
                peer = RawTLS(peer_sock, cctx, server_side=False, server_hostname="localhost")
                await peer.handshake()
                while not apps or apps[0].transport is None:
                    await asyncio.sleep(0.01)
        yield apps[0], peer
    finally:
        for app in apps:
            if app.transport is not None:
                app.transport.abort()
        if peer_sock is not None:
            peer_sock.close()
        listener.close()
        if server is not None:
            server.close()


@pytest.mark.parametrize("end", ["close_notify", "bad_record"])
@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_the_end_after_the_data_comes_once_a_paused_app_resumes(
    impl: str, side: str, end: str, tls_ca: Any, server_cert: Any
) -> None:
    """The peer's last data and its end (a close_notify, or a record that
    fails) come in one read; the app pauses in the data's callback and
    resumes in the next one. The engine had read the end with the data, so
    nothing was left to decrypt, and the resume looked only for ciphertext
    or plaintext: the EOF or error waited for input that would never come,
    and the app for it, until it closed the connection itself (or the
    peer's shutdown timeout, 30 s for asyncio's, cut TCP). asyncio's TLS
    delivers the end at once."""
    async with raw_peer_of(impl, side, PausesEachTime, tls_ca, server_cert) as (app, peer):
        wire = peer.seal(b"x" * 100)
        if end == "close_notify":
            wire += peer.close_notify()
        else:
            wire += b"\x17\x03\x03\x00\x20" + bytes(32)
        await peer.send(wire)  # (one send: one read on the other side)
        # The peer keeps TCP open (it waits for our close_notify): only the
        # end it sent can end the connection here.
        exc = await asyncio.wait_for(app.lost, WAKE)
        if impl == "slabnet" or end == "close_notify":
            # (asyncio's TLS drops the data in front of a failing record.)
            assert bytes(app.got) == b"x" * 100
        if end == "close_notify":
            assert app.eof and exc is None
        else:
            assert not app.eof and isinstance(exc, ssl.SSLError), exc


class PausedByTheTest(asyncio.Protocol):
    """Pauses in every ``data_received``; the test resumes it. Writes down
    each callback, and whether it came while paused."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.paused = False
        self.events: list[tuple[str, bool]] = []
        self.got = bytearray()
        self.pause = asyncio.Event()
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.events.append(("data", self.paused))
        self.got += data
        self.paused = True
        self.transport.pause_reading()
        self.pause.set()

    def resume(self) -> None:
        self.pause.clear()
        self.paused = False
        self.transport.resume_reading()

    def eof_received(self) -> None:
        self.events.append(("eof", self.paused))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append(("lost", self.paused))
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.parametrize("end", ["close_notify_fin", "fin"])
@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_a_fin_reaches_a_paused_app_only_after_it_resumes(
    impl: str, side: str, end: str, tls_ca: Any, server_cert: Any
) -> None:
    """The peer sends four 16 KiB records and its FIN (after a close_notify,
    or without one), all before the app, paused in the first record's
    callback, resumes. slabnet's TLS layer read the FIN while paused and,
    at it, delivered every record left (and then the EOF, and the
    connection's end) to the paused app. asyncio's TLS never calls
    ``data_received()`` while paused (it does deliver the end then on some
    loops: not asserted of it). Now the records come one per resume, then
    the end."""
    payload = os.urandom(4 * 16384)
    async with raw_peer_of(impl, side, PausedByTheTest, tls_ca, server_cert) as (app, peer):
        async with asyncio.timeout(WAKE):
            wire = b"".join(peer.seal(payload[i:i + 16384]) for i in range(0, len(payload), 16384))
            if end == "close_notify_fin":
                wire += peer.close_notify()
            await peer.send(wire)
            peer.sock.shutdown(socket.SHUT_WR)
            await wait_acked(peer.sock)
            while not app.lost.done():
                paused = asyncio.ensure_future(app.pause.wait())
                await asyncio.wait([paused, app.lost], return_when=asyncio.FIRST_COMPLETED)
                if app.lost.done():
                    paused.cancel()
                    break
                # Everything, FIN included, is in our kernel, or read: the
                # app stays paused a while, as one that forwards each chunk.
                await asyncio.sleep(0.05)
                app.resume()
        if impl == "slabnet":
            assert bytes(app.got) == payload
            assert [e for e in app.events if e[1]] == []  # nothing while paused
            assert [e[0] for e in app.events][-2:] == ["eof", "lost"]
        else:
            # (uvloop's TLS server drops the records left at the FIN.)
            assert payload.startswith(bytes(app.got))
            assert [e for e in app.events if e == ("data", True)] == []
