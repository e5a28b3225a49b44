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
import hashlib
import os
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, server_ctx

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
