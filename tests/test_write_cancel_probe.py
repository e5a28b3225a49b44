"""The write path under cancellation and failure, on real sockets, on both
loops: what an ``await`` of a ``WriteRequest`` leaves behind once it has
raised.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

import slabnet

WAKE = 5.0  # seconds any wait may take before the test fails
SMALL_BUF = 16 * 1024  # SO_SNDBUF / SO_RCVBUF: a write far larger must queue
PAYLOAD = 4 * 1024 * 1024


def shrink(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUF)


@pytest_asyncio.fixture
async def small_listener() -> AsyncIterator[socket.socket]:
    """A plain listening socket whose connections have small buffers."""
    sock = socket.socket()
    shrink(sock)  # inherited by accepted sockets
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    yield sock
    sock.close()


async def blocked_writer(
    listener: socket.socket,
) -> tuple[slabnet.StreamWriter, socket.socket, slabnet.WriteRequest]:
    """A slabnet client whose peer reads nothing, and the pending request
    of a write far larger than the two kernels hold."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    shrink(sock)
    sock.setblocking(False)
    await loop.sock_connect(sock, listener.getsockname())
    _, writer = await slabnet.open_connection(sock=sock)
    peer, _ = await loop.sock_accept(listener)
    req = writer.write(os.urandom(PAYLOAD))
    assert req is not None and not req.done()
    return writer, peer, req


class Payload(bytearray):
    """An awaiter's own buffer (weakly referenceable)."""


def traceback_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


@pytest.mark.asyncio
async def test_a_failed_write_request_awaited_again_keeps_no_earlier_awaiter(
    small_listener: socket.socket,
) -> None:
    """A request that failed raised its error (the connection's, kept by
    the transport and the queue too) with a bare ``raise``, so every await
    added its frames to that one exception's traceback: after 20 awaits by
    20 coroutines it was 40 entries long and held all 20 frames, and with
    them each coroutine's locals (here a 1 MiB buffer each), for as long as
    the request or the connection lived, garbage collection or not. An
    asyncio future re-raises its exception with the traceback it was set
    with; so does a request now: at most the last awaiter's frames are
    kept, as by a future."""
    writer, peer, req = await blocked_writer(small_listener)
    alive: list[weakref.ref[Payload]] = []

    async def send_or_give_up() -> None:
        payload = Payload(1024 * 1024)  # what the app keeps while it waits
        alive.append(weakref.ref(payload))
        try:
            await req
        except ConnectionAbortedError:
            pass

    try:
        writer.transport.abort()
        lengths = []
        for _ in range(20):
            await asyncio.wait_for(send_or_give_up(), WAKE)
            exc = req.exception()
            assert isinstance(exc, slabnet.LocalAbortError)
            lengths.append(traceback_length(exc))
            del exc
        gc.collect()
        kept = sum(ref() is not None for ref in alive)
        assert kept <= 1, f"{kept} awaiters' buffers kept by the request's error"
        assert lengths[-1] == lengths[0], lengths
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    finally:
        peer.close()


@pytest.mark.asyncio
async def test_a_failed_write_request_still_raises_its_own_error(
    small_listener: socket.socket,
) -> None:
    """(The same exception object each time, as from a future.)"""
    writer, peer, req = await blocked_writer(small_listener)
    try:
        writer.transport.abort()
        seen: list[Any] = []
        for _ in range(3):
            with pytest.raises(slabnet.LocalAbortError) as info:
                await asyncio.wait_for(req, WAKE)
            seen.append(info.value)
        assert seen[0] is seen[1] is seen[2] is req.exception()
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    finally:
        peer.close()
