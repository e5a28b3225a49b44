"""The server side against hostile and broken clients (server audit), on
real loopback sockets, on both loops.

Each test bounds every wait, so a hang fails fast, and checks what asyncio's
own server does in the same case, or better: the connection ends, the error
is reported once (or not at all, for a client's fault), nothing is leaked.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import slabnet
from conftest import fds_settle, open_fds

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
