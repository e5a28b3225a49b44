"""Where slabnet's streams and asyncio's disagreed, found by running
CPython's own stream tests with slabnet's streams swapped in.

Every test runs on the asyncio loop and on uvloop, on loopback sockets, and
bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

import slabnet
from conftest import hard_close

WAKE = 5.0  # seconds any waiter may take to wake


async def connect(
    listener: socket.socket, limit: int = 2**16
) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, socket.socket]:
    """A slabnet client connected to a raw peer accepted on ``listener``."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(
            slabnet.open_connection(*listener.getsockname(), limit=limit)
        )
        peer, _ = await loop.sock_accept(listener)
        reader, writer = await opening
    peer.setblocking(False)
    return reader, writer, peer


async def until(done: Callable[[], bool], what: str) -> None:
    """Wait (a loop iteration at a time) until ``done()`` is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAKE
    while not done():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_reader_repr_has_asyncio_fields(listener: socket.socket) -> None:
    # asyncio's reader repr is "<StreamReader [N bytes] [eof] [limit=L]
    # [waiter=...] [exception=...] [transport=...] [paused]>". slabnet's
    # said "N bytes in K chunks" and named neither the transport nor the
    # waiter of a pending read, so a log line could not tell which
    # connection, or that a read was stuck.
    reader, writer, peer = await connect(listener, limit=123)
    loop = asyncio.get_running_loop()

    def tr() -> str:  # (the transport's repr shows its state)
        return f"transport={writer.transport!r}"

    try:
        assert repr(reader) == f"<StreamReader limit=123 {tr()}>"
        pending = asyncio.ensure_future(reader.readexactly(4))
        await asyncio.sleep(0)
        text = repr(reader)
        assert text.startswith("<StreamReader limit=123 waiter=<Future pending"), text
        assert text.endswith(f"> {tr()}>"), text
        await loop.sock_sendall(peer, b"abcd")
        async with asyncio.timeout(WAKE):
            assert await pending == b"abcd"
        await loop.sock_sendall(peer, b"xyz")
        await until(lambda: "bytes" in repr(reader), "3 bytes buffered")
        assert repr(reader) == f"<StreamReader 3 bytes limit=123 {tr()}>"
        peer.shutdown(socket.SHUT_WR)
        await until(lambda: "eof" in repr(reader), "EOF seen")
        assert repr(reader) == f"<StreamReader 3 bytes eof limit=123 {tr()}>"
    finally:
        writer.close()
        peer.close()


@pytest.mark.asyncio
async def test_zero_byte_reads_raise_the_connections_error(listener: socket.socket) -> None:
    # A reader whose connection was reset, with nothing buffered: asyncio's
    # read(0) and readexactly(0) raise the error, as every other read does;
    # slabnet's returned b"", so a framing loop that reads an empty body
    # with readexactly(0) went on as if the connection were fine.
    reader, writer, peer = await connect(listener)
    try:
        hard_close(peer)
        async with asyncio.timeout(WAKE):
            with pytest.raises(ConnectionResetError):
                await reader.read(10)
        with pytest.raises(ConnectionResetError):
            await reader.read(0)
        with pytest.raises(ConnectionResetError):
            await reader.readexactly(0)
        with pytest.raises(ValueError):  # (the argument is checked first, as asyncio)
            await reader.readexactly(-1)
    finally:
        writer.close()
