"""httpx and httpcore on slabnet (``slabnet.contrib``), against real servers.

Every test that has an answer on httpx's default backend runs the same
requests on both (``BACKENDS``) and asserts that the two agree: the same
status, headers and body bytes, the same exception class and message. The
servers are slabnet's own TLS server speaking hand-written HTTP/1.1
(``_HTTPServer``), ``openssl s_server -WWW`` serving a file, and raw sockets
where a test needs every byte (or silence) under its control.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
import pytest_asyncio
import trustme

import slabnet
from slabnet.contrib.httpcore import SlabnetBackend, SlabnetStream
from slabnet.contrib.httpx import AsyncSlabnetTransport

from conftest import RawTLS, hard_close, wait_acked

BACKENDS = ("slabnet", "default")
WAIT = 10.0  # seconds: the bound on every test's waits

MiB = 1 << 20


def payload(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def client(backend: str, verify: ssl.SSLContext | bool = True, **kwds: Any) -> httpx.AsyncClient:
    """An httpx client on slabnet or on httpx's default backend, the
    transport options (``kwds``) the same."""
    timeout = kwds.pop("timeout", httpx.Timeout(WAIT))
    transport: httpx.AsyncBaseTransport
    if backend == "slabnet":
        transport = AsyncSlabnetTransport(verify=verify, **kwds)
    else:
        transport = httpx.AsyncHTTPTransport(verify=verify, **kwds)
    return httpx.AsyncClient(transport=transport, timeout=timeout)


# ---------------------------------------------------------------- servers


class _HTTPServer:
    """slabnet's server speaking just enough HTTP/1.1 (keep-alive, request
    heads without bodies). ``GET /bytes/N`` answers ``payload(N)``; the other
    paths misbehave on purpose (see ``_respond``). Counts connections and
    requests."""

    HEADERS = [
        (b"Content-Type", b"application/octet-stream"),
        (b"X-Server", b"slabnet-test"),
    ]
    PARTIAL = 64 * 1024  # body bytes sent before /reset and /cut stop

    def __init__(self) -> None:
        self.accepted = 0
        self.requests = 0
        self.stop_now = asyncio.Event()  # /reset and /cut: the client has PARTIAL
        self.closed = asyncio.Event()  # /close-after: our close has completed
        self.writers: list[slabnet.StreamWriter] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def handle(self, reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        self.accepted += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, OSError):
                    return
                self.requests += 1
                path = head.split(b" ", 2)[1].decode()
                if not await self._respond(path, reader, writer):
                    return
        finally:
            writer.close()

    def _head(self, length: int) -> bytes:
        lines = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % length]
        lines += [name + b": " + value for name, value in self.HEADERS]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _respond(
        self, path: str, reader: slabnet.StreamReader, writer: slabnet.StreamWriter
    ) -> bool:
        """Answer one request; False ends the connection."""
        if path.startswith("/bytes/"):
            body = payload(int(path.rsplit("/", 1)[1]))
            writer.write(self._head(len(body)))
            writer.write(body)
            await writer.drain()
            return True
        if path == "/close-after":  # keep-alive response, then close while idle:
            writer.write(self._head(2) + b"ok")
            writer.close()  # close_notify,
            writer.transport.abort()  # and FIN at once (no wait for the client's)
            await writer.wait_closed()
            self.closed.set()
            return False
        if path == "/close-notify":  # the same, but the FIN waits for the client's
            writer.write(self._head(2) + b"ok")  # close_notify (slabnet's close())
            writer.close()
            self.closed.set()
            await writer.wait_closed()
            return False
        if path in ("/reset", "/cut"):  # promise 1 MiB, send PARTIAL, then stop
            writer.write(self._head(MiB) + payload(MiB)[: self.PARTIAL])
            await writer.drain()
            await self.stop_now.wait()
            if path == "/reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                writer.transport.abort()  # SO_LINGER 0: RST
            return False  # /cut: close_notify and FIN, mid-body
        if path == "/hang":  # never answer; read (nothing) until the client goes
            while await reader.read(65536):
                pass
            return False
        raise AssertionError(f"unexpected path {path!r}")

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for writer in self.writers:
                try:
                    await writer.wait_closed()
                except OSError:
                    pass
            if self.server is not None:
                await self.server.wait_closed()


@pytest_asyncio.fixture
async def https_server(tls_server_context: ssl.SSLContext) -> AsyncIterator[_HTTPServer]:
    srv = _HTTPServer()
    srv.server = await slabnet.start_server(srv.handle, "127.0.0.1", 0, ssl=tls_server_context)
    try:
        yield srv
    finally:
        await srv.aclose()


@pytest.fixture
def other_ca_context() -> ssl.SSLContext:
    """A client context that trusts a CA that did not sign the server's certificate."""
    ctx = ssl.create_default_context()
    trustme.CA().configure_trust(ctx)
    return ctx


