"""Faults and bad input (issue 7), on real sockets, on both loops.

Each test checks three things where they apply: the data that arrived before
the fault is delivered, the fault surfaces as a specific exception (never a
hang: every wait is bounded), and no file descriptor is left behind.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import resource
import socket
import ssl
import time
import struct
from typing import Any

import pytest
import trustme

import slabnet
from slabnet._slab import LEND_SIZE
from conftest import (
    Recorder,
    RawTLS,
    client_ctx,
    connect_slab,
    fds_settle,
    hard_close,
    open_fds,
    records,
    server_ctx,
    unacked,
    wait_acked,
)

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])
LIMIT = 2**16  # StreamReader's default limit; it pauses above twice this
READ_SIZE = 2**16
MAX_READ = 2**18  # the largest single read (slabnet._slab.READ_SIZES[-1])
# Seconds any waiter may take to wake after a fault. Waking takes
# milliseconds; the margin is for a shared 2-core machine under load, and a
# passing test never waits it out.
WAKE = 10.0


async def accept(listener: socket.socket) -> socket.socket:
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    return conn


async def tls_client(listener: socket.socket, ca: Any, **kw: Any) -> tuple[slabnet.StreamReader, slabnet.StreamWriter]:
    port = listener.getsockname()[1]
    return await slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(ca), server_hostname="localhost", **kw
    )


async def roomy_client(listener: socket.socket) -> socket.socket:
    """A client socket connected to ``listener`` whose receive buffer is set,
    not autotuned: 2 x 1 MiB, or 2 x net.core.rmem_max where that is lower
    (Linux's default is 208 KiB). Its window then takes a few hundred KiB the
    reader has not read, whatever the host's net.ipv4.tcp_rmem; the socket
    option must be set before connect(), the window's scale is fixed there."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024 * 1024)
    sock.setblocking(False)
    await asyncio.wait_for(
        asyncio.get_running_loop().sock_connect(sock, listener.getsockname()), WAKE
    )
    return sock


async def read_all(reader: slabnet.StreamReader) -> tuple[bytes, BaseException | None]:
    parts = []
    while True:
        try:
            data = await asyncio.wait_for(reader.read(READ_SIZE), WAKE)
        except (ConnectionError, ssl.SSLError) as exc:
            return b"".join(parts), exc
        if not data:
            return b"".join(parts), None
        parts.append(data)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def closed(writer: slabnet.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    except (ConnectionError, ssl.SSLError):
        pass


# ---------------------------------------------------------------- peer reset


@pytest.mark.parametrize("paused", [False, True], ids=["reading", "paused"])
@pytest.mark.asyncio
async def test_peer_reset_mid_transfer_plain(listener: socket.socket, paused: bool) -> None:
    baseline = open_fds()
    # More than the reader buffers before it pauses (2 x 64 KiB), less than
    # that plus the receive window (roomy_client), so all of it gets
    # acknowledged.
    payload = os.urandom(224 * 1024)
    connected = asyncio.Event()
    client_paused = asyncio.Event()

    async def peer() -> None:
        conn = await accept(listener)
        await connected.wait()
        await asyncio.get_running_loop().sock_sendall(conn, payload)
        await wait_acked(conn)
        if paused:
            await client_paused.wait()
        hard_close(conn)

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(sock=await roomy_client(listener))
    connected.set()
    if paused:
        async with asyncio.timeout(WAKE):
            while writer.transport.is_reading():
                await asyncio.sleep(0.005)
        client_paused.set()
        await task  # the RST arrives while reading is paused
        await asyncio.sleep(0.1)
        assert not writer.transport.is_reading()
    data, exc = await read_all(reader)
    await task
    assert len(data) == len(payload) and data == payload
    assert isinstance(exc, ConnectionResetError), repr(exc)
    writer.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_peer_reset_mid_transfer_tls(listener: socket.socket, server_cert: Any, tls_ca: Any) -> None:
    baseline = open_fds()
    payload = os.urandom(200 * 1024)

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.send(tls.seal(*(payload[i : i + 16384] for i in range(0, len(payload), 16384))))
        await wait_acked(tls.sock)
        hard_close(tls.sock)

    task = asyncio.create_task(peer())
    # The client's window must take what its reader has not read yet.
    reader, writer = await slabnet.open_connection(
        sock=await roomy_client(listener), ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    await task
    await asyncio.sleep(0.1)
    data, exc = await read_all(reader)
    assert len(data) == len(payload) and data == payload
    assert isinstance(exc, ConnectionResetError), repr(exc)
    writer.close()
    assert await fds_settle(baseline) <= baseline


async def reset_arrived(transport: asyncio.BaseTransport) -> None:
    """Wait until the peer's reset has reached ``transport``'s socket (its
    TCP state is CLOSE), with reading paused: only a send can meet it."""
    sock = transport.get_extra_info("socket")
    while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 7:  # TCP_CLOSE
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_a_write_that_meets_a_reset_keeps_what_the_kernel_had_received(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """The peer sends more than the reader takes (it pauses), then resets.
    The app's next write meets the reset: the connection ends with the
    send's error. What the kernel had received and slabnet had not read yet
    was dropped with the connection (a third of it and more: a server's
    early error response to an upload, lost to the upload's failure). Now it is
    read before the end, and the reader returns every byte, then the error.
    (asyncio's reader raises at once, dropping even what it had buffered.)"""
    baseline = open_fds()
    # Over TLS the layer reads on while the stream is paused, up to its read
    # high-water mark (256 KiB): 96 KiB more then wait in the kernel.
    payload = os.urandom((96 + (256 if tls else 0)) * 1024)

    async def peer() -> None:
        sock = await accept(listener)
        if tls:
            raw = RawTLS(sock, server_ctx(server_cert), server_side=True)
            await raw.handshake()
            await raw.send(raw.seal(*(payload[i : i + 16384] for i in range(0, len(payload), 16384))))
        else:
            await asyncio.get_running_loop().sock_sendall(sock, payload)
        await wait_acked(sock)  # (all of it in the client's kernel or read)
        hard_close(sock)

    task = asyncio.create_task(peer())
    # limit=1024: the reader pauses after a few KiB; the client's window
    # (roomy_client) takes the rest.
    kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    reader, writer = await slabnet.open_connection(
        sock=await roomy_client(listener), limit=1024, **kw
    )
    await asyncio.wait_for(task, WAKE)  # the reset is on its way
    async with asyncio.timeout(WAKE):
        with pytest.raises(ConnectionError):  # a write meets it
            while True:
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.005)
    data, exc = await read_all(reader)
    assert len(data) == len(payload) and data == payload
    assert isinstance(exc, ConnectionError), repr(exc)
    writer.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_a_paused_app_whose_first_write_meets_a_reset_gets_every_byte(
    listener: socket.socket,
) -> None:
    """An app paused from ``connection_made``; the peer sends 64 KiB and
    resets. The app resumes and writes in its first chunk's callback: the
    write meets the reset. The app got the 1 KiB a read made while paused
    holds, then the loss; the rest stayed in the kernel and went with the
    connection. (asyncio's first read after the resume takes 256 KiB, so
    it lost them only beyond that.) Now the rest comes before the loss."""
    loop = asyncio.get_running_loop()
    payload = os.urandom(64 * 1024)

    class PausedReplier(Recorder):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.transport.pause_reading()  # type: ignore[union-attr]

        def chunk_received(self, chunk: memoryview) -> None:
            super().chunk_received(chunk)
            if len(self.events) == 2:  # ("made", the first chunk)
                self.transport.write(b"reply")  # type: ignore[union-attr]

    transport, app, peer = await connect_slab(listener, WAKE, PausedReplier())
    async with asyncio.timeout(WAKE):
        await loop.sock_sendall(peer, payload)
        await wait_acked(peer)
        hard_close(peer)
        await reset_arrived(transport)
        transport.resume_reading()
        exc = await app.lost
    assert b"".join(e for e in app.events if isinstance(e, bytes)) == payload
    assert isinstance(exc, ConnectionResetError), repr(exc)


@pytest.mark.asyncio
async def test_the_loss_goes_to_the_protocol_its_last_chunk_switched_to(
    listener: socket.socket,
) -> None:
    """An app paused from ``connection_made`` gets the peer's last bytes
    at the loss (data before errors), and switches protocols in that
    chunk's callback (an upgrade the peer asked for). ``connection_lost``
    went to the old protocol, read before the delivery; the new one never
    heard the connection go. As the loops' transports do, the protocol set
    at that moment gets it."""
    loop = asyncio.get_running_loop()

    class Upgrading(Recorder):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.transport.pause_reading()  # type: ignore[union-attr]

        def chunk_received(self, chunk: memoryview) -> None:
            super().chunk_received(chunk)
            self.transport.set_protocol(upgraded)  # type: ignore[union-attr]

    upgraded = Recorder()
    transport, app, peer = await connect_slab(listener, WAKE, Upgrading())
    async with asyncio.timeout(WAKE):
        await loop.sock_sendall(peer, b"UPGRADE")
        await wait_acked(peer)
        hard_close(peer)
        await reset_arrived(transport)
        transport.write(b"reply")  # meets the reset: the connection is lost
        exc = await upgraded.lost
    assert isinstance(exc, ConnectionResetError), repr(exc)
    assert app.events == ["made", b"UPGRADE"]  # (no loss: it had handed over)
    assert upgraded.events == [("lost", ConnectionResetError)]


# ---------------------------------------------------------------- certificates


def _expired_cert(ca: Any) -> Any:
    now = datetime.datetime.now(datetime.timezone.utc)
    return ca.issue_cert(
        "localhost", not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1),
    )


@pytest.mark.parametrize(
    ("case", "code", "text"),
    [
        ("wrong_ca", 20, "unable to get local issuer certificate"),
        ("hostname", 62, "Hostname mismatch"),
        ("expired", 10, "certificate has expired"),
    ],
)
@pytest.mark.asyncio
async def test_certificate_verification_fails_clearly(
    server_cert: Any, tls_ca: Any, case: str, code: int, text: str
) -> None:
    baseline = open_fds()
    if case == "wrong_ca":
        cert = trustme.CA().issue_cert("localhost", "127.0.0.1")
    elif case == "expired":
        cert = _expired_cert(tls_ca)
    else:
        cert = server_cert
    handled = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        handled.append(writer)
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(cert))
    port = server.sockets[0].getsockname()[1]
    hostname = "wrong.example.org" if case == "hostname" else "localhost"
    with pytest.raises(ssl.SSLCertVerificationError) as info:
        await asyncio.wait_for(
            slabnet.open_connection("127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname=hostname),
            WAKE,
        )
    assert info.value.verify_code == code, info.value
    assert text in str(info.value)
    assert "certificate verify failed" in str(info.value)
    await asyncio.sleep(0.1)
    assert handled == []  # the server never got a connection
    server.close()
    await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- bad TLS input


@pytest.mark.asyncio
async def test_garbage_instead_of_a_handshake_client_side(listener: socket.socket, tls_ca: Any) -> None:
    baseline = open_fds()

    async def peer() -> None:
        conn = await accept(listener)
        await asyncio.get_running_loop().sock_sendall(conn, b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await asyncio.sleep(0.5)
        conn.close()

    task = asyncio.create_task(peer())
    with pytest.raises(ssl.SSLError) as info:
        await asyncio.wait_for(tls_client(listener, tls_ca), WAKE)
    assert isinstance(info.value, slabnet.TLSRecordError), repr(info.value)
    assert "content type 72" in str(info.value)  # "H"
    await task
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_garbage_instead_of_a_handshake_server_side(server_cert: Any) -> None:
    baseline = open_fds()
    handled = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        handled.append(writer)

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        got = await asyncio.wait_for(reader.read(), WAKE)
    except ConnectionResetError:
        got = b""
    assert not got.startswith(b"HTTP")  # nothing but maybe a TLS alert
    assert handled == []
    writer.close()
    server.close()
    await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# RFC 8446 §5.2: TLSCiphertext.length <= 2^14 + 256. In TLS 1.2, OpenSSL's
# 2^14 + 320 (RFC 5246 §6.2.3 allows 2^14 + 2048; OpenSSL refuses more).
LIMITS = {TLS12: 2**14 + 320, TLS13: 2**14 + 256}


@pytest.mark.parametrize(
    ("version", "length"),
    [(TLS12, 2**14 + 321), (TLS12, 17_000), (TLS12, 2**14 + 2048),
     (TLS13, 2**14 + 257), (TLS13, 2**14 + 324)],
    ids=["tls12-16705", "tls12-17000", "tls12-18432", "tls13-16641", "tls13-16708"],
)
@pytest.mark.asyncio
async def test_record_longer_than_allowed_after_data(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, length: int
) -> None:
    """The data in front comes first, then the header's error, at once,
    while the peer stalls after part of the record's body. In TLS 1.2 the
    scanner allowed RFC 5246's 2^14 + 2048 and waited for the whole record
    before handing it to OpenSSL, which refuses any header above 2^14 +
    320 (asyncio's TLS, on both loops, at once): the read waited for as
    long as the peer held the connection, then failed as a truncation."""
    good = os.urandom(20_000)

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert, version), server_side=True)
        await tls.handshake()
        bad = struct.pack("!BHH", 23, 0x0303, length) + os.urandom(100)
        await tls.send(tls.seal(good[:10_000], good[10_000:]) + bad)
        await tls.linger(2 * WAKE)  # (the connection stays open past the wait below)

    task = asyncio.create_task(peer())
    reader, writer = await tls_client(listener, tls_ca)
    assert await asyncio.wait_for(reader.readexactly(len(good)), WAKE) == good
    with pytest.raises(slabnet.TLSRecordError) as info:
        await asyncio.wait_for(reader.read(1), WAKE)
    assert f"length {length} is above the limit of {LIMITS[version]}" in str(info.value)
    expected = "ENCRYPTED_LENGTH_TOO_LONG" if length <= 2**14 + 323 else "PACKET_LENGTH_TOO_LONG"
    assert info.value.reason == expected
    writer.close()
    await task


@pytest.mark.parametrize("op", ["read", "readexactly", "readline"])
@pytest.mark.asyncio
async def test_a_truncated_body_read_whole_is_an_error_with_strict_eof(
    server_cert: Any, tls_ca: Any, op: str
) -> None:
    """With ``ssl_ragged_eof=False`` a FIN without close_notify is an
    attack or a crash, not the end of the body: ``read()`` to EOF,
    ``readexactly`` and ``readline`` of a unit it cut raise
    ``TLSTruncatedError``, and the bytes before it stay for ``read(n)``.
    (``read()`` returned them as a complete body and ``readexactly``
    raised ``IncompleteReadError``, as for a clean end.)"""
    result: asyncio.Future[tuple[BaseException, bytes]] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            if op == "read":
                await reader.read()
            elif op == "readexactly":
                await reader.readexactly(20_000)
            else:
                await reader.readline()
        except Exception as exc:
            result.set_result((exc, await reader.read(100_000)))
        else:
            result.set_exception(AssertionError(f"{op}() did not raise"))
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert),
                                        ssl_ragged_eof=False)
    try:
        tls = await _raw_client(server.sockets[0].getsockname()[1], tls_ca)
        await tls.send(tls.seal(b"y" * 10_000))
        tls.sock.shutdown(socket.SHUT_WR)
        exc, rest = await asyncio.wait_for(result, WAKE)
        assert isinstance(exc, slabnet.TLSTruncatedError), repr(exc)
        assert rest == b"y" * 10_000
        await tls.linger()
    finally:
        server.close()
        await server.wait_closed()


