"""TLS inside TLS: ``writer.start_tls()`` on a connection that already uses
TLS runs a second session inside the first (a TLS destination through a TLS
proxy), as asyncio's streams do on both loops.

The far end is real: slabnet's own servers running the same nesting, or
``Nested``, a raw peer whose outer session is a ``conftest.RawTLS`` on the
socket and whose inner session is an ``ssl.SSLObject`` whose records travel
as the outer session's plaintext, so the test picks every byte at each
layer. Where asyncio's streams behave otherwise, the test says what they do.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, hard_close, server_ctx, wait_acked
from test_asyncio_parity import until

WAKE = 10.0  # seconds any waiter may take to wake


class Nested:
    """The far end of a TLS connection that carries a second TLS session:
    ``outer`` is the socket's session (a ``RawTLS``), ``inner`` an
    ``SSLObject`` whose records are ``outer``'s plaintext."""

    def __init__(
        self, sock: socket.socket, outer_ctx: ssl.SSLContext, inner_ctx: ssl.SSLContext,
        *, server_side: bool = True, server_hostname: str | None = None,
    ) -> None:
        self.outer = RawTLS(
            sock, outer_ctx, server_side=server_side, server_hostname=server_hostname
        )
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.inner = inner_ctx.wrap_bio(
            self.incoming, self.outgoing, server_side=server_side,
            server_hostname=server_hostname,
        )

    async def pull(self) -> None:
        """Move the outer session's next plaintext into the inner's BIO."""
        while True:
            try:
                data = self.outer.obj.read(1 << 20)
            except ssl.SSLWantReadError:
                await self.outer.flush()
                await self.outer._pull()
                continue
            if not data:
                raise EOFError("outer close_notify")
            self.incoming.write(data)
            return

    async def flush(self) -> None:
        data = self.outgoing.read()
        if data:
            await self.outer.send(self.outer.seal(data))

    async def handshake(self) -> None:
        while True:
            try:
                self.inner.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self.flush()
                await self.pull()
        await self.flush()

    async def send(self, data: bytes) -> None:
        self.inner.write(data)
        await self.flush()

    async def recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                piece = self.inner.read(n - len(out))
            except ssl.SSLWantReadError:
                await self.flush()
                await self.pull()
                continue
            if not piece:
                raise EOFError(f"inner close_notify after {len(out)} bytes")
            out += piece
        return bytes(out)

    def inner_close_notify(self) -> bytes:
        """The inner session's close_notify, as outer ciphertext."""
        try:
            self.inner.unwrap()
        except ssl.SSLWantReadError:
            pass
        return self.outer.seal(self.outgoing.read())

    async def inner_end(self) -> str:
        """Read the inner session to its end: "close_notify", or what ended it."""
        try:
            async with asyncio.timeout(WAKE):
                extra = await self.recv(1)
        except ssl.SSLZeroReturnError:
            return "close_notify"
        except EOFError as exc:
            return "close_notify" if str(exc).startswith("inner") else "outer close_notify"
        except (ssl.SSLError, OSError) as exc:
            return repr(exc)
        return f"data {extra!r}"

    async def outer_end(self) -> tuple[str, bytes]:
        """Read the outer session to its end: ("close_notify" | "eof" |
        "reset", the outer plaintext that came before it)."""
        loop = asyncio.get_running_loop()
        extra = b""
        try:
            async with asyncio.timeout(WAKE):
                while True:
                    try:
                        data = self.outer.obj.read(1 << 20)
                    except ssl.SSLWantReadError:
                        wire = await loop.sock_recv(self.outer.sock, 65536)
                        if not wire:
                            return "eof", extra
                        self.outer.incoming.write(wire)
                        continue
                    except ssl.SSLZeroReturnError:
                        return "close_notify", extra
                    if not data:
                        return "close_notify", extra
                    extra += data
        except ConnectionResetError:
            return "reset", extra


