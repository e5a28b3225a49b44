"""The write path under attack: regressions found by auditing slabnet's
writes (plain and TLS) against asyncio's streams on both loops.

Every test runs on the asyncio loop and on uvloop, on loopback sockets whose
buffers are set small where a backlog is needed."""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest

import slabnet
from conftest import shrink
from test_writer_hardening import connect_small

WAKE = 5.0  # seconds any wait may take before the test fails
async def count_to_eof(reader: slabnet.StreamReader) -> int:
    n = 0
    while chunk := await reader.read_chunk():
        n += len(chunk)
    return n


# ------------------------------------------------ TLS flow control


@pytest.mark.asyncio
async def test_tls_pause_taken_during_the_starttls_handshake_is_released(
    small_listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    # Writes made while the STARTTLS handshake runs wait as plaintext; above
    # the high-water mark the TLS transport pauses. Once the handshake is
    # done they are encrypted: the kernel takes part, and the rest queued on
    # the plain connection lies between low and high, so that connection
    # never pauses, and never resumes. The TLS transport stayed paused with
    # nothing left to send and drain() waited forever.
    high, low = 1 << 20, 1 << 18  # wide: the kernel takes far less than high - low
    size = high + 1
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        assert await reader.readexactly(9) == b"STARTTLS\n"
        await writer.start_tls(tls_server_context)
        received.set_result(await count_to_eof(reader))
        writer.close()

    server = await slabnet.start_server(handle, sock=small_listener)
    reader, writer = await connect_small(small_listener.getsockname()[1])
    try:
        writer.write(b"STARTTLS\n")
        upgrade = asyncio.create_task(
            writer.start_tls(tls_client_context, server_hostname="localhost")
        )
        await asyncio.sleep(0)  # the writer is on the TLS transport, handshaking
        assert isinstance(writer.transport, slabnet.TLSTransport)
        writer.transport.set_write_buffer_limits(high, low)
        writer.write(b"p" * size)
        await asyncio.wait_for(writer.drain(), WAKE)
        await asyncio.wait_for(upgrade, WAKE)
        writer.close()
        assert await asyncio.wait_for(received, WAKE) == size
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_tls_bulk_writes_with_drain_never_stall(
    small_listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    # The loop's own order makes the case above without STARTTLS: a write
    # gathered as plaintext pauses the TLS transport (queue + plaintext
    # above high), the plain connection sends part of its queue before the
    # end-of-iteration flush encrypts it (uvloop polls between the two), and
    # the queue then sits between the limits. It stalled uvloop within a few
    # writes of 60,000 bytes. Every write must be drained, whatever the order.
    size, total = 60_000, 4 * 2**20
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        received.set_result(await count_to_eof(reader))
        writer.close()

    server = await slabnet.start_server(handle, sock=small_listener, ssl=tls_server_context)
    reader, writer = await connect_small(
        small_listener.getsockname()[1], ssl=tls_client_context, server_hostname="localhost"
    )
    try:
        data = b"q" * size
        sent = 0
        while sent < total:
            writer.write(data)
            sent += size
            await asyncio.wait_for(writer.drain(), WAKE)
        writer.close()
        assert await asyncio.wait_for(received, WAKE) == sent
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()


class _Paced(slabnet.ChunkProtocol):
    """Records pause_writing/resume_writing."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")


@pytest.mark.asyncio
async def test_starttls_while_writing_is_paused_still_resumes_the_app(
    small_listener: socket.socket, tls_client_context: ssl.SSLContext,
) -> None:
    # The app was paused by the plain connection, whose queue had drained
    # to between low and high when the app upgraded to TLS: the plain
    # connection's resume went to the TLS layer, which had never paused,
    # and the app never heard it: paused for good.
    high, low = 256 * 1024, 16 * 1024  # a band far wider than one send
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    shrink(sock)
    sock.setblocking(False)
    await loop.sock_connect(sock, small_listener.getsockname())
    peer, _ = await loop.sock_accept(small_listener)
    peer.setblocking(False)
    app = _Paced()
    await loop.create_connection(lambda: slabnet.SlabProtocol(app), sock=sock)
    plain = app.transport
    tls = None
    try:
        plain.set_write_buffer_limits(high, low)
        plain.write(b"x" * (4 * high))
        assert app.events == ["pause"]
        async with asyncio.timeout(WAKE):
            while plain.get_write_buffer_size() > high:
                await loop.sock_recv(peer, 4096)
                await asyncio.sleep(0.001)
        assert plain.get_write_buffer_size() > low  # still paused: in the band
        tls, handshake = plain.upgrade_tls(tls_client_context, server_hostname="localhost")
        handshake.add_done_callback(lambda f: f.cancelled() or f.exception())
        async with asyncio.timeout(WAKE):
            while plain.get_write_buffer_size():
                await loop.sock_recv(peer, 65536)  # the rest, then the ClientHello
            while app.events == ["pause"]:
                await asyncio.sleep(0.005)
        assert app.events == ["pause", "resume"]
    finally:
        (tls or plain).abort()
        peer.close()


class _RaisesLimitsWhenPaused(_Paced):
    """Raises the write-buffer limits past what is queued from inside
    ``pause_writing()``: as an app that answers back-pressure by allowing
    a larger buffer does."""

    def pause_writing(self) -> None:
        self.events.append("pause")
        size = self.transport.get_write_buffer_size()
        self.transport.set_write_buffer_limits(high=4 * size, low=2 * size)
        self.events.append("pause returned")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_raised_limits_resume_at_the_next_drain_not_inside_the_call(
    small_listener: socket.socket, tls: bool, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    # set_write_buffer_limits() that raised the limits of a paused transport
    # past its buffer called resume_writing() from inside that call; from
    # pause_writing() the app heard the resume before its pause had
    # returned, and an app that sets its paused flag last stayed paused for
    # good. Both loops' transports only pause there, and resume when the
    # buffer next drains to the low-water mark.
    loop = asyncio.get_running_loop()
    release = asyncio.Event()
    received: asyncio.Future[int] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await release.wait()  # not reading: the client's writes back up
        received.set_result(await count_to_eof(reader))
        writer.close()

    server = await slabnet.start_server(
        handle, sock=small_listener, ssl=tls_server_context if tls else None
    )
    sock = socket.socket()
    shrink(sock)
    sock.setblocking(False)
    await loop.sock_connect(sock, small_listener.getsockname())
    app = _RaisesLimitsWhenPaused()
    made: asyncio.Future[None] = loop.create_future()
    kw: dict[str, Any] = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
    await loop.create_connection(
        lambda: slabnet.SlabProtocol(app, handshake_waiter=made, **kw), sock=sock
    )
    await asyncio.wait_for(made, WAKE)
    tr = app.transport
    tr.set_write_buffer_limits(high=64 * 1024)
    sent = 0
    try:
        async with asyncio.timeout(WAKE):
            while not app.events:  # until the buffer passes the high-water mark
                tr.write(b"w" * 65536)
                sent += 65536
                await asyncio.sleep(0)
        # (Whether the kernel took more since, and the resume came, is
        # timing; that it did not come inside the pause is not.)
        assert app.events[:2] == ["pause", "pause returned"]
        low, high = tr.get_write_buffer_limits()
        assert tr.get_write_buffer_size() <= low < high
        release.set()
        async with asyncio.timeout(WAKE):
            while "resume" not in app.events:
                await asyncio.sleep(0.001)
        assert app.events == ["pause", "pause returned", "resume"]
        tr.close()
        assert await asyncio.wait_for(received, WAKE) == sent
    finally:
        tr.abort()
        server.close()
        await server.wait_closed()
