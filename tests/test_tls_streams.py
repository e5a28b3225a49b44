"""TLS over slabnet streams against real peers (issue 3).

Every test runs on the default asyncio loop and on uvloop (``slabnet_loops``).
Peers are real: slabnet itself, the stdlib's asyncio streams, a raw
``ssl.SSLObject`` peer whose wire bytes the test controls (``conftest.RawTLS``)
and the ``openssl s_server`` / ``s_client`` programs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, block_until_records, client_ctx, records, server_ctx

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])
OPENSSL_FLAG = {TLS12: "-tls1_2", TLS13: "-tls1_3"}
RECORD = 512  # small records, as sent by peers with a small send fragment
MAX_CHUNK = 16384  # slabnet's chunk bound: one TLSPlaintext fragment


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def pem_files(tmp_path_factory: pytest.TempPathFactory, tls_ca: Any, server_cert: Any) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pem")
    files = {"ca": d / "ca.pem", "server": d / "server.pem", "client": d / "client.pem"}
    tls_ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    tls_ca.issue_cert("client@example.org").private_key_and_cert_chain_pem.write_to_path(
        str(files["client"])
    )
    return {k: str(v) for k, v in files.items()}


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def connect_retry(port: int, **kw: Any) -> tuple[slabnet.StreamReader, slabnet.StreamWriter]:
    """open_connection to a subprocess server that may not listen yet (it
    may take seconds to start on a loaded machine)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await slabnet.open_connection("127.0.0.1", port, **kw)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on port {port}") from None
            await asyncio.sleep(0.02)


async def until_paused(transport: Any, timeout: float = 10) -> None:
    """Wait until the transport has paused reading (its reader is full)."""
    async with asyncio.timeout(timeout):
        while transport.is_reading():
            await asyncio.sleep(0.005)


async def read_chunks(reader: slabnet.StreamReader, total: int) -> list[memoryview]:
    chunks: list[memoryview] = []
    got = 0
    while got < total:
        chunk = await reader.read_chunk()
        assert chunk, f"EOF after {got} of {total} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return chunks


def assert_owned(chunk: memoryview) -> None:
    assert chunk.readonly
    assert len(chunk.obj) == len(chunk), (len(chunk.obj), len(chunk))  # type: ignore[arg-type]


async def slow_read(
    reader: slabnet.StreamReader, transport: Any, pause: float = 0.002
) -> tuple[bytes, BaseException | None, bool]:
    """Read to the end like a slow consumer: (data, error or None, saw reading paused)."""
    parts: list[bytes] = []
    paused = False
    while True:
        await asyncio.sleep(pause)
        paused = paused or not transport.is_reading()
        try:
            data = await reader.read(65536)
        except Exception as exc:
            return b"".join(parts), exc, paused
        if not data:
            return b"".join(parts), None, paused
        parts.append(data)


async def close(writer: slabnet.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 10)
    except (ConnectionError, ssl.SSLError):
        pass


# ---------------------------------------------------------------- coalescing


@VERSIONS
@pytest.mark.asyncio
async def test_small_records_in_one_read_are_coalesced(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    payload = os.urandom(64 * RECORD)
    pieces = [payload[i : i + RECORD] for i in range(0, len(payload), RECORD)]

    async def peer() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, version), server_side=True)
        await tls.handshake()
        wire = tls.seal(*pieces)
        assert len(records(wire)) == len(pieces)
        await tls.send(wire)  # 64 records, one send
        await tls.send(tls.close_notify())
        conn.close()

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    chunks = await read_chunks(reader, len(payload))
    await task
    assert b"".join(chunks) == payload
    assert len(chunks) < len(pieces) // 4, [len(c) for c in chunks]
    for chunk in chunks:
        assert len(chunk) <= MAX_CHUNK
        assert_owned(chunk)
    assert await reader.read() == b""
    await close(writer)