async def open_nested(
    listener: socket.socket, server_cert: Any, tls_ca: Any, *,
    inner: bool = True, limit: int = 2**16, ssl_shutdown_timeout: float | None = None,
) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, Nested]:
    """A slabnet client with TLS to a ``Nested`` peer (accepted on
    ``listener``), and, if ``inner``, the second session inside it (with
    that ``ssl_shutdown_timeout``)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(slabnet.open_connection(
            *listener.getsockname(), ssl=client_ctx(tls_ca), server_hostname="localhost",
            limit=limit,
        ))
        sock, _ = await loop.sock_accept(listener)
        peer = Nested(sock, server_ctx(server_cert), server_ctx(server_cert))
        await peer.outer.handshake()
        reader, writer = await opening
        if inner:
            upgrading = asyncio.ensure_future(writer.start_tls(
                client_ctx(tls_ca), server_hostname="localhost",
                ssl_shutdown_timeout=ssl_shutdown_timeout,
            ))
            await peer.handshake()
            await upgrading
    return reader, writer, peer


OpenNested = Callable[..., Awaitable[tuple[slabnet.StreamReader, slabnet.StreamWriter, Nested]]]


@pytest.fixture
def nested(listener: socket.socket, server_cert: Any, tls_ca: Any) -> Iterator[OpenNested]:
    """``await nested(**kw)`` is ``open_nested(listener, server_cert, tls_ca,
    **kw)``; the peers' sockets are closed after the test, however it ends."""
    peers: list[Nested] = []

    async def open_(**kw: Any) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, Nested]:
        reader, writer, peer = await open_nested(listener, server_cert, tls_ca, **kw)
        peers.append(peer)
        return reader, writer, peer

    yield open_
    for peer in peers:
        peer.outer.sock.close()


def layers(writer: slabnet.StreamWriter) -> tuple[Any, Any, Any]:
    """The inner TLS transport, the outer one, and the plain connection."""
    inner = writer.transport
    outer = inner._lower  # type: ignore[attr-defined]
    return inner, outer, outer._lower


async def wait_closed(writer: slabnet.StreamWriter) -> None:
    async with asyncio.timeout(WAKE):
        await writer.wait_closed()


# ---------------------------------------------------------------- bulk data


