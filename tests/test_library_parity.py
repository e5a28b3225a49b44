"""Where slabnet's streams and asyncio's disagreed, found by running
third-party libraries (redis-py's asyncio client, hypercorn) and their own
test suites over slabnet's streams instead of asyncio's.

Each test reproduces what the library ran into without the library: a
slabnet stream on loopback sockets against a raw peer. Every test runs on
the asyncio loop and on uvloop, and bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import random
import socket
import ssl
from collections.abc import Callable
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, server_ctx
from test_asyncio_parity import connect, until

WAKE = 5.0  # seconds any waiter may take to wake


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


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of ``sock`` (TCP_INFO's first byte)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


TCP_CLOSE = 7  # include/net/tcp_states.h: what a reset leaves


async def eof_after_reset(
    open_connection: Callable[..., Any], listener: socket.socket
) -> tuple[int | None, int | None]:
    """write_eof() once the peer's reset has come, then close(): the errno
    each of write_eof() and wait_closed() raised (None: none)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(open_connection(*listener.getsockname()))
        peer, _ = await loop.sock_accept(listener)
        reader, writer = await opening
    peer.close()  # FIN; what we write next is answered with a reset
    raised: list[int | None] = []
    try:
        async with asyncio.timeout(WAKE):
            assert await reader.read() == b""
            writer.write(b"x")
            await writer.drain()
        sock = writer.get_extra_info("socket")
        await until(lambda: tcp_state(sock) == TCP_CLOSE, "the peer's reset")
        try:
            writer.write_eof()
        except OSError as exc:
            raised.append(exc.errno)
        else:
            raised.append(None)
    finally:
        writer.close()
    try:
        async with asyncio.timeout(WAKE):
            await writer.wait_closed()
    except OSError as exc:
        raised.append(exc.errno)
    else:
        raised.append(None)
    return raised[0], raised[1]


@pytest.mark.asyncio
async def test_write_eof_after_reset_fails_as_the_loops_own(
    listener: socket.socket, loop_name: str
) -> None:
    # hypercorn ends a connection with write_eof() (OSError caught), then
    # close() and wait_closed() (only ConnectionError and RuntimeError
    # caught). A client that went away mid-request leaves a reset behind
    # the response: on the asyncio loop asyncio's write_eof() raises
    # ENOTCONN and the close is clean. slabnet took the error for the
    # connection's loss instead, so wait_closed() raised it and the
    # handler died ("Unhandled exception in client_connected_cb") without
    # telling the app the client had gone. uvloop reports the failure as
    # the loss (here, with close() right behind, not at all), for its
    # streams and slabnet's alike.
    theirs = await eof_after_reset(asyncio.open_connection, listener)
    ours = await eof_after_reset(slabnet.open_connection, listener)
    assert ours == theirs
    if loop_name == "asyncio":
        assert ours == (errno.ENOTCONN, None)


@pytest.mark.asyncio
async def test_loop_start_tls_upgrades_a_slabnet_connection(
    listener: socket.socket, server_cert: Any, tls_ca: Any, loop_name: str
) -> None:
    # nats-py reads the server's INFO over plain TCP, then upgrades with
    # loop.start_tls(writer.transport, asyncio.StreamReaderProtocol(...))
    # and wraps the result in asyncio's own reader and writer. The asyncio
    # loop's start_tls() refused slabnet's transport (TypeError: "is not
    # supported by start_tls()"), and set_protocol() took only a
    # ChunkProtocol, so no TLS connection to NATS could be made. uvloop's
    # start_tls() takes only uvloop's own transports: there it stays a
    # TypeError, as the README says.
    loop = asyncio.get_running_loop()
    reader, writer, peer = await connect(listener)
    try:
        await loop.sock_sendall(peer, b"INFO {}\r\n")
        async with asyncio.timeout(WAKE):
            assert await reader.readline() == b"INFO {}\r\n"
        tls_reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(tls_reader)
        upgrade = loop.start_tls(
            writer.transport, protocol, client_ctx(tls_ca), server_hostname="localhost"
        )
        if loop_name == "uvloop":
            with pytest.raises(TypeError, match="not supported by start_tls"):
                await upgrade
            return
        tls = RawTLS(peer, server_ctx(server_cert), server_side=True)
        async with asyncio.timeout(WAKE):
            transport, _ = await asyncio.gather(upgrade, tls.handshake())
        tls_writer = asyncio.StreamWriter(transport, protocol, tls_reader, loop)
        assert transport.get_extra_info("ssl_object") is not None
        big = bytes(range(256)) * 1024  # several records, several chunks
        async with asyncio.timeout(WAKE):
            tls_writer.write(b"CONNECT {}\r\n")
            await tls_writer.drain()
            assert await tls.recv_plain(12) == b"CONNECT {}\r\n"
            await tls.send(tls.seal(b"+OK\r\n", big))
            assert await tls_reader.readline() == b"+OK\r\n"
            assert await tls_reader.readexactly(len(big)) == big
            await tls.send(tls.close_notify())
            assert await tls_reader.read() == b""
            tls_writer.close()
            await tls_writer.wait_closed()
        assert writer.transport.is_closing()
    finally:
        writer.close()
        peer.close()


