"""Where slabnet's streams and asyncio's disagreed, found by running
libraries built on asyncio's streams (aiomcache against memcached,
aioconsole's console server, aiosmtpd's SMTP server) over slabnet's
streams instead of asyncio's.

Each test reproduces what the library ran into without the library: a
slabnet stream on loopback sockets against a raw peer. Every test runs on
the asyncio loop and on uvloop, and bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from test_asyncio_parity import connect, until

WAKE = 5.0  # seconds any waiter may take to wake


@pytest.mark.asyncio
async def test_reader_buffer_clear_discards_the_unread_bytes(listener: socket.socket) -> None:
    # aiosmtpd's SMTP server, after STARTTLS, drops the plaintext a client
    # sent after its STARTTLS command (RFC 3207 section 4.2: leftover
    # unencrypted data is discarded) with reader._buffer.clear() on
    # asyncio's bytearray. slabnet's _buffer had no clear(): every STARTTLS
    # session ended in AttributeError and the client saw the connection
    # close.
    reader, writer, peer = await connect(listener)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(WAKE):
            await loop.sock_sendall(peer, b"injected plaintext\r\n")
            await until(lambda: len(reader._buffer) == 20, "20 bytes buffered")
            reader._buffer.clear()
            assert reader._buffer == b""
            await loop.sock_sendall(peer, b"EHLO after\r\n")
            assert await reader.readline() == b"EHLO after\r\n"
            assert reader._buffer == b""
    finally:
        writer.close()
        peer.close()


@pytest.mark.asyncio
async def test_reader_buffer_clear_of_a_paused_reader_reads_on(listener: socket.socket) -> None:
    # The same, with more than twice the limit buffered, so the reader has
    # stopped reading (asyncio pauses above 2 * limit): clearing it must not
    # leave the connection paused with nothing buffered to read.
    limit = 1024
    reader, writer, peer = await connect(listener, limit=limit)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(WAKE):
            await loop.sock_sendall(peer, b"x" * (4 * limit))
            await until(lambda: len(reader._buffer) > 2 * limit, "over 2 * limit buffered")
            reader._buffer.clear()
            await loop.sock_sendall(peer, b"END\n")
            rest = await reader.readuntil(b"END\n")
            assert rest.endswith(b"END\n")
            assert len(rest) <= 4 * limit + 4
            assert reader._buffer == b""
    finally:
        writer.close()
        peer.close()