async def _raw_client(port: int, ca: Any, version: ssl.TLSVersion | None = None) -> RawTLS:
    sock = socket.create_connection(("127.0.0.1", port))
    tls = RawTLS(sock, client_ctx(ca, version), server_side=False, server_hostname="localhost")
    await tls.handshake()
    return tls


@pytest.mark.parametrize("fault", ["corrupt_mac", "alert", "fin_without_close_notify"])
@VERSIONS
@pytest.mark.asyncio
async def test_bad_input_to_a_server_after_data(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, fault: str
) -> None:
    baseline = open_fds()
    good = os.urandom(50_000)
    result: asyncio.Future[tuple[bytes, BaseException | None]] = (
        asyncio.get_running_loop().create_future()
    )

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        result.set_result(await read_all(reader))
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version),
                                        ssl_ragged_eof=False)
    tls = await _raw_client(server.sockets[0].getsockname()[1], tls_ca, version)
    wire = tls.seal(*(good[i : i + 5000] for i in range(0, len(good), 5000)))
    if fault == "corrupt_mac":
        tail = bytearray(tls.seal(b"x" * 300))
        tail[-1] ^= 1
        wire += bytes(tail)
    elif fault == "alert":
        wire += tls.fatal_alert()
    await tls.send(wire)
    if fault == "fin_without_close_notify":
        tls.sock.shutdown(socket.SHUT_WR)
    data, exc = await asyncio.wait_for(result, WAKE)
    assert data == good
    if fault == "corrupt_mac":
        assert isinstance(exc, ssl.SSLError) and exc.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC", repr(exc)
    elif fault == "alert":
        assert isinstance(exc, ssl.SSLError) and exc.reason == "SSLV3_ALERT_BAD_RECORD_MAC", repr(exc)
    else:
        assert isinstance(exc, slabnet.TLSTruncatedError), repr(exc)
    await tls.linger()
    server.close()
    await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_cut_record_is_truncation_even_with_ragged_eof(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        wire = tls.seal(b"a" * 1000, b"b" * 1000)
        _, off, length = records(wire)[-1]
        await tls.send(wire[: off + length // 2])
        tls.sock.close()

    task = asyncio.create_task(peer())
    reader, writer = await tls_client(listener, tls_ca, ssl_ragged_eof=True)
    data, exc = await read_all(reader)
    await task
    assert data == b"a" * 1000
    assert isinstance(exc, slabnet.TLSTruncatedError), repr(exc)
    writer.close()


@pytest.mark.asyncio
async def test_silent_client_hits_the_server_handshake_timeout(server_cert: Any) -> None:
    baseline = open_fds()
    handled = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        handled.append(writer)

    server = await slabnet.start_server(
        handle, "127.0.0.1", 0, ssl=server_ctx(server_cert), ssl_handshake_timeout=0.3
    )
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    start = loop.time()
    try:
        got = await asyncio.wait_for(loop.sock_recv(sock, 100), WAKE)
    except ConnectionResetError:
        got = b""
    elapsed = loop.time() - start
    sock.close()
    assert got == b"" and 0.25 <= elapsed < WAKE, (got, elapsed)
    assert handled == []
    server.close()
    await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- memory


@pytest.mark.slow
@pytest.mark.asyncio
async def test_slow_consumer_memory_stays_bounded(listener: socket.socket) -> None:
    total = 256 * 1024 * 1024
    block = os.urandom(1024 * 1024)
    rss_before = rss()

    async def sender() -> None:
        conn = await accept(listener)
        loop = asyncio.get_running_loop()
        for _ in range(total // len(block)):
            await loop.sock_sendall(conn, block)
        conn.close()

    task = asyncio.create_task(sender())
    reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    got = reads = 0
    max_buffered = max_pinned = 0
    paused = 0
    while True:
        chunk = await asyncio.wait_for(reader.read_chunk(), WAKE)
        if not chunk:
            break
        # the payload repeats `block`: check each chunk where it falls
        off = got % len(block)
        n = min(len(chunk), len(block) - off)
        assert chunk[:n] == block[off : off + n]
        got += len(chunk)
        reads += 1
        del chunk
        if reads % 16 == 0:
            await asyncio.sleep(0.001)  # slow consumer
            max_buffered = max(max_buffered, reader._size)
            paused += not writer.transport.is_reading()
        if reads % 256 == 0:
            max_pinned = max(max_pinned, slabnet.memory_stats().pinned_bytes)
    await task
    assert got == total
    assert paused > 0, "reading never paused"
    assert max_buffered <= 2 * LIMIT + MAX_READ, max_buffered
    assert max_pinned <= 1024 * 1024, max_pinned
    assert rss() - rss_before < 64 * 1024 * 1024
    writer.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_consumer_that_never_reads_does_not_grow(server_cert: Any, tls_ca: Any, tls: bool) -> None:
    baseline = open_fds()
    loop = asyncio.get_running_loop()
    conns: asyncio.Queue[tuple[slabnet.StreamReader, slabnet.StreamWriter]] = asyncio.Queue()
    stop = asyncio.Event()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await conns.put((reader, writer))
        await stop.wait()  # never reads
        writer.close()

    # Small kernel buffers on both ends (set, not autotuned; before listen()
    # and connect()): what the kernel holds stays far below the 64 MiB
    # asserted below, whatever the host's TCP buffer sysctls allow.
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    server = await slabnet.start_server(
        handle, sock=lsock, ssl=server_ctx(server_cert) if tls else None
    )
    port = server.sockets[0].getsockname()[1]
    csock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    csock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    csock.setblocking(False)
    await asyncio.wait_for(loop.sock_connect(csock, ("127.0.0.1", port)), WAKE)
    reader, writer = await slabnet.open_connection(
        sock=csock, ssl=client_ctx(tls_ca) if tls else None,
        server_hostname="localhost" if tls else None,
    )
    s_reader, s_writer = await asyncio.wait_for(conns.get(), WAKE)
    block = os.urandom(1024 * 1024)
    rss_before = rss()
    sent = 0
    try:
        while sent < 256 * 1024 * 1024:  # bounded: stops long before when blocked
            writer.write(block)
            await asyncio.wait_for(writer.drain(), 1.0)
            sent += len(block)
    except TimeoutError:
        pass
    await asyncio.sleep(0.2)
    assert sent < 64 * 1024 * 1024, "the sender was never blocked"
    assert not s_writer.transport.is_reading()
    if not tls:
        assert s_reader._size <= 2 * LIMIT + MAX_READ, s_reader._size
    else:
        # A TLS read is delivered whole even if the stream pauses during it
        # (as asyncio's SSL transport does), so the stream may hold one read
        # more; the pause pauses the socket at once, so the BIO keeps no more
        # than a partial record.
        assert s_reader._size <= 2 * LIMIT + LEND_SIZE, s_reader._size
        assert not s_writer.transport._lower.is_reading()  # the socket
        engine = s_writer.transport._engine
        assert engine.buffered_ciphertext <= 32 * 1024, engine.buffered_ciphertext
    assert rss() - rss_before < 48 * 1024 * 1024
    writer.transport.abort()
    stop.set()
    server.close()
    await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- pending waiters


async def _blocked_write(writer: slabnet.StreamWriter) -> slabnet.WriteRequest:
    """Fill the kernel buffers towards a peer that does not read; return the
    WriteRequest of a write queued behind them."""
    # Far more than the kernel holds: the peer's receive buffer is set small
    # (the listener fixture) and the client's send buffer autotunes to a few
    # MiB at most without a window to send into.
    first = writer.write(os.urandom(32 * 1024 * 1024))
    if writer.transport.get_extra_info("ssl_object") is None:
        assert isinstance(first, slabnet.WriteRequest)  # plain: queued at once
    await asyncio.sleep(0.05)  # TLS encrypts and sends at the end of the iteration
    req = writer.write(b"behind the queue" * 1000)
    assert isinstance(req, slabnet.WriteRequest) and not req.done()
    await asyncio.sleep(0.02)
    assert not req.done()
    return req


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_peer_reset_wakes_every_waiter(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    baseline = open_fds()
    accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def peer() -> None:
        conn = await accept(listener)
        if tls:
            raw = RawTLS(conn, server_ctx(server_cert), server_side=True)
            await raw.handshake()
        accepted.set_result(conn)  # and never reads again

    task = asyncio.create_task(peer())
    if tls:
        reader, writer = await tls_client(listener, tls_ca)
    else:
        reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    conn = await accepted
    await task
    req = await _blocked_write(writer)
    drain = asyncio.ensure_future(writer.drain())
    read = asyncio.ensure_future(reader.read(100))
    await asyncio.sleep(0.05)
    assert not drain.done() and not read.done()
    hard_close(conn)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(req, WAKE)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(drain, WAKE)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(read, WAKE)
    writer.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_local_close_wakes_a_pending_read(
    echo_server: tuple[str, int], tls_echo_server: tuple[str, int],
    tls_client_context: ssl.SSLContext, tls: bool, how: str,
) -> None:
    baseline = open_fds()
    if tls:
        host, port = tls_echo_server
        reader, writer = await slabnet.open_connection(
            host, port, ssl=tls_client_context, server_hostname="localhost"
        )
    else:
        reader, writer = await slabnet.open_connection(*echo_server)
    read = asyncio.ensure_future(reader.read(100))
    await asyncio.sleep(0.05)
    assert not read.done()
    if how == "close":
        writer.close()
        # A graceful close: the pending read sees EOF, as with asyncio.
        assert await asyncio.wait_for(read, WAKE) == b""
    else:
        writer.transport.abort()
        # An abort drops data: the pending read raises (asyncio says EOF).
        with pytest.raises(ConnectionAbortedError, match="aborted locally"):
            await asyncio.wait_for(read, WAKE)
        await writer.wait_closed()  # our own abort is not a failure here
    assert writer.write(b"late") is None  # dropped, as asyncio does
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_local_abort_fails_pending_writes(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    baseline = open_fds()
    peer_conn: list[socket.socket] = []

    async def peer() -> None:
        conn = await accept(listener)
        peer_conn.append(conn)
        if tls:
            await RawTLS(conn, server_ctx(server_cert), server_side=True).handshake()

    task = asyncio.create_task(peer())
    if tls:
        reader, writer = await tls_client(listener, tls_ca)
    else:
        reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    await task
    req = await _blocked_write(writer)
    drain = asyncio.ensure_future(writer.drain())
    await asyncio.sleep(0.01)
    writer.transport.abort()
    with pytest.raises(ConnectionAbortedError):
        await asyncio.wait_for(req, WAKE)
    # the drain waiter wakes with the error too
    with pytest.raises(ConnectionAbortedError):
        await asyncio.wait_for(drain, WAKE)
    with pytest.raises(ConnectionError):
        await writer.drain()
    for conn in peer_conn:
        conn.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_many_failed_connections_leak_nothing(listener: socket.socket, tls_ca: Any) -> None:
    # Handshakes that fail in every way the client can see, repeated: the
    # descriptor count and the loop's reader count come back.
    baseline = open_fds()
    loop = asyncio.get_running_loop()

    async def peers() -> None:
        for i in range(30):
            conn = await accept(listener)
            if i % 3 == 0:
                hard_close(conn)
            elif i % 3 == 1:
                await loop.sock_sendall(conn, b"\x15\x03\x03\x00\x02\x02\x28")  # plaintext alert
                conn.close()
            else:
                conn.close()

    task = asyncio.create_task(peers())
    for _ in range(30):
        with pytest.raises((ConnectionError, ssl.SSLError)):
            await asyncio.wait_for(tls_client(listener, tls_ca), WAKE)
    await task
    assert await fds_settle(baseline) <= baseline
    usage = resource.getrusage(resource.RUSAGE_SELF)
    assert usage.ru_maxrss > 0


@pytest.mark.asyncio
async def test_read_all_raises_a_reset_and_keeps_the_data_before_it() -> None:
    """read(-1) asks for everything up to EOF: a reset means that never
    comes, so it raises the error, as asyncio's; what arrived before it
    stays buffered, where read(n) returns it, then the error again.
    (It returned the bytes as if the peer had ended the stream.)"""
    loop = asyncio.get_running_loop()
    sent: asyncio.Future[None] = loop.create_future()

    def serve(sock: socket.socket) -> None:
        conn, _ = sock.accept()
        conn.sendall(b"before-the-reset")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        loop.call_soon_threadsafe(sent.set_result, None)
        deadline = time.monotonic() + 10
        while unacked(conn):  # until the data is in the client's socket buffer
            assert time.monotonic() < deadline, "the client never acknowledged"
            time.sleep(0.005)
        conn.close()  # SO_LINGER 0: a reset

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    reader, writer = await slabnet.open_connection(*listener.getsockname())
    thread_done = loop.run_in_executor(None, serve, listener)
    await sent
    await thread_done
    listener.close()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 10)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.readexactly(100), 10)
    assert await asyncio.wait_for(reader.read(100), 10) == b"before-the-reset"
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), 10)
    writer.close()
