"""Unix-domain sockets, and streams over sockets the app passes in (``sock=``).

Most tests run the same scenario through asyncio's streams and slabnet's on
the same loop and compare what each saw: paths (stale socket files, files
that are not sockets, paths longer than ``sun_path``, ``pathlib.Path``,
``bytes``, Linux abstract names, pre-bound sockets, ``cleanup_socket``),
the errors of a refused connect, the addresses ``get_extra_info`` gives,
and the reads at their edges. The rest check that bytes arrive whole
(8 MiB each way through slow readers, 1-byte writes, half-closes, TLS,
``start_tls``), that ``socket.socketpair()`` ends work as ``sock=`` (a
thread on the other end, with blocking I/O and with TLS), and that no
descriptor is left behind (cancelled connects, 1,000 clients, blocked
queues with their duplicate descriptors).

Socket paths live in a short directory under /tmp: pytest's ``tmp_path``
can be longer than the 108 bytes of ``sun_path``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import select
import shutil
import socket
import ssl
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, fds_settle, open_fds, server_ctx

IMPLS: tuple[ModuleType, ...] = (asyncio, slabnet)

#: Every wait in these tests is bounded by this (seconds).
WAIT = 10.0


@pytest.fixture
def sockdir() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="sn-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def outcome_of(exc: BaseException, *paths: str) -> tuple[Any, ...]:
    """An error as a comparable tuple, this scenario's directory removed."""
    text = str(exc)
    for p in paths:
        text = text.replace(p, "<dir>")
    return (type(exc).__name__, getattr(exc, "errno", None), text)


async def attempt(call: Awaitable[Any], *paths: str) -> tuple[Any, ...]:
    try:
        value = await asyncio.wait_for(call, WAIT)
    except Exception as exc:
        return outcome_of(exc, *paths)
    if isinstance(value, tuple):  # (reader, writer)
        value[1].close()
        await asyncio.wait_for(value[1].wait_closed(), WAIT)
        return ("connected",)
    if hasattr(value, "sockets"):  # (uvloop's Server is no AbstractServer)
        value.close()
        await asyncio.wait_for(value.wait_closed(), WAIT)
        return ("served",)
    return ("ok", value)


async def both(
    scenario: Callable[[ModuleType, str], Awaitable[Any]], sockdir: str
) -> dict[str, Any]:
    """``scenario(impl, directory)`` for asyncio's streams and slabnet's, each
    in a directory of its own under ``sockdir``."""
    seen = {}
    for impl in IMPLS:
        where = os.path.join(sockdir, impl.__name__[:2])
        os.mkdir(where)
        seen[impl.__name__] = await asyncio.wait_for(scenario(impl, where), 2 * WAIT)
    return seen


async def shut(writer: Any, server: Any) -> None:
    """Close the client's writer and the server, each wait bounded."""
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAIT)
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)


async def echo(reader: Any, writer: Any) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


# ------------------------------------------------------------------ paths


@pytest.mark.asyncio
async def test_path_errors_match_asyncio(sockdir: str) -> None:
    """A missing path, a stale socket file from a dead server, a file that
    is not a socket, a directory, a path longer than sun_path: the same
    error, errno and message as asyncio's streams on this loop."""

    async def scenario(impl: ModuleType, where: str) -> list[tuple[Any, ...]]:
        stale = os.path.join(where, "stale")
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(stale)
        dead.close()  # the file stays: nobody listens on it
        regular = os.path.join(where, "file")
        with open(regular, "w"):
            pass
        too_long = os.path.join(where, "x" * 120)
        return [
            await attempt(impl.open_unix_connection(os.path.join(where, "none")), where),
            await attempt(impl.open_unix_connection(stale), where),
            await attempt(impl.open_unix_connection(regular), where),
            await attempt(impl.open_unix_connection(where), where),
            await attempt(impl.open_unix_connection(too_long), where),
            await attempt(impl.start_unix_server(echo, regular), where),
            await attempt(impl.start_unix_server(echo, too_long), where),
            # A stale socket file is replaced, as asyncio does.
            await attempt(impl.start_unix_server(echo, stale), where),
        ]

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    refused = seen["slabnet"]
    assert refused[0][0] == "FileNotFoundError"
    assert refused[1][0] == "ConnectionRefusedError"
    assert refused[5][:2] == ("OSError", 98)  # EADDRINUSE: not a socket, kept
    assert refused[7] == ("served",)