@pytest.mark.asyncio
async def test_ciphertext_never_takes_a_slab(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    # TLS reads are lent to the engine, which copies them into its BIO:
    # no slab is made, committed or pinned for ciphertext, on either loop.
    payload = os.urandom(4 << 20)

    async def peer() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, ssl.TLSVersion.TLSv1_3), server_side=True)
        await tls.handshake()
        await tls.send(tls.seal(payload) + tls.close_notify())
        conn.close()

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    before = slabnet.memory_stats()
    chunks = await read_chunks(reader, len(payload))
    after = slabnet.memory_stats()
    await task
    assert hashlib.sha256(b"".join(chunks)).digest() == hashlib.sha256(payload).digest()
    assert after.lent_reads > before.lent_reads
    assert after.slabs_allocated == before.slabs_allocated
    assert after.zero_copy_reads == before.zero_copy_reads
    assert after.copies == before.copies
    assert after.own_buffers == before.own_buffers
    assert all(len(c) <= MAX_CHUNK for c in chunks)
    assert await reader.read() == b""
    await close(writer)


@pytest.mark.asyncio
async def test_every_tls_chunk_owns_its_buffer(tls_echo_server: tuple[str, int], tls_client_context: ssl.SSLContext) -> None:
    host, port = tls_echo_server
    reader, writer = await slabnet.open_connection(host, port, ssl=tls_client_context, server_hostname="localhost")
    sizes = [1, 7, 100, 511, 4096, 16383, 16384, 16385, 40000, 3]
    for size in sizes:
        data = os.urandom(size)
        writer.write(data)
        chunks = await read_chunks(reader, size)
        assert b"".join(chunks) == data
        for chunk in chunks:
            assert_owned(chunk)
            assert 0 < len(chunk) <= MAX_CHUNK
    await close(writer)


# ---------------------------------------------------------------- errors after data


def corrupt_last(wire: bytes) -> bytes:
    _, off, length = records(wire)[-1]
    damaged = bytearray(wire)
    damaged[off + length - 3] ^= 0x40  # inside the AEAD tag
    return bytes(damaged)


@VERSIONS
@pytest.mark.asyncio
async def test_corrupted_record_after_good_ones(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    good = os.urandom(10 * RECORD)

    async def peer() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, version), server_side=True)
        await tls.handshake()
        wire = tls.seal(*(good[i : i + RECORD] for i in range(0, len(good), RECORD)))
        wire += corrupt_last(tls.seal(b"never delivered" * 20))
        await tls.send(wire)
        await tls.linger()

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    assert await reader.readexactly(len(good)) == good
    with pytest.raises(ssl.SSLError) as info:
        await reader.read(100)
    assert not isinstance(info.value, slabnet.TLSTruncatedError)
    assert "BAD_RECORD_MAC" in str(info.value.reason), info.value
    writer.close()
    await task


@VERSIONS
@pytest.mark.asyncio
async def test_alert_after_data_ends_the_batch(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    good = os.urandom(8 * RECORD)

    async def peer() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, version), server_side=True)
        await tls.handshake()
        wire = tls.seal(*(good[i : i + RECORD] for i in range(0, len(good), RECORD)))
        alert = tls.fatal_alert()
        if version is TLS12:
            assert [r[0] for r in records(alert)] == [21]  # an alert record
        await tls.send(wire + alert)
        await tls.linger()

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    chunks = await read_chunks(reader, len(good))
    assert b"".join(chunks) == good
    with pytest.raises(ssl.SSLError) as info:
        await reader.read_chunk()
    assert "ALERT_BAD_RECORD_MAC" in str(info.value.reason), info.value
    writer.close()
    await task


