"""The server side against hostile and broken clients (server audit), on
real loopback sockets, on both loops.

Each test bounds every wait, so a hang fails fast, and checks what asyncio's
own server does in the same case, or better: the connection ends, the error
is reported once (or not at all, for a client's fault), nothing is leaked.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, fds_settle, open_fds, server_ctx

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])

WAKE = 5.0  # seconds any waiter may take to wake after a fault


class Handler:
    """Collects what the loop's exception handler is given."""

    def __init__(self) -> None:
        self.contexts: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.contexts.append(context)

    def exceptions(self) -> list[BaseException | None]:
        return [c.get("exception") for c in self.contexts]


class Boom(Exception):
    pass


async def recv_until_closed(sock: socket.socket, timeout: float = WAKE) -> tuple[bytes, str]:
    """Read until EOF or reset; return (bytes read, "eof" or "reset")."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                return bytes(got), "reset"
            if not data:
                return bytes(got), "eof"
            got += data


# ---------------------------------------------------------------- app errors


@pytest.mark.asyncio
async def test_chunk_received_raising_on_held_bytes_ends_the_connection() -> None:
    # An app that pauses reading as it is made gets the bytes read while it
    # was paused (held, at most 1 KiB) from a callback once it resumes. If
    # its chunk_received raises there, the loop reports the error as it
    # does for a chunk it delivers itself, and the connection must end with
    # it, as then: it stayed open with its socket paused, never read again
    # nor closed, and connection_lost was never called.
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    made: asyncio.Future[slabnet.SlabProtocol] = loop.create_future()
    lost: asyncio.Future[BaseException | None] = loop.create_future()

    class App(slabnet.ChunkProtocol):
        def connection_made(self, transport: Any) -> None:
            transport.pause_reading()

        def chunk_received(self, chunk: memoryview) -> None:
            raise Boom("chunk_received")

        def connection_lost(self, exc: BaseException | None) -> None:
            lost.set_result(exc)

    def factory() -> slabnet.SlabProtocol:
        proto = slabnet.SlabProtocol(App(), loop=loop)
        made.set_result(proto)
        return proto

    server = await loop.create_server(factory, "127.0.0.1", 0)
    baseline = open_fds()
    sock = socket.create_connection(server.sockets[0].getsockname())
    try:
        sock.setblocking(False)
        await loop.sock_sendall(sock, b"hello")
        proto = await asyncio.wait_for(made, WAKE)
        async with asyncio.timeout(WAKE):  # the paused read took the bytes
            while proto._held is None:
                await asyncio.sleep(0.005)
        transport = proto._transport
        assert transport is not None
        transport.resume_reading()
        exc = await asyncio.wait_for(lost, WAKE)
        got, _ = await recv_until_closed(sock)
        assert isinstance(exc, Boom), repr(exc)
        assert got == b""
        errors = handler.exceptions()
        assert len(errors) == 1 and isinstance(errors[0], Boom), handler.contexts
    finally:
        sock.close()
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- TLS shutdown


async def read_to_close_notify(tls: RawTLS, timeout: float = WAKE) -> bytes:
    """Plaintext until the peer's close_notify (which must come)."""
    got = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                got += tls.obj.read(65536)
            except ssl.SSLWantReadError:
                await tls._pull()
            except ssl.SSLZeroReturnError:
                return bytes(got)


@VERSIONS
@pytest.mark.asyncio
async def test_data_after_the_servers_close_does_not_stall_its_shutdown(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    # A server answers (413, say) and closes while its client is still
    # uploading; the client's close_notify comes behind the rest of the
    # upload. The server must read on to that close_notify and drop the
    # data (past what was on its way), as asyncio's does. It delivered all
    # of it to a reader nobody reads any more, which paused reading past
    # its limit: the close_notify was never read, and every such connection
    # was held (socket, buffers) until the shutdown timeout, 30 s by
    # default, then ended with ShutdownTimeoutError.
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[BaseException | None] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"413 too large\n")
        writer.close()
        try:
            await writer.wait_closed()
        except Exception as exc:
            closed.set_result(exc)
        else:
            closed.set_result(None)

    server = await slabnet.start_server(
        handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version),
        ssl_shutdown_timeout=60.0,
    )
    baseline = open_fds()
    sock = socket.create_connection(server.sockets[0].getsockname())
    try:
        tls = RawTLS(sock, client_ctx(tls_ca, version), server_side=False,
                     server_hostname="localhost")
        await tls.handshake()
        # Far more than the reader holds before it pauses (2 x 64 KiB) and
        # than is still delivered after close() (AFTER_CLOSE_MAX).
        wire = tls.seal(b"POST\n", *[b"u" * 16384] * 128) + tls.close_notify()
        upload = asyncio.create_task(tls.send(wire))
        assert await read_to_close_notify(tls) == b"413 too large\n"
        assert await asyncio.wait_for(closed, WAKE) is None
        await asyncio.wait_for(upload, WAKE)
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline
