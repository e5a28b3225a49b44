"""Where slabnet's streams and asyncio's disagreed, found by running
third-party libraries (redis-py's asyncio client, hypercorn) and their own
test suites over slabnet's streams instead of asyncio's.

Each test reproduces what the library ran into without the library: a
slabnet stream on loopback sockets against a raw peer. Every test runs on
the asyncio loop and on uvloop, and bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

import slabnet

WAKE = 5.0  # seconds any waiter may take to wake


async def connect(
    listener: socket.socket,
) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, socket.socket]:
    """A slabnet client connected to a raw peer accepted on ``listener``."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(
            slabnet.open_connection(*listener.getsockname())
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
async def test_reader_buffer_shows_unread_bytes_without_consuming(
    listener: socket.socket,
) -> None:
    # redis-py asks whether a pooled connection has a response waiting with
    # bool(reader._buffer) (asyncio's bytearray of unread bytes) and counts
    # pending invalidations with len(reader._buffer). slabnet's reader had
    # no such attribute: every checkout of a pooled connection raised
    # AttributeError.
    reader, writer, peer = await connect(listener)
    loop = asyncio.get_running_loop()
    try:
        assert reader._buffer == b""
        assert not reader._buffer
        await loop.sock_sendall(peer, b"+first\r\n")
        await until(lambda: len(reader._buffer) == 8, "8 bytes buffered")
        # A small piece arriving while data is buffered is coalesced
        # (the reader's tail), and counts too.
        await loop.sock_sendall(peer, b"+second\r\n")
        await until(lambda: len(reader._buffer) == 17, "17 bytes buffered")
        assert reader._buffer == b"+first\r\n+second\r\n"
        assert await reader.readexactly(3) == b"+fi"  # part of a chunk
        assert reader._buffer == b"rst\r\n+second\r\n"
        assert reader._buffer.find(b"\r\n") == 3
        assert reader._buffer == b"rst\r\n+second\r\n"  # nothing consumed
        assert await reader.readline() == b"rst\r\n"
        assert await reader.readline() == b"+second\r\n"
        assert reader._buffer == b""
    finally:
        writer.close()
        peer.close()
