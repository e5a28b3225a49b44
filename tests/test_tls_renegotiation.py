"""Writes during a TLS 1.2 renegotiation, against a real ``openssl s_server``.

While a renegotiation is in progress OpenSSL refuses to encrypt application
data (``SSLObject.write`` raises ``SSLWantReadError``), so the engine holds
such plaintext until the new handshake is done. A ``WriteRequest`` for it
must not complete before its bytes are encrypted and handed to the kernel.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import ssl
import threading

from typing import Any

import pytest

import slabnet
from conftest import (
    ForgedTLS12, RawTLS, block_until_records, client_ctx, forgeable, server_ctx, shrink, unread,
)
from slabnet._slab import LEND_SIZE
from slabnet._tls import _DRAIN_AT, _LEND_LOW, LEND_PIECE, TLSState
from slabnet._tls_transport import ANSWERS_MAX
from test_writer_hardening import WAKE
from test_tls_streams import connect_retry, free_port, pem_files  # noqa: F401 (fixture)


class SServer:
    """``openssl s_server -tls1_2`` for one connection, its stdout collected
    in ``out`` by a thread (it blocks once its stdout pipe is full), and
    SIGSTOP/SIGCONT that the exit undoes before it kills the process."""

    def __init__(self, port: int, pem_files: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", pem_files["server"],
             "-naccept", "1", "-tls1_2"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.out = bytearray()
        self.stopped = False
        self.threads = [threading.Thread(target=self._collect, daemon=True)]
        self.threads[0].start()

    def _collect(self) -> None:
        while data := self.stdout.read1(65536):
            self.out.extend(data)

    def command(self, line: bytes) -> None:
        self.stdin.write(line)  # a command must come alone on its line
        self.stdin.flush()

    def feed(self, data: bytes) -> None:
        """Write ``data`` to its stdin from a thread (it sends it on)."""

        def run() -> None:
            try:
                self.command(data)
            except (BrokenPipeError, ValueError):
                pass

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def text(self) -> bytes:
        """What it received, without its status line about the
        renegotiation (which can land anywhere in the data)."""
        return bytes(self.out).replace(b"SSL_do_handshake -> 1\n", b"")

    def __enter__(self) -> "SServer":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stopped:
            self.cont()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for thread in self.threads:
            thread.join(10)
        self.stdin.close()
        self.stdout.close()


async def renegotiating(srv: SServer, fd: int) -> None:
    """s_server sends a HelloRequest and stops before it can answer our
    ClientHello; returns once the engine has read the request (and is
    renegotiating)."""
    srv.command(b"r\n")  # s_server: renegotiate
    block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
    srv.stop()
    async with asyncio.timeout(WAKE):
        while unread(fd):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_write_request_waits_for_plaintext_held_by_a_renegotiation(
    pem_files: dict[str, str],  # noqa: F811
) -> None:
    port = free_port()
    with SServer(port, pem_files) as srv:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        engine = writer.transport._engine
        sock = writer.get_extra_info("socket")
        fd = sock.fileno()
        # A send buffer of our own size: the backlog below does not depend on
        # the host's autotuning.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        srv.command(b"r\n")  # s_server: renegotiate
        block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
        # The server stops before it can read anything more: what we send
        # from now on stays in the kernels (a window that cannot grow while
        # nobody reads) or in our queue.
        srv.stop()
        bulk = os.urandom(4 * 1024 * 1024).hex().encode()[: 8 * 1024 * 1024]
        writer.write(bulk)  # encrypted at once (64 KiB and more): it queues
        assert writer.transport.get_write_buffer_size() > 0
        # Let the loop read the HelloRequest: the engine answers with a
        # ClientHello (queued behind the bulk) and is now renegotiating.
        async with asyncio.timeout(10):
            while unread(fd):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
        req = writer.write(b"DURING-RENEGOTIATION\n")
        assert req is not None  # the socket is backed up: it has to wait
        await asyncio.sleep(0.05)  # the end-of-iteration flush ran: the engine holds it
        assert engine.held_plaintext == len(b"DURING-RENEGOTIATION\n")
        srv.cont()
        async with asyncio.timeout(30):
            await req
        # Done means encrypted and handed to the kernel: nothing held back.
        assert engine.held_plaintext == 0
        assert writer.transport.get_write_buffer_size() == 0
        writer.write(b"AFTER\n")
        await writer.drain()
        async with asyncio.timeout(30):
            while b"AFTER\n" not in srv.out[-64:]:
                await asyncio.sleep(0.02)
        writer.close()
        await writer.wait_closed()
    text = srv.text()
    at = text.index(bulk[:4096])
    assert text[at : at + len(bulk)] == bulk
    rest = text[at + len(bulk) :]
    assert rest.index(b"DURING-RENEGOTIATION\n") < rest.index(b"AFTER\n"), rest[-2000:]


# ------------------------------------------------ held writes are not answers


@pytest.mark.asyncio
async def test_writes_a_renegotiation_held_do_not_stop_the_reads(
    pem_files: dict[str, str],  # noqa: F811
) -> None:
    """Plaintext written during a TLS 1.2 renegotiation is encrypted when it
    ends, and goes out with the engine's own output. The transport counted
    it as answers the peer had asked for (ANSWERS_MAX): more than 16 KiB of
    it behind a paused queue stopped the reads until the peer read some.
    openssl s_server reads its socket only between writes that block, so a
    server sending to us while we sent to it waited for us, and we for it,
    for good (found by tests/test_real_peers.py's TLS-in-TLS test under
    load). The held bytes are the app's data: reading goes on."""
    port = free_port()
    # More than the kernels hold between s_server and a reader that stops
    # (hex: s_server takes a line that starts with some letters as a command).
    down = os.urandom(8 * 1024 * 1024).hex().encode()
    held = os.urandom(4 * 1024 * 1024).hex().encode()  # 8 MiB, far above ANSWERS_MAX
    with SServer(port, pem_files) as srv:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        loop = asyncio.get_running_loop()
        # Buffers of our own size on our side (the receive buffer before
        # connecting: the window's scale is fixed at the handshake), so what
        # the kernels hold does not depend on the host's autotuning much.
        async with asyncio.timeout(30):  # s_server may take a while to listen
            while True:
                sock = socket.socket()  # a new one each time: a refused one is done
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, ("127.0.0.1", port))
                    break
                except ConnectionRefusedError:
                    sock.close()
                    await asyncio.sleep(0.02)
        reader, writer = await asyncio.wait_for(
            slabnet.open_connection(sock=sock, ssl=ctx, server_hostname="localhost"), WAKE
        )
        engine = writer.transport._engine
        fd = sock.fileno()
        await renegotiating(srv, fd)
        writer.write(held)
        await asyncio.sleep(0.05)  # the end-of-iteration flush ran
        assert engine.held_plaintext == len(held)
        srv.feed(down)  # s_server will send `down` as soon as it runs
        srv.cont()
        assert await asyncio.wait_for(reader.readexactly(len(down)), 30) == down
        await asyncio.wait_for(writer.drain(), WAKE)
        assert engine.held_plaintext == 0
        async with asyncio.timeout(WAKE):
            while held[-64:] not in srv.out[-4096:]:
                await asyncio.sleep(0.02)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    assert held in srv.text()