@pytest.mark.asyncio
async def test_tls12_renegotiation_between_data_records(pem_files: dict[str, str]) -> None:
    # s_server sends A (small records), then a HelloRequest, while our loop is
    # blocked, so both arrive in one read; then B after the renegotiation.
    port = free_port()
    proc = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", pem_files["server"],
         "-naccept", "1", "-max_send_frag", str(RECORD), "-tls1_2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        assert proc.stdin is not None
        a = b"x" + os.urandom(3000).hex().encode() + b"\n"
        b = b"y" + os.urandom(3000).hex().encode() + b"\n"
        # The loop is blocked on purpose until A's records and then the
        # HelloRequest wait in the socket, so that one read takes them all.
        fd = writer.get_extra_info("socket").fileno()
        proc.stdin.write(a)
        proc.stdin.flush()
        n_records = -(-len(a) // RECORD)
        block_until_records(fd, lambda recs: len(recs) >= n_records)
        proc.stdin.write(b"r\n")  # s_server: renegotiate (a command must come alone)
        proc.stdin.flush()
        block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
        first = await reader.read_chunk()
        assert_owned(first)
        assert bytes(first) == a[: len(first)]
        assert len(first) > RECORD  # coalesced
        assert bytes(first) + await reader.readexactly(len(a) - len(first)) == a
        proc.stdin.write(b)
        proc.stdin.flush()
        assert await asyncio.wait_for(reader.readexactly(len(b)), 10) == b
        writer.write(b"zz-from-slabnet\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        await close(writer)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"zz-from-slabnet\n" in out
    assert b"2 server accepts that finished" in out, out[-400:]


# ---------------------------------------------------------------- openssl interop


@VERSIONS
@pytest.mark.asyncio
async def test_openssl_s_server_interop(pem_files: dict[str, str], version: ssl.TLSVersion) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        "openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", pem_files["server"],
        "-naccept", "1", "-quiet", "-max_send_frag", str(RECORD), OPENSSL_FLAG[version],
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        assert writer.get_extra_info("ssl_object").version() == version.name.replace("v1_", "v1.")
        to_client = os.urandom(150_000)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(to_client)
        await proc.stdin.drain()
        chunks = await asyncio.wait_for(read_chunks(reader, len(to_client)), 20)
        assert b"".join(chunks) == to_client
        assert len(chunks) < len(to_client) // RECORD
        for chunk in chunks:
            assert_owned(chunk)
        to_server = os.urandom(200_000)
        writer.write(to_server)
        await writer.drain()
        await close(writer)
        proc.stdin.close()
        out = await asyncio.wait_for(proc.stdout.read(), 20)
        assert hashlib.sha256(out).hexdigest() == hashlib.sha256(to_server).hexdigest()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@VERSIONS
@pytest.mark.asyncio
async def test_openssl_s_client_interop(
    pem_files: dict[str, str], server_cert: Any, version: ssl.TLSVersion
) -> None:
    to_server = os.urandom(120_000)
    to_client = os.urandom(180_000)
    seen: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            seen.set_result(await reader.readexactly(len(to_server)))
            writer.write(to_client)
            await writer.drain()
        finally:
            writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version))
    port = server.sockets[0].getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        "openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", "localhost",
        "-CAfile", pem_files["ca"], "-verify_return_error", "-quiet",
        "-max_send_frag", str(RECORD), OPENSSL_FLAG[version],
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(to_server)
        await proc.stdin.drain()
        got = await asyncio.wait_for(seen, 20)
        assert got == to_server
        out = await asyncio.wait_for(proc.stdout.read(), 20)
        assert hashlib.sha256(out).hexdigest() == hashlib.sha256(to_client).hexdigest()
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- slow consumers