async def round_trip(impl: ModuleType, address: Any, **kw: Any) -> list[Any]:
    """Serve ``address``, connect, echo; what both ends' get_extra_info say,
    and whether the path is left behind after close()/wait_closed()."""
    server_saw: list[Any] = []

    async def handle(reader: Any, writer: Any) -> None:
        server_saw.append((writer.get_extra_info("peername"), writer.get_extra_info("sockname")))
        await echo(reader, writer)

    sock = kw.pop("sock", None)
    if sock is not None:
        server = await impl.start_unix_server(handle, sock=sock, **kw)
    else:
        server = await impl.start_unix_server(handle, address, **kw)
    refused = None
    try:
        reader, writer = await impl.open_unix_connection(address)
    except OSError as exc:  # (uvloop refuses abstract names: EINVAL)
        refused = outcome_of(exc)
        client = socket.socket(socket.AF_UNIX)
        client.connect(address)
        reader, writer = await impl.open_unix_connection(sock=client)
    writer.write(b"ping")
    data = await asyncio.wait_for(reader.readexactly(4), WAIT)
    info = [
        writer.get_extra_info("peername"), writer.get_extra_info("sockname"),
        writer.get_extra_info("socket").family,
    ]
    await shut(writer, server)
    fspath = address if isinstance(address, (str, bytes)) else os.fspath(address)
    left = fspath[:1] not in ("\0", b"\0") and os.path.exists(fspath)
    return [data, info, server_saw, left, refused]


def _norm(value: Any, where: str) -> Any:
    """``value`` with ``where`` (str or bytes, as it appears) taken out."""
    if isinstance(value, str):
        return value.replace(where, "<dir>")
    if isinstance(value, bytes):
        return value.replace(where.encode(), b"<dir>")
    if isinstance(value, (list, tuple)):
        return type(value)(_norm(v, where) for v in value)
    return value


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["str", "pathlib", "bytes", "abstract"])
async def test_path_kinds_match_asyncio(sockdir: str, kind: str) -> None:
    """str, pathlib.Path, bytes and Linux abstract (leading NUL) addresses:
    the same round trip and the same peername/sockname on both ends (''
    for an unbound client, the path as the loop gives it) as asyncio's
    streams. (uvloop refuses abstract names with EINVAL, for both.)"""

    async def scenario(impl: ModuleType, where: str) -> Any:
        path = os.path.join(where, "s")
        address: Any = {
            "str": path,
            "pathlib": pathlib.Path(path),
            "bytes": path.encode(),
            "abstract": "\0" + path,
        }[kind]
        if kind != "abstract":
            return _norm(await round_trip(impl, address), where)
        # Bound here: uvloop's create_unix_server() refuses an abstract
        # name (EINVAL) and leaks its server handle doing so.
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(address)
        sock.listen()
        return _norm(await round_trip(impl, address, sock=sock), where)

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    data, info, server_saw, left, refused = seen["slabnet"]
    assert data == b"ping"
    assert info[1] == "" and info[2] == socket.AF_UNIX  # an unbound client
    assert server_saw[0][0] == ""
    assert refused is None or (_uvloop() and kind == "abstract")