@pytest.mark.asyncio
async def test_large_transfer_both_ways_through_nested_sessions(
    server_cert: Any, tls_ca: Any
) -> None:
    # slabnet at both ends, each running the inner session inside the outer:
    # 8 MiB each way at once, a small high-water mark on the client's inner
    # writer and a reader on each side that takes small pieces.
    n = 8 << 20
    up_payload = random.Random(1).randbytes(n)
    down_payload = random.Random(2).randbytes(n)
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def send_all(writer: slabnet.StreamWriter, data: bytes) -> None:
        for i in range(0, len(data), 1 << 16):
            writer.write(data[i:i + (1 << 16)])
            await writer.drain()

    async def read_all(reader: slabnet.StreamReader, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            piece = await reader.read(1 << 13)
            assert piece, f"EOF after {len(out)} bytes"
            out += piece
        return bytes(out)

    async def proxy_and_destination(reader: Any, writer: Any) -> None:
        try:
            assert await reader.readline() == b"CONNECT\n"
            writer.write(b"OK\n")
            await writer.drain()
            await writer.start_tls(server_ctx(server_cert))
            sending = asyncio.ensure_future(send_all(writer, down_payload))
            received.set_result(await read_all(reader, n))
            await sending
            assert await reader.read() == b""
        except BaseException as exc:
            if not received.done():
                received.set_exception(exc)
            raise
        finally:
            writer.close()

    server = await slabnet.start_server(
        proxy_and_destination, "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    try:
        async with asyncio.timeout(45):
            reader, writer = await slabnet.open_connection(
                *server.sockets[0].getsockname()[:2],
                ssl=client_ctx(tls_ca), server_hostname="localhost",
            )
            writer.write(b"CONNECT\n")
            assert await reader.readline() == b"OK\n"
            await writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
            writer.transport.set_write_buffer_limits(high=1 << 15)
            sending = asyncio.ensure_future(send_all(writer, up_payload))
            back = await read_all(reader, n)
            await sending
            got = await received
            writer.close()
            await writer.wait_closed()
        assert hashlib.sha256(got).digest() == hashlib.sha256(up_payload).digest()
        assert hashlib.sha256(back).digest() == hashlib.sha256(down_payload).digest()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_inner_drain_blocks_while_the_outer_connection_is_full(
    nested: OpenNested
) -> None:
    # The peer reads nothing: the plain connection's queue fills, the outer
    # layer pauses the inner one, and the inner writer's drain() waits; the
    # queued bytes are the inner transport's write buffer. Then the peer
    # reads everything, in order.
    reader, writer, peer = await nested()
    inner, outer, plain = layers(writer)
    try:
        writer.transport.set_write_buffer_limits(high=1 << 16)
        payload = random.Random(3).randbytes(8 << 20)
        blocked = asyncio.Event()

        async def send_all() -> None:
            for i in range(0, len(payload), 1 << 16):
                writer.write(payload[i:i + (1 << 16)])
                if writer.transport.get_write_buffer_size() > (1 << 16):
                    blocked.set()
                await writer.drain()

        sending = asyncio.ensure_future(send_all())
        async with asyncio.timeout(WAKE):
            await blocked.wait()
        # Paused: the inner writer waits on the outer connection's queue,
        # which is part of the inner transport's buffer.
        assert not sending.done()
        assert plain.get_write_buffer_size() > 0
        assert inner.get_write_buffer_size() >= outer.get_write_buffer_size()
        assert outer.get_write_buffer_size() >= plain.get_write_buffer_size()
        async with asyncio.timeout(45):
            got = await peer.recv(len(payload))
            await sending
        assert got == payload
    finally:
        writer.transport.abort()


@pytest.mark.asyncio
async def test_a_paused_inner_reader_pauses_the_outer_connection(nested: OpenNested) -> None:
    # The app reads nothing: the stream pauses the inner transport, which
    # pauses the outer one and the socket; the peer's 8 MiB wait in the
    # kernel. Then the app reads it all, without loss.
    reader, writer, peer = await nested()
    inner, outer, plain = layers(writer)
    payload = random.Random(4).randbytes(8 << 20)
    try:
        sending = asyncio.ensure_future(peer.send(payload))
        await until(lambda: not plain.is_reading(), "the socket paused")
        assert not inner.is_reading() and not outer.is_reading()
        assert not sending.done()
        got = bytearray()
        async with asyncio.timeout(45):
            while len(got) < len(payload):
                got += await reader.read(1 << 16)
            await sending
        assert bytes(got) == payload
    finally:
        writer.transport.abort()


# ---------------------------------------------------------------- the inner handshake


@pytest.mark.asyncio
async def test_cancelled_inner_handshake_ends_both_layers(
    nested: OpenNested, tls_ca: Any
) -> None:
    # The destination never answers the ClientHello; the caller's timeout
    # cancels start_tls(). The connection ends (asyncio's default loop
    # closes the outer session with close_notify, uvloop and slabnet end the
    # socket), wait_closed() returns, and no task is left.
    reader, writer, peer = await nested(inner=False)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"), 0.2
        )
    assert writer.transport.is_closing()
    how, plaintext = await peer.outer_end()
    assert how == "eof"
    assert plaintext.startswith(b"\x16\x03")  # the inner ClientHello, then nothing
    await wait_closed(writer)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.parametrize("fault", ["unknown_ca", "wrong_hostname"])
@pytest.mark.asyncio
async def test_inner_certificate_failure_raises_and_ends_the_outer_session(
    nested: OpenNested, tls_ca: Any, fault: str
) -> None:
    # ssl.SSLCertVerificationError, as on uvloop (asyncio's default loop
    # raises TypeError from its own _force_close for TLS inside TLS), and
    # the proxy's connection ends too.
    reader, writer, peer = await nested(inner=False)
    ctx = ssl.create_default_context() if fault == "unknown_ca" else client_ctx(tls_ca)
    hostname = "localhost" if fault == "unknown_ca" else "example.org"
    upgrading = asyncio.ensure_future(writer.start_tls(ctx, server_hostname=hostname))
    with pytest.raises(ssl.SSLError):
        await peer.handshake()  # the client's alert
    with pytest.raises(ssl.SSLCertVerificationError):
        await asyncio.wait_for(upgrading, WAKE)
    assert writer.transport.is_closing()
    assert (await peer.outer_end())[0] == "eof"
    with pytest.raises(ssl.SSLCertVerificationError):  # the connection's error
        await wait_closed(writer)


@pytest.mark.parametrize("fault", ["reset", "fin", "outer_close_notify"])
@pytest.mark.asyncio
async def test_outer_connection_ending_during_the_inner_handshake(
    nested: OpenNested, tls_ca: Any, fault: str
) -> None:
    # ConnectionResetError (uvloop's too; asyncio's default loop raises
    # TypeError from _force_close), never a hang.
    reader, writer, peer = await nested(inner=False)
    upgrading = asyncio.ensure_future(
        writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
    )
    await peer.pull()  # the ClientHello
    if fault == "reset":
        hard_close(peer.outer.sock)
    elif fault == "fin":
        peer.outer.sock.close()
    else:
        await peer.outer.send(peer.outer.close_notify())
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(upgrading, WAKE)
    assert writer.transport.is_closing()
    with pytest.raises(ConnectionResetError):
        await wait_closed(writer)


@pytest.mark.asyncio
async def test_cancelled_read_drain_and_wait_closed_leave_the_connection_usable(
    nested: OpenNested
) -> None:
    # As with asyncio's streams, a cancelled read() or drain() changes
    # nothing: the next one gets the bytes. A cancelled wait_closed() leaves
    # the close going; a later one returns (asyncio's raises CancelledError
    # then: the close waiter it shares was cancelled with the first).
    reader, writer, peer = await nested()
    reading = asyncio.ensure_future(reader.read(10))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await peer.send(b"abc")
    assert await asyncio.wait_for(reader.read(10), WAKE) == b"abc"

    high = 1 << 14
    writer.transport.set_write_buffer_limits(high=high)
    sent = 0
    while writer.transport.get_write_buffer_size() <= high:  # the peer reads nothing
        writer.write(b"w" * (1 << 20))
        sent += 1 << 20
        await asyncio.sleep(0)
    draining = asyncio.ensure_future(writer.drain())
    await asyncio.sleep(0)
    assert not draining.done()
    draining.cancel()
    with pytest.raises(asyncio.CancelledError):
        await draining
    writer.write(b"!")
    async with asyncio.timeout(45):
        assert await peer.recv(sent + 1) == b"w" * sent + b"!"
        await writer.drain()

    writer.close()
    closing = asyncio.ensure_future(writer.wait_closed())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert await peer.inner_end() == "close_notify"
    await peer.outer.send(peer.inner_close_notify())
    assert await peer.outer_end() == ("close_notify", b"")
    await peer.outer.send(peer.outer.close_notify())
    await wait_closed(writer)
    peer.outer.sock.close()


# ---------------------------------------------------------------- faults with data


@pytest.mark.asyncio
async def test_outer_reset_during_inner_data(nested: OpenNested) -> None:
    reader, writer, peer = await nested()
    await peer.send(b"x" * 1000)
    assert await reader.readexactly(1000) == b"x" * 1000
    hard_close(peer.outer.sock)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), WAKE)
    with pytest.raises(ConnectionResetError):
        await wait_closed(writer)