@pytest.mark.asyncio
async def test_close_notify_while_reading_is_paused(server_cert: Any, tls_ca: Any) -> None:
    payload = os.urandom(4 * 1024 * 1024)

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(payload)
        writer.close()  # close_notify right behind the data

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    await until_paused(writer.transport)  # the data and close_notify keep coming
    await asyncio.sleep(0.1)
    data, exc, _ = await slow_read(reader, writer.transport)
    assert exc is None
    assert len(data) == len(payload) and data == payload
    await close(writer)
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("ending", ["close_notify", "fin", "fin_ragged", "corrupt", "cut_record"])
@pytest.mark.asyncio
async def test_no_byte_lost_when_the_end_arrives_while_paused(
    listener: socket.socket, server_cert: Any, tls_ca: Any, ending: str
) -> None:
    payload = os.urandom(2 * 1024 * 1024)

    async def peer() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.send(tls.seal(*(payload[i : i + 16384] for i in range(0, len(payload), 16384))))
        if ending == "close_notify":
            await tls.send(tls.close_notify())
        elif ending == "corrupt":
            await tls.send(corrupt_last(tls.seal(b"lost" * 100)))
        elif ending == "cut_record":
            tail = tls.seal(b"half" * 100)
            await tls.send(tail[: len(tail) // 2])
        conn.close()  # FIN

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca), server_hostname="localhost",
        ssl_ragged_eof=ending in ("fin_ragged", "cut_record"),
    )
    await until_paused(writer.transport)  # then the end arrives while paused
    data, exc, paused = await slow_read(reader, writer.transport, pause=0.003)
    await task
    assert paused, "the reader never paused reading"
    assert len(data) == len(payload) and data == payload
    if ending in ("close_notify", "fin_ragged"):
        assert exc is None
    elif ending in ("fin", "cut_record"):
        # a FIN inside a record is a truncation even with ragged EOF allowed
        assert isinstance(exc, slabnet.TLSTruncatedError), repr(exc)
        assert isinstance(exc, ssl.SSLEOFError)
    else:
        assert isinstance(exc, ssl.SSLError) and "BAD_RECORD_MAC" in str(exc.reason), repr(exc)
    writer.close()


@pytest.mark.asyncio
async def test_pausing_a_tls_stream_pauses_the_socket_and_bounds_the_bio(
    server_cert: Any, tls_ca: Any
) -> None:
    # Each read is delivered whole, which may take the stream over its
    # high-water mark and pause reading.  The plain connection under the
    # TLS layer pauses with it: its next read takes in at most 1 KiB, holds
    # it and pauses the socket, so while the stream is paused the engine's
    # BIO keeps at most a partial record.  Every byte arrives.
    payload = os.urandom(16 * 1024 * 1024)

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert))
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    loop = asyncio.get_running_loop()
    try:
        tr = writer.transport
        engine = tr._engine  # type: ignore[union-attr]
        pauses: list[bool] = []  # was the socket reading right after the pause?
        resumes: list[tuple[bool, int]] = []  # socket reading, BIO bytes, at resume
        pause, resume = tr.pause_reading, tr.resume_reading

        def counted_pause() -> None:
            pause()
            pauses.append(tr._lower.is_reading())  # type: ignore[union-attr]

        def counted_resume() -> None:
            resumes.append((tr._lower.is_reading(), engine.buffered_ciphertext))  # type: ignore[union-attr]
            resume()

        tr.pause_reading = counted_pause  # type: ignore[method-assign]
        tr.resume_reading = counted_resume  # type: ignore[method-assign]
        digest = hashlib.sha256()
        got = 0
        async for chunk in reader.chunks():
            digest.update(chunk)
            got += len(chunk)
        assert got == len(payload) and digest.digest() == hashlib.sha256(payload).digest()
        assert pauses and resumes, "the stream never paused"
        assert not any(pauses)
        for socket_reading, buffered in resumes:
            assert not socket_reading
            assert buffered <= 16 * 1024 + 256, buffered  # a partial record
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- features


@pytest.mark.asyncio
async def test_sni_reaches_the_server(server_cert: Any, tls_ca: Any) -> None:
    names: list[str | None] = []
    ctx = server_ctx(server_cert)
    ctx.sni_callback = lambda obj, name, _ctx: names.append(name)  # type: ignore[func-returns-value]

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(b"hi")
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    assert await reader.read() == b"hi"
    assert names == ["localhost"]
    assert writer.get_extra_info("server_hostname") == "localhost"
    await close(writer)
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_alpn(server_cert: Any, tls_ca: Any) -> None:
    sctx = server_ctx(server_cert)
    sctx.set_alpn_protocols(["h2", "http/1.1"])
    server_alpn: list[str | None] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        server_alpn.append(writer.get_extra_info("ssl_object").selected_alpn_protocol())
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=sctx)
    port = server.sockets[0].getsockname()[1]
    cctx = client_ctx(tls_ca)
    cctx.set_alpn_protocols(["http/1.1", "spdy/3"])
    reader, writer = await slabnet.open_connection("127.0.0.1", port, ssl=cctx, server_hostname="localhost")
    assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    assert await reader.read() == b""
    assert server_alpn == ["http/1.1"]
    await close(writer)
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_hostname_is_verified_by_default(tls_ca: Any) -> None:
    # A certificate for "localhost" only: connecting by IP with no
    # server_hostname checks the IP (the host argument) and must fail.
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.issue_cert("localhost").configure_cert(ctx)

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(ssl.SSLCertVerificationError) as info:
        await slabnet.open_connection("127.0.0.1", port, ssl=client_ctx(tls_ca))
    assert "IP address mismatch" in str(info.value)
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    assert writer.get_extra_info("peercert")["subjectAltName"] == (("DNS", "localhost"),)
    await close(writer)
    server.close()
    await server.wait_closed()