@pytest.mark.asyncio
async def test_bytes_put_back_through_buffer_come_first(listener: socket.socket) -> None:
    # pproxy serves HTTP, SOCKS4/5 and more on one port: each protocol's
    # guess() reads the first byte(s) and puts them back with
    # reader._buffer[0:0] = header (asyncio's bytearray) for the next guess
    # or for the protocol that matched. slabnet's _buffer was a bytes copy,
    # so the put-back raised TypeError, pproxy dropped the connection, and
    # no client could use a pproxy server over slabnet.
    reader, writer, peer = await connect(listener)
    loop = asyncio.get_running_loop()
    try:
        request = b"CONNECT example.org:443 HTTP/1.1\r\n\r\n"
        await loop.sock_sendall(peer, request + b"\x16\x03\x01")
        async with asyncio.timeout(WAKE):
            header = await reader.read(1)  # (what arrived comes as one read)
            assert header == b"C"
            reader._buffer[0:0] = header  # not SOCKS: put back, try HTTP
            header = await reader.readexactly(7)
            assert header == b"CONNECT"
            reader._buffer[0:0] = header
            assert await reader.readuntil(b"\r\n\r\n") == request
            assert await reader.readexactly(3) == b"\x16\x03\x01"
            # Put back into an empty buffer: a read waiting in another
            # task (pproxy's channel) gets it.
            pending = asyncio.ensure_future(reader.read(100))
            await asyncio.sleep(0)
            reader._buffer[0:0] = bytearray(b"back")
            assert await pending == b"back"
            reader._buffer[:0] = b"again"
            await loop.sock_sendall(peer, b" and more")
            await until(lambda: len(reader._buffer) == 14, "14 bytes buffered")
            assert await reader.readexactly(14) == b"again and more"
        with pytest.raises(TypeError):
            reader._buffer[0:1] = b"x"  # only a put-back in front
        with pytest.raises(TypeError):
            del reader._buffer[:1]
    finally:
        writer.close()
        peer.close()


