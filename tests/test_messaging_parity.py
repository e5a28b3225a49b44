"""Where slabnet's streams and asyncio's disagreed, found by running
messaging clients and brokers (nats-py against nats-server, aiormq and
aio-pika against RabbitMQ, amqtt's broker and client) over slabnet's
streams instead of asyncio's.

Each test reproduces what the library ran into without the library: a
stream on loopback sockets against a raw peer. Every test runs on the
asyncio loop and on uvloop, and bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

import slabnet

WAKE = 5.0  # seconds any waiter may take to wake


@pytest.mark.asyncio
async def test_writer_over_asyncio_protocol_waits_for_close(listener: socket.socket) -> None:
    # nats-py upgrades to TLS with loop.start_tls() and builds its own
    # stream on the result: asyncio.StreamReaderProtocol(asyncio.StreamReader())
    # and asyncio.StreamWriter(transport, protocol, reader, loop). With
    # asyncio's stream classes swapped for slabnet's (a drop-in, same
    # constructor), the writer sits on asyncio's protocol, and
    # wait_closed() raised TypeError ("_get_close_waiter() missing 1
    # required positional argument: 'stream'"): nats-py's close() handed it
    # to the error callback. asyncio's writer passes itself to the
    # protocol's _get_close_waiter(); slabnet's now does too.
    loop = asyncio.get_running_loop()
    reader = slabnet.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    async with asyncio.timeout(WAKE):
        connecting = asyncio.ensure_future(
            loop.create_connection(lambda: protocol, *listener.getsockname())
        )
        peer, _ = await loop.sock_accept(listener)
        transport, _ = await connecting
    peer.setblocking(False)
    try:
        writer = slabnet.StreamWriter(transport, protocol, reader, loop)  # type: ignore[arg-type]
        async with asyncio.timeout(WAKE):
            writer.write(b"PING\r\n")
            await writer.drain()
            assert await loop.sock_recv(peer, 6) == b"PING\r\n"
            await loop.sock_sendall(peer, b"PONG\r\n")
            assert await reader.readline() == b"PONG\r\n"
            writer.close()
            await writer.wait_closed()
            assert await loop.sock_recv(peer, 1) == b""
        assert writer.is_closing()
    finally:
        transport.close()
        peer.close()