@VERSIONS
@pytest.mark.asyncio
async def test_client_certificates(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    sctx = server_ctx(server_cert, version)
    sctx.verify_mode = ssl.CERT_REQUIRED
    tls_ca.configure_trust(sctx)
    peers: list[Any] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peercert"))
        writer.write(b"welcome")
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=sctx)
    port = server.sockets[0].getsockname()[1]
    with_cert = client_ctx(tls_ca)
    tls_ca.issue_cert("client@example.org").configure_cert(with_cert)
    reader, writer = await slabnet.open_connection("127.0.0.1", port, ssl=with_cert, server_hostname="localhost")
    assert await reader.read() == b"welcome"
    assert peers and ("email", "client@example.org") in peers[0]["subjectAltName"]
    await close(writer)

    # Without a certificate: TLS 1.2 fails in the handshake; in TLS 1.3 the
    # client's handshake is over before the server checks, so the
    # certificate_required alert surfaces on the first read.
    with pytest.raises(ssl.SSLError) as info:
        reader, writer = await slabnet.open_connection(
            "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
        )
        try:
            await reader.read()
        finally:
            writer.close()
    expected = "CERTIFICATE_REQUIRED" if version is TLS13 else "HANDSHAKE_FAILURE"
    assert expected in str(info.value.reason), info.value
    assert len(peers) == 1, "the server accepted a client without a certificate"
    server.close()
    await server.wait_closed()


@VERSIONS
@pytest.mark.asyncio
async def test_session_resumption(server_cert: Any, tls_ca: Any, version: ssl.TLSVersion) -> None:
    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(b"hello")
        await reader.read()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version))
    port = server.sockets[0].getsockname()[1]
    cctx = client_ctx(tls_ca)
    reader, writer = await slabnet.open_connection("127.0.0.1", port, ssl=cctx, server_hostname="localhost")
    assert await reader.readexactly(5) == b"hello"  # TLS 1.3 tickets come with it
    first = writer.get_extra_info("ssl_object")
    assert not first.session_reused
    session = first.session
    assert session is not None
    await close(writer)

    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=cctx, server_hostname="localhost", ssl_session=session
    )
    assert await reader.readexactly(5) == b"hello"
    assert writer.get_extra_info("ssl_object").session_reused
    assert writer.get_extra_info("session_reused") is True
    await close(writer)
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_handshake_timeout(listener: socket.socket, tls_ca: Any) -> None:
    accepted: list[socket.socket] = []

    async def silent() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        accepted.append(conn)  # never answers the ClientHello

    task = asyncio.create_task(silent())
    start = time.monotonic()
    with pytest.raises(slabnet.HandshakeTimeoutError) as info:
        await slabnet.open_connection(
            "127.0.0.1", port_of(listener), ssl=client_ctx(tls_ca),
            server_hostname="localhost", ssl_handshake_timeout=0.3,
        )
    elapsed = time.monotonic() - start
    assert isinstance(info.value, TimeoutError)
    assert 0.25 <= elapsed < 10, elapsed  # fired, not before its time; load may delay it
    await task
    for conn in accepted:
        conn.close()


