"""Write path (issue 4): synchronous writes allocate nothing, small writes of
one iteration share one sendmsg, queued bytes come out whole and in order.

Both loops (slabnet's pytest plugin).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

import slabnet
import slabnet._transport as transport_mod
import slabnet._write as write_mod

from conftest import hard_close, recv_exactly, wait_acked

WAKE = 10.0  # a bound on waits that must not fail: a failure fails fast


class CountingOS:
    """Stands for ``os`` in ``slabnet._transport`` to count its sends."""

    def __init__(self) -> None:
        self.send_calls = 0
        self.sendmsg_calls = 0
        self.sendmsg_buffers: list[int] = []
        self.send_sizes: list[int] = []

    def write(self, fd: int, data: Any) -> int:
        self.send_calls += 1
        self.send_sizes.append(len(data))
        return os.write(fd, data)

    def writev(self, fd: int, buffers: Any) -> int:
        self.sendmsg_calls += 1
        self.sendmsg_buffers.append(len(buffers))
        return os.writev(fd, buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def count_sends(monkeypatch: pytest.MonkeyPatch) -> CountingOS:
    counting = CountingOS()
    monkeypatch.setattr(transport_mod, "os", counting)
    return counting


async def sink_server() -> tuple[asyncio.Server, int, asyncio.Future[bytes]]:
    """A plain asyncio server that collects everything until EOF."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        if not done.done():
            done.set_result(data)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], done


# Kernel buffers for the tests that need a backlog. Setting SO_SNDBUF and
# SO_RCVBUF turns the kernel's autotuning off for that socket (tcp(7)) and the
# kernel doubles the value for its bookkeeping, so all the kernel can hold
# between writer and reader is about 4 x SMALL_BUF (plus one segment),
# whatever the host's net.ipv4.tcp_wmem / tcp_rmem allow. The socket options
# must be set before connect() and listen(): the receive window's scale is
# fixed at the handshake.
SMALL_BUF = 32 * 1024
KERNEL_HOLDS_AT_MOST = 4 * SMALL_BUF + 64 * 1024


def small_listener() -> socket.socket:
    """A listening socket whose accepted connections get a small receive buffer."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUF)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    return lsock


async def roomy_connect(port: int) -> socket.socket:
    """A client socket whose send buffer is set, not autotuned: 2 x 256 KiB, or
    2 x net.core.wmem_max where that is lower (Linux's default is 208 KiB).
    The kernel queues what the receiver's window does not take yet, so one
    send of up to 400 KiB is accepted whole, whatever the host's tcp_wmem."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
    sock.setblocking(False)
    async with asyncio.timeout(5):
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def small_connect(lsock: socket.socket) -> tuple[socket.socket, socket.socket]:
    """(client, accepted peer), the client with a small send buffer; the peer
    reads nothing until the test reads from it."""
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUF)
    client.setblocking(False)
    async with asyncio.timeout(5):
        await loop.sock_connect(client, lsock.getsockname())
        peer, _ = await loop.sock_accept(lsock)
    peer.setblocking(False)
    return client, peer


@asynccontextmanager
async def tls_pair(
    handler: Callable[[slabnet.StreamReader, slabnet.StreamWriter], Awaitable[None]],
    server_context: Any,
    client_context: Any,
) -> AsyncIterator[tuple[slabnet.StreamReader, slabnet.StreamWriter]]:
    """A slabnet TLS server running `handler`, and a client connected to
    it; the server is closed after the block."""
    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=server_context)
    try:
        port = server.sockets[0].getsockname()[1]
        yield await slabnet.open_connection(
            "127.0.0.1", port, ssl=client_context, server_hostname="localhost"
        )
    finally:
        server.close()