@pytest.mark.parametrize("end", ["fin", "outer_close_notify", "outer_close_notify_fin"])
@pytest.mark.asyncio
async def test_outer_end_without_inner_close_notify_is_eof_after_the_data(
    nested: OpenNested, end: str
) -> None:
    # The inner session is cut without its close_notify (ragged, accepted
    # as on both loops): every byte first, then EOF; the client answers an
    # outer close_notify with its own.
    reader, writer, peer = await nested()
    peer.inner.write(b"y" * 5000)
    wire = peer.outer.seal(peer.outgoing.read())
    if end != "fin":
        wire += peer.outer.close_notify()
    await peer.outer.send(wire)
    if end != "outer_close_notify":
        peer.outer.sock.shutdown(socket.SHUT_WR)
    async with asyncio.timeout(WAKE):
        assert await reader.readexactly(5000) == b"y" * 5000
        assert await reader.read() == b""
    how, plaintext = await peer.outer_end()
    assert plaintext == b""  # no inner close_notify: that session was cut
    assert how == ("eof" if end == "fin" else "close_notify")
    await wait_closed(writer)


@pytest.mark.parametrize("after", ["outer_data", "outer_close_notify"])
@pytest.mark.asyncio
async def test_inner_close_notify_then_more_outer_bytes(
    nested: OpenNested, after: str
) -> None:
    # The destination's close_notify, then the proxy sends more: outer
    # plaintext that is not TLS, or its own close_notify, in the same read.
    # Data, EOF; the client answers close_notify at both layers, in order.
    reader, writer, peer = await nested()
    peer.inner.write(b"z" * 3000)
    wire = peer.inner_close_notify()
    if after == "outer_data":
        wire += peer.outer.seal(b"GARBAGE after the inner close_notify")
    else:
        wire += peer.outer.close_notify()
    await peer.outer.send(wire)
    async with asyncio.timeout(WAKE):
        assert await reader.readexactly(3000) == b"z" * 3000
        assert await reader.read() == b""
    assert await peer.inner_end() == "close_notify"
    assert await peer.outer_end() == ("close_notify", b"")
    if after == "outer_data":
        await peer.outer.send(peer.outer.close_notify())
    await wait_closed(writer)


