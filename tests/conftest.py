"""Shared helpers for the TLS, fault and soak suites.

``RawTLS`` is a TLS peer whose every byte on the wire the test decides: an
``ssl.SSLObject`` over two ``MemoryBIO``\\ s on a plain non-blocking socket,
driven by the running loop's ``sock_*`` methods. ``seal()`` returns the
ciphertext of the given plaintexts, one ``SSLObject.write`` (so one record
each, for pieces up to 16 KiB) per piece, for the test to send, cut or damage.

The watchdog
------------
Every test has pytest-timeout's limit (``timeout`` in pyproject.toml, thread
method: it dumps the stacks and ends the run). pytest-timeout stops its timer
as soon as a test fails, though (so that a debugger session is not cut short),
and pytest's own faulthandler timeout does the same: the teardown of a failed
test runs with no limit, and a teardown that hangs there would hold CI until
its own limit. So every test also runs under faulthandler's watchdog, a C
thread that needs neither the GIL nor the test to be passing: when a phase
(setup, call, teardown) takes twice the test's timeout it writes every
thread's stack to stderr and exits the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import fcntl
import gc
import os
import resource
import socket
import ssl
import struct
import sys
import tempfile
import termios
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

# (Imported here, at the top of the stack: imported first by its pytest
# plugin's summary, deep in pytest's hooks, its modules' assertion rewrite
# on CPython 3.11.7 failed with "SystemError: AST constructor recursion
# depth mismatch", CPython gh-106905, in a run of a file that does not use
# it.)
import hypothesis  # noqa: F401
import pytest
import pytest_asyncio

import slabnet


_watchdog_fd: int | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _watchdog_fd
    # A descriptor of the real stderr, taken before output capture can
    # redirect descriptor 2 (the way pytest's faulthandler plugin does).
    _watchdog_fd = os.dup(sys.stderr.fileno() if hasattr(sys.stderr, "fileno") else 2)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _watchdog_fd
    if _watchdog_fd is not None:
        os.close(_watchdog_fd)
        _watchdog_fd = None


def _test_timeout(item: pytest.Item) -> float:
    """The item's pytest-timeout limit in seconds (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0] or 0)
    option = item.config.getoption("timeout", None)
    if option is not None:
        return float(option)
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout is not installed
        return 0.0


def _watched(item: pytest.Item) -> Generator[None, object, object]:
    limit = _test_timeout(item)
    if limit <= 0 or _watchdog_fd is None or item.config.getoption("usepdb"):
        return (yield)
    faulthandler.dump_traceback_later(2 * limit, exit=True, file=_watchdog_fd)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


# Armed per phase: pytest's faulthandler plugin cancels any pending dump when
# a phase fails (pytest_exception_interact), which is just before the teardown.


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item))


def open_fds() -> int:
    """Open socket descriptors of this process. (Only sockets: libuv keeps
    a spare /dev/null descriptor per loop once it has a listening socket.)"""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the descriptor listdir itself used
            pass
    return n


async def fds_settle(baseline: int, timeout: float = 5.0) -> int:
    """Wait until the process is back to ``baseline`` descriptors; return the count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (n := open_fds()) > baseline and loop.time() < deadline:
        gc.collect()  # a traceback kept by pytest.raises may hold a socket
        await asyncio.sleep(0.02)
    return n


def unacked(sock: socket.socket) -> int:
    """Bytes we sent that the peer's kernel has not acknowledged yet."""
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0])


def unread(sock: socket.socket | int) -> int:
    """Bytes in the socket's receive queue that nobody has read (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0])


async def wait_acked(sock: socket.socket, timeout: float = 10.0) -> None:
    """Wait until the peer's kernel has acknowledged every byte we sent (a
    RST discards what is still in our send queue, so only acknowledged bytes
    can be expected at the other end)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        queued = unacked(sock)
        if not queued:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{queued} bytes never acknowledged by the peer")
        await asyncio.sleep(0.005)


