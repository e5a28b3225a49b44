"""Where slabnet's streams and asyncio's disagreed, found by running aioftp
(its client and server, and its own test suite) over slabnet's streams
instead of asyncio's.

Each test reproduces what the library ran into without the library: a
slabnet stream on loopback sockets against a raw peer. Every test runs on
the asyncio loop and on uvloop, and bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import select
import socket

import pytest

from test_asyncio_parity import connect

WAKE = 5.0  # seconds any waiter may take to wake
IOV_MAX = 1024  # one sendmsg's most buffers (Linux UIO_MAXIOV)


@pytest.mark.asyncio
async def test_tiny_writes_each_drained_meet_a_reset_without_yielding(
    listener: socket.socket,
) -> None:
    # aioftp's test_passive_closed_on_recall writes one byte at a time to a
    # data connection the server has closed, `while True: w.write(b"-");
    # await w.drain()`, until the reset raises. drain() does not yield while
    # writing is not paused (in asyncio either), so slabnet's end-of-iteration
    # flush of gathered small writes never ran: the bytes went out only at
    # 64 KiB, and the reset they met was raised after 65,535 writes (0.5 to
    # 1.3 s of spinning; aioftp's 1 s test timeout fired under load) where
    # asyncio raises on the second write. The gather now also goes out once
    # it holds IOV_MAX writes, all one sendmsg can take anyway.
    reader, writer, peer = await connect(listener)
    try:
        peer.close()  # FIN; the bytes that follow it are answered with RST
        assert await asyncio.wait_for(reader.read(), WAKE) == b""
        writes = 0
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            async with asyncio.timeout(WAKE):
                while writes < 65536:
                    writer.write(b"-")
                    await writer.drain()
                    writes += 1
        # The first flush is taken (the RST answers it), a later one meets
        # the reset; loopback answers at once, 16 flushes is ample room.
        assert writes < 16 * IOV_MAX, writes
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_tiny_writes_each_drained_reach_the_kernel_in_order(
    listener: socket.socket,
) -> None:
    # The same loop on a healthy connection: every IOV_MAX writes are handed
    # to the kernel without the loop turning, in order, none lost or doubled.
    reader, writer, peer = await connect(listener)
    try:
        data = bytes(i % 251 for i in range(5 * IOV_MAX + 7))
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
        # No await since the first write: that write went at once (the first
        # of its iteration), and only the early flushes sent the others.
        sent = 1 + 5 * IOV_MAX
        got = bytearray()
        while len(got) < sent:
            ready, _, _ = select.select([peer], [], [], WAKE)
            assert ready, f"only {len(got)} bytes reached the kernel"
            got += peer.recv(65536)
        assert bytes(got) == data[:sent]
        await writer.drain()
        await asyncio.sleep(0)  # the end-of-iteration flush: the last 6
        async with asyncio.timeout(WAKE):
            while len(got) < len(data):
                got += await asyncio.get_running_loop().sock_recv(peer, 65536)
        assert bytes(got) == data
    finally:
        writer.close()
        peer.close()