@pytest.mark.asyncio
async def test_inner_fatal_alert_after_data(nested: OpenNested) -> None:
    # The destination's data, then its fatal alert: the data is read first
    # (uvloop's reader raises at once), then the alert's ssl.SSLError, and
    # the proxy's connection ends.
    reader, writer, peer = await nested()
    peer.inner.write(b"d" * 1000)
    peer.incoming.write(b"\x17\x03\x03\x00\x20" + bytes(32))
    with pytest.raises(ssl.SSLError):
        peer.inner.read(1)
    await peer.flush()  # the data and the bad_record_mac alert
    async with asyncio.timeout(WAKE):
        assert await reader.readexactly(1000) == b"d" * 1000
        with pytest.raises(ssl.SSLError, match="BAD_RECORD_MAC"):
            await reader.read(1)
    assert writer.transport.is_closing()
    assert (await peer.outer_end())[0] == "eof"
    with pytest.raises(ssl.SSLError):
        await wait_closed(writer)


@pytest.mark.asyncio
async def test_outer_plaintext_that_is_not_tls_fails_the_inner_session(
    nested: OpenNested
) -> None:
    # A proxy that answers in plaintext inside the tunnel (an HTTP error):
    # the inner session's data first, then TLSRecordError (an ssl.SSLError).
    reader, writer, peer = await nested()
    await peer.send(b"e" * 1000)
    await peer.outer.send(peer.outer.seal(b"HTTP/1.1 502 Bad Gateway\r\n\r\n"))
    async with asyncio.timeout(WAKE):
        assert await reader.readexactly(1000) == b"e" * 1000
        with pytest.raises(ssl.SSLError):
            await reader.read(1)
    assert (await peer.outer_end())[0] == "eof"
    peer.outer.sock.close()


# ---------------------------------------------------------------- close and abort


@pytest.mark.asyncio
async def test_close_sends_queued_data_then_inner_then_outer_close_notify(
    nested: OpenNested
) -> None:
    reader, writer, peer = await nested()
    payload = random.Random(5).randbytes(4 << 20)
    writer.transport.set_write_buffer_limits(high=1 << 14)
    writer.write(payload)
    writer.close()
    assert writer.is_closing()
    writer.write(b"dropped")  # dropped without an error, as asyncio's
    async with asyncio.timeout(45):
        assert await peer.recv(len(payload)) == payload
    assert await peer.inner_end() == "close_notify"
    await peer.outer.send(peer.inner_close_notify())
    assert await peer.outer_end() == ("close_notify", b"")
    await peer.outer.send(peer.outer.close_notify())
    await wait_closed(writer)


@pytest.mark.asyncio
async def test_outer_close_notify_while_the_inner_session_closes(nested: OpenNested) -> None:
    # The client closes; the proxy answers with its own close_notify only
    # (the destination is gone): the client's shutdown ends with it.
    reader, writer, peer = await nested()
    writer.close()
    assert await peer.inner_end() == "close_notify"
    await peer.outer.send(peer.outer.close_notify())
    assert (await peer.outer_end())[0] == "close_notify"
    await wait_closed(writer)


@pytest.mark.asyncio
async def test_inner_shutdown_timeout_ends_both_layers(nested: OpenNested) -> None:
    reader, writer, peer = await nested(ssl_shutdown_timeout=0.2)
    writer.close()
    assert await peer.inner_end() == "close_notify"  # never answered
    with pytest.raises(slabnet.ShutdownTimeoutError):
        await wait_closed(writer)
    assert (await peer.outer_end())[0] == "eof"


@pytest.mark.asyncio
async def test_abort_of_the_inner_transport_aborts_the_connection(nested: OpenNested) -> None:
    reader, writer, peer = await nested()
    inner, outer, plain = layers(writer)
    writer.transport.abort()
    assert inner.is_closing() and outer.is_closing() and plain.is_closing()
    assert (await peer.outer_end())[0] == "reset"
    await wait_closed(writer)  # (no error, as asyncio's after abort())


@pytest.mark.asyncio
async def test_extra_info_of_the_inner_session_and_of_the_socket(nested: OpenNested) -> None:
    reader, writer, peer = await nested()
    inner, outer, plain = layers(writer)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        assert ssl_object is inner.get_extra_info("ssl_object")
        assert ssl_object is not outer.get_extra_info("ssl_object")
        assert ssl_object.server_hostname == "localhost"
        assert writer.get_extra_info("peercert") is not None
        # What is not TLS comes from the socket, under both sessions.
        assert writer.get_extra_info("peername") == peer.outer.sock.getsockname()
        assert writer.get_extra_info("socket") is not None
        assert not writer.is_closing()
    finally:
        writer.transport.abort()


