"""Writer hardening, on real sockets, on both loops.

A writer dropped without ``close()`` closes its connection and warns; a
graceful close of the loop's own transport (``Server.close_clients()``) sends
slabnet's queue first; each ``await`` of a ``WriteRequest`` is cancelled
alone; ``write()`` on a closed connection is dropped, as asyncio does; an
``abort()`` from ``chunk_received`` is the last delivery; and bytes queued
from a read-only view of a mutable buffer are the bytes of ``write()`` time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import socket
import ssl
import sys
import weakref
from typing import Any

import pytest

import slabnet
from slabnet._transport import _PAUSED_READ
from conftest import (
    SMALL_BUF, RawTLS, client_ctx, fds_settle, hard_close, lowest_free_in_the_upper_half,
    open_fds, recv_exactly, server_ctx, shrink, wait_acked,
)

WAKE = 5.0  # seconds any wait may take before the test fails
PAYLOAD = 4 * 1024 * 1024  # far more than SMALL_BUF buffers hold


async def read_to_end(reader: slabnet.StreamReader) -> tuple[bytes, BaseException | None]:
    """Everything until EOF, and the error that ended it instead, if any."""
    parts = []
    try:
        async with asyncio.timeout(WAKE):
            async for chunk in reader.chunks():
                parts.append(bytes(chunk))
    except (OSError, ssl.SSLError) as exc:
        return b"".join(parts), exc
    return b"".join(parts), None


async def sock_read_to_end(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    parts = []
    async with asyncio.timeout(WAKE):
        while data := await loop.sock_recv(sock, 65536):
            parts.append(data)
    return b"".join(parts)


async def connect_small(port: int, **kw: Any) -> tuple[slabnet.StreamReader, slabnet.StreamWriter]:
    """A slabnet client whose socket has small buffers from the start."""
    sock = socket.socket()
    shrink(sock)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await slabnet.open_connection(sock=sock, **kw)


# ------------------------------------------------ 9: a dropped writer


#: asyncio's StreamReaderProtocol keeps a server connection's writer until
#: the connection is lost before 3.13, and no reference to it from 3.13 on.
WRITER_KEPT = sys.version_info < (3, 13)
START_SERVER = {"slabnet": slabnet.start_server, "asyncio": asyncio.start_server}


@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_server_writer_dropped_without_close_as_asyncio(impl: str) -> None:
    """3.13+: the handler's return closes the connection, with a warning.
    Before: the protocol keeps the writer, and the connection stays open,
    half-closed once the peer has sent its FIN, as asyncio's does (until
    the server closes it)."""
    baseline = open_fds()
    transports: list[Any] = []
    readers: list[Any] = []
    returned = asyncio.get_running_loop().create_future()

    async def forgetful(reader: Any, writer: Any) -> None:
        transports.append(writer.transport)
        readers.append(reader)
        writer.write(b"hello")  # and return without close()
        returned.set_result(None)

    server = await START_SERVER[impl](forgetful, "127.0.0.1", 0)
    sock = socket.create_connection(server.sockets[0].getsockname())
    sock.setblocking(False)
    try:
        if WRITER_KEPT:
            await asyncio.wait_for(returned, WAKE)
            gc.collect()
            assert await recv_exactly(sock, 5, WAKE) == b"hello"
            await asyncio.sleep(0.05)
            assert not transports[0].is_closing()
            sock.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(WAKE):
                while not readers[0].at_eof():
                    await asyncio.sleep(0.01)
            assert not transports[0].is_closing()
        else:
            with pytest.warns(ResourceWarning, match=r"unclosed <StreamWriter"):
                # The client sees the bytes, then EOF: the server closed its side.
                assert await sock_read_to_end(sock) == b"hello"
            assert transports and transports[0].is_closing()
    finally:
        sock.close()
        server.close()
        for transport in transports:
            transport.close()  # (if the test failed)
    # 3.12+: wait_closed() waits for every connection of the server.
    await asyncio.wait_for(server.wait_closed(), WAKE)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
# (3.13+: the dropped writer's warning, checked by the test above.)
@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
@pytest.mark.asyncio
async def test_a_handler_that_gives_its_reader_to_a_task_loses_nothing_as_asyncio(
    impl: str, tls: bool, tls_ca: Any, server_cert: Any
) -> None:
    """A read-only sink: the handler hands the reader to a task of its own
    and returns without keeping the writer. Before 3.13 the task gets every
    byte the peer sends after that (slabnet's writer closed the connection
    when the handler returned, and the task saw EOF at once); from 3.13 on
    asyncio closes such a connection, and so does slabnet."""
    loop = asyncio.get_running_loop()
    total = 200_000
    returned = loop.create_future()
    got: asyncio.Future[tuple[int, str]] = loop.create_future()

    async def consume(reader: Any) -> None:
        n = 0
        try:
            while data := await reader.read(65536):
                n += len(data)
        except (ConnectionError, ssl.SSLError) as exc:
            got.set_result((n, type(exc).__name__))
            return
        got.set_result((n, "EOF"))

    tasks: list[asyncio.Task[None]] = []

    transports: list[Any] = []

    async def handler(reader: Any, writer: Any) -> None:
        transports.append(writer.transport)
        tasks.append(asyncio.create_task(consume(reader)))
        returned.set_result(None)

    server = await START_SERVER[impl](
        handler, "127.0.0.1", 0, ssl=server_ctx(server_cert) if tls else None
    )
    port = server.sockets[0].getsockname()[1]
    try:
        kwargs: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        # The peer: asyncio's client, whatever the server.
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, **kwargs), WAKE)
        await asyncio.wait_for(returned, WAKE)
        await asyncio.sleep(0)
        gc.collect()  # the handler's frame and its writer are gone
        try:
            for _ in range(20):
                writer.write(b"d" * (total // 20))
                await writer.drain()
        except ConnectionError:
            pass  # the server closed first (3.13+)
        writer.close()  # (FIN, or close_notify over TLS: the consumer's EOF)
        n, end = await asyncio.wait_for(got, WAKE)
        if WRITER_KEPT:
            assert (n, end) == (total, "EOF")
        else:
            assert n < total
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        for transport in transports:
            transport.abort()  # (kept open half-closed, as asyncio's)
    await asyncio.wait_for(server.wait_closed(), WAKE)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_client_writer_dropped_without_close_is_freed_closed_and_warned(
    echo_server: tuple[str, int], tls_echo_server: tuple[str, int],
    tls_client_context: ssl.SSLContext, tls: bool,
) -> None:
    baseline = open_fds()
    if tls:
        reader, writer = await slabnet.open_connection(
            *tls_echo_server, ssl=tls_client_context, server_hostname="localhost"
        )
    else:
        reader, writer = await slabnet.open_connection(*echo_server)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), WAKE) == b"ping"
    ref = weakref.ref(writer)
    transport = writer.transport
    gc.disable()  # no cycle may be what keeps it: freed by its refcount alone
    try:
        with pytest.warns(ResourceWarning, match=r"unclosed <StreamWriter"):
            del writer
        assert ref() is None
        assert transport.is_closing()
        # The echo server answers our EOF (or close_notify) by closing.
        data, exc = await read_to_end(reader)
        assert data == b"" and exc is None, (data, exc)
    finally:
        gc.enable()
        transport.close()  # (if the test failed: the echo server must stop)
    assert await fds_settle(baseline) <= baseline


# ------------------------------------------------ 10: the loop closes its transport


async def backlogged_server(
    tls: ssl.SSLContext | None = None,
) -> tuple[asyncio.Server, asyncio.Future[slabnet.StreamWriter], asyncio.Future[None]]:
    """A server whose handler queues PAYLOAD bytes it cannot send yet, then
    waits until its connection is closed."""
    loop = asyncio.get_running_loop()
    queued: asyncio.Future[slabnet.StreamWriter] = loop.create_future()
    closed: asyncio.Future[None] = loop.create_future()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        shrink(writer.get_extra_info("socket"))
        writer.write(os.urandom(16) * (PAYLOAD // 16))
        await asyncio.sleep(0)  # TLS: the plaintext is encrypted and queued
        queued.set_result(writer)
        try:
            await writer.wait_closed()
        finally:
            closed.set_result(None)

    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=tls)
    return server, queued, closed


async def backlogged_connection(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> tuple[
    asyncio.Server, asyncio.Future[None], slabnet.StreamReader, slabnet.StreamWriter,
    slabnet.StreamWriter,
]:
    """A client of ``backlogged_server`` (plain or TLS): the server, its
    handler's ``closed``, the client's reader and writer, and the server's
    writer once its payload is queued."""
    server, queued, closed = await backlogged_server(tls_server_context if tls else None)
    port = server.sockets[0].getsockname()[1]
    kw: dict[str, Any] = {}
    if tls:
        kw = dict(ssl=tls_client_context, server_hostname="localhost", ssl_ragged_eof=True)
    reader, writer = await connect_small(port, **kw)
    server_writer = await asyncio.wait_for(queued, WAKE)
    return server, closed, reader, writer, server_writer


async def check_graceful_end_of_loop_transport(
    close: Any, tls: bool, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext, crowded: bool = False,
) -> None:
    """``crowded``: with no duplicate descriptor allowed, so the queue
    waits lent to the loop's transport when that transport is closed."""
    baseline = open_fds()
    with lowest_free_in_the_upper_half() if crowded else contextlib.nullcontext():
        server, closed, reader, writer, server_writer = await backlogged_connection(
            tls, tls_server_context, tls_client_context
        )
        backlog = server_writer.transport.get_write_buffer_size()
        assert backlog > PAYLOAD // 2, backlog  # most of it waits in slabnet's queue
        lower = getattr(server_writer.transport, "_lower", server_writer.transport)
        assert lower._lending == crowded
        tail = server_writer.write(b"tail")  # (behind it, in slabnet's queue)
        close(server, server_writer)
        data, exc = await read_to_end(reader)
        assert exc is None, exc
        assert len(data) == PAYLOAD + 4 and data.endswith(b"tail")
        await asyncio.wait_for(closed, WAKE)
        if tail is not None:
            await asyncio.wait_for(tail, WAKE)
    server_writer.write(b"late")  # dropped: the connection is gone
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAKE)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.skipif(sys.version_info < (3, 13), reason="Server.close_clients() is new in 3.13")
@pytest.mark.parametrize("crowded", [False, True], ids=["", "crowded"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_close_clients_sends_the_queue_first(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
    crowded: bool,
) -> None:
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        pytest.skip("uvloop's Server has no close_clients()")

    def close_clients(server: asyncio.Server, writer: slabnet.StreamWriter) -> None:
        server.close_clients()

    await check_graceful_end_of_loop_transport(
        close_clients, tls, tls_server_context, tls_client_context, crowded
    )


@pytest.mark.parametrize("crowded", [False, True], ids=["", "crowded"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_closing_the_loop_transport_sends_the_queue_first(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
    crowded: bool,
) -> None:
    # What close_clients() does to each connection, on every version and loop.
    def close_raw(server: asyncio.Server, writer: slabnet.StreamWriter) -> None:
        getattr(writer.transport, "_lower", writer.transport)._raw.close()

    await check_graceful_end_of_loop_transport(
        close_raw, tls, tls_server_context, tls_client_context, crowded
    )


@pytest.mark.asyncio
async def test_abort_after_the_loop_transport_closed_drops_the_queue() -> None:
    baseline = open_fds()
    server, queued, closed = await backlogged_server()
    port = server.sockets[0].getsockname()[1]
    reader, writer = await connect_small(port)
    server_writer = await asyncio.wait_for(queued, WAKE)
    server_writer.transport._raw.close()
    await asyncio.sleep(0.05)
    assert not closed.done()  # still sending
    server_writer.transport.abort()
    await asyncio.wait_for(closed, WAKE)  # connection_lost came, no hang
    data, exc = await read_to_end(reader)
    assert len(data) < PAYLOAD
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAKE)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.skipif(sys.version_info < (3, 13), reason="Server.abort_clients() is new in 3.13")
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("first", ["abort", "close_clients_then_abort"])
@pytest.mark.asyncio
async def test_abort_clients_drops_the_queue(
    tls: bool, first: str, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    # Server.abort_clients() aborts the loop's transports. To slabnet that
    # looked like close_clients()'s graceful close (connection_lost(None)
    # either way), so a queue waiting on its duplicate descriptor was still
    # sent, for as long as the client took to read it: a client that never
    # reads -- the one abort_clients() is for -- kept its connection open.
    #
    # close_clients_then_abort: the shutdown asyncio's docs show (close(),
    # close_clients(), a bounded wait_closed(), then abort_clients() for the
    # clients that did not finish). After close_clients() the loop's
    # transport is gone and slabnet still sends its queue on the duplicate
    # descriptor, but the Server saw no client left: wait_closed() returned
    # at once, and abort_clients() reached nothing, so a client that never
    # read kept the connection, the queue and a descriptor. asyncio's
    # transport, still flushing, stays among the Server's clients until it
    # is lost.
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        pytest.skip("uvloop's Server has no abort_clients()")
    baseline = open_fds()
    server, closed, reader, writer, server_writer = await backlogged_connection(
        tls, tls_server_context, tls_client_context
    )
    assert server_writer.transport.get_write_buffer_size() > PAYLOAD // 2
    if first == "close_clients_then_abort":
        server.close()
        server.close_clients()
        waiting = asyncio.ensure_future(server.wait_closed())
        done, _ = await asyncio.wait([waiting], timeout=0.2)
        assert not done  # the queue is still going out, to a client that does not read
    server.abort_clients()
    await asyncio.wait_for(closed, WAKE)  # without the client reading a byte
    data, exc = await read_to_end(reader)
    assert len(data) < PAYLOAD // 2  # the queue was dropped, as asyncio's buffer is
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAKE)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.skipif(sys.version_info < (3, 13), reason="Server.abort_clients() is new in 3.13")
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_abort_clients_drops_the_queue_of_a_slab_protocol_server(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    # The same abort, on a server of loop.create_server() with a factory of
    # SlabProtocols (the README's way for a server that handles bytes in
    # the callback). Only start_server's Server aborted slabnet's transports
    # first, so here the loop's abort looked like a close: the queue still
    # went out on the duplicate descriptor, to a client that never reads,
    # so connection_lost never came, wait_closed() never returned, and the
    # connection kept its descriptor (plain and TLS).
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        pytest.skip("uvloop's Server has no abort_clients()")
    loop = asyncio.get_running_loop()
    made: asyncio.Future[Any] = loop.create_future()
    lost: asyncio.Future[BaseException | None] = loop.create_future()

    class App(slabnet.ChunkProtocol):
        def connection_made(self, transport: Any) -> None:
            shrink(transport.get_extra_info("socket"))
            transport.write(os.urandom(16) * (PAYLOAD // 16))
            made.set_result(transport)

        def chunk_received(self, chunk: memoryview) -> None:
            pass

        def connection_lost(self, exc: BaseException | None) -> None:
            lost.set_result(exc)

    def factory() -> slabnet.SlabProtocol:
        return slabnet.SlabProtocol(
            App(), ssl=tls_server_context if tls else None, server_side=True)

    baseline = open_fds()
    server = await loop.create_server(factory, "127.0.0.1", 0)
    kw: dict[str, Any] = {}
    if tls:
        kw = dict(ssl=tls_client_context, server_hostname="localhost")
    reader, writer = await connect_small(server.sockets[0].getsockname()[1], **kw)
    try:
        transport = await asyncio.wait_for(made, WAKE)
        await asyncio.sleep(0)  # TLS: the plaintext is encrypted and queued
        assert transport.get_write_buffer_size() > PAYLOAD // 2
        server.close()
        server.abort_clients()
        exc = await asyncio.wait_for(lost, WAKE)  # without the client reading a byte
        assert isinstance(exc, slabnet.LocalAbortError), repr(exc)
        await asyncio.wait_for(server.wait_closed(), WAKE)
        data, _ = await read_to_end(reader)
        assert len(data) < PAYLOAD // 2  # the queue was dropped, as asyncio's buffer is
    finally:
        writer.close()
        server.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("how", ["abort", "abort_clients"])
@pytest.mark.asyncio
async def test_a_drain_cut_by_an_abort_raises_connection_reset_as_asyncio(
    how: str, tls: bool, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    # A handler blocked in drain() when its connection is aborted (by
    # Server.abort_clients(), or by another task's transport.abort()):
    # asyncio's drain() raises ConnectionResetError there, and a handler
    # written for it catches that. slabnet's LocalAbortError was only a
    # ConnectionAbortedError, so it escaped such a handler, and the loop
    # logged "Unhandled exception in client_connected_cb".
    loop = asyncio.get_running_loop()
    if how == "abort_clients" and (
        sys.version_info < (3, 13) or type(loop).__module__.startswith("uvloop")
    ):
        pytest.skip("Server.abort_clients() is new in 3.13, and uvloop's Server has none")
    contexts: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda loop, context: contexts.append(context))
    blocked: asyncio.Future[slabnet.StreamWriter] = loop.create_future()
    caught: asyncio.Future[BaseException] = loop.create_future()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        shrink(writer.get_extra_info("socket"))
        try:
            while True:
                writer.write(os.urandom(16) * 4096)
                if writer.transport.get_write_buffer_size() > 65536 and not blocked.done():
                    loop.call_soon(blocked.set_result, writer)
                await writer.drain()
        except ConnectionResetError as exc:
            caught.set_result(exc)

    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=tls_server_context if tls else None)
    kw: dict[str, Any] = {}
    if tls:
        kw = dict(ssl=tls_client_context, server_hostname="localhost")
    reader, writer = await connect_small(server.sockets[0].getsockname()[1], **kw)
    try:
        server_writer = await asyncio.wait_for(blocked, WAKE)
        if how == "abort":
            server_writer.transport.abort()
        else:
            server.close()
            getattr(server, how)()
        exc = await asyncio.wait_for(caught, WAKE)
        assert isinstance(exc, slabnet.LocalAbortError), repr(exc)
        await asyncio.sleep(0.01)  # (the handler's task has ended)
        assert contexts == []
    finally:
        loop.set_exception_handler(None)
        writer.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAKE)


# ------------------------------------------------ 13: one future per await


@pytest.mark.asyncio
async def test_a_timed_out_await_of_a_write_request_cancels_only_itself(
    small_listener: socket.socket,
) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await connect_small(small_listener.getsockname()[1])
    peer, _ = await loop.sock_accept(small_listener)
    peer.setblocking(False)
    payload = os.urandom(PAYLOAD)
    req = writer.write(payload)
    assert req is not None and not req.done()

    async def await_req() -> str:
        await req
        return "sent"

    other = asyncio.create_task(await_req())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(req, 0.1)  # nobody reads: it times out
    assert not other.done()
    assert not req.done()
    later = asyncio.create_task(await_req())
    data = await recv_exactly(peer, PAYLOAD, WAKE)
    assert data == payload
    assert await asyncio.wait_for(other, WAKE) == "sent"
    assert await asyncio.wait_for(later, WAKE) == "sent"
    await asyncio.wait_for(req, WAKE)
    assert req._waiters is None  # nothing left behind
    writer.close()
    peer.close()
    await writer.wait_closed()


@pytest.mark.asyncio
async def test_repeated_timeouts_on_a_write_request_leave_nothing_behind(
    small_listener: socket.socket,
) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await connect_small(small_listener.getsockname()[1])
    peer, _ = await loop.sock_accept(small_listener)
    req = writer.write(os.urandom(PAYLOAD))
    assert req is not None
    for _ in range(20):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(req, 0.001)
    assert not req._waiters
    writer.transport.abort()
    with pytest.raises(ConnectionAbortedError):
        await asyncio.wait_for(req, WAKE)  # the abort reaches a later await
    peer.close()
    await writer.wait_closed()


# ------------------------------------------------ 15: write() on a closed connection


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_write_after_close_is_dropped_and_drain_raises(
    echo_server: tuple[str, int], tls_echo_server: tuple[str, int],
    tls_client_context: ssl.SSLContext, tls: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    if tls:
        reader, writer = await slabnet.open_connection(
            *tls_echo_server, ssl=tls_client_context, server_hostname="localhost"
        )
    else:
        reader, writer = await slabnet.open_connection(*echo_server)
    writer.close()
    with caplog.at_level(logging.WARNING, logger="slabnet"):
        # As asyncio: silently dropped ...
        for _ in range(2):
            assert writer.write(b"late" * 10000) is None
            assert writer.writelines([b"late", b"r"]) is None
        assert not caplog.records
        await writer.wait_closed()
        # ... and from the fifth on, with a warning each.
        for _ in range(3):
            assert writer.write(b"later") is None
        assert [r.getMessage() for r in caplog.records] == [
            f"{writer.transport!r}: write() on a closed connection: data dropped"
        ] * 3
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(writer.drain(), WAKE)
    assert writer.transport.get_write_buffer_size() == 0


@pytest.mark.asyncio
async def test_write_after_peer_reset_or_abort_is_dropped(
    listener: socket.socket,
) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await slabnet.open_connection(*listener.getsockname())
    peer, _ = await loop.sock_accept(listener)
    hard_close(peer)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), WAKE)
    assert writer.write(b"x" * 100_000) is None
    assert writer.writelines([b"x"]) is None
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(writer.drain(), WAKE)
    writer.close()

    reader, writer = await slabnet.open_connection(*listener.getsockname())
    peer, _ = await loop.sock_accept(listener)
    writer.transport.abort()
    assert writer.write(b"x") is None
    assert writer.write(b"x" * 100_000) is None
    await writer.wait_closed()
    assert writer.write(b"x") is None
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(writer.drain(), WAKE)
    peer.close()
    # write_eof() still forbids writes loudly, as asyncio does.
    reader, writer = await slabnet.open_connection(*listener.getsockname())
    peer, _ = await loop.sock_accept(listener)
    writer.write_eof()
    with pytest.raises(RuntimeError, match="after write_eof"):
        writer.write(b"x")
    writer.close()
    peer.close()
    await writer.wait_closed()


# ------------------------------------------------ 18: abort in chunk_received


class AbortsOnFirstChunk(slabnet.ChunkProtocol):
    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )
        self.made: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.made.set_result(transport)

    def chunk_received(self, chunk: memoryview) -> None:
        self.chunks.append(len(chunk))
        self.transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_no_chunk_is_delivered_after_abort_in_chunk_received(
    listener: socket.socket, tls: bool, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    loop = asyncio.get_running_loop()
    app = AbortsOnFirstChunk()
    baseline = open_fds()
    # The client does not read until everything is in its receive buffer.
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    client.setblocking(False)
    await loop.sock_connect(client, listener.getsockname())
    peer, _ = await loop.sock_accept(listener)
    peer.setblocking(False)
    if tls:
        raw = RawTLS(peer, tls_server_context, server_side=True)
        handshake = asyncio.ensure_future(raw.handshake())
    ctx = tls_client_context if tls else None
    await loop.create_connection(
        lambda: slabnet.SlabProtocol(app, ssl=ctx, server_hostname="localhost" if tls else None),
        sock=client,
    )
    if tls:
        await asyncio.wait_for(handshake, WAKE)
    transport = await asyncio.wait_for(app.made, WAKE)
    transport.pause_reading()
    if tls:
        # Records of sizes that are not coalesced into one chunk: a batch.
        pieces = [os.urandom(1000 + (i % 7) * 1111) for i in range(200)]
        await raw.send(raw.seal(*pieces))
    else:
        await loop.sock_sendall(peer, os.urandom(512 * 1024))
    await asyncio.sleep(0.1)  # all of it is in the client's receive buffer
    transport.resume_reading()
    exc = await asyncio.wait_for(app.lost, WAKE)
    assert isinstance(exc, ConnectionAbortedError), exc
    assert len(app.chunks) == 1, app.chunks
    peer.close()
    assert await fds_settle(baseline) <= baseline


# ------------------------------------------------ 18: read-only views of mutable buffers


def mutable_views(size: int) -> tuple[bytearray, memoryview]:
    buf = bytearray(os.urandom(size))
    return buf, memoryview(buf).toreadonly()


@pytest.mark.parametrize("how", ["write", "writelines", "behind_small_writes"])
@pytest.mark.asyncio
async def test_queued_read_only_view_of_a_mutable_buffer_is_copied(
    small_listener: socket.socket, how: str,
) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await connect_small(small_listener.getsockname()[1])
    peer, _ = await loop.sock_accept(small_listener)
    peer.setblocking(False)
    buf, view = mutable_views(PAYLOAD)
    expected = bytes(buf)
    if how == "write":
        writer.write(view)
    elif how == "writelines":
        writer.writelines([b"head", view])
        expected = b"head" + expected
    else:
        writer.write(b"small")  # pooled: the view queues behind it
        writer.write(view)
        expected = b"small" + expected
    assert writer.transport.get_write_buffer_size() > 0  # (some of it waits)
    buf[:] = bytes(len(buf))  # the caller reuses its buffer
    writer.write_eof()
    assert await sock_read_to_end(peer) == expected
    writer.close()
    peer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("how", ["write", "writelines"])
@pytest.mark.asyncio
async def test_tls_read_only_view_of_a_mutable_buffer_is_copied(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext, how: str,
) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()

    async def collect(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        done.set_result(await reader.read())
        writer.close()

    server = await slabnet.start_server(collect, "127.0.0.1", 0, ssl=tls_server_context)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=tls_client_context, server_hostname="localhost"
    )
    buf, view = mutable_views(10_000)  # below CORK_LIMIT: encrypted at the end of the iteration
    expected = bytes(buf)
    if how == "write":
        writer.write(view)
    else:
        writer.writelines([view])
    buf[:] = bytes(len(buf))  # before the end of the iteration encrypts it
    writer.close()
    assert await asyncio.wait_for(done, WAKE) == expected
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_queued_chunk_of_the_read_slab_is_not_copied(
    small_listener: socket.socket, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy is only for buffers that can change: a chunk of the read
    slab and ``bytes`` queue as they are."""
    import slabnet._transport as transport_mod

    copies = []
    real_keep = transport_mod._keep

    def counting_keep(view: memoryview) -> memoryview:
        kept = real_keep(view)
        if kept is not view:
            copies.append(view.nbytes)
        return kept

    monkeypatch.setattr(transport_mod, "_keep", counting_keep)
    loop = asyncio.get_running_loop()
    # Default buffers on our side, so one read takes a whole slab.
    reader, writer = await slabnet.open_connection(*small_listener.getsockname())
    peer, _ = await loop.sock_accept(small_listener)
    peer.setblocking(False)
    writer.transport.pause_reading()
    await loop.sock_sendall(peer, os.urandom(64 * 1024))
    await asyncio.sleep(0.1)
    writer.transport.resume_reading()
    chunk = await asyncio.wait_for(reader.read_chunk(), WAKE)
    if len(chunk) <= _PAUSED_READ:  # (a read made while paused holds a copy)
        chunk = await asyncio.wait_for(reader.read_chunk(), WAKE)
    assert type(chunk.obj).__name__ == "_Slab"
    big = os.urandom(PAYLOAD)
    writer.write(big)
    writer.write(chunk)  # queued behind the big write
    assert writer.transport.get_write_buffer_size() > chunk.nbytes
    writer.write_eof()
    assert await sock_read_to_end(peer) == big + bytes(chunk)
    assert copies == []
    writer.close()
    peer.close()
    await writer.wait_closed()


@pytest.mark.asyncio
async def test_tls_chunks_echoed_over_tls_are_not_copied(
    monkeypatch: pytest.MonkeyPatch, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    """A TLS chunk owns a buffer that nobody changes after it was filled
    (``bytes``, joined from its records when a read brought several), so
    echoing it queues it as it is; so do the reader's coalesced small chunks
    (slabnet's ``_Sealed``)."""
    import slabnet._transport as transport_mod

    copies: list[str] = []
    real_keep = transport_mod._keep

    def counting_keep(view: memoryview) -> memoryview:
        kept = real_keep(view)
        if kept is not view:
            copies.append(type(view.obj).__name__)
        return kept

    monkeypatch.setattr(transport_mod, "_keep", counting_keep)
    owners: set[str] = set()
    go = asyncio.Event()

    async def echo(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await go.wait()  # every record is there: one read brings them all
        async for chunk in reader.chunks():
            owners.add(type(chunk.obj).__name__)
            writer.write(chunk)
            await writer.drain()
        writer.close()

    server = await slabnet.start_server(echo, "127.0.0.1", 0, ssl=tls_server_context)
    try:
        reader, writer = await slabnet.open_connection(
            *server.sockets[0].getsockname()[:2], ssl=tls_client_context,
            server_hostname="localhost",
        )
        payload = os.urandom(60_000)
        # Records of unequal sizes (one flush per iteration), so that the
        # server's chunks are joined from several records into one buffer.
        i = 0
        for size in itertools.cycle((700, 3100, 9000, 1500, 12000)):
            writer.write(payload[i : i + size])
            i += size
            if i >= len(payload):
                break
            await asyncio.sleep(0)
        await writer.drain()
        await asyncio.sleep(0)  # the last end-of-iteration flush
        await wait_acked(writer.get_extra_info("socket"))
        go.set()
        async with asyncio.timeout(WAKE):
            assert await reader.readexactly(len(payload)) == payload
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert owners <= {"_Sealed", "bytes"}, owners
    assert copies == []


# ------------------------------------------------ 19: any bytes-like object, any layout


async def written_through(tls: bool, request: Any, write: Any) -> bytes:
    """What a slabnet server reads to EOF after a slabnet client's
    ``write(writer)`` and close; the close must end (no wedged queue)."""
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        data, exc = await read_to_end(reader)
        if not got.done():
            got.set_result(data if exc is None else data + repr(exc).encode())
        writer.close()

    server_ssl = request.getfixturevalue("tls_server_context") if tls else None
    client_ssl = request.getfixturevalue("tls_client_context") if tls else None
    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ssl)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(WAKE):
            _, writer = await slabnet.open_connection(
                "127.0.0.1", port, ssl=client_ssl,
                server_hostname="localhost" if tls else None,
            )
            try:
                write(writer)
            finally:
                writer.close()
            await writer.wait_closed()
            return await got
    finally:
        server.close()
        await server.wait_closed()


def one_byte_formats() -> list[Any]:
    """Buffers of 1-byte items in formats other than "B"."""
    import array
    import ctypes

    return [
        memoryview(b"c1").cast("c"),
        array.array("b", b"b2"),
        ctypes.create_string_buffer(b"t3", 2),  # format "<c"
        memoryview(bytearray(b"m4")).cast("b"),
    ]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_writes_of_one_byte_items_in_any_format_are_sent(
    tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A buffer of 1-byte items whose format is not "B" ("c", "b", ctypes'
    "<c"), as asyncio's loops send it. slabnet's gathered small write raised
    ValueError from its copy into the shared write pool, after taking a
    region of it, and the connection's next gathered write then sent the
    bytes of an earlier region: possibly another connection's."""
    big = memoryview(os.urandom(100_000)).cast("c")
    expected = [b"<"]

    def write(writer: slabnet.StreamWriter) -> None:
        writer.write(b"<")  # (at once: the ones below are gathered)
        for buf in one_byte_formats():
            writer.write(buf)
            expected.append(bytes(memoryview(buf)))
        writer.writelines(one_byte_formats())
        expected.extend(bytes(memoryview(b)) for b in one_byte_formats())
        writer.write(big)
        expected.append(big.tobytes())
        writer.write(b">")
        expected.append(b">")

    assert await written_through(tls, request, write) == b"".join(expected)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("how", ["behind_small_writes", "writelines_past_iov_max", "alone"])
@pytest.mark.asyncio
async def test_a_strided_view_is_sent_and_the_close_completes(
    tls: bool, how: str, request: pytest.FixtureRequest,
) -> None:
    """A non-contiguous memoryview (``view[::2]``) is bytes-like: it is sent
    (copied: the kernel and OpenSSL take only contiguous memory). slabnet
    queued it uncopied when it had to wait, its writev raised BufferError
    at the head of the queue for good: the bytes written before it never
    arrived, close() raised, wait_closed() hung and the peer saw no EOF
    (over TLS the write aborted the connection)."""
    strided = memoryview(os.urandom(600_000))[::2]
    expected: list[bytes] = []

    def write(writer: slabnet.StreamWriter) -> None:
        if how != "alone":  # (alone: nothing ahead of it, it goes at once)
            writer.write(b"A")
            writer.write(b"B")  # gathered: what follows queues behind it
            expected.extend([b"A", b"B"])
        if how == "writelines_past_iov_max":
            ones = [b"%d" % (i % 10) for i in range(1100)]
            writer.writelines([*ones, strided])
            expected.extend(ones)
        else:
            writer.write(strided)
        expected.append(strided.tobytes())
        writer.write(memoryview(b"-C-")[::2])  # a small one
        expected.append(b"--")

    assert await written_through(tls, request, write) == b"".join(expected)


@pytest.mark.asyncio
async def test_a_gathered_copy_that_raises_leaves_the_queue_as_it_was() -> None:
    """(sans-IO) If the copy into a freshly carved region of the shared pool
    raises, the queue does not point at that region with the previous
    region's bounds: the next write queues its own bytes, not bytes the
    pool held before (another connection's)."""
    from slabnet import _pool
    from slabnet import _write as write_mod

    pool = _pool.BufferPool()
    mine, other = write_mod.OutQueue(), write_mod.OutQueue()
    mine.gather(pool, b"old", 3)
    other.gather(pool, b"secret", 6)  # carved since: mine starts a new region
    with pytest.raises((ValueError, TypeError)):
        mine.gather(pool, memoryview(b"cc").cast("c"), 2)  # (the shell casts to "B" first)
    mine.gather(pool, b"new", 3)
    assert b"".join(bytes(b) for b in mine.buffers()) == b"oldnew"
    assert mine.queued == 6


# ------------------------------------------------ a reset the loop read first


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_a_reset_the_loop_read_first_is_a_reset_for_every_waiter(side: str) -> None:
    """The loop's transport reads the peer's RST and starts closing; its
    ``connection_lost`` is still queued when the app writes. The kernel
    refuses that send with EPIPE, but the connection was reset: ``drain()``,
    ``read()`` and ``wait_closed()`` raise ``ConnectionResetError``, as
    asyncio's do on both loops. (On uvloop slabnet's own send error won,
    and all three raised ``BrokenPipeError``.)"""
    loop = asyncio.get_running_loop()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    served: asyncio.Future[tuple[Any, Any]] = loop.create_future()
    server = None
    try:
        if side == "client":
            reader, writer = await slabnet.open_connection(*lsock.getsockname())
            peer, _ = await loop.sock_accept(lsock)
        else:
            server = await slabnet.start_server(
                lambda r, w: served.set_result((r, w)), sock=lsock
            )
            peer = socket.create_connection(lsock.getsockname())
            reader, writer = await asyncio.wait_for(served, WAKE)
        hard_close(peer)
        raw = writer.transport._raw
        async with asyncio.timeout(WAKE):
            while not raw.is_closing():  # the loop has read the reset
                await asyncio.sleep(0)
            writer.write(b"x" * 200_000)  # (sent at once: large)
            with pytest.raises(ConnectionResetError):
                await writer.drain()
            with pytest.raises(ConnectionResetError):
                await reader.read()
            with pytest.raises(ConnectionResetError):
                await writer.wait_closed()
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
        lsock.close()


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_a_tls_writer_whose_peer_reset_is_told_by_drain(
    side: str, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """A TLS connection whose peer reset it mid-stream: the send below the
    TLS layer fails, or the loop reads the RST, and that plain connection
    is closing while the TLS layer still said ``is_closing()`` False. A
    streaming loop of ``write(); await drain()`` then never yielded:
    ``drain()`` returned at once, the writes were dropped with a warning
    each, and the loop served no one else for good (here: 1,000 rounds and
    no error). Now ``drain()`` lets ``connection_lost`` run and raises the
    reset, as it does over plain TCP."""
    loop = asyncio.get_running_loop()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    served: asyncio.Future[tuple[Any, Any]] = loop.create_future()
    server = None
    raw: RawTLS
    try:
        if side == "client":
            connecting = asyncio.ensure_future(slabnet.open_connection(
                *lsock.getsockname(), ssl=tls_client_context, server_hostname="localhost",
            ))
            conn, _ = await loop.sock_accept(lsock)
            raw = RawTLS(conn, tls_server_context, server_side=True)
            await asyncio.wait_for(raw.handshake(), WAKE)
            _, writer = await asyncio.wait_for(connecting, WAKE)
        else:
            server = await slabnet.start_server(
                lambda r, w: served.set_result((r, w)), sock=lsock, ssl=tls_server_context,
            )
            conn = socket.create_connection(lsock.getsockname())
            raw = RawTLS(conn, tls_client_context, server_side=False, server_hostname="localhost")
            await asyncio.wait_for(raw.handshake(), WAKE)
            _, writer = await asyncio.wait_for(served, WAKE)
        hard_close(raw.sock)
        frame = b"x" * 65536
        with pytest.raises(ConnectionError):
            for _ in range(1000):  # (bounded: before, this never raised nor yielded)
                writer.write(frame)
                await writer.drain()
        assert writer.is_closing()
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
        lsock.close()