async def recv_exactly(sock: socket.socket, n: int, timeout: float) -> bytes:
    """Read ``n`` bytes from a non-blocking socket within ``timeout``; fail
    on EOF before them."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout):
        while len(got) < n:
            data = await loop.sock_recv(sock, min(n - len(got), 1 << 20))
            assert data, f"EOF after {len(got)} of {n} bytes"
            got += data
    return bytes(got)


def openssl_like(exc: BaseException) -> tuple[Any, ...]:
    """What code that catches an ``ssl.SSLError`` reads of it: ``reason``,
    ``library``, ``errno``, and whether ``str()`` starts "[SSL: REASON] "."""
    assert isinstance(exc, ssl.SSLError), repr(exc)
    return exc.reason, exc.library, exc.errno, str(exc).startswith(f"[SSL: {exc.reason}] ")


@contextlib.contextmanager
def lowest_free_in_the_upper_half() -> Iterator[None]:
    """A soft limit with the lowest free descriptor in its last quarter,
    and descriptors to spare above it: slabnet refuses a blocked queue a
    duplicate there (it lends the queue to the loop's transport)."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, old[1]))
        while (fd := os.open(os.devnull, os.O_RDONLY)) <= highest:
            fillers.append(fd)  # (the gaps below the highest)
        os.close(fd)
        assert highest + 1 >= (highest + 8) // 2
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def hard_close(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the kernel sends RST instead of FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class RawTLS:
    def __init__(
        self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self.incoming, self.outgoing, server_side=server_side,
            server_hostname=server_hostname,
        )

    async def _pull(self) -> None:
        data = await self.loop.sock_recv(self.sock, 65536)
        if not data:
            raise ConnectionResetError("RawTLS: peer closed")
        self.first_in = self.first_in or data
        self.incoming.write(data)

    async def flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.first_out = self.first_out or data
            await self.loop.sock_sendall(self.sock, data)

    # The first bytes received and sent (the server's is its ServerHello
    # flight, for ForgedTLS12).
    first_in = b""
    first_out = b""

    async def handshake(self, *, send_last: bool = True) -> None:
        """Run the handshake to its end on this side. ``send_last=False``
        keeps this side's last flight (a client's Finished, a server's
        tickets) in ``outgoing``, for the test to send with data behind
        it, or cut."""
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self.flush()
                await self._pull()
        if send_last:
            await self.flush()

    def seal(self, *pieces: bytes) -> bytes:
        for piece in pieces:
            self.obj.write(piece)
        return self.outgoing.read()

    async def send(self, wire: bytes) -> None:
        await self.loop.sock_sendall(self.sock, wire)

    async def recv_plain(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                piece = self.obj.read(n - len(out))
            except ssl.SSLWantReadError:
                await self.flush()
                await self._pull()
                continue
            if not piece:  # the peer's close_notify: no more will come
                raise EOFError(f"RawTLS: close_notify after {len(out)} of {n} bytes")
            out += piece
        return bytes(out)

    async def linger(self, timeout: float = 5.0) -> None:
        """Read and drop until the other side closes (or resets), then close."""
        try:
            async with asyncio.timeout(timeout):
                while await self.loop.sock_recv(self.sock, 65536):
                    pass
        except (OSError, TimeoutError):
            pass
        finally:
            self.sock.close()

    def close_notify(self) -> bytes:
        try:
            self.obj.unwrap()
        except ssl.SSLWantReadError:
            pass
        return self.outgoing.read()

    def fatal_alert(self) -> bytes:
        """A real, encrypted fatal alert: feed our own SSLObject a record it
        cannot decrypt and return the bad_record_mac alert it answers with."""
        self.incoming.write(b"\x17\x03\x03\x00\x20" + bytes(32))
        try:
            self.obj.read(1)
        except ssl.SSLError:
            pass
        else:  # pragma: no cover
            raise AssertionError("a forged record was accepted")
        return self.outgoing.read()

    def request_key_update(self) -> None:
        """Make the next record we seal a TLS 1.3 KeyUpdate that asks the
        peer for one of its own (RFC 8446 4.6.3), which ``ssl`` has no call
        for: OpenSSL's ``SSL_key_update`` on our ``SSLObject``'s ``SSL *``."""
        if self._ssl_ptr is None:
            self._ssl_ptr = _ssl_pointer(self.obj)
        if not _libssl().SSL_key_update(self._ssl_ptr, 1):  # SSL_KEY_UPDATE_REQUESTED
            raise AssertionError("SSL_key_update failed (not TLS 1.3?)")

    _ssl_ptr: int | None = None


class ForgedTLS12:
    """Seals TLS 1.2 AES-128-GCM records of any content type, as either
    side, with the keys of a real session: what no TLS library sends on
    request (a handshake record of the test's own choosing after the
    handshake, a record packed with many handshake messages).

    The keys come from the client's ``keylog_filename`` (RFC 5246 6.3:
    ``key_block = PRF(master_secret, "key expansion", server_random +
    client_random)``, SHA-256 PRF for the ``*_AES_128_GCM_SHA256`` suites);
    the nonce and additional data are RFC 5288's. Each side's next sequence
    number is 1 (its Finished was 0): the session's own SSLObjects must send
    no record after the handshake."""

    def __init__(self, keylog: str, server_hello_flight: bytes) -> None:
        import hashlib
        import hmac

        with open(keylog) as f:
            line = next(ln for ln in f.read().splitlines() if ln.startswith("CLIENT_RANDOM "))
        client_random, master = (bytes.fromhex(f) for f in line.split()[1:3])
        # record header (5), handshake header (4), version (2), then the random
        server_random = server_hello_flight[11:43]
        seed = b"key expansion" + server_random + client_random
        block, a = b"", seed
        while len(block) < 40:
            a = hmac.new(master, a, hashlib.sha256).digest()
            block += hmac.new(master, a + seed, hashlib.sha256).digest()
        self._keys = {False: (block[0:16], block[32:36]), True: (block[16:32], block[36:40])}
        self._seq = {False: 1, True: 1}

    def seal(self, ctype: int, plaintext: bytes, *, from_server: bool = False) -> bytes:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key, salt = self._keys[from_server]
        seq = self._seq[from_server]
        self._seq[from_server] = seq + 1
        explicit = struct.pack("!Q", seq)
        aad = struct.pack("!QBHH", seq, ctype, 0x0303, len(plaintext))
        body = explicit + AESGCM(key).encrypt(salt + explicit, plaintext, aad)
        return struct.pack("!BHH", ctype, 0x0303, len(body)) + body


def forgeable(ctx: ssl.SSLContext, keylog: str) -> ssl.SSLContext:
    """``ctx`` (a RawTLS peer's) made to negotiate sessions ``ForgedTLS12``
    can seal for: TLS 1.2, AES-128-GCM, keys written to ``keylog``."""
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers("ECDHE+AESGCM:!AES256")
    ctx.keylog_filename = keylog
    return ctx


def _libssl() -> Any:
    """The libssl that the ``ssl`` module runs on: looked up through
    ``_ssl``'s own extension module, whose dependencies dlsym searches."""
    import ctypes
    import _ssl

    lib = ctypes.CDLL(_ssl.__file__)
    lib.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.SSL_key_update.restype = ctypes.c_int
    lib.SSL_version.argtypes = [ctypes.c_void_p]
    lib.SSL_version.restype = ctypes.c_int
    lib.SSL_is_server.argtypes = [ctypes.c_void_p]
    lib.SSL_is_server.restype = ctypes.c_int
    return lib


def _ssl_pointer(obj: ssl.SSLObject) -> int:
    """The ``SSL *`` of a client ``SSLObject`` after a TLS 1.3 handshake.

    CPython's ``_ssl._SSLSocket`` (the object ``SSLObject._sslobj`` holds)
    is a C struct that starts with the object header, then the socket's
    weak reference, then the ``SSL *`` (Modules/_ssl.c, the same from 3.7
    to 3.13). The pointer found there is checked with OpenSSL before use."""
    import ctypes

    inner = obj._sslobj  # type: ignore[attr-defined]
    offset = 3 * ctypes.sizeof(ctypes.c_void_p)  # refcount, type, socket
    ptr = ctypes.c_void_p.from_address(id(inner) + offset).value
    lib = _libssl()
    if not ptr or lib.SSL_version(ptr) != 0x0304 or lib.SSL_is_server(ptr) != 0:
        raise AssertionError("no TLS 1.3 client SSL * found in the SSLObject")
    return int(ptr)


def records(wire: bytes) -> list[tuple[int, int, int]]:
    """(content type, offset, total length) of each record in ``wire``."""
    out = []
    off = 0
    while off + 5 <= len(wire):
        ctype, _ver, length = struct.unpack_from("!BHH", wire, off)
        out.append((ctype, off, 5 + length))
        off += 5 + length
    return out


def block_until_records(
    fd: int, done: Callable[[list[tuple[int, int, int]]], bool], timeout: float = 10.0
) -> None:
    """Block (the running loop too, on purpose) until the TLS records waiting
    unread in the socket ``fd`` (peeked, not consumed) satisfy ``done``: a
    test that needs records to arrive together waits for exactly that, not
    for a peer process to be quick enough. The queue must start at a record."""
    with socket.socket(fileno=os.dup(fd)) as peek:
        deadline = time.monotonic() + timeout
        while True:
            try:
                wire = peek.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                wire = b""
            complete = [r for r in records(wire) if r[1] + r[2] <= len(wire)]
            if done(complete):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"records never arrived; waiting: {complete}")
            time.sleep(0.005)


# Certificates and contexts shared by the TLS test files.


@pytest_asyncio.fixture
async def listener() -> AsyncIterator[socket.socket]:
    """A plain listening socket for a raw peer (tests accept on it).

    Accepted sockets get a receive buffer that is set, not autotuned: 2 x
    256 KiB at most (the kernel doubles the value), so a peer that does not
    read holds that much whatever the host's net.ipv4.tcp_rmem, and a test
    that writes "far more than the kernel holds" does. Set before listen():
    the window's scale is fixed at the handshake."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.fixture(scope="session")
def server_cert(tls_ca: Any) -> Any:
    return tls_ca.issue_cert("localhost", "127.0.0.1")


def server_ctx(cert: Any, version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    if version is not None:
        ctx.minimum_version = ctx.maximum_version = version
    return ctx


def client_ctx(ca: Any, version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(ctx)
    if version is not None:
        ctx.minimum_version = ctx.maximum_version = version
    return ctx


class Handler:
    """Collects what the loop's exception handler is given (install it
    with ``loop.set_exception_handler``)."""

    def __init__(self) -> None:
        self.contexts: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.contexts.append(context)

    def exceptions(self) -> list[BaseException | None]:
        return [c.get("exception") for c in self.contexts]


class Boom(Exception):
    """The app's own bug, raised from a callback."""


class Recorder(slabnet.ChunkProtocol):
    """An app that writes down every callback its
    transport makes, in order; ``lost`` has connection_lost's argument."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.transport: slabnet.SlabTransport | None = None
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, slabnet.SlabTransport)
        self.transport = transport
        self.events.append("made")

    def chunk_received(self, chunk: memoryview) -> None:
        self.events.append(bytes(chunk))

    def eof_received(self) -> None:
        self.events.append("eof")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append(("lost", type(exc) if exc else None))
        self.lost.set_result(exc)


async def connect_slab(
    listener: socket.socket, wake: float = 5.0, app: Recorder | None = None
) -> tuple[slabnet.SlabTransport, Recorder, socket.socket]:
    """A ``SlabProtocol`` connection (its transport, its ``Recorder`` app:
    ``app``, or a new one) to a raw peer accepted on ``listener``."""
    loop = asyncio.get_running_loop()
    app = Recorder() if app is None else app
    async with asyncio.timeout(wake):
        opening = asyncio.ensure_future(loop.create_connection(
            lambda: slabnet.SlabProtocol(app), *listener.getsockname()
        ))
        peer, _ = await loop.sock_accept(listener)
        await opening
    peer.setblocking(False)
    assert app.transport is not None
    return app.transport, app, peer


@contextlib.asynccontextmanager
async def connect_raw_tls(
    address: tuple[str, int], ctx: ssl.SSLContext
) -> AsyncIterator[RawTLS]:
    """A ``RawTLS`` client (for "localhost") on a socket connected to
    ``address``, its handshake not begun; the socket is closed on exit."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
        yield RawTLS(sock, ctx, server_side=False, server_hostname="localhost")
    finally:
        sock.close()


# ---------------------------------------------------------- small socket buffers

SMALL_BUF = 16 * 1024  # SO_SNDBUF / SO_RCVBUF where a test needs a backlog


def shrink(sock: socket.socket) -> None:
    """Small kernel buffers, so that a write far larger than SMALL_BUF queues."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUF)


@pytest_asyncio.fixture
async def small_listener() -> AsyncIterator[socket.socket]:
    """A plain listening socket whose connections have small buffers."""
    sock = socket.socket()
    shrink(sock)  # inherited by accepted sockets
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    yield sock
    sock.close()


# ------------------------------------------------------------------ stream helpers


async def until(
    done: Callable[[], object], what: str, *, timeout: float = 10.0, step: float = 0.005
) -> None:
    """Wait until ``done()`` is true, polling every ``step`` seconds (0: every
    loop iteration); AssertionError naming ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(step)


@contextlib.asynccontextmanager
async def stream_pair(
    lib: Any, tls: bool, tls_ca: Any, server_cert: Any, *, unix: bool = False,
    timeout: float = 10.0,
) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A connection made with ``lib``'s streams (asyncio or slabnet) at both
    ends, over TCP on loopback or (``unix``) a Unix socket: the client's
    reader and writer, then the server's; aborted and the server closed on
    the way out."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[tuple[Any, Any]] = loop.create_future()

    async def handle(r: Any, w: Any) -> None:
        accepted.set_result((r, w))

    with tempfile.TemporaryDirectory() if unix else contextlib.nullcontext("") as d:
        server_ssl = server_ctx(server_cert) if tls else None
        if unix:
            path = os.path.join(d, "s")
            server = await lib.start_unix_server(handle, path, ssl=server_ssl)
        else:
            server = await lib.start_server(handle, "127.0.0.1", 0, ssl=server_ssl)
        client_ssl: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        writers: list[Any] = []
        try:
            async with asyncio.timeout(timeout):
                if unix:
                    r, w = await lib.open_unix_connection(path, **client_ssl)
                else:
                    port = server.sockets[0].getsockname()[1]
                    r, w = await lib.open_connection("127.0.0.1", port, **client_ssl)
                writers.append(w)
                pr, pw = await accepted
                writers.append(pw)
            yield r, w, pr, pw
        finally:
            for wr in writers:
                wr.transport.abort()
            server.close()
            async with asyncio.timeout(timeout):
                await server.wait_closed()
