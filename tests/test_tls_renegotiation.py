"""Writes during a TLS 1.2 renegotiation, against a real ``openssl s_server``.

While a renegotiation is in progress OpenSSL refuses to encrypt application
data (``SSLObject.write`` raises ``SSLWantReadError``), so the engine holds
such plaintext until the new handshake is done. A ``WriteRequest`` for it
must not complete before its bytes are encrypted and handed to the kernel.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import subprocess
import termios
import threading
import struct

import pytest

from conftest import block_until_records
from test_tls_streams import connect_retry, free_port, pem_files  # noqa: F401 (fixture)


def unread(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


@pytest.mark.asyncio
async def test_write_request_waits_for_plaintext_held_by_a_renegotiation(
    pem_files: dict[str, str],  # noqa: F811
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", pem_files["server"],
         "-naccept", "1", "-tls1_2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    out = bytearray()
    assert proc.stdout is not None and proc.stdin is not None
    stdout = proc.stdout

    def collect() -> None:  # s_server blocks once its stdout pipe is full
        while data := stdout.read1(65536):
            out.extend(data)

    drain = threading.Thread(target=collect)
    drain.start()
    stopped = False
    try:
        import ssl

        ctx = ssl.create_default_context(cafile=pem_files["ca"])
        reader, writer = await connect_retry(port, ssl=ctx, server_hostname="localhost")
        engine = writer.transport._engine
        sock = writer.get_extra_info("socket")
        fd = sock.fileno()
        # A send buffer of our own size: the backlog below does not depend on
        # the host's autotuning.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        proc.stdin.write(b"r\n")  # s_server: renegotiate (a command must come alone)
        proc.stdin.flush()
        block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
        # The server stops before it can read anything more: what we send
        # from now on stays in the kernels (a window that cannot grow while
        # nobody reads) or in our queue.
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
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
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        async with asyncio.timeout(30):
            await req
        # Done means encrypted and handed to the kernel: nothing held back.
        assert engine.held_plaintext == 0
        assert writer.transport.get_write_buffer_size() == 0
        writer.write(b"AFTER\n")
        await writer.drain()
        async with asyncio.timeout(30):
            while b"AFTER\n" not in out[-64:]:
                await asyncio.sleep(0.02)
        writer.close()
        await writer.wait_closed()
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        drain.join(10)
        proc.stdin.close()
        proc.stdout.close()
    # s_server prints what it received, with its own status lines; the one
    # about the renegotiation it started can land anywhere in the bulk.
    text = bytes(out).replace(b"SSL_do_handshake -> 1\n", b"")
    at = text.index(bulk[:4096])
    assert text[at : at + len(bulk)] == bulk
    rest = text[at + len(bulk) :]
    assert rest.index(b"DURING-RENEGOTIATION\n") < rest.index(b"AFTER\n"), rest[-2000:]