# ---------------------------------------------------------------- more layers, other side


@pytest.mark.asyncio
async def test_a_third_session_inside_the_second(
    nested: OpenNested, server_cert: Any, tls_ca: Any
) -> None:
    reader, writer, peer = await nested()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    third = server_ctx(server_cert).wrap_bio(incoming, outgoing, server_side=True)

    async def pull() -> None:
        while True:
            try:
                incoming.write(peer.inner.read(1 << 20))
                return
            except ssl.SSLWantReadError:
                await peer.pull()

    async def flush() -> None:
        data = outgoing.read()
        if data:
            await peer.send(data)

    try:
        async with asyncio.timeout(WAKE):
            upgrading = asyncio.ensure_future(
                writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
            )
            while True:
                try:
                    third.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await flush()
                    await pull()
            await flush()
            await upgrading
            assert writer.get_extra_info("ssl_object") is not layers(writer)[1].get_extra_info(
                "ssl_object"
            )
            writer.write(b"three layers")
            got = b""
            while len(got) < 12:
                try:
                    got += third.read(12)
                except ssl.SSLWantReadError:
                    await pull()
            assert got == b"three layers"
            third.write(b"back")
            await flush()
            assert await reader.readexactly(4) == b"back"
    finally:
        writer.transport.abort()


@pytest.mark.asyncio
async def test_server_inner_handshake_sent_behind_the_connect_line(
    server_cert: Any, tls_ca: Any
) -> None:
    # A client that sends its inner ClientHello in the same outer record as
    # its CONNECT line: the server's reader holds it when start_tls() is
    # called, and it goes to the inner session. (asyncio's streams lose it
    # and the handshake hangs.)
    loop = asyncio.get_running_loop()
    result: asyncio.Future[bytes] = loop.create_future()

    async def handler(reader: Any, writer: Any) -> None:
        try:
            assert await reader.readline() == b"CONNECT\n"
            await writer.start_tls(server_ctx(server_cert))
            result.set_result(await reader.readexactly(5))
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
        finally:
            writer.transport.abort()

    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    sock = socket.create_connection(server.sockets[0].getsockname()[:2])
    try:
        async with asyncio.timeout(WAKE):
            peer = Nested(
                sock, client_ctx(tls_ca), client_ctx(tls_ca),
                server_side=False, server_hostname="localhost",
            )
            await peer.outer.handshake()
            with pytest.raises(ssl.SSLWantReadError):
                peer.inner.do_handshake()
            await peer.outer.send(peer.outer.seal(b"CONNECT\n" + peer.outgoing.read()))
            await peer.handshake()
            await peer.send(b"hello")
            assert await result == b"hello"
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- defects found here


@pytest.mark.asyncio
async def test_inner_close_notify_is_answered_when_the_outer_one_follows_while_paused(
    nested: OpenNested
) -> None:
    # The destination's data and close_notify, then the proxy's close_notify,
    # all in one read of a client whose reader pauses on the first chunk.
    # The outer layer delivers its whole read to the paused inner one, which
    # keeps the records in its engine, and reaches the outer close_notify:
    # the inner layer heard eof_received() before reading its own
    # close_notify, which came first, took it for the peer's FIN and closed
    # without answering it. asyncio's streams answer it (inner close_notify,
    # then outer), as slabnet does when the reader is not paused.
    reader, writer, peer = await nested(limit=1024)
    payload = random.Random(6).randbytes(40_000)
    peer.inner.write(payload)
    wire = peer.outer.seal(peer.outgoing.read()) + peer.inner_close_notify()
    wire += peer.outer.close_notify()
    # The socket is paused while all of it arrives, so that one read takes it.
    writer.transport.pause_reading()
    await peer.outer.send(wire)
    await wait_acked(peer.outer.sock)
    writer.transport.resume_reading()
    got = bytearray()
    async with asyncio.timeout(WAKE):
        while piece := await reader.read(1 << 16):
            got += piece
    assert bytes(got) == payload
    how, plaintext = await peer.outer_end()
    assert how == "close_notify"
    assert plaintext, "no inner close_notify came before the outer one"
    peer.incoming.write(plaintext)
    peer.inner.unwrap()  # the inner shutdown completes: no SSLWantReadError
    await wait_closed(writer)