@pytest.mark.asyncio
@pytest.mark.parametrize("listening", [True, False])
async def test_prebound_socket_matches_asyncio(sockdir: str, listening: bool) -> None:
    """``start_unix_server(sock=)`` with a bound socket, listening or not."""

    async def scenario(impl: ModuleType, where: str) -> Any:
        path = os.path.join(where, "s")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        if listening:
            sock.listen()
        got = _norm(await round_trip(impl, path, sock=sock), where)
        return got + [sock.fileno()]  # (-1: the server closed it)

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    assert seen["slabnet"][0] == b"ping"


def _cleanup_options() -> list[dict[str, Any]]:
    return [{}, {"cleanup_socket": True}, {"cleanup_socket": False}]


@pytest.mark.asyncio
@pytest.mark.parametrize("kw", _cleanup_options(), ids=["default", "cleanup", "keep"])
async def test_socket_file_after_close_matches_asyncio(sockdir: str, kw: dict[str, Any]) -> None:
    """Whether the path is left after ``close()``/``wait_closed()``: 3.13's
    ``cleanup_socket`` (default True) removes it, as uvloop's does; before
    3.13 the asyncio loop keeps it and refuses the keyword, as asyncio's."""

    async def scenario(impl: ModuleType, where: str) -> Any:
        try:
            return _norm(await round_trip(impl, os.path.join(where, "s"), **kw), where)
        except TypeError as exc:
            return ("TypeError", str(exc))

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    if seen["slabnet"][0] != "TypeError":
        removes = kw.get("cleanup_socket", sys.version_info >= (3, 13))
        assert seen["slabnet"][3] is not removes


def _uvloop() -> bool:
    return "uvloop" in type(asyncio.get_running_loop()).__module__


# ------------------------------------------------------------------ data

PAYLOAD = os.urandom(1 << 16) * 128  # 8 MiB


@pytest.mark.asyncio
async def test_8mib_each_way_through_slow_readers(sockdir: str) -> None:
    """8 MiB each way at once, both readers slow and with a small limit (so
    reading pauses and resumes all along): every byte, in order, then EOF."""
    path = os.path.join(sockdir, "s")
    server_got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def slow_read(reader: slabnet.StreamReader) -> bytes:
        data = bytearray()
        while part := await reader.read(3000):
            data += part
            if len(data) % 5 == 0:
                await asyncio.sleep(0)
        return bytes(data)

    async def send(writer: slabnet.StreamWriter) -> None:
        view = memoryview(PAYLOAD)
        for i in range(0, len(view), 100_000):
            writer.write(view[i : i + 100_000])
            await writer.drain()
        writer.write_eof()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        sending = asyncio.ensure_future(send(writer))
        server_got.set_result(await slow_read(reader))
        await sending
        writer.close()

    server = await slabnet.start_unix_server(handle, path, limit=512)
    reader, writer = await slabnet.open_unix_connection(path, limit=512)
    sending = asyncio.ensure_future(send(writer))
    got = await asyncio.wait_for(slow_read(reader), 30)
    await asyncio.wait_for(sending, WAIT)
    assert reader.at_eof()
    assert len(got) == len(PAYLOAD) and got == PAYLOAD
    assert await asyncio.wait_for(server_got, WAIT) == PAYLOAD
    await shut(writer, server)


@pytest.mark.asyncio
async def test_one_byte_writes_and_half_close_both_ways(sockdir: str) -> None:
    """20,000 one-byte writes, then write_eof(); the server reads to EOF,
    answers, and half-closes its side too: the client reads the answer to
    EOF and the connection still closes cleanly."""
    path = os.path.join(sockdir, "s")
    sent = PAYLOAD[:20_000]

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        data = await reader.read()
        assert reader.at_eof()
        writer.write(b"%d:" % len(data) + hashlib.sha256(data).hexdigest().encode())
        writer.write_eof()
        await writer.drain()
        writer.close()

    server = await slabnet.start_unix_server(handle, path)
    reader, writer = await slabnet.open_unix_connection(path)
    assert writer.can_write_eof()
    for i in range(len(sent)):
        writer.write(sent[i : i + 1])
        if i % 1000 == 0:
            await writer.drain()
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), WAIT)
    assert answer == b"20000:" + hashlib.sha256(sent).hexdigest().encode()
    assert reader.at_eof()
    with pytest.raises(asyncio.IncompleteReadError):
        await reader.readexactly(1)
    assert await reader.readline() == b""
    await shut(writer, server)


