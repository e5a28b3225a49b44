"""TLS audit: how slabnet's TLS behaves against hostile or broken peers,
compared with what asyncio's SSL transport does (on both loops).

Real loopback sockets, real TLS (trustme), raw peers whose bytes the test
picks (``conftest.RawTLS``, or plain sockets for bytes that are not TLS).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import subprocess
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, block_until_records, client_ctx, server_ctx
from test_tls_renegotiation import unread
from test_tls_streams import connect_retry, free_port, pem_files  # noqa: F401 (fixture)

WAKE = 10.0  # seconds any waiter may take to wake after a fault (see test_faults)


async def accept(listener: socket.socket) -> socket.socket:
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    return conn


# ------------------------------------------------- the peer's FIN during the handshake


async def recv_record(conn: socket.socket) -> bytes:
    """Read one whole TLS record (header and body) from ``conn``."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
        more = await loop.sock_recv(conn, 65536)
        assert more, f"EOF after {len(data)} bytes of a record"
        data += more
    return data


@pytest.mark.parametrize("stage", ["before_hello", "after_hello", "mid_flight"])
@pytest.mark.asyncio
async def test_fin_during_the_handshake_is_connection_reset(
    listener: socket.socket, server_cert: Any, tls_ca: Any, stage: str
) -> None:
    """asyncio (sslproto.py and uvloop alike) fails a handshake cut by the
    peer's FIN with ConnectionResetError; code written for it catches that."""
    loop = asyncio.get_running_loop()

    async def peer() -> None:
        conn = await accept(listener)
        try:
            # The whole ClientHello is read first in every stage: closing a
            # socket with bytes unread sends an RST instead of the FIN, and
            # the client's read would fail with the kernel's ECONNRESET.
            hello = await recv_record(conn)
            if stage != "before_hello":
                tls = RawTLS(conn, server_ctx(server_cert), server_side=True)
                tls.incoming.write(hello)
                if stage == "mid_flight":
                    try:
                        tls.obj.do_handshake()
                    except ssl.SSLWantReadError:
                        pass
                    flight = tls.outgoing.read()
                    await loop.sock_sendall(conn, flight[: len(flight) // 2])
        finally:
            conn.close()  # FIN, no RST: everything sent was received

    task = asyncio.create_task(peer())
    with pytest.raises(ConnectionResetError) as info:
        await asyncio.wait_for(
            slabnet.open_connection(
                "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca),
                server_hostname="localhost",
            ),
            WAKE,
        )
    assert "during the TLS handshake" in str(info.value)
    await task


# ------------------------------------------------- the timeout keywords


BAD_TIMEOUTS = pytest.mark.parametrize(
    ("name", "value"),
    [("ssl_handshake_timeout", 0), ("ssl_handshake_timeout", -1.0),
     ("ssl_shutdown_timeout", 0), ("ssl_shutdown_timeout", -5),
     ("ssl_handshake_timeout", float("nan")), ("ssl_shutdown_timeout", float("nan"))],
)


@BAD_TIMEOUTS
@pytest.mark.asyncio
async def test_timeouts_that_are_not_positive_are_refused(
    tls_echo_server: tuple[str, int], tls_client_context: ssl.SSLContext,
    server_cert: Any, name: str, value: float,
) -> None:
    """asyncio: ValueError("... should be a positive number, got 0"). A
    handshake timeout of 0 failing every handshake, or a shutdown timeout of
    0 dropping what close() still sends, is an operator's typo, not a wish."""
    message = f"{name} should be a positive number, got {value}"
    with pytest.raises(ValueError, match=message):
        await slabnet.open_connection(
            *tls_echo_server, ssl=tls_client_context, server_hostname="localhost",
            **{name: value},
        )
    with pytest.raises(ValueError, match=message):
        await slabnet.start_server(
            lambda r, w: None, "127.0.0.1", 0, ssl=server_ctx(server_cert), **{name: value}
        )
    # STARTTLS: refused before anything changes; the plain connection goes on.
    reader, writer = await slabnet.open_connection(*tls_echo_server)
    try:
        with pytest.raises(ValueError, match=message):
            await writer.start_tls(
                tls_client_context, server_hostname="localhost", **{name: value}
            )
        assert not isinstance(writer.transport, slabnet.TLSTransport)
    finally:
        writer.close()
        await writer.wait_closed()


# ------------------------------------------------- a cancelled STARTTLS handshake


@pytest.mark.parametrize("how", ["writer", "transport"])
@pytest.mark.asyncio
async def test_cancelled_start_tls_ends_the_connection(
    listener: socket.socket, tls_ca: Any, how: str
) -> None:
    """A STARTTLS handshake given up by its caller (a timeout, a cancelled
    task) leaves bytes that are neither plaintext nor TLS: asyncio closes the
    transport (its start_tls: ``except BaseException: transport.close()``).
    slabnet went on waiting for the handshake, so a read hung until the
    60 s handshake timeout and the peer's connection stayed open."""
    loop = asyncio.get_running_loop()
    reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    conn = await accept(listener)
    try:
        if how == "writer":
            upgrade = writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
        else:
            transport = writer.transport
            assert isinstance(transport, slabnet.SlabTransport)
            upgrade = transport.start_tls(client_ctx(tls_ca), server_hostname="localhost")
        task = asyncio.ensure_future(upgrade)
        assert (await loop.sock_recv(conn, 65536))[:1] == b"\x16"  # ClientHello; no answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The peer sees the connection end (FIN or RST), without waiting.
        try:
            rest = await asyncio.wait_for(loop.sock_recv(conn, 65536), WAKE)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
        if how == "writer":
            assert writer.is_closing()
            with pytest.raises(ConnectionAbortedError):
                await asyncio.wait_for(reader.read(), WAKE)
    finally:
        conn.close()
        writer.close()


# ------------------------------------------------- write flow control


@pytest.mark.asyncio
async def test_writer_paused_by_plaintext_is_resumed_once_the_socket_drains(
    server_cert: Any, tls_ca: Any
) -> None:
    """The TLS transport pauses the app on plaintext plus the plain queue;
    it looked again only when the plain connection paused or resumed. Text
    gathered past the high-water mark (here: written during a STARTTLS
    handshake; in bulk transfers, plaintext gathered while the queue was
    just under the mark) whose ciphertext left the plain queue between the
    marks, so that the plain connection never paused, left the app paused
    for good: drain() hung although every byte was sent (seen on uvloop
    with a 4 KiB send buffer and drain() after each 30 KB write)."""
    loop = asyncio.get_running_loop()
    size = 64 * 1024 + 1  # just over the high-water mark
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited, before listen
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.connect(lsock.getsockname())
    reader, writer = await slabnet.open_connection(sock=sock)
    conn = await accept(lsock)
    try:
        tls = RawTLS(conn, server_ctx(server_cert), server_side=True)
        upgrade = asyncio.ensure_future(
            writer.start_tls(client_ctx(tls_ca), server_hostname="localhost")
        )
        await asyncio.sleep(0)
        writer.write(b"s" * size)  # gathered: encrypted once the handshake is done
        assert writer.transport.get_write_buffer_size() == size
        drained = asyncio.ensure_future(writer.drain())  # paused: waits
        async with asyncio.timeout(WAKE):
            await tls.handshake()
            await upgrade
            got = await tls.recv_plain(size)  # every byte arrives...
        assert got == b"s" * size
        assert writer.transport.get_write_buffer_size() == 0
        # ... and the writer is let go.
        await asyncio.wait_for(drained, 5.0)
    finally:
        writer.transport.abort()
        conn.close()
        lsock.close()


@pytest.mark.asyncio
async def test_plaintext_held_by_a_stalled_renegotiation_pauses_the_writer(
    pem_files: dict[str, str],  # noqa: F811
) -> None:
    """A TLS 1.2 server that starts a renegotiation and never finishes it:
    OpenSSL encrypts nothing meanwhile and the engine holds the plaintext.
    That plaintext was not in get_write_buffer_size(), so drain() never
    blocked and a writer looping on write()/drain() buffered without bound
    (13 MB in 200 writes here; asyncio pauses it at its high-water mark)."""
    port = free_port()
    proc = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", pem_files["server"],
         "-naccept", "1", "-tls1_2"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    stopped = False
    try:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        transport = writer.transport
        engine = transport._engine  # type: ignore[union-attr]
        fd = writer.get_extra_info("socket").fileno()
        proc.stdin.write(b"r\n")  # s_server: renegotiate (a command must come alone)
        proc.stdin.flush()
        block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
        os.kill(proc.pid, signal.SIGSTOP)  # it never answers our ClientHello
        stopped = True
        async with asyncio.timeout(WAKE):
            while unread(fd):  # the engine reads the HelloRequest, renegotiates
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
        high = transport.get_write_buffer_limits()[1]
        for _ in range(4):
            writer.write(b"w" * 65536)
        await asyncio.sleep(0.05)  # the end-of-iteration flush ran: all held
        held = engine.held_plaintext
        assert held == 4 * 65536
        assert transport.get_write_buffer_size() >= held > high
        drained = asyncio.ensure_future(writer.drain())
        await asyncio.sleep(0.2)
        assert not drained.done()  # paused: nothing can leave
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        await asyncio.wait_for(drained, 30)  # the renegotiation ends: resumed
        assert engine.held_plaintext == 0
        writer.close()
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        proc.stdin.close()