# ---------------------------------------------------------------- bytes


@pytest.mark.asyncio
async def test_status_headers_body_exact(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """A small body read whole and a 4 MiB body streamed with aiter_bytes:
    status, raw headers and every byte as sent, on both backends."""
    url = f"https://127.0.0.1:{https_server.port}"
    seen = {}
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, tls_client_context) as c:
                small = await c.get(f"{url}/bytes/1000")
                async with c.stream("GET", f"{url}/bytes/{4 * MiB}") as big:
                    parts = [part async for part in big.aiter_bytes()]
            seen[backend] = (
                small.status_code, small.http_version, small.headers.raw, small.content,
                big.status_code, big.headers.raw, b"".join(parts),
            )
            assert big.status_code == small.status_code == 200
            assert small.headers.raw == [(b"Content-Length", b"1000"), *_HTTPServer.HEADERS]
            assert big.headers.raw == [(b"Content-Length", b"%d" % (4 * MiB)), *_HTTPServer.HEADERS]
            assert small.content == payload(1000)
            assert b"".join(parts) == payload(4 * MiB)
            assert len(parts) > 1  # streamed, not read whole
    assert seen["slabnet"] == seen["default"]


@pytest.mark.asyncio
async def test_keepalive_reuses_one_connection(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """Twenty sequential requests go over one connection on either backend."""
    url = f"https://127.0.0.1:{https_server.port}"
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            before = https_server.accepted
            async with client(backend, tls_client_context) as c:
                for i in range(20):
                    r = await c.get(f"{url}/bytes/{100 + i}")
                    assert r.content == payload(100 + i)
            assert https_server.accepted - before == 1, backend
    assert https_server.requests == 40


@pytest.mark.asyncio
async def test_dead_keepalive_connection_is_replaced(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """The server closes a keep-alive connection while it is idle in the
    pool: the next request goes out on a new connection and succeeds."""
    url = f"https://127.0.0.1:{https_server.port}"
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            https_server.closed.clear()
            before = https_server.accepted
            async with client(backend, tls_client_context) as c:
                first = await c.get(f"{url}/close-after")
                assert (first.status_code, first.content) == (200, b"ok")
                await https_server.closed.wait()
                second = await c.get(f"{url}/bytes/10")
                assert second.content == payload(10)
            assert https_server.accepted - before == 2, backend


@pytest.mark.asyncio
async def test_keepalive_connection_ended_by_close_notify_alone_is_replaced(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """The server ends an idle keep-alive connection with close_notify and
    keeps TCP open until the client answers (slabnet's own ``close()``, and
    any server that waits for the client's close_notify). slabnet's reader
    has the EOF, so the pool drops the connection. (httpx's default backend
    sees nothing in the socket, sends the next request on that connection
    and raises RemoteProtocolError: no comparison here.)"""
    url = f"https://127.0.0.1:{https_server.port}"
    async with asyncio.timeout(WAIT):
        async with client("slabnet", tls_client_context) as c:
            first = await c.get(f"{url}/close-notify")
            assert (first.status_code, first.content) == (200, b"ok")
            await https_server.closed.wait()
            await asyncio.sleep(0)  # the loop's reads (one iteration is enough)
            second = await c.get(f"{url}/bytes/10")
            assert second.content == payload(10)
    assert https_server.accepted == 2


async def _tls_peer(listener: socket.socket, ctx: ssl.SSLContext) -> RawTLS:
    """Accept one connection on ``listener`` and be its TLS server."""
    peer, _ = await asyncio.get_running_loop().sock_accept(listener)
    tls = RawTLS(peer, ctx, server_side=True)
    await tls.handshake()
    return tls


async def _answer_one(tls: RawTLS, body: bytes = b"ok") -> None:
    """Read one request head, byte by byte, and answer it (keep-alive)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += await tls.recv_plain(1)
    await tls.send(tls.seal(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body))


@pytest.mark.asyncio
async def test_keepalive_connection_holding_a_partial_tls_record_is_replaced(
    listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    """The server sends the first bytes of a TLS record on an idle keep-alive
    connection (a record that never completes: junk, or an alert cut in
    flight). httpx's default backend finds them in the socket and drops the
    connection; slabnet read them into its TLS layer, where they made no
    plaintext, and used to reuse the connection: the next request waited for
    an answer that never came (ReadTimeout)."""
    port = listener.getsockname()[1]
    url = f"https://127.0.0.1:{port}/"
    seen: dict[str, object] = {}
    peers: list[RawTLS] = []

    async def serve(body: bytes) -> None:
        peers.append(await _tls_peer(listener, tls_server_context))
        await _answer_one(peers[-1], body)

    try:
        async with asyncio.timeout(WAIT):
            for backend in BACKENDS:
                async with client(backend, tls_client_context,
                                  timeout=httpx.Timeout(WAIT, read=1.0)) as c:
                    first, _ = await asyncio.gather(c.get(url), serve(b"ok"))
                    assert first.content == b"ok"
                    old = peers[-1]
                    await old.send(old.seal(b"x" * 100)[:4])  # the start of a record
                    await wait_acked(old.sock)  # in the client's kernel (or read)
                    sock = first.extensions["network_stream"].get_extra_info("socket")
                    while backend == "slabnet" and _socket_has_data(sock):
                        await asyncio.sleep(0.001)  # slabnet's loop has read them
                    server = asyncio.ensure_future(serve(b"new"))
                    try:
                        seen[backend] = (await c.get(url)).content
                    except httpx.TransportError as exc:
                        seen[backend] = type(exc)
                    finally:
                        server.cancel()
    finally:
        for peer in peers:
            peer.sock.close()
    assert seen == {"slabnet": b"new", "default": b"new"}


# ---------------------------------------------------------------- errors


async def _stream_until_stopped(
    backend: str, url: str, ctx: ssl.SSLContext, server: _HTTPServer
) -> tuple[type[BaseException], str, int]:
    """Stream a body the server stops sending after PARTIAL bytes (it stops
    once we have them all): (exception class, message, bytes received)."""
    server.stop_now.clear()
    got = 0
    async with client(backend, ctx) as c:
        with pytest.raises(httpx.TransportError) as info:
            async with c.stream("GET", url) as r:
                async for part in r.aiter_raw():
                    got += len(part)
                    if got >= server.PARTIAL:
                        server.stop_now.set()
    return info.type, str(info.value), got


@pytest.mark.asyncio
async def test_reset_mid_body_gives_read_error(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """A TCP RST in the middle of a body: httpx.ReadError on both backends,
    after every byte that came before it."""
    url = f"https://127.0.0.1:{https_server.port}/reset"
    async with asyncio.timeout(WAIT):
        seen = {b: await _stream_until_stopped(b, url, tls_client_context, https_server)
                for b in BACKENDS}
    # The same class after the same bytes; the message differs: the default
    # backend's is empty (anyio's BrokenResourceError), slabnet's names it.
    assert seen["slabnet"][::2] == seen["default"][::2] == (httpx.ReadError, _HTTPServer.PARTIAL)
    assert seen["slabnet"][1] == "[Errno 104] Connection reset by peer"


@pytest.mark.asyncio
async def test_close_mid_body_gives_remote_protocol_error(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """A clean close (close_notify, FIN) before Content-Length bytes came:
    httpx.RemoteProtocolError on both backends."""
    url = f"https://127.0.0.1:{https_server.port}/cut"
    async with asyncio.timeout(WAIT):
        seen = {b: await _stream_until_stopped(b, url, tls_client_context, https_server)
                for b in BACKENDS}
    assert seen["slabnet"] == seen["default"]
    assert seen["slabnet"][0] is httpx.RemoteProtocolError
    assert seen["slabnet"][2] == _HTTPServer.PARTIAL


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", ["close_notify", "ragged"])
async def test_close_delimited_body_ended_then_reset_is_whole(
    listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext, ending: str,
) -> None:
    """A body delimited by the end of the connection: the server ends it
    (close_notify and FIN, or a FIN alone), then resets the connection, as
    one does that closes with bytes unread (say our close_notify). The EOF
    came first, so the body is whole, on both backends. slabnet's reader
    used to hold the later error (a broken pipe: our close_notify) beside
    the EOF, and the last read raised it: ReadError."""
    url = f"https://127.0.0.1:{listener.getsockname()[1]}/"
    body = payload(1000)

    async def serve() -> None:
        peer = await _tls_peer(listener, tls_server_context)
        try:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += await peer.recv_plain(1)
            wire = peer.seal(b"HTTP/1.1 200 OK\r\n\r\n" + body)
            if ending == "close_notify":
                wire += peer.close_notify()
            await peer.send(wire)
            peer.sock.shutdown(socket.SHUT_WR)
        finally:
            hard_close(peer.sock)

    seen = {}
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, tls_client_context) as c:
                served = asyncio.ensure_future(serve())
                try:
                    async with c.stream("GET", url) as r:
                        await served
                        sock = r.extensions["network_stream"].get_extra_info("socket")
                        while backend == "slabnet" and sock.fileno() != -1:
                            await asyncio.sleep(0.001)  # the reset has come
                        seen[backend] = len(await r.aread()), r.content == body
                except httpx.TransportError as exc:
                    seen[backend] = type(exc)
                finally:
                    served.cancel()
    assert seen == {"slabnet": (1000, True), "default": (1000, True)}


@pytest.mark.asyncio
async def test_wrong_ca_gives_connect_error_with_reason(
    https_server: _HTTPServer, other_ca_context: ssl.SSLContext
) -> None:
    url = f"https://127.0.0.1:{https_server.port}/bytes/10"
    seen = {}
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, other_ca_context) as c:
                with pytest.raises(httpx.ConnectError) as info:
                    await c.get(url)
            # httpx's error from httpcore's, which carries the ssl module's
            # (httpcore's pool re-raises ``from None``: args, not __cause__).
            assert isinstance(info.value.__cause__, httpcore.ConnectError)
            assert isinstance(info.value.__cause__.args[0], ssl.SSLCertVerificationError)
            seen[backend] = str(info.value)
    assert "CERTIFICATE_VERIFY_FAILED" in seen["slabnet"]
    assert "unable to get local issuer certificate" in seen["slabnet"]
    assert seen["slabnet"] == seen["default"]


@pytest.mark.asyncio
async def test_server_that_never_answers_gives_read_timeout(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    url = f"https://127.0.0.1:{https_server.port}/hang"
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, tls_client_context,
                              timeout=httpx.Timeout(WAIT, read=0.2)) as c:
                t0 = time.monotonic()
                with pytest.raises(httpx.ReadTimeout):
                    await c.get(url)
                assert 0.15 < time.monotonic() - t0 < WAIT / 2, backend


@pytest.mark.asyncio
async def test_handshake_that_never_completes_gives_connect_timeout(
    listener: socket.socket, tls_client_context: ssl.SSLContext
) -> None:
    """A listener that never accepts: TCP connects (the kernel's backlog),
    the TLS handshake never starts on the other side."""
    url = f"https://127.0.0.1:{listener.getsockname()[1]}/"
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, tls_client_context,
                              timeout=httpx.Timeout(WAIT, connect=0.2)) as c:
                with pytest.raises(httpx.ConnectTimeout):
                    await c.get(url)


@pytest.mark.asyncio
async def test_refused_connection_gives_connect_error() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, not listening: refused
        seen = {}
        async with asyncio.timeout(WAIT):
            for backend in BACKENDS:
                async with client(backend) as c:
                    with pytest.raises(httpx.ConnectError) as info:
                        await c.get(f"http://127.0.0.1:{port}/")
                seen[backend] = (info.type, info.value.__cause__.args[0])
    assert seen["slabnet"][0] is seen["default"][0] is httpx.ConnectError
    # (anyio's OSError says "All connection attempts failed"; slabnet's is the kernel's.)
    assert isinstance(seen["slabnet"][1], ConnectionRefusedError)


@pytest.mark.asyncio
async def test_upload_to_server_that_never_reads_gives_write_timeout(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext
) -> None:
    """Small socket buffers on both sides (set, not autotuned), and a server
    that reads the request head and then nothing: an 8 MiB body cannot go
    out, and the write timeout fires."""
    srv = _HTTPServer()
    release = asyncio.Event()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        srv.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.close()

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.bind(("127.0.0.1", 0))
    srv.server = await slabnet.start_server(handle, sock=sock, ssl=tls_server_context, limit=4096)
    url = f"https://127.0.0.1:{srv.port}/upload"
    options = [(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)]
    try:
        async with asyncio.timeout(WAIT):
            for backend in BACKENDS:
                async with client(backend, tls_client_context, socket_options=options,
                                  timeout=httpx.Timeout(WAIT, write=0.2)) as c:
                    with pytest.raises(httpx.WriteTimeout):
                        await c.post(url, content=payload(8 * MiB))
    finally:
        release.set()
        await srv.aclose()


# ---------------------------------------------------------------- openssl s_server


@pytest.fixture(params=["tls1_2", "tls1_3"])
def openssl_www(request: pytest.FixtureRequest, tmp_path: Path, tls_ca: Any) -> Iterator[int]:
    """``openssl s_server -WWW`` serving ``tmp_path`` (HTTP/1.0, one
    connection per request), the certificate from ``tls_ca``; its port."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    tls_ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "server.pem"))
    (tmp_path / "file.bin").write_bytes(payload(3 * MiB))
    out = tmp_path / "out.txt"
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [openssl, "s_server", "-accept", "127.0.0.1:0", "-cert", "server.pem",
             "-WWW", "-http_server_binmode", f"-{request.param}"],
            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + WAIT
        while b"ACCEPT" not in out.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"openssl s_server did not start: {out.read_bytes()!r}")
            time.sleep(0.01)
        line = next(x for x in out.read_bytes().splitlines() if x.startswith(b"ACCEPT"))
        yield int(line.rsplit(b":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(WAIT)


@pytest.mark.asyncio
async def test_openssl_www_file_exact(openssl_www: int, tls_client_context: ssl.SSLContext) -> None:
    """A server slabnet did not write: three sequential downloads of a 3 MiB
    file on one client (the server closes after each, HTTP/1.0 style)."""
    url = f"https://127.0.0.1:{openssl_www}/file.bin"
    seen = {}
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            results = []
            async with client(backend, tls_client_context) as c:
                for _ in range(3):
                    async with c.stream("GET", url) as r:
                        body = b"".join([part async for part in r.aiter_bytes()])
                    results.append((r.status_code, r.http_version, r.headers.raw, body))
            seen[backend] = results
    status, version, headers, body = seen["slabnet"][0]
    assert (status, version, headers) == (200, "HTTP/1.0", [(b"Content-type", b"text/plain")])
    assert body == payload(3 * MiB)
    assert seen["slabnet"] == seen["default"] == [seen["slabnet"][0]] * 3


@pytest.mark.asyncio
async def test_openssl_www_wrong_ca(openssl_www: int, other_ca_context: ssl.SSLContext) -> None:
    url = f"https://127.0.0.1:{openssl_www}/file.bin"
    seen = {}
    async with asyncio.timeout(WAIT):
        for backend in BACKENDS:
            async with client(backend, other_ca_context) as c:
                with pytest.raises(httpx.ConnectError) as info:
                    await c.get(url)
            seen[backend] = str(info.value)
    assert "certificate verify failed" in seen["slabnet"]
    assert seen["slabnet"] == seen["default"]


# ---------------------------------------------------------------- the httpcore stream


async def _poll_without_loop(stream: SlabnetStream) -> bool:
    """is_readable, asked again and again for up to a second with the loop
    blocked (time.sleep): only the socket can make it true."""
    deadline = time.monotonic() + 1.0
    while not stream.get_extra_info("is_readable"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.mark.asyncio
async def test_is_readable(listener: socket.socket) -> None:
    """is_readable of an idle connection: false while nothing came; true for
    bytes still in the socket, bytes the reader holds, EOF and a reset."""
    loop = asyncio.get_running_loop()
    backend = SlabnetBackend()
    port = listener.getsockname()[1]
    async with asyncio.timeout(WAIT):
        stream = await backend.connect_tcp("127.0.0.1", port)
        peer, _ = await loop.sock_accept(listener)
        try:
            assert stream.get_extra_info("is_readable") is False
            peer.send(b"x")
            assert await _poll_without_loop(stream)  # in the socket
            sock = stream.get_extra_info("socket")
            while _socket_has_data(sock):
                await asyncio.sleep(0.001)  # the loop reads it into the reader
            assert stream.get_extra_info("is_readable") is True  # in the reader
            assert await stream.read(10, timeout=WAIT) == b"x"
            assert stream.get_extra_info("is_readable") is False
            peer.shutdown(socket.SHUT_WR)
            assert await _poll_without_loop(stream)  # FIN in the socket
            assert await stream.read(10, timeout=WAIT) == b""
            assert stream.get_extra_info("is_readable") is True  # EOF in the reader
        finally:
            await stream.aclose()
            peer.close()
        assert stream.get_extra_info("is_readable") is True  # closed

        stream = await backend.connect_tcp("127.0.0.1", port)
        peer, _ = await loop.sock_accept(listener)
        try:
            hard_close(peer)
            assert await _poll_without_loop(stream)  # RST in the socket
            with pytest.raises(httpcore.ReadError) as info:
                await stream.read(10, timeout=WAIT)
            assert isinstance(info.value.__cause__, ConnectionResetError)
            assert stream.get_extra_info("is_readable") is True
        finally:
            await stream.aclose()


@pytest.mark.asyncio
async def test_is_readable_with_a_partial_tls_record(
    listener: socket.socket, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    """An idle TLS connection on which the start of a record arrived: the
    bytes left the socket for slabnet's TLS layer, made no plaintext yet,
    and the connection is readable (the pool must drop it)."""
    backend = SlabnetBackend()
    async with asyncio.timeout(WAIT):
        stream = await backend.connect_tcp("127.0.0.1", listener.getsockname()[1])
        try:
            peer, (stream, _) = await asyncio.gather(
                _tls_peer(listener, tls_server_context),
                asyncio.gather(stream.start_tls(tls_client_context, "127.0.0.1", WAIT),
                               asyncio.sleep(0)),
            )
            await asyncio.sleep(0.01)  # (TLS 1.3: the session tickets, read)
            assert stream.get_extra_info("is_readable") is False
            await peer.send(peer.seal(b"x" * 100)[:4])
            await wait_acked(peer.sock)
            sock = stream.get_extra_info("socket")
            while _socket_has_data(sock):
                await asyncio.sleep(0.001)  # the loop reads them
            assert stream.get_extra_info("is_readable") is True
        finally:
            await stream.aclose()
            peer.sock.close()


def _socket_has_data(sock: Any) -> bool:
    import select

    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


@pytest.mark.asyncio
async def test_stream_extra_info_options_and_tls(
    https_server: _HTTPServer, tls_client_context: ssl.SSLContext
) -> None:
    """connect_tcp with socket options and a local address, start_tls with
    slabnet's TLS, and get_extra_info's names."""
    backend = SlabnetBackend()
    async with asyncio.timeout(WAIT):
        stream = await backend.connect_tcp(
            "127.0.0.1", https_server.port, timeout=WAIT, local_address="127.0.0.1",
            socket_options=[(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)],
        )
        try:
            assert stream.get_extra_info("ssl_object") is None
            assert await stream.start_tls(
                tls_client_context, server_hostname="127.0.0.1", timeout=WAIT) is stream
            ssl_object = stream.get_extra_info("ssl_object")
            assert isinstance(ssl_object, ssl.SSLObject)
            assert ssl_object.version() in ("TLSv1.2", "TLSv1.3")
            assert stream.get_extra_info("server_addr") == ("127.0.0.1", https_server.port)
            client_addr = stream.get_extra_info("client_addr")
            assert client_addr[0] == "127.0.0.1"
            sock = stream.get_extra_info("socket")
            assert sock.getsockname() == client_addr
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert stream.get_extra_info("no such thing") is None
            await stream.write(b"GET /bytes/5 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=WAIT)
            answer = b""
            while not answer.endswith(payload(5)):
                answer += await stream.read(65536, timeout=WAIT)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")
        finally:
            await stream.aclose()
        await stream.aclose()  # again: nothing happens
        with pytest.raises(httpcore.WriteError):
            await stream.write(b"more", timeout=WAIT)


@pytest.mark.asyncio
async def test_unix_socket(tmp_path: Path) -> None:
    """connect_unix_socket, through the transport's ``uds`` option."""
    srv = _HTTPServer()
    path = str(tmp_path / "http.sock")
    srv.server = await slabnet.start_unix_server(srv.handle, path)
    try:
        async with asyncio.timeout(WAIT):
            seen = {}
            for backend in BACKENDS:
                async with client(backend, uds=path) as c:
                    r = await c.get("http://localhost/bytes/300")
                    seen[backend] = (r.status_code, r.headers.raw, r.content)
            assert seen["slabnet"] == seen["default"]
            assert seen["slabnet"][2] == payload(300)
    finally:
        await srv.aclose()


def test_import_slabnet_imports_no_http_library() -> None:
    """httpx and httpcore are optional: ``import slabnet`` (and its
    ``contrib`` package) must not import them."""
    root = str(Path(slabnet.__file__).resolve().parent.parent)
    code = (
        "import sys, slabnet, slabnet.contrib\n"
        "loaded = {'httpx', 'httpcore', 'anyio', 'h11'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


async def _connect_proxy(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """An HTTPS proxy on asyncio's own streams: CONNECT, then both ways."""
    head = await reader.readuntil(b"\r\n\r\n")
    method, target, _ = head.split(b" ", 2)
    assert method == b"CONNECT", head
    host, port = target.decode().rsplit(":", 1)
    up_reader, up_writer = await asyncio.open_connection(host, int(port))
    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)


@pytest.mark.asyncio
async def test_https_request_through_an_https_proxy(
    https_server: _HTTPServer, tls_server_context: ssl.SSLContext,
    tls_client_context: ssl.SSLContext,
) -> None:
    """httpcore's tunnel through an HTTPS proxy to an https:// URL runs the
    destination's TLS inside the proxy's: start_tls on a TLS stream, which
    raised NotImplementedError ("TLS inside TLS") before slabnet had it."""
    proxy = await asyncio.start_server(_connect_proxy, "127.0.0.1", 0, ssl=tls_server_context)
    try:
        pool = httpcore.AsyncConnectionPool(
            ssl_context=tls_client_context,
            proxy=httpcore.Proxy(
                f"https://127.0.0.1:{proxy.sockets[0].getsockname()[1]}",
                ssl_context=tls_client_context,
            ),
            network_backend=SlabnetBackend(),
        )
        async with pool, asyncio.timeout(WAIT):
            for n in (5, 1 << 20):
                response = await pool.request("GET", f"https://127.0.0.1:{https_server.port}/bytes/{n}")
                assert response.status == 200
                assert response.content == payload(n)
            assert https_server.accepted == 1  # one tunnel, kept alive
    finally:
        proxy.close()