@pytest.mark.asyncio
async def test_read_edges_match_asyncio(sockdir: str) -> None:
    """readline/readuntil/readexactly/at_eof at the edges of a small limit
    and of EOF, over a Unix socket: what asyncio's reader returns/raises."""
    wire = b"line1\nab|cd|" + b"x" * 100 + b"|tail"

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")

        async def handle(reader: Any, writer: Any) -> None:
            writer.write(wire)
            await writer.drain()
            writer.close()

        server = await impl.start_unix_server(handle, path)
        reader, writer = await impl.open_unix_connection(path, limit=64)
        seen: list[Any] = []
        for call in (
            lambda: reader.readline(),
            lambda: reader.readuntil(b"|"),
            lambda: reader.readuntil(b"cd|"),
            lambda: reader.readuntil(b"|"),  # 100 bytes to it: over the limit
            lambda: reader.readexactly(10),
            lambda: reader.readuntil(b"zz"),  # never found, over the limit
            lambda: reader.readexactly(1000),  # EOF first
            lambda: reader.readexactly(0),
            lambda: reader.readline(),
            lambda: reader.read(),
        ):
            try:
                seen.append(await asyncio.wait_for(call(), WAIT))
            except asyncio.IncompleteReadError as exc:
                seen.append(("IncompleteReadError", exc.partial, exc.expected))
            except asyncio.LimitOverrunError as exc:
                seen.append(("LimitOverrunError", exc.consumed, str(exc)))
            seen.append(reader.at_eof())
        await shut(writer, server)
        return seen

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]


async def until_readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not select.select([sock], [], [], 0)[0]:
        assert loop.time() < deadline, "nothing arrived"
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_peer_closing_with_unread_data(sockdir: str) -> None:
    """A Unix peer that closes with our bytes unread resets the connection
    (ECONNRESET), like TCP's RST: slabnet hands out what the peer sent
    before it, then raises the reset (asyncio raises at once; README,
    "Data before errors") -- to read(n): read() to EOF raises it, as the
    stream never ended; the writer's wait_closed() raises it too, as
    asyncio's."""
    ours, theirs = socket.socketpair()
    reader, writer = await slabnet.open_connection(sock=ours)
    writer.write(b"never read")
    await writer.drain()
    await until_readable(theirs)  # (slabnet sends a small write at the end of the iteration)
    theirs.sendall(b"bye")
    theirs.close()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), WAIT)
    assert await asyncio.wait_for(reader.read(100), WAIT) == b"bye"
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), WAIT)
    writer.close()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(writer.wait_closed(), WAIT)


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [10, 100_000], ids=["gathered", "direct"])
async def test_write_to_a_gone_peer_is_an_error(sockdir: str, size: int) -> None:
    """A write to a Unix peer that has gone fails with EPIPE at once (no
    RST round trip as over TCP): asyncio's write() sees it; so does a large
    write of slabnet's, while a small one that slabnet gathers sees it at
    the end-of-iteration flush, so ``write(); await drain()`` returns and
    the error comes one iteration later. It is never lost: once the loop
    has run, drain() and wait_closed() raise the EPIPE, as asyncio's do."""

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        ours, theirs = socket.socketpair()
        reader, writer = await impl.open_connection(sock=ours)
        theirs.close()
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
        writer.write(b"z" * size)
        for _ in range(3):  # the flush, then the loss of the connection
            await asyncio.sleep(0)
        seen: list[Any] = [writer.is_closing()]
        try:
            await writer.drain()
        except Exception as exc:
            seen.append(type(exc).__name__)
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), WAIT)
        except Exception as exc:
            seen.append(type(exc).__name__)
        return seen

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"] == [True, "BrokenPipeError", "BrokenPipeError"]