# ------------------------------------------------ renegotiation requests nobody reads


@pytest.mark.parametrize("side", ["server", "client"])
@pytest.mark.asyncio
async def test_renegotiation_requests_nobody_reads_stop_the_reads(
    small_listener: socket.socket, server_cert: Any, tls_ca: Any, tmp_path: Any, side: str,
) -> None:
    # A TLS 1.2 peer that asks for renegotiation over and over and reads
    # none of the answers: ClientHellos to a slabnet server (OpenSSL 3
    # refuses each with a no_renegotiation alert), HelloRequests to a
    # slabnet client whose context refuses renegotiation. A record may pack
    # many such 4-byte messages, each answered by a 31-byte alert (asyncio
    # and uvloop queue them all, at 7.75 times the peer's sending rate).
    # The answers queued stay under the low-water mark plus ANSWERS_MAX plus
    # the answers of one read; once the peer reads, the reads go on and
    # every byte of data sent after the requests arrives.
    loop = asyncio.get_running_loop()
    keylog = str(tmp_path / "keylog")
    received: asyncio.Future[bytes] = loop.create_future()

    async def read_all(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        got = bytearray()
        while chunk := await reader.read_chunk():
            got += chunk
        received.set_result(bytes(got))
        writer.close()

    server = None
    if side == "server":
        served: asyncio.Future[slabnet.StreamWriter] = loop.create_future()

        async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
            served.set_result(writer)
            await read_all(reader, writer)

        server = await slabnet.start_server(handle, sock=small_listener, ssl=server_ctx(server_cert))
        sock = socket.socket()
        shrink(sock)
        await loop.sock_connect(sock, small_listener.getsockname())
        peer = RawTLS(sock, forgeable(client_ctx(tls_ca), keylog), server_side=False,
                      server_hostname="localhost")
        request = b"\x01\0\0\0"  # a ClientHello's header
    else:
        ctx = client_ctx(tls_ca)
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        opening = asyncio.ensure_future(slabnet.open_connection(
            *small_listener.getsockname(), ssl=ctx, server_hostname="localhost"))
        sock, _ = await loop.sock_accept(small_listener)
        peer = RawTLS(sock, forgeable(server_ctx(server_cert), keylog), server_side=True)
        request = b"\0\0\0\0"  # a HelloRequest
    try:
        async with asyncio.timeout(WAKE):
            await peer.handshake()
            if side == "server":
                transport = (await served).transport
            else:
                reader, writer = await opening
                transport = writer.transport
                reading = asyncio.ensure_future(read_all(reader, writer))
        flight = peer.first_in if side == "server" else peer.first_out
        forged = ForgedTLS12(keylog, flight)
        from_server = side == "client"
        sent = 0
        for _ in range(2000):  # far more answers than any socket buffers take
            wire = b"".join(
                forged.seal(22, request * 64, from_server=from_server) for _ in range(16)
            )
            sent += 16 * 64
            async with asyncio.timeout(WAKE):
                await peer.send(wire)
                await asyncio.sleep(0)
            if not transport.is_reading():
                break
        queued = transport.get_write_buffer_size()
        assert not transport.is_reading(), f"still reading after {sent} requests, {queued} queued"
        low, _ = transport.get_write_buffer_limits()
        assert queued <= low + ANSWERS_MAX + LEND_SIZE * 31 // 4, queued
        # The peer reads (and drops) the answers; then sends data and ends.
        data = os.urandom(100_000)
        drained = asyncio.ensure_future(peer.linger(WAKE))
        async with asyncio.timeout(WAKE):
            await peer.send(b"".join(
                forged.seal(23, data[i : i + 16384], from_server=from_server)
                for i in range(0, len(data), 16384)
            ) + forged.seal(21, b"\x01\0", from_server=from_server))  # close_notify
            assert await received == data
            await drained
    finally:
        sock.close()
        if server is not None:
            server.close()
            await server.wait_closed()
        elif opening.done() and not opening.exception():
            opening.result()[1].transport.abort()


@pytest.mark.asyncio
async def test_one_read_of_renegotiation_requests_queues_little(
    server_cert: Any, tls_ca: Any, tmp_path: Any,
) -> None:
    # Reading stopped for answers only after a whole read: one 256 KiB read
    # of records packed with ClientHello headers queued 7.75 times its size
    # (1.8 MiB) of refusals before the check. Now the engine stops the read
    # once ANSWERS_MAX of them wait, the transport sends them, and reading
    # stops there while nobody takes them.
    loop = asyncio.get_running_loop()
    keylog = str(tmp_path / "keylog")
    served: asyncio.Future[slabnet.StreamWriter] = loop.create_future()
    received: asyncio.Future[bytes] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        served.set_result(writer)
        got = bytearray()
        while chunk := await reader.read_chunk():
            got += chunk
        received.set_result(bytes(got))
        writer.close()

    listener = socket.socket()
    # Room for the whole flood in the server's kernel (set before listen():
    # the window scale is fixed at the handshake); a small send buffer for
    # its answers, and a client that reads none of them.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = await slabnet.start_server(handle, sock=listener, ssl=server_ctx(server_cert))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    await loop.sock_connect(sock, listener.getsockname())
    peer = RawTLS(sock, forgeable(client_ctx(tls_ca), keylog), server_side=False,
                  server_hostname="localhost")
    try:
        async with asyncio.timeout(WAKE):
            await peer.handshake()
            writer = await served
        transport = writer.transport
        server_sock = writer.get_extra_info("socket")
        server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        forged = ForgedTLS12(keylog, peer.first_in)
        wire = b"".join(forged.seal(22, b"\x01\0\0\0" * 4096) for _ in range(15))
        # The loop is blocked until all of it waits in the server's socket:
        # its next read takes it whole (up to the 256 KiB lending buffer).
        sock.setblocking(True)  # (O_NONBLOCK is the socket's, not the descriptor's)
        try:
            sock.sendall(wire)
        finally:
            sock.setblocking(False)
        block_until_records(server_sock.fileno(), lambda recs: len(recs) == 15)
        async with asyncio.timeout(WAKE):
            while transport.is_reading():
                await asyncio.sleep(0)
        queued = transport.get_write_buffer_size()
        low, _ = transport.get_write_buffer_limits()
        # The answers stop after one SSL_read (the records in the BIO, under
        # LEND_PIECE plus _LEND_LOW) past ANSWERS_MAX, or _DRAIN_AT taken out.
        bound = low + ANSWERS_MAX + _DRAIN_AT + (LEND_PIECE + _LEND_LOW) * 31 // 4
        assert queued <= bound, (queued, bound)
        # The peer reads them: the rest of the read is answered, then data.
        data = os.urandom(20_000)
        drained = asyncio.ensure_future(peer.linger(WAKE))
        async with asyncio.timeout(WAKE):
            await peer.send(
                forged.seal(23, data[:16384]) + forged.seal(23, data[16384:])
                + forged.seal(21, b"\x01\0")  # close_notify
            )
            assert await received == data
            await drained
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


# ------------------------------------------------ close during a renegotiation


@pytest.mark.asyncio
async def test_close_during_a_renegotiation_sends_close_notify_after_it(
    pem_files: dict[str, str],  # noqa: F811
) -> None:
    """A stream closed while the server's renegotiation runs: OpenSSL
    refuses SSL_shutdown until it is done (SHUTDOWN_WHILE_IN_INIT), and
    wait_closed() raised that SSLError, no close_notify sent. Now the
    close_notify follows the renegotiation, and the close is clean."""
    port = free_port()
    with SServer(port, pem_files) as srv:
        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        fd = writer.get_extra_info("socket").fileno()
        await renegotiating(srv, fd)
        writer.close()
        await asyncio.sleep(0.05)
        assert writer.transport._engine.state is TLSState.OPEN  # (the alert waits)
        srv.cont()
        await asyncio.wait_for(writer.wait_closed(), WAKE)
        async with asyncio.timeout(WAKE):
            while b"DONE" not in srv.out:  # s_server: close_notify received
                await asyncio.sleep(0.02)