@pytest.mark.asyncio
async def test_extra_info(server_cert: Any, tls_ca: Any) -> None:
    server_side: dict[str, Any] = {}
    sctx = server_ctx(server_cert)

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        for name in ("peercert", "cipher", "ssl_object", "sslcontext"):
            server_side[name] = writer.get_extra_info(name)
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=sctx)
    port = server.sockets[0].getsockname()[1]
    cctx = client_ctx(tls_ca)
    reader, writer = await slabnet.open_connection("127.0.0.1", port, ssl=cctx, server_hostname="localhost")
    cert = writer.get_extra_info("peercert")
    assert ("DNS", "localhost") in cert["subjectAltName"]
    assert isinstance(writer.get_extra_info("peercert_bin"), bytes)
    name, proto, bits = writer.get_extra_info("cipher")
    obj = writer.get_extra_info("ssl_object")
    assert isinstance(obj, ssl.SSLObject)
    assert (name, proto) == (obj.cipher()[0], obj.version()) and bits >= 128
    assert writer.get_extra_info("sslcontext") is cctx
    assert writer.get_extra_info("peername")[0] == "127.0.0.1"
    assert writer.get_extra_info("socket") is not None
    assert await reader.read() == b""
    assert server_side["peercert"] is None  # no client certificate asked for
    assert server_side["cipher"][0] == name
    assert server_side["sslcontext"] is sctx
    assert server_side["ssl_object"].server_side
    await close(writer)
    server.close()
    await server.wait_closed()


# ---------------------------------------------------------------- STARTTLS


async def _starttls_server_side(
    reader: Any, writer: Any, ctx: ssl.SSLContext, upgraded: list[Any]
) -> None:
    assert await reader.readline() == b"STARTTLS\r\n"
    writer.write(b"220 go ahead\r\n")
    await writer.drain()
    await writer.start_tls(ctx)
    upgraded.append(writer.get_extra_info("ssl_object"))
    while line := await reader.readline():
        writer.write(line.upper())
        await writer.drain()
    writer.close()


async def _starttls_client_side(reader: Any, writer: Any, ctx: ssl.SSLContext) -> None:
    writer.write(b"STARTTLS\r\n")
    assert await reader.readline() == b"220 go ahead\r\n"
    assert writer.get_extra_info("ssl_object") is None
    await writer.start_tls(ctx, server_hostname="localhost")
    assert isinstance(writer.get_extra_info("ssl_object"), ssl.SSLObject)
    body = os.urandom(20_000).hex().encode()
    writer.write(b"secret " + body + b"\n")
    assert await reader.readline() == b"SECRET " + body.upper() + b"\n"
    writer.close()