@pytest.mark.asyncio
async def test_abort_over_unix(sockdir: str) -> None:
    """abort(): the peer reads what was sent, then EOF; our own reader
    raises LocalAbortError (README: abort() is an error for the waiters)."""
    path = os.path.join(sockdir, "s")
    peer_read: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        peer_read.set_result(await reader.read())
        writer.close()

    server = await slabnet.start_unix_server(handle, path)
    reader, writer = await slabnet.open_unix_connection(path)
    writer.write(b"abc")
    await writer.drain()
    writer.transport.abort()
    assert await asyncio.wait_for(peer_read, WAIT) == b"abc"
    with pytest.raises(slabnet.LocalAbortError):
        await asyncio.wait_for(reader.read(), WAIT)
    await asyncio.wait_for(writer.wait_closed(), WAIT)
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)


# ------------------------------------------------------------------ TLS


@pytest.mark.asyncio
async def test_tls_over_unix(sockdir: str, tls_ca: Any, server_cert: Any) -> None:
    """ssl= with server_hostname over a Unix socket: 3 MB each way, the
    hostname checked, and without server_hostname a ValueError as asyncio."""
    path = os.path.join(sockdir, "s")
    data = PAYLOAD[: 3_000_000]

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        n = int(await reader.readline())
        got = await reader.readexactly(n)
        writer.write(hashlib.sha256(got).hexdigest().encode() + b"\n" + got)
        await writer.drain()
        writer.close()

    server = await slabnet.start_unix_server(handle, path, ssl=server_ctx(server_cert))
    reader, writer = await slabnet.open_unix_connection(
        path, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    assert writer.get_extra_info("ssl_object").server_hostname == "localhost"
    assert writer.get_extra_info("peername") == path
    writer.write(b"%d\n" % len(data))
    writer.write(data)
    await writer.drain()
    assert await asyncio.wait_for(reader.readline(), WAIT) == (
        hashlib.sha256(data).hexdigest().encode() + b"\n"
    )
    assert await asyncio.wait_for(reader.read(), WAIT) == data
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAIT)
    with pytest.raises(ValueError, match="server_hostname"):
        await slabnet.open_unix_connection(path, ssl=client_ctx(tls_ca))
    with pytest.raises(ssl.SSLCertVerificationError):
        await asyncio.wait_for(
            slabnet.open_unix_connection(path, ssl=client_ctx(tls_ca), server_hostname="other"),
            WAIT,
        )
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)