def _xor(data: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in data)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_a_feed_data_put_in_place_on_a_reader_hears_every_read(
    server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    # pproxy's shadowsocks ciphers (and its websocket unframing) replace
    # feed_data on a connection's reader with one that decrypts and calls
    # the replaced one, and feed what was already buffered through it:
    # reader._buffer, buf = bytearray(), reader._buffer. asyncio's protocol
    # calls reader.feed_data() for every read. slabnet's handed chunks to
    # the reader without it, and _buffer could not be assigned: no byte
    # ever reached the cipher.
    head = b"buffered before the cipher was in place, "
    rest = b"and everything after it. " * 2000  # many reads; TLS: many records
    kinds: set[type] = set()
    result: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            assert await reader.readexactly(4) == b"key:"
            await until(lambda: len(reader._buffer) == len(head), "the head buffered")
            reader._buffer, buf = bytearray(), reader._buffer  # pproxy's moves
            assert not reader._buffer

            def feed_data(data: bytes, feed: Callable[[bytes], None] = reader.feed_data) -> None:
                if data is not buf:
                    kinds.add(type(data))  # what the connection passes
                feed(_xor(data))

            reader.feed_data = feed_data  # type: ignore[method-assign]
            feed_data(buf)
            writer.write(b"ok")
            result.set_result(await reader.readexactly(len(head) + len(rest)))
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            raise
        finally:
            writer.close()

    server = await slabnet.start_server(
        handle, "127.0.0.1", 0, ssl=server_ctx(server_cert) if tls else None
    )
    try:
        async with asyncio.timeout(WAKE):
            reader, writer = await asyncio.open_connection(
                *server.sockets[0].getsockname()[:2],
                ssl=client_ctx(tls_ca) if tls else None,
                server_hostname="localhost" if tls else None,
            )
            writer.write(b"key:" + _xor(head))
            assert await reader.readexactly(2) == b"ok"
            writer.write(_xor(rest))
            assert await result == head + rest
            writer.close()
    finally:
        server.close()
    assert kinds == {bytes}, "bytes, as asyncio's protocol passes"


@pytest.mark.asyncio
async def test_a_reader_subclass_with_its_own_feed_data_hears_every_read(
    listener: socket.socket,
) -> None:
    # A StreamReader subclass that defines feed_data (to count, unframe or
    # decode) expects it to be called for every read, as asyncio's
    # protocol calls it. slabnet's transport went past it.
    loop = asyncio.get_running_loop()

    class Upper(slabnet.StreamReader):
        def feed_data(self, data: bytes | bytearray | memoryview) -> None:
            super().feed_data(bytes(data).upper())

    reader = Upper()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(loop.create_connection(
            lambda: slabnet.SlabProtocol(slabnet._streams._StreamProtocol(reader)),
            *listener.getsockname(),
        ))
        peer, _ = await loop.sock_accept(listener)
        transport, _ = await opening
    try:
        await loop.sock_sendall(peer, b"shouted ")
        await until(lambda: len(reader._buffer) == 8, "the first read buffered")
        await loop.sock_sendall(peer, b"from the start")
        peer.close()
        async with asyncio.timeout(WAKE):
            assert await reader.read() == b"SHOUTED FROM THE START"
    finally:
        transport.close()
        peer.close()


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_tls_inside_tls_through_a_tls_proxy(
    server_cert: Any, tls_ca: Any, side: str
) -> None:
    # python-socks reaches a TLS destination through a TLS proxy: TLS to
    # the proxy, the proxy's CONNECT, then writer.start_tls() on that TLS
    # connection, so that the destination's records travel as the proxy
    # connection's plaintext. asyncio's streams run the second session
    # inside the first on both loops; slabnet raised "RuntimeError: the
    # connection already uses TLS". Here slabnet is one end and asyncio's
    # streams the other (side: slabnet's end).
    payload = random.Random(7).randbytes(1 << 20)
    result: asyncio.Future[tuple[bytes, bytes]] = asyncio.get_running_loop().create_future()

    async def client(reader: Any, writer: Any) -> None:
        outer = writer.transport
        writer.write(b"CONNECT destination:443\n")
        assert await reader.readline() == b"OK\n"
        await writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
        assert writer.transport is not outer
        assert writer.get_extra_info("ssl_object") is not outer.get_extra_info("ssl_object")
        writer.write(payload)
        result.set_result((await reader.readexactly(32), await reader.readexactly(len(payload))))
        writer.close()
        await writer.wait_closed()

    async def server(reader: Any, writer: Any) -> None:
        try:
            assert await reader.readline() == b"CONNECT destination:443\n"
            writer.write(b"OK\n")
            await writer.drain()
            await writer.start_tls(server_ctx(server_cert))
            data = await reader.readexactly(len(payload))
            writer.write(hashlib.sha256(data).digest() + data[::-1])
            await writer.drain()
            assert await reader.read() == b""  # the inner session's close_notify
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            raise
        finally:
            writer.close()

    serve, connect_to = (
        (asyncio.start_server, slabnet.open_connection) if side == "client"
        else (slabnet.start_server, asyncio.open_connection)
    )
    listening = await serve(server, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    try:
        async with asyncio.timeout(WAKE):
            reader, writer = await connect_to(
                *listening.sockets[0].getsockname()[:2],
                ssl=client_ctx(tls_ca), server_hostname="localhost",
            )
            await client(reader, writer)
            digest, back = await result
        assert digest == hashlib.sha256(payload).digest()
        assert back == payload[::-1]
    finally:
        listening.close()


async def read_after_close(
    start_server: Callable[..., Any], server_cert: Any, tls_ca: Any
) -> tuple[bytes | BaseException, BaseException | None]:
    """A TLS server reads a line and closes; the client's data (and then
    its close_notify) come after that close(). What the server's read()
    returned after its close() (or raised), and what wait_closed() raised."""
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    result: asyncio.Future[tuple[bytes | BaseException, BaseException | None]] = (
        loop.create_future()
    )

    async def handle(reader: Any, writer: Any) -> None:
        try:
            assert await reader.readline() == b"GET /a\n"
            writer.close()
            closed.set()
            read: bytes | BaseException
            try:
                read = await reader.read()
            except Exception as exc:
                read = exc
            try:
                await writer.wait_closed()
            except Exception as exc:
                result.set_result((read, exc))
            else:
                result.set_result((read, None))
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            raise

    server = await start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    sock = socket.create_connection(server.sockets[0].getsockname()[:2])
    try:
        tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
        async with asyncio.timeout(WAKE):
            await tls.handshake()
            await tls.send(tls.seal(b"GET /a\n"))
            await closed.wait()
            # Sent after the server's close(); the client has not read the
            # close_notify yet, so to it the connection is still open.
            await tls.send(tls.seal(b"GET /b\n", b"x" * 100_000) + tls.close_notify())
            return await result
    finally:
        sock.close()
        server.close()


@pytest.mark.asyncio
async def test_tls_data_after_close_is_not_delivered(
    server_cert: Any, tls_ca: Any, loop_name: str
) -> None:
    # hypercorn closes an idle HTTP/2 connection (keep-alive timeout) with
    # writer.close(); a request the client sent at the same moment comes
    # after the close_notify. Neither loop's SSL transport gives the app
    # data after its close(): uvloop drops it, the asyncio loop fails the
    # connection (SSLError APPLICATION_DATA_AFTER_CLOSE_NOTIFY). slabnet
    # delivered it: hypercorn's reader, still reading, handed the request
    # to a protocol it had closed, which started a stream on the closed
    # connection; at shutdown its handler died with "Unhandled exception
    # in client_connected_cb" (RuntimeError: TaskGroup is shutting down).
    # slabnet drops it on both loops, as uvloop does.
    theirs, _ = await read_after_close(asyncio.start_server, server_cert, tls_ca)
    if loop_name == "uvloop":
        assert theirs == b""
    else:
        assert isinstance(theirs, ssl.SSLError), theirs
    assert await read_after_close(slabnet.start_server, server_cert, tls_ca) == (b"", None)