@pytest.mark.parametrize("peer", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_starttls_server_side(server_cert: Any, tls_ca: Any, peer: str) -> None:
    upgraded: list[Any] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await _starttls_server_side(reader, writer, server_ctx(server_cert), upgraded)

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    opener: Callable[..., Any] = (
        slabnet.open_connection if peer == "slabnet" else asyncio.open_connection
    )
    reader, writer = await opener("127.0.0.1", port)
    await asyncio.wait_for(_starttls_client_side(reader, writer, client_ctx(tls_ca)), 10)
    assert len(upgraded) == 1 and upgraded[0].server_side
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("peer", ["slabnet", "asyncio"])
@pytest.mark.asyncio
async def test_starttls_client_side(server_cert: Any, tls_ca: Any, peer: str) -> None:
    upgraded: list[Any] = []
    done = asyncio.get_running_loop().create_future()

    async def handle(reader: Any, writer: Any) -> None:
        try:
            await _starttls_server_side(reader, writer, server_ctx(server_cert), upgraded)
        finally:
            done.set_result(None)

    starter: Callable[..., Any] = slabnet.start_server if peer == "slabnet" else asyncio.start_server
    server = await starter(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    await asyncio.wait_for(_starttls_client_side(reader, writer, client_ctx(tls_ca)), 10)
    await asyncio.wait_for(done, 10)
    assert len(upgraded) == 1
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_starttls_after_reading_was_paused(server_cert: Any, tls_ca: Any) -> None:
    # Reading paused on the plain connection pauses the socket itself; a
    # STARTTLS upgrade started meanwhile waits, and the next resume_reading()
    # (now on a TLS transport) must resume that socket.
    upgraded: list[Any] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await _starttls_server_side(reader, writer, server_ctx(server_cert), upgraded)

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        writer.write(b"STARTTLS\r\n")
        assert await reader.readline() == b"220 go ahead\r\n"
        tr = writer.transport
        tr.pause_reading()
        assert not tr.is_reading()
        upgrade = asyncio.create_task(writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"))
        await asyncio.sleep(0.2)
        assert not upgrade.done()  # the handshake cannot read yet
        tr.resume_reading()
        await asyncio.wait_for(upgrade, 10)
        assert tr.is_reading() and writer.transport.is_reading()
        writer.write(b"after the pause\n")
        assert await asyncio.wait_for(reader.readline(), 10) == b"AFTER THE PAUSE\n"
        assert len(upgraded) == 1
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_starttls_writes_made_during_the_handshake_are_encrypted(
    server_cert: Any, tls_ca: Any
) -> None:
    # The client writes while its STARTTLS handshake is still running. Those
    # bytes must travel inside TLS, after the handshake: sent in plaintext
    # they would land in the middle of it and break it.
    upgraded: list[Any] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await _starttls_server_side(reader, writer, server_ctx(server_cert), upgraded)

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            writer.write(b"STARTTLS\r\n")
            assert await reader.readline() == b"220 go ahead\r\n"
            upgrade = asyncio.create_task(
                writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
            )
            await asyncio.sleep(0)  # the handshake has started, not finished
            assert not upgrade.done()
            req = writer.write(b"early words\n")
            assert req is not None  # it waits for the handshake
            await upgrade
            await req
            assert await reader.readline() == b"EARLY WORDS\n"
            assert len(upgraded) == 1
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_starttls_resumes_a_session(server_cert: Any, tls_ca: Any) -> None:
    # StreamWriter.start_tls takes ssl_session, as open_connection does: a
    # second STARTTLS connection resumes the first one's TLS 1.2 session.
    sctx = server_ctx(server_cert, ssl.TLSVersion.TLSv1_2)
    cctx = client_ctx(tls_ca, ssl.TLSVersion.TLSv1_2)
    upgraded: list[Any] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await _starttls_server_side(reader, writer, sctx, upgraded)

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = None
    reused = []
    try:
        async with asyncio.timeout(10):
            for _ in range(2):
                reader, writer = await slabnet.open_connection("127.0.0.1", port)
                writer.write(b"STARTTLS\r\n")
                assert await reader.readline() == b"220 go ahead\r\n"
                await writer.start_tls(cctx, server_hostname="localhost", ssl_session=session)
                ssl_object = writer.get_extra_info("ssl_object")
                reused.append(ssl_object.session_reused)
                session = ssl_object.session
                writer.write(b"ping\n")
                assert await reader.readline() == b"PING\n"
                writer.close()
                await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert reused == [False, True]


@pytest.mark.asyncio
async def test_starttls_handshake_sent_right_behind_the_command(
    server_cert: Any, tls_ca: Any
) -> None:
    # The client does not wait for the server's answer: its ClientHello goes
    # out in the same segment as the STARTTLS command, so the server's
    # reader already holds it when the server calls start_tls(). Those bytes
    # are ciphertext and must reach the TLS layer (they sat in the reader,
    # and the handshake timed out).
    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        assert await reader.readline() == b"STARTTLS\r\n"
        await writer.start_tls(server_ctx(server_cert), ssl_handshake_timeout=5)
        writer.write((await reader.readline()).upper())
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            writer.write(b"STARTTLS\r\n")  # gathered: one sendmsg with the hello
            await writer.start_tls(
                client_ctx(tls_ca), server_hostname="localhost", ssl_handshake_timeout=5
            )
            writer.write(b"pipelined\n")
            assert await reader.readline() == b"PIPELINED\n"
    finally:
        writer.transport.abort()
        server.close()
        await server.wait_closed()