@pytest.mark.asyncio
async def test_start_tls_on_a_unix_stream(sockdir: str, tls_ca: Any, server_cert: Any) -> None:
    path = os.path.join(sockdir, "s")

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        assert await reader.readline() == b"STARTTLS\n"
        writer.write(b"GO\n")
        await writer.drain()
        await writer.start_tls(server_ctx(server_cert))
        writer.write(b"secure:" + await reader.readline())
        await writer.drain()
        writer.close()

    server = await slabnet.start_unix_server(handle, path)
    reader, writer = await slabnet.open_unix_connection(path)
    writer.write(b"STARTTLS\n")
    assert await asyncio.wait_for(reader.readline(), WAIT) == b"GO\n"
    await asyncio.wait_for(writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"), WAIT)
    writer.write(b"hi\n")
    assert await asyncio.wait_for(reader.read(), WAIT) == b"secure:hi\n"
    assert writer.get_extra_info("ssl_object") is not None
    await shut(writer, server)


# ------------------------------------------------------------------ sock=


@pytest.mark.asyncio
async def test_socketpair_both_ends() -> None:
    """Both ends of a socketpair as sock=: a line one way, 400 KB and a
    half-close the other, then each side closes; the sockets are detached
    (fileno -1) once their transports took them, as with asyncio."""
    a, b = socket.socketpair()
    ra, wa = await slabnet.open_connection(sock=a)
    rb, wb = await slabnet.open_connection(sock=b)
    assert (wa.get_extra_info("peername"), wa.get_extra_info("sockname")) == ("", "")
    wa.write(b"ping\n")
    assert await asyncio.wait_for(rb.readline(), WAIT) == b"ping\n"
    wb.write(b"pong" * 100_000)
    wb.write_eof()
    assert await asyncio.wait_for(ra.read(), WAIT) == b"pong" * 100_000
    wa.close()
    await asyncio.wait_for(wa.wait_closed(), WAIT)
    assert await asyncio.wait_for(rb.read(), WAIT) == b""
    wb.close()
    await asyncio.wait_for(wb.wait_closed(), WAIT)
    assert a.fileno() == b.fileno() == -1


@pytest.mark.asyncio
async def test_socketpair_with_a_blocking_thread_peer() -> None:
    """The usual way to talk to a thread: it uses blocking I/O on its end.
    The end we pass in is blocking too; the loop makes it non-blocking, and
    4 MiB the thread does not read yet do not block the loop."""
    ours, theirs = socket.socketpair()
    assert ours.getblocking()
    start = threading.Event()

    def peer() -> None:
        start.wait(WAIT)
        with theirs, theirs.makefile("rwb") as f:
            for line in f:
                f.write(line.upper())
                f.flush()
            theirs.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    reader, writer = await slabnet.open_connection(sock=ours)
    assert not ours.getblocking()
    lines = b"".join(b"line %d %s\n" % (i, b"p" * 4000) for i in range(1000))
    # Far more than the kernel holds for a peer that does not read yet: on
    # a blocking socket this write would never return (the thread waits).
    assert writer.write(lines) is not None
    start.set()
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), WAIT)
    assert got == lines.upper()
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAIT)
    await asyncio.wait_for(asyncio.to_thread(thread.join, WAIT), 2 * WAIT)
    assert not thread.is_alive()


@pytest.mark.asyncio
async def test_tls_over_socketpair_to_a_thread(tls_ca: Any, server_cert: Any) -> None:
    """ssl= with server_hostname over a socketpair whose other end is a
    thread's blocking stdlib TLS server."""
    ours, theirs = socket.socketpair()
    data = PAYLOAD[:500_000]

    def peer() -> None:
        with server_ctx(server_cert).wrap_socket(theirs, server_side=True) as tls:
            got = b""
            while len(got) < len(data):
                got += tls.recv(65536)
            tls.sendall(hashlib.sha256(got).digest())
            tls.unwrap()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    reader, writer = await slabnet.open_connection(
        sock=ours, ssl=client_ctx(tls_ca), server_hostname="localhost"
    )
    writer.write(data)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(32), WAIT) == hashlib.sha256(data).digest()
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAIT)
    await asyncio.wait_for(asyncio.to_thread(thread.join, WAIT), 2 * WAIT)
    assert not thread.is_alive()


@pytest.mark.asyncio
async def test_sockets_that_are_no_stream_match_asyncio(sockdir: str) -> None:
    """A SOCK_DGRAM socketpair, a UDP socket, a TCP socket for the Unix
    opener and server, an already closed socket: the same error as asyncio's
    streams on this loop (ValueError naming the socket; EBADF), and the
    refused socket is left open for the app, as asyncio leaves it."""

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        seen = []
        dgram, dgram_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = socket.socket()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        closed, closed_peer = socket.socketpair()
        closed.close()
        with dgram, dgram_peer, udp, tcp, closed_peer:
            for call in (
                lambda: impl.open_connection(sock=dgram),
                lambda: impl.open_connection(sock=udp),
                lambda: impl.open_unix_connection(sock=tcp),
                lambda: impl.start_unix_server(echo, sock=dgram),
                lambda: impl.start_unix_server(echo, sock=tcp),
                lambda: impl.open_connection(sock=closed),
            ):
                got = await attempt(call())
                seen.append(got[:2] + (got[2].split(", got")[0],))
            seen.append((dgram.fileno() >= 0, udp.fileno() >= 0, tcp.fileno() >= 0))
        return seen

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    assert [s[0] for s in seen["slabnet"][:5]] == ["ValueError"] * 5
    assert seen["slabnet"][5][:2] == ("OSError", 9)
    assert seen["slabnet"][6] == (True, True, True)