@asynccontextmanager
async def tls_sink(
    server_context: Any, client_context: Any
) -> AsyncIterator[tuple[slabnet.StreamWriter, asyncio.Future[bytes]]]:
    """A slabnet TLS client, and a future for all that its server received
    until the client closed."""
    done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def collect(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        done.set_result(await reader.read())
        writer.close()

    async with tls_pair(collect, server_context, client_context) as (_, writer):
        yield writer, done


@pytest.mark.asyncio
async def test_synchronous_writes_create_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class Counted(write_mod.WriteRequest):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            made.append(1)
            super().__init__(*args)

    monkeypatch.setattr(write_mod, "WriteRequest", Counted)
    monkeypatch.setattr(transport_mod, "WriteRequest", Counted)
    server, port, done = await sink_server()
    sock = await roomy_connect(port)
    reader, writer = await slabnet.open_connection(sock=sock)
    results = []
    for size in (10, 1024, 40_000, 100_000):
        for _ in range(5):
            results.append(writer.write(os.urandom(size)))
            await asyncio.sleep(0)  # the end-of-iteration flush of a small write
            await wait_acked(sock)  # the send buffer is empty again: never fills
    assert results == [None] * len(results)
    assert made == []
    writer.write_eof()
    assert len(await asyncio.wait_for(done, 10)) == 5 * (10 + 1024 + 40_000 + 100_000)
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_small_writes_of_one_iteration_share_one_sendmsg(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, port, done = await sink_server()
    reader, writer = await slabnet.open_connection(sock=await roomy_connect(port))
    counting = count_sends(monkeypatch)
    pieces = [bytes([i]) * 1024 for i in range(48)]
    for piece in pieces:
        assert writer.write(piece) is None
    # The first goes at once; the 47 after it are gathered.
    assert counting.send_calls + counting.sendmsg_calls == 1
    assert writer.transport.get_write_buffer_size() == 47 * 1024
    await asyncio.sleep(0)  # the end-of-iteration flush
    await asyncio.sleep(0)
    # One system call, and one buffer: the 47 copies are one region of the
    # shared pool, each right after the one before.
    assert counting.sendmsg_calls == 0 and counting.send_sizes == [1024, 47 * 1024]
    assert writer.transport.get_write_buffer_size() == 0
    # 64 KiB gathered flushes at once, before the iteration ends.
    sends = counting.sendmsg_calls + counting.send_calls
    for piece in pieces + pieces:
        writer.write(piece)
    assert counting.sendmsg_calls + counting.send_calls == sends + 2
    monkeypatch.undo()
    writer.write_eof()
    assert await asyncio.wait_for(done, 10) == b"".join(pieces + pieces + pieces)
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_writelines_is_one_sendmsg_and_keeps_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, port, done = await sink_server()
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    counting = count_sends(monkeypatch)
    big = [os.urandom(50_000) for _ in range(4)]
    assert writer.writelines(big) is None
    assert counting.sendmsg_calls == 1 and counting.sendmsg_buffers == [4]
    monkeypatch.undo()
    writer.write(b"small")
    writer.write_eof()
    assert await asyncio.wait_for(done, 10) == b"".join(big) + b"small"
    writer.close()
    server.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["bytes", "mixed"])
async def test_writelines_of_many_small_buffers_is_one_write_of_them_joined(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Thousands of 100-byte pieces (a line per item) cost a view, an iovec
    # and a queue entry each, and more than IOV_MAX of them took several
    # sendmsg calls: 1.2 us per piece against asyncio's 0.1 (its join).
    # Small ones are joined: one write of them all.
    server, port, done = await sink_server()
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    pieces: list[Any] = [b"line %04d\n" % i for i in range(3000)]
    if kind == "mixed":
        pieces[1::3] = [bytearray(p) for p in pieces[1::3]]
        pieces[2::3] = [memoryview(p) for p in pieces[2::3]]
        pieces.insert(5, b"")
    sent = b"".join(pieces)
    counting = count_sends(monkeypatch)
    assert writer.writelines(iter(pieces)) is None
    assert (counting.send_calls, counting.sendmsg_calls) == (1, 0)
    assert counting.send_sizes == [len(sent)]
    monkeypatch.undo()
    writer.write_eof()
    assert await asyncio.wait_for(done, WAKE) == sent
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_a_burst_of_tiny_tls_writes_holds_no_more_than_the_plain_gather(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    """65,536 one-byte writes in one turn of the loop, over TLS. Each was
    kept as a view of its own until the end of the iteration or 64 KiB
    (some 300 bytes of objects a byte: 20 MiB held), where the plain
    transport gathers at most IOV_MAX writes. Now TLS encrypts every
    IOV_MAX writes too: what is held stays within a few hundred KiB, and
    every byte arrives in order."""
    data = bytes(i % 251 for i in range(65536))
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(len(data)):
                writer.write(data[i : i + 1])
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        writer.close()
        assert await asyncio.wait_for(done, WAKE) == data
        assert held < 2 * 1024 * 1024, held


@pytest.mark.asyncio
async def test_a_tls_write_from_another_thread_is_refused(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    """``writer.write()`` called from a thread of the app's own, over TLS:
    the loop's thread may be inside OpenSSL with the same SSL object (CPython
    lets go of the GIL there), and a fuzzer crashed the process so (a
    segfault in ssl.py). It is refused with a RuntimeError that names
    the way (``call_soon_threadsafe``); the connection goes on."""
    loop = asyncio.get_running_loop()
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        errors: list[BaseException] = []

        def from_a_thread() -> None:
            for method, arg in ((writer.write, b"x" * 5000), (writer.writelines, [b"y", b"z"])):
                try:
                    method(arg)  # type: ignore[operator]
                except BaseException as exc:
                    errors.append(exc)

        await asyncio.wait_for(loop.run_in_executor(None, from_a_thread), WAKE)
        assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
        assert "call_soon_threadsafe" in str(errors[0])
        loop.call_soon_threadsafe(writer.write, b"via the loop")
        await asyncio.sleep(0)  # (it runs first)
        writer.write(b", then here")
        writer.close()
        assert await asyncio.wait_for(done, WAKE) == b"via the loop, then here"


@pytest.mark.asyncio
async def test_tls_writelines_of_many_small_buffers_keeps_every_byte_in_order(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    pieces: list[Any] = [b"%d," % i for i in range(5000)]
    pieces[::7] = [bytearray(p) for p in pieces[::7]]
    pieces += [os.urandom(70_000), b"tail"]  # (a large one among them: not joined)
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        writer.writelines(pieces)
        writer.writelines(p for p in pieces)
        writer.close()
        assert await asyncio.wait_for(done, WAKE) == 2 * b"".join(pieces)
        await asyncio.wait_for(writer.wait_closed(), WAKE)


@pytest.mark.asyncio
async def test_partial_sends_with_tiny_sndbuf_and_slow_reader() -> None:
    """Mixed small and large writes through a tiny send buffer: exact, ordered."""
    got = hashlib.sha256()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[int] = loop.create_future()

    async def slow_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while data := await reader.read(7000):
            got.update(data)
            n += len(data)
            await asyncio.sleep(0)  # one small read per turn of the loop
        finished.set_result(n)
        writer.close()

    # Small kernel buffers on both ends (not only the 4 KiB send buffer: on
    # loopback the receiver's window counts as much), so the writes must queue
    # whatever the host's TCP buffer sysctls, and the reader need not sleep.
    server = await asyncio.start_server(slow_reader, sock=small_listener())
    port = server.sockets[0].getsockname()[1]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.setblocking(False)
    async with asyncio.timeout(5):
        await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await slabnet.open_connection(sock=sock)
    expected = hashlib.sha256()
    total = 0
    requests = []
    rnd = os.urandom(300_000)
    for i in range(200):
        size = (1, 700, 3000, 33_000, 120_000, 299_999)[i % 6]
        data = rnd[i : i + size]
        expected.update(data)
        total += len(data)
        req = writer.write(data if i % 2 else bytearray(data))  # bytearray: copied
        if req is not None:
            requests.append(req)
        if i % 10 == 9:
            async with asyncio.timeout(30):
                await writer.drain()
    assert requests, "small socket buffers must make some writes queue"
    assert all(isinstance(r, slabnet.WriteRequest) for r in requests)
    async with asyncio.timeout(30):
        await asyncio.gather(*requests)
    assert all(r.done() for r in requests)
    writer.write_eof()
    assert await asyncio.wait_for(finished, 30) == total
    assert got.hexdigest() == expected.hexdigest()
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_mutating_a_bytearray_after_write_does_not_change_what_is_sent() -> None:
    server, port, done = await sink_server()
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    buf = bytearray(b"a" * 1000)
    writer.write(buf)  # small: copied into the pool
    buf[:] = b"b" * 1000
    writer.write(buf)
    buf[:] = b"c" * 1000
    writer.write_eof()
    assert await asyncio.wait_for(done, 10) == b"a" * 1000 + b"b" * 1000
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_flow_control_pauses_above_high_and_resumes_below_low() -> None:
    """The backlog is what the kernel cannot hold: small socket buffers on
    both ends bound that to KERNEL_HOLDS_AT_MOST, whatever the host's TCP
    buffer sysctls, and the peer reads nothing until released."""
    loop = asyncio.get_running_loop()
    lsock = small_listener()
    client, peer = await small_connect(lsock)
    release = asyncio.Event()

    async def consume() -> int:
        await release.wait()
        n = 0
        while data := await loop.sock_recv(peer, 65536):
            n += len(data)
        return n

    consumer = asyncio.ensure_future(consume())
    reader, writer = await slabnet.open_connection(sock=client)
    tr = writer.transport
    tr.set_write_buffer_limits(high=256 * 1024, low=64 * 1024)
    assert tr.get_write_buffer_limits() == (64 * 1024, 256 * 1024)
    payload = os.urandom(2 << 20)
    assert len(payload) > 256 * 1024 + KERNEL_HOLDS_AT_MOST
    writer.write(payload)
    drain = asyncio.ensure_future(writer.drain())
    await asyncio.sleep(0.2)  # the kernel takes what fits; the peer reads nothing
    assert not drain.done(), "drain() must block above the high mark"
    assert tr.get_write_buffer_size() >= len(payload) - KERNEL_HOLDS_AT_MOST
    release.set()
    async with asyncio.timeout(10):
        await drain
    assert tr.get_write_buffer_size() <= 64 * 1024
    writer.write_eof()
    async with asyncio.timeout(10):
        assert await consumer == len(payload)
    writer.close()
    await writer.wait_closed()
    peer.close()
    lsock.close()


@pytest.mark.asyncio
async def test_reset_while_writes_are_queued_fails_requests() -> None:
    lsock = small_listener()
    client, peer = await small_connect(lsock)
    reader, writer = await slabnet.open_connection(sock=client)
    block = os.urandom(1 << 20)  # each far above what the kernel can hold
    requests = [r for r in (writer.write(block) for _ in range(4)) if r is not None]
    assert len(requests) == 4
    # Reset: the peer closes with SO_LINGER 0.
    hard_close(peer)
    async with asyncio.timeout(10):
        results = await asyncio.gather(*requests, return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results), results
    with pytest.raises(ConnectionError):
        async with asyncio.timeout(10):
            await writer.drain()
    with pytest.raises(ConnectionError):
        async with asyncio.timeout(10):
            await reader.read(10)
    writer.close()
    lsock.close()


@pytest.mark.asyncio
async def test_close_flushes_queued_data_and_write_eof_orders_after_it() -> None:
    server, port, done = await sink_server()
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    payload = os.urandom(8 << 20)
    writer.write(payload)
    writer.write(b"tail")
    writer.write_eof()
    with pytest.raises(RuntimeError, match="after write_eof"):
        writer.write(b"x")
    assert await asyncio.wait_for(done, 30) == payload + b"tail"
    writer.close()
    await writer.wait_closed()
    with pytest.raises(RuntimeError, match="after write_eof"):
        writer.write(b"y")
    server.close()


@pytest.mark.asyncio
async def test_tls_writes_of_one_iteration_are_encrypted_together(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        engine = writer.transport._engine
        before = engine.write_calls
        pieces = [os.urandom(100) for _ in range(100)]
        for p in pieces:
            assert writer.write(p) is None
        assert engine.write_calls - before == 1  # the first at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert engine.write_calls - before == 2  # the 99 after it: 9,900 bytes, one record
        writer.close()
        assert await asyncio.wait_for(done, 10) == b"".join(pieces)
        await writer.wait_closed()


# ------------------------------------------------ a reply goes at once


@pytest.mark.asyncio
async def test_the_first_small_write_after_a_read_goes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reply (a small write after a read) waited for the end-of-iteration
    # flush: a callback and, on both loops, one more loop iteration for
    # every request and reply (the rpc benchmark: 1.3-1.45x the CPU of
    # asyncio streams per round trip). Now the first small write after a
    # read is sent at once; the writes after it in the same iteration are
    # gathered, as before, and the order holds.
    loop = asyncio.get_running_loop()
    lsock = small_listener()
    client, peer = await small_connect(lsock)
    lsock.close()
    reader, writer = await slabnet.open_connection(sock=client)
    iterations = transport_mod._loop_resources(loop).iterations
    counting = count_sends(monkeypatch)
    try:
        assert writer.write(b"before any read\n") is None
        assert writer.write(b"and after it\n") is None
        assert counting.send_calls + counting.sendmsg_calls == 1  # the first at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert counting.send_calls + counting.sendmsg_calls == 2
        for n in (1, 2):
            await loop.sock_sendall(peer, b"request %d\n" % n)
            assert await asyncio.wait_for(reader.readline(), WAKE) == b"request %d\n" % n
            sends = counting.send_calls + counting.sendmsg_calls
            assert writer.write(b"reply %d\n" % n) is None
            assert counting.send_calls + counting.sendmsg_calls == sends + 1  # at once
            # A reply costs no callback (the rpc benchmark's round trip):
            # the next read marks the next reply again.
            assert not iterations._armed
            # Nothing tells the reply's iteration from a later one, so the
            # write after it goes at once too, and marks; then they gather.
            assert writer.write(b"more %d\n" % n) is None
            assert counting.send_calls + counting.sendmsg_calls == sends + 2
            assert iterations._armed
            writer.write(b"and more %d\n" % n)
            writer.write(b"and then %d\n" % n)
            assert counting.send_calls + counting.sendmsg_calls == sends + 2  # gathered
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert counting.send_calls + counting.sendmsg_calls == sends + 3
        # A reply, then a frame on a timer's turn: the frame goes at once
        # (it waited for the end-of-iteration flush: the reply had left the
        # iteration number as it was).
        await loop.sock_sendall(peer, b"request 3\n")
        assert await asyncio.wait_for(reader.readline(), WAKE) == b"request 3\n"
        writer.write(b"reply 3\n")
        await asyncio.sleep(0.001)
        sends = counting.send_calls + counting.sendmsg_calls
        assert writer.write(b"tick\n") is None
        assert counting.send_calls + counting.sendmsg_calls == sends + 1
        assert writer.transport.get_write_buffer_size() == 0
        writer.write_eof()
        got = bytearray()
        async with asyncio.timeout(WAKE):
            while data := await loop.sock_recv(peer, 65536):
                got += data
        assert got == (
            b"before any read\nand after it\n"
            b"reply 1\nmore 1\nand more 1\nand then 1\n"
            b"reply 2\nmore 2\nand more 2\nand then 2\nreply 3\ntick\n"
        )
    finally:
        writer.close()
        peer.close()


@pytest.mark.asyncio
async def test_the_first_small_write_of_an_iteration_goes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A write that follows no read -- a voice server's 20 ms frame, sent on
    # a timer -- was copied into the pool and sent by a callback at the end
    # of the iteration: on uvloop 1.4-1.9x the server CPU per frame of
    # uvloop's own streams. Now each connection's first small write of an
    # iteration is sent at once, on every connection that writes in it;
    # the writes after it in the same iteration are gathered.
    loop = asyncio.get_running_loop()
    lsock = small_listener()
    pairs = [await small_connect(lsock) for _ in range(3)]
    lsock.close()
    writers = [(await slabnet.open_connection(sock=client))[1] for client, _ in pairs]
    counting = count_sends(monkeypatch)
    try:
        for frame in range(4):
            for i, writer in enumerate(writers):
                sends = counting.send_calls + counting.sendmsg_calls
                assert writer.write(b"frame %d of %d\n" % (frame, i)) is None
                assert counting.send_calls + counting.sendmsg_calls == sends + 1  # at once
                assert writer.transport.get_write_buffer_size() == 0
                writer.write(b"tail %d of %d\n" % (frame, i))
                assert counting.send_calls + counting.sendmsg_calls == sends + 1  # gathered
            await asyncio.sleep(0.001)  # (a timer: the next frame's iteration)
            assert counting.send_calls + counting.sendmsg_calls == 2 * len(writers) * (frame + 1)
        for writer in writers:
            writer.write_eof()
        for i, (_, peer) in enumerate(pairs):
            got = bytearray()
            async with asyncio.timeout(WAKE):
                while data := await loop.sock_recv(peer, 65536):
                    got += data
            assert got == b"".join(
                b"frame %d of %d\ntail %d of %d\n" % (f, i, f, i) for f in range(4)
            )
    finally:
        for writer in writers:
            writer.close()
        for _, peer in pairs:
            peer.close()


@pytest.mark.asyncio
async def test_the_first_small_tls_write_after_a_read_is_encrypted_at_once(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    # The same over TLS: the reply is encrypted (one record) and sent at
    # once; what follows in the iteration is gathered into one record.
    async def echo(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(line)
        writer.close()

    async with tls_pair(echo, tls_server_context, tls_client_context) as (reader, writer):
        engine = writer.transport._engine
        iterations = transport_mod._loop_resources(asyncio.get_running_loop()).iterations
        try:
            writer.write(b"ping\n")
            assert await asyncio.wait_for(reader.readline(), WAKE) == b"ping\n"
            before = engine.write_calls
            assert writer.write(b"reply\n") is None
            assert engine.write_calls == before + 1  # encrypted at once
            assert not iterations._armed  # (no callback for a reply)
            writer.write(b"more\n")
            assert engine.write_calls == before + 2  # at once too (see the plain test)
            writer.write(b"and more\n")
            writer.write(b"and then\n")
            assert engine.write_calls == before + 2  # gathered
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert engine.write_calls == before + 3  # one record for both
            async with asyncio.timeout(WAKE):
                assert await reader.readline() == b"reply\n"
                assert await reader.readline() == b"more\n"
                assert await reader.readline() == b"and more\n"
                assert await reader.readline() == b"and then\n"
        finally:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), WAKE)


@pytest.mark.asyncio
async def test_the_first_small_tls_write_of_an_iteration_is_encrypted_at_once(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    # Over TLS a frame sent on a timer waited for a callback at the end of
    # its iteration too (on uvloop 2.3x uvloop streams' CPU per frame in the
    # benchmarks' frames scenario); now it is encrypted and sent at once.
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        engine = writer.transport._engine
        sent = []
        for frame in range(4):
            before = engine.write_calls
            # (A read just before: the server's TLS 1.3 session tickets.)
            after_read = writer.transport._sent_in == transport_mod._AFTER_READ
            sent.append(b"frame %d\n" % frame)
            assert writer.write(sent[-1]) is None
            assert engine.write_calls == before + 1  # encrypted at once
            assert writer.transport.get_write_buffer_size() == 0
            sent.append(b"tail %d\n" % frame)
            writer.write(sent[-1])
            # Gathered, unless the frame was a reply: then the write after
            # it goes at once too (see the plain test of replies).
            assert engine.write_calls == before + 1 + after_read
            await asyncio.sleep(0.001)  # (a timer: the next frame's iteration)
            assert engine.write_calls == before + 2
        writer.close()
        assert await asyncio.wait_for(done, WAKE) == b"".join(sent)
        await asyncio.wait_for(writer.wait_closed(), WAKE)


@pytest.mark.asyncio
async def test_tls_writelines_of_one_frame_takes_the_one_record_path(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    # writelines([frame]) on a timer was gathered: a plaintext list, an
    # end-of-iteration callback armed for nothing, and write_many (49
    # against 34 us per frame for write() in a voice server probe). It is
    # now write(frame).
    async with tls_sink(tls_server_context, tls_client_context) as (writer, done):
        transport, engine = writer.transport, writer.transport._engine
        sent = []
        for frame in range(3):
            before = engine.write_calls
            sent.append(b"frame %d\n" % frame)
            assert writer.writelines([sent[-1]]) is None
            assert engine.write_calls == before + 1  # encrypted at once
            assert not transport._flush_scheduled and not transport._plain
            assert transport.get_write_buffer_size() == 0
            await asyncio.sleep(0.001)
        sent.append(b"two ")
        sent.append(b"pieces\n")
        before = engine.write_calls
        writer.writelines(sent[-2:])  # several: one record for them all, at once
        assert engine.write_calls == before + 1 and not transport._plain
        writer.close()
        assert await asyncio.wait_for(done, WAKE) == b"".join(sent)
        await asyncio.wait_for(writer.wait_closed(), WAKE)


# ------------------------------------------------ a peer that stops reading


def fill_kernel(sock: socket.socket) -> int:
    """Send on ``sock`` (non-blocking) until the kernel takes no more, behind
    slabnet's back: its next write finds the socket full, whatever the
    host's buffer sizes. Returns the bytes sent."""
    sent = 0
    while True:
        try:
            sent += sock.send(b"k" * 65536)
        except BlockingIOError:
            return sent


@pytest.mark.asyncio
async def test_small_writes_to_a_peer_that_stops_reading_pin_no_shared_pool() -> None:
    # A server broadcasting small messages, one client of which stopped
    # reading: each message queued for it was a region of the loop's shared
    # 64 KiB write pool, which then could not be reused, so the other
    # connections' writes made a new pool every 64 KiB. With 200 busy
    # clients slabnet held 14 MB where asyncio held 0.24 MB. And each
    # queued write kept a WriteRequest in the queue, awaited or not: 64 KiB
    # of 1-byte writes held 28 MB. Now the writes that wait are copied into
    # one buffer of the queue's own, and the queue keeps only requests that
    # someone awaits.
    loop = asyncio.get_running_loop()
    pool = slabnet.get_pool()
    lsock = small_listener()
    stuck_sock, stuck_peer = await small_connect(lsock)
    busy_sock, busy_peer = await small_connect(lsock)
    lsock.close()
    _, stuck = await slabnet.open_connection(sock=stuck_sock)
    _, busy = await slabnet.open_connection(sock=busy_sock)
    rounds, size = 5000, 100
    busy_got = asyncio.ensure_future(recv_exactly(busy_peer, rounds * size, WAKE))
    try:
        prefill = fill_kernel(stuck_sock)
        allocated = pool.pools_allocated
        first = [b"%099d\n" % i for i in range(100)]  # gathered, then the kernel is full
        for m in first:
            stuck.write(m)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        out = stuck.transport._out
        assert out and stuck.transport._waiting_writable
        assert not any(write_mod.is_pooled(v) for v in out._bufs)  # copied out
        kept = None
        queued = 0
        for i in range(rounds):
            req = stuck.write(b"%099d\n" % (100 + i))
            if req is not None:  # queued: a request to await
                queued += 1
                if kept is None and i >= rounds // 2:
                    kept = req
            busy.write(b"%099d\n" % i)
            await asyncio.sleep(0)
        # (A full socket may still take a few KiB now and then, as the
        # kernels pack the small segments queued on either side -- sooner
        # on a busy machine -- but never the 500 KB written here.)
        assert queued > rounds * 0.9
        assert kept is not None and not kept.done()
        # Every pool the busy connection filled was reused: none is pinned.
        assert pool.pools_allocated - allocated <= 1
        out = stuck.transport._out
        assert out
        assert not any(write_mod.is_pooled(v) for v in out.buffers())
        # 5100 writes wait in a few buffers: one for the writes made between
        # two times the kernel took some (it may, while its bytes move to
        # the peer's receive buffer), not one each.
        assert len(out.buffers()) < 100
        assert out._requests is None  # no one awaits them: none is kept
        async with asyncio.timeout(WAKE):
            assert await busy_got == b"".join(b"%099d\n" % i for i in range(rounds))
            waiting = asyncio.ensure_future(kept)
            await asyncio.sleep(0)
            assert out._requests == [kept]  # awaited: the queue finishes it
            got = await recv_exactly(stuck_peer, prefill + (100 + rounds) * size, WAKE)
            await waiting
            assert kept.done() and kept.exception() is None
        assert got[:prefill] == b"k" * prefill
        assert got[prefill:] == b"".join(b"%099d\n" % i for i in range(100 + rounds))
    finally:
        busy_got.cancel()
        for w in (stuck, busy):
            w.transport.abort()
            await asyncio.wait_for(w.wait_closed(), WAKE)
        stuck_peer.close()
        busy_peer.close()


@pytest.mark.asyncio
async def test_writelines_behind_a_full_socket_coalesces_its_small_buffers() -> None:
    lsock = small_listener()
    client, peer = await small_connect(lsock)
    lsock.close()
    _, writer = await slabnet.open_connection(sock=client)
    try:
        prefill = fill_kernel(client)
        writer.write(b"x" * 100_000)  # queued: the socket is full
        out = writer.transport._out
        assert out and writer.transport._waiting_writable
        parts = [bytearray(b"%05d" % i) for i in range(2000)]
        assert writer.writelines(parts) is not None
        for p in parts:
            p[:] = b"-----"  # the caller reuses its buffers: the copies stay
        assert len(out.buffers()) < 100  # 2000 small buffers wait in a few
        async with asyncio.timeout(WAKE):
            got = await recv_exactly(peer, prefill + 100_000 + 10_000, WAKE)
        assert got[prefill + 100_000 :] == b"".join(b"%05d" % i for i in range(2000))
    finally:
        writer.transport.abort()
        await asyncio.wait_for(writer.wait_closed(), WAKE)
        peer.close()


@pytest.mark.asyncio
async def test_tls_writes_to_a_peer_that_stops_reading_keep_no_requests(
    tls_server_context: Any, tls_client_context: Any
) -> None:
    # The same over TLS: a request for each write whose ciphertext waited,
    # kept in the lower queue until sent (16-byte writes: 990 KiB held
    # against asyncio's 73 KiB).
    release, finished = asyncio.Event(), asyncio.Event()

    async def slow(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            await release.wait()
            while await reader.read(1 << 20):
                pass
        except ConnectionError:
            pass  # (the client aborts)
        finally:
            writer.close()
            finished.set()

    async with tls_pair(slow, tls_server_context, tls_client_context) as (reader, writer):
        lower = writer.transport._lower
        try:
            async with asyncio.timeout(WAKE):
                while not lower.get_write_buffer_size():
                    writer.write(b"f" * 65536)
                    await asyncio.sleep(0.001)
            out = lower._out
            for i in range(3000):
                assert writer.write(b"%015d" % i) is not None
                await asyncio.sleep(0)
            assert out._requests is None
            assert not any(write_mod.is_pooled(v) for v in out.buffers())
            assert len(out.buffers()) < 100  # (3000 records)
        finally:
            release.set()
            writer.transport.abort()
            await asyncio.wait_for(writer.wait_closed(), WAKE)
            await asyncio.wait_for(finished.wait(), WAKE)


@pytest.mark.asyncio
async def test_write_requests_follow_their_queue_and_only_awaited_ones_are_kept() -> None:
    # (sans-IO: the queue alone; the loop only runs the awaits)
    q = write_mod.OutQueue()
    q.append(memoryview(b"a" * 10))
    r1 = q.request(10)
    q.append_small(memoryview(b"b" * 5))
    q.append_small(b"B" * 5)
    r2 = q.request(10)
    q.append(memoryview(b"c" * 3))
    r3 = q.request(3)
    assert q._requests is None and not r1.done() and r1.exception() is None
    bufs = q.buffers()
    assert [bytes(b) for b in bufs] == [b"a" * 10, b"bbbbbBBBBB", b"ccc"]  # in order
    third = asyncio.ensure_future(r3)  # awaited out of order
    first = asyncio.ensure_future(r1)
    await asyncio.sleep(0)
    assert q._requests == [r1, r3]  # kept once awaited, by position
    assert not q.sent(12)
    await asyncio.sleep(0)
    assert first.done() and not third.done() and not r2.done()
    assert q.sent(11)
    assert r2.done() and r2.exception() is None  # (from the queue's position)
    await asyncio.wait_for(third, WAKE)
    assert q._requests is None

    # A layer above tracks its own request, awaited before it was tracked.
    req = write_mod.WriteRequest(7, -1)
    waiting = asyncio.ensure_future(req)
    await asyncio.sleep(0)
    q.append(memoryview(b"d" * 7))
    q.track(req)
    assert q._requests == [req]
    q.append_small(b"late")
    late = q.request(4)
    err = ConnectionResetError("gone")
    q.fail(err)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(waiting, WAKE)
    assert late.done() and late.exception() is err
    with pytest.raises(ConnectionResetError):
        await late
    done_before = write_mod.OutQueue()
    done_before.append(memoryview(b"e"))
    sent = done_before.request(1)
    done_before.buffers()
    done_before.sent(1)
    done_before.fail(err)
    assert sent.done() and sent.exception() is None  # sent before the failure