# ------------------------------------------------------------------ lifetime


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_cancel_open_unix_connection_at_every_step(
    sockdir: str, tls: bool, tls_ca: Any, server_cert: Any
) -> None:
    """open_unix_connection() cancelled after 0, 1, 2, ... loop iterations,
    until it completes before the cancel: each either raises CancelledError
    or connects, and no descriptor is left behind."""
    path = os.path.join(sockdir, "s")

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            await reader.read()
        except ConnectionError:
            pass  # (a client cancelled mid-handshake resets)
        writer.close()

    server = await slabnet.start_unix_server(
        handle, path, ssl=server_ctx(server_cert) if tls else None
    )
    baseline = open_fds()
    kw: dict[str, Any] = (
        {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    )
    results = []
    for steps in range(40):
        task = asyncio.ensure_future(slabnet.open_unix_connection(path, **kw))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            _, writer = await asyncio.wait_for(task, WAIT)
        except asyncio.CancelledError:
            results.append("cancelled")
            continue
        results.append("connected")
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        break
    assert results[0] == "cancelled" and results[-1] == "connected"
    assert await fds_settle(baseline) == baseline
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)


@pytest.mark.asyncio
async def test_1000_clients_and_no_descriptor_left(sockdir: str) -> None:
    path = os.path.join(sockdir, "s")
    baseline = open_fds()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        line = await reader.readline()
        writer.write(line * 100)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await slabnet.start_unix_server(handle, path, backlog=1000)

    async def client(i: int) -> bool:
        reader, writer = await slabnet.open_unix_connection(path)
        writer.write(b"%d\n" % i)
        got = await reader.read()
        writer.close()
        await writer.wait_closed()
        return got == b"%d\n" % i * 100

    assert all(await asyncio.wait_for(asyncio.gather(*map(client, range(1000))), 30))
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)
    assert await fds_settle(baseline) == baseline


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["clients_abort", "clients_read"])
async def test_blocked_queues_leave_no_descriptor(sockdir: str, end: str) -> None:
    """300 server connections with 1 MiB queued for clients that do not read
    yet (each queue waits on a duplicate descriptor); then the clients
    abort, or read it all: every byte or an error, and no descriptor left."""
    path = os.path.join(sockdir, "s")
    baseline = open_fds()
    n = 300
    queued = asyncio.Semaphore(0)
    outcomes: list[str] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(b"q" * (1 << 20))
        queued.release()
        try:
            await writer.drain()
            outcomes.append("sent")
        except ConnectionError:
            outcomes.append("error")
        writer.close()

    server = await slabnet.start_unix_server(handle, path, backlog=n)
    clients = [await slabnet.open_unix_connection(path) for _ in range(n)]
    for _ in range(n):
        await asyncio.wait_for(queued.acquire(), WAIT)
    if end == "clients_abort":
        for _, writer in clients:
            writer.transport.abort()
    else:
        sizes = await asyncio.wait_for(
            asyncio.gather(*(reader.read() for reader, _ in clients)), 30
        )
        assert sizes == [b"q" * (1 << 20)] * n
        for _, writer in clients:
            writer.close()
    for _, writer in clients:
        await asyncio.wait_for(writer.wait_closed(), WAIT)
    del clients
    server.close()
    await asyncio.wait_for(server.wait_closed(), WAIT)
    for _ in range(100):
        if len(outcomes) == n:
            break
        await asyncio.sleep(0.02)
    assert outcomes == (["error"] if end == "clients_abort" else ["sent"]) * n
    assert await fds_settle(baseline) == baseline


@pytest.mark.asyncio
async def test_server_close_while_clients_transfer(sockdir: str) -> None:
    """Server.close() while its handlers are sending: the transfers already
    accepted run to their end, every byte. (Accepted by the loop: a client
    still in the listener's backlog when it closes waits for ever, with
    asyncio's streams too, on the asyncio loop of 3.13.)"""
    path = os.path.join(sockdir, "s")
    started = asyncio.Semaphore(0)

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        started.release()
        for _ in range(100):
            writer.write(b"z" * 65536)
            await writer.drain()
        writer.close()

    server = await slabnet.start_unix_server(handle, path)
    clients = [await slabnet.open_unix_connection(path) for _ in range(4)]
    for _ in clients:
        await asyncio.wait_for(started.acquire(), WAIT)
    server.close()
    sizes = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in clients)), 30)
    assert [len(s) for s in sizes] == [100 * 65536] * 4
    await asyncio.wait_for(server.wait_closed(), WAIT)
    for _, writer in clients:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        await slabnet.open_unix_connection(path)


@pytest.mark.asyncio
async def test_full_backlog_matches_asyncio(sockdir: str) -> None:
    """Connects to a listener that never accepts, past its backlog: an
    AF_UNIX connect() then fails with EAGAIN, which the asyncio loop takes
    for "in progress" and reports as connected (writes then fail with
    EINVAL) and uvloop raises as BlockingIOError. slabnet's streams do
    what asyncio's do on the same loop, and leave no descriptor behind."""

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")
        baseline = open_fds()
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)  # (the kernel queues backlog + 1)
        seen: list[Any] = []
        writers = []
        with listener:
            for _ in range(4):
                try:
                    _, writer = await asyncio.wait_for(impl.open_unix_connection(path), WAIT)
                except OSError as exc:
                    seen.append(outcome_of(exc))
                    continue
                writers.append(writer)
                seen.append("connected")
            for writer in writers:
                writer.write(b"hi")
                await asyncio.sleep(0)
                try:
                    await asyncio.wait_for(writer.drain(), WAIT)
                    seen.append("sent")
                except OSError as exc:
                    seen.append(outcome_of(exc))
                writer.close()
                try:
                    await asyncio.wait_for(writer.wait_closed(), WAIT)
                except OSError:
                    pass
        seen.append(await fds_settle(baseline) - baseline)
        return seen

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    assert seen["slabnet"][:2] == ["connected", "connected"]
    assert seen["slabnet"][-1] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("opener", ["unix_path", "sock"])
async def test_tls_without_server_hostname_refused_as_asyncio(
    sockdir: str, opener: str, server_cert: Any
) -> None:
    """ssl= with no host to take the name from (a Unix path, a sock=) and no
    server_hostname: asyncio refuses it on both loops, whatever the context's
    check_hostname (server_hostname='' is how to go without one), and so
    does slabnet. (It used to connect when check_hostname was off, so code
    that worked on slabnet failed on asyncio's streams.)"""

    def unchecked() -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")

        async def handle(reader: Any, writer: Any) -> None:
            writer.write(b"hi")
            await writer.drain()
            writer.close()

        server = await impl.start_unix_server(handle, path, ssl=server_ctx(server_cert))
        seen: list[Any] = []
        for kw in ({}, {"server_hostname": ""}):
            if opener == "unix_path":
                call = impl.open_unix_connection(path, ssl=unchecked(), **kw)
            else:
                client = socket.socket(socket.AF_UNIX)
                client.connect(path)
                call = impl.open_connection(sock=client, ssl=unchecked(), **kw)
            try:
                reader, writer = await asyncio.wait_for(call, WAIT)
            except ValueError:
                seen.append("ValueError")
                if opener == "sock":
                    client.close()
                continue
            seen.append(await asyncio.wait_for(reader.read(), WAIT))
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), WAIT)
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        return seen

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"] == ["ValueError", b"hi"]
