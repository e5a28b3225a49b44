"""Connection set-up, STARTTLS, ragged EOF and app errors (hardening issue
items 6, 7, 8, 14 and 18), on real sockets, on both loops.

Each test bounds every wait, so a hang fails fast, and checks that no socket
descriptor is left behind where a connection fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import pytest

import slabnet
from conftest import (
    Boom, Handler, RawTLS, client_ctx, fds_settle, hard_close, lowest_free_in_the_upper_half,
    open_fds, recv_exactly, server_ctx,
)

WAKE = 3.0  # seconds any waiter may take to wake after a fault


async def accept(listener: socket.socket) -> socket.socket:
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    return conn


async def recv_until_closed(sock: socket.socket, timeout: float = WAKE) -> tuple[int, str]:
    """Read until EOF or reset; return (bytes read, "eof" or "reset")."""
    loop = asyncio.get_running_loop()
    got = 0
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                return got, "reset"
            if not data:
                return got, "eof"
            got += len(data)


class App(slabnet.ChunkProtocol):
    """A ChunkProtocol whose callbacks can be made to raise."""

    def __init__(self, raise_in: str = "") -> None:
        self.raise_in = raise_in
        self.transport: Any = None
        self.chunks: list[bytes] = []
        self.made = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.made.set_result(None)
        if self.raise_in == "connection_made":
            raise Boom("connection_made")

    def chunk_received(self, chunk: memoryview) -> None:
        self.chunks.append(bytes(chunk))
        if self.raise_in == "chunk_received":
            raise Boom("chunk_received")

    def eof_received(self) -> bool | None:
        if self.raise_in == "eof_received":
            raise Boom("eof_received")
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


# ---------------------------------------------------------------- item 6


@pytest.mark.asyncio
async def test_bad_server_hostname_fails_open_connection(
    listener: socket.socket, tls_ca: Any
) -> None:
    # asyncio raises UnicodeError here (the idna codec, in wrap_bio); slabnet
    # logged it from connection_made and open_connection never returned.
    # The engine is made before connecting now: no connection is made at
    # all (see test_streams_surface.py for a sock= of the caller's).
    baseline = open_fds()
    with pytest.raises(UnicodeError):
        await asyncio.wait_for(slabnet.open_connection(
            "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca),
            server_hostname=".localhost",
        ), WAKE)
    # (A connect to loopback is queued here before connect() returns.)
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_client_context_on_the_server_aborts_and_reports(tls_ca: Any) -> None:
    # wrap_bio refuses a PROTOCOL_TLS_CLIENT context on the server side. The
    # connection must be aborted, not read as plaintext (on the asyncio loop
    # every byte the client sent was buffered, unbounded), and the error
    # reported to the loop's exception handler.
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    called: list[object] = []
    server = await slabnet.start_server(
        lambda r, w: called.append(w), "127.0.0.1", 0, ssl=client_ctx(tls_ca)
    )
    baseline = open_fds()
    try:
        sock = socket.create_connection(server.sockets[0].getsockname())
        sock.setblocking(False)
        sent = 0
        try:
            async with asyncio.timeout(WAKE):
                # A client that keeps sending, as the ClientHello and what follows.
                while True:
                    await loop.sock_sendall(sock, b"\x16\x03\x01" + bytes(65533))
                    sent += 65536
        except (ConnectionResetError, BrokenPipeError):
            pass
        got, how = await recv_until_closed(sock)
        sock.close()
        assert got == 0 and how in ("eof", "reset")
        assert sent < 64 * 2**20, f"the server took {sent} bytes of a dead connection"
        assert not called
        errors = handler.exceptions()
        assert len(errors) == 1 and isinstance(errors[0], ssl.SSLError), handler.contexts
    finally:
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


def _take_every_descriptor() -> list[int]:
    """Open /dev/null until EMFILE; the caller closes what is returned."""
    taken: list[int] = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
    return taken


def _fill_descriptors(keep_free: int) -> tuple[list[int], tuple[int, int]]:
    """Lower RLIMIT_NOFILE and open /dev/null until ``keep_free`` are left."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 64, old[1]))
    fillers = _take_every_descriptor()
    for _ in range(keep_free):
        os.close(fillers.pop())
    return fillers, old


async def _connect_with_free(keep_free: int, opener: Any, port: int) -> Any:
    fillers, old = _fill_descriptors(keep_free)
    try:
        return await asyncio.wait_for(opener("127.0.0.1", port), WAKE)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.mark.asyncio
async def test_one_descriptor_per_connection_even_at_the_limit(listener: socket.socket) -> None:
    # slabnet used to send on a duplicate of every connection's descriptor:
    # with as few descriptors left as asyncio's open_connection needs, it
    # failed with EMFILE. It needs one now, as asyncio, and takes a second
    # only while its queue waits for writability; with none to spare, that
    # queue is lent to the loop's transport, and every byte still goes out.
    port = listener.getsockname()[1]
    baseline = open_fds()
    # A first connection, so that what a loop sets up once (uvloop) is done.
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    await writer.wait_closed()
    (await accept(listener)).close()
    for keep_free in (1, 2, 3):
        try:
            _, writer = await _connect_with_free(keep_free, asyncio.open_connection, port)
        except OSError as exc:
            assert exc.errno == errno.EMFILE, repr(exc)
            continue
        writer.close()
        await writer.wait_closed()
        break
    (await accept(listener)).close()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the peer's
    fillers, old = _fill_descriptors(keep_free)
    taken: list[int] = []
    try:
        reader, writer = await asyncio.wait_for(slabnet.open_connection("127.0.0.1", port), WAKE)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        os.close(fillers.pop())  # room for the peer's end
        peer = await accept(listener)
        taken = _take_every_descriptor()
        payload = os.urandom(256 * 1024)
        req = writer.write(payload)
        assert req is not None  # the kernel took a part; the rest waits
        tr = writer.transport
        assert tr._dup is None and tr._lending  # no descriptor: lent
        assert await recv_exactly(peer, len(payload), WAKE) == payload
        await asyncio.wait_for(req, WAKE)
        assert tr._dup is None and not tr._lending  # the queue is empty: idle
        # Blocked and lent again, and then the loop closes its transport
        # (what Server.close_clients() does): it sends what it holds first,
        # and the rest of the queue still follows.
        req = writer.write(payload)
        assert req is not None and tr._lending
        tail = writer.write(b"tail")  # (behind the lent bytes, in slabnet's queue)
        os.close((taken or fillers).pop())
        tr._raw.close()
        assert await recv_exactly(peer, len(payload) + 4, WAKE) == payload + b"tail"
        await asyncio.wait_for(req, WAKE)
        await asyncio.wait_for(tail, WAKE)
        writer.close()
        await writer.wait_closed()
        peer.close()
    finally:
        for fd in fillers + taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_a_write_while_the_loop_closes_with_no_descriptor_free_is_never_a_lie(
    listener: socket.socket,
) -> None:
    """The loop has started closing its transport (Server.close_clients())
    when a write blocks, and no descriptor is free for a duplicate to carry
    the queue past that close. Lending it to the closing transport lost it
    on the asyncio loop (a closing transport drops writes silently) and its
    request still completed. Now the request completes only if the peer got
    every byte; else it raises."""
    writer, peer = await _blocking_pair(listener)
    tr = writer.transport
    taken = _take_every_descriptor()
    try:
        tr._raw.close()
        payload = os.urandom(256 * 1024)
        req = writer.write(payload)
        try:
            if req is not None:
                await asyncio.wait_for(req, WAKE)
        except ConnectionError:
            pass  # (told: the bytes did not all go)
        else:
            assert await recv_exactly(peer, len(payload), WAKE) == payload
    finally:
        for fd in taken:
            os.close(fd)
    writer.close()
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    peer.close()


@pytest.mark.asyncio
async def test_a_connection_holds_one_descriptor_and_a_second_only_while_blocked(
    listener: socket.socket,
) -> None:
    baseline = open_fds()
    writer, peer = await _blocking_pair(listener)
    assert open_fds() == baseline + 2  # ours and the peer's: one each
    payload = os.urandom(256 * 1024)
    req = writer.write(payload)
    assert req is not None
    assert open_fds() == baseline + 3  # a duplicate to wait for writability on
    assert await recv_exactly(peer, len(payload), WAKE) == payload
    await asyncio.wait_for(req, WAKE)
    assert open_fds() == baseline + 2  # given back once the queue is empty
    writer.close()
    await writer.wait_closed()
    peer.close()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_a_queue_whose_peer_stopped_reading_gives_its_second_descriptor_back(
    listener: socket.socket,
) -> None:
    """A streaming server's slow readers block their queues for good, and
    each held a duplicate descriptor for as long: two descriptors per
    stalled reader, so a server with a descriptor limit of 256 stopped
    accepting (EMFILE, good clients timed out) at about 125 of them, where
    asyncio's serves about 250. Now, once the process holds half its limit,
    a queue that sent nothing between two sweeps (one a second) gives the
    duplicate back and lends its bytes to the loop's transport; below that
    it keeps it. When the peer reads again every byte still comes, in
    order. (The sweep is called here, as its timer calls it.)"""
    loop = asyncio.get_running_loop()
    baseline = open_fds()
    writer, peer = await _blocking_pair(listener)
    payload = os.urandom(1024 * 1024)
    req = writer.write(payload)
    assert req is not None
    tr = writer.transport
    assert tr._dup is not None and open_fds() == baseline + 3  # blocked: a duplicate
    tr._res._sweep_blocked(loop)  # nothing sent since it blocked: stalled
    assert tr._dup is not None  # but the process holds few descriptors: kept
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        while (fd := os.open(os.devnull, os.O_RDONLY)) <= highest:
            fillers.append(fd)  # (the gaps below the highest: a dense table)
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (2 * (highest + 1), old[1]))  # half held
        tr._res._sweep_blocked(loop)
        assert tr._dup is None and tr._lending  # given back: lent
        assert open_fds() == baseline + 2  # one each again (sockets)
        assert await recv_exactly(peer, len(payload), WAKE) == payload
        await asyncio.wait_for(req, WAKE)
        assert tr._dup is None and not tr._lending
        # Blocked again later: a duplicate again (the stall was that queue's).
        req = writer.write(payload)
        assert req is not None and tr._dup is not None
        assert await recv_exactly(peer, len(payload), WAKE) == payload
        await asyncio.wait_for(req, WAKE)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    writer.close()
    await writer.wait_closed()
    peer.close()
    assert await fds_settle(baseline) <= baseline


async def _blocking_pair(listener: socket.socket) -> tuple[Any, socket.socket]:
    """A slabnet writer and its peer's socket, both with small buffers."""
    port = listener.getsockname()[1]
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    _, writer = await slabnet.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return writer, await accept(listener)


@pytest.mark.asyncio
async def test_no_duplicate_in_the_upper_half_of_the_descriptor_limit(
    listener: socket.socket,
) -> None:
    """A blocked queue's duplicate descriptor is not taken where it would
    lie in the upper half of the soft limit: that part is left to what the
    application opens (accept(), files). The queue is lent to the loop's
    transport, and every byte still goes out."""
    writer, peer = await _blocking_pair(listener)
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    with lowest_free_in_the_upper_half():
        payload = os.urandom(256 * 1024)
        req = writer.write(payload)
        assert req is not None
        tr = writer.transport
        assert tr._dup is None and tr._lending  # lent to the loop's transport
        probe = os.open(os.devnull, os.O_RDONLY)  # (a descriptor was free: not EMFILE)
        os.close(probe)
        assert await recv_exactly(peer, len(payload), WAKE) == payload
        await asyncio.wait_for(req, WAKE)
        # With the limit far above, the same queue waits on a duplicate.
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
        req = writer.write(payload)
        assert req is not None and tr._dup is not None
        assert await recv_exactly(peer, len(payload), WAKE) == payload
        await asyncio.wait_for(req, WAKE)
    writer.close()
    await writer.wait_closed()
    peer.close()


@pytest.mark.asyncio
async def test_a_queue_with_no_descriptor_to_wait_on_is_not_woken_while_its_peer_reads_nothing(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blocked queue refused a duplicate used to poll the socket on a
    timer (1 ms after each send, doubling to 50 ms): 600 connections under
    write backpressure in a server with a limit of 1024 cost 10-11 % of a
    core, where asyncio's cost 1 % (and slabnet's with duplicates 1.3 %).
    Its bytes now wait in the loop's transport, woken by the kernel as
    asyncio's are: while the peer reads nothing, nothing of slabnet's runs,
    and when it reads everything comes, in order, with what was written
    meanwhile."""
    flushes = 0
    flush = slabnet.SlabTransport._flush

    def counting(self: Any, *args: Any) -> None:
        nonlocal flushes
        flushes += 1
        flush(self, *args)

    writer, peer = await _blocking_pair(listener)
    with lowest_free_in_the_upper_half():
        payload = os.urandom(256 * 1024)
        req = writer.write(payload)
        assert req is not None and writer.transport._dup is None
        monkeypatch.setattr(slabnet.SlabTransport, "_flush", counting)
        await asyncio.sleep(0.3)
        assert flushes == 0  # (polling, it made 19 in 0.3 s)
        later = writer.write(b"after")
        assert later is not None  # behind the lent bytes
        assert await recv_exactly(peer, len(payload) + 5, WAKE) == payload + b"after"
        await asyncio.wait_for(req, WAKE)
        await asyncio.wait_for(later, WAKE)
        assert writer.transport.get_write_buffer_size() == 0
    writer.close()
    await writer.wait_closed()
    peer.close()


@pytest.mark.parametrize("end", ["close", "write_eof", "abort", "peer_reset"])
@pytest.mark.asyncio
async def test_a_lent_queue_ends_as_asked(listener: socket.socket, end: str) -> None:
    """close() and write_eof() made while the loop's transport holds the
    queue's bytes come after every byte, the one written meanwhile too;
    abort() drops what the kernel had not taken and fails the requests,
    as asyncio's abort() drops its buffer; a reset from the peer fails them
    with a connection error. Nothing hangs."""
    writer, peer = await _blocking_pair(listener)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    with lowest_free_in_the_upper_half():
        payload = os.urandom(256 * 1024)
        req = writer.write(payload)
        assert req is not None and writer.transport._lending
        later = writer.write(b"after")
        if end == "peer_reset":
            hard_close(peer)
            for r in (req, later):
                with pytest.raises((ConnectionResetError, BrokenPipeError)):
                    await asyncio.wait_for(r, WAKE)
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                await asyncio.wait_for(writer.drain(), WAKE)
            writer.close()
            with contextlib.suppress(ConnectionError):  # (it raises the loss, as asyncio's)
                await asyncio.wait_for(writer.wait_closed(), WAKE)
            return
        getattr(writer.transport, end)()
        if end == "abort":
            for r in (req, later):
                with pytest.raises(ConnectionAbortedError):
                    await asyncio.wait_for(r, WAKE)
            got, _ = await recv_until_closed(peer)  # (what the kernel had, then the end)
            assert got < len(payload) + 5
        else:
            assert await recv_exactly(peer, len(payload) + 5, WAKE) == payload + b"after"
            assert await asyncio.wait_for(loop.sock_recv(peer, 1), WAKE) == b""  # then EOF
            await asyncio.wait_for(later, WAKE)
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAKE)
    peer.close()
    await asyncio.sleep(0.05)  # (callbacks the end scheduled)
    # (The loop's transport, closed from inside its own callback, ended
    # twice on the asyncio loop: AttributeError in _call_connection_lost.)
    assert reported == []


@pytest.mark.asyncio
async def test_a_tls_server_refused_duplicates_sends_every_byte(
    server_cert: Any, tls_ca: Any,
) -> None:
    """TLS records lent to the loop's transport go out whole and in order,
    with those written after them, to a client that reads late."""
    payload = os.urandom(2 * 1024 * 1024)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    lent = 0

    async def handler(reader: Any, writer: Any) -> None:
        nonlocal lent
        try:
            writer.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            lower = writer.transport._lower
            for i in range(0, len(payload), 256 * 1024):
                writer.write(payload[i : i + 256 * 1024])
                lent += lower._lending
                await writer.drain()
            writer.close()
            await writer.wait_closed()
            done.set_result(None)
        except BaseException as exc:
            done.set_exception(exc)

    with lowest_free_in_the_upper_half():
        server = await slabnet.start_server(
            handler, "127.0.0.1", 0, ssl=server_ctx(server_cert))
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx(tls_ca)), WAKE)
        await asyncio.sleep(0.2)  # the server's queue blocks meanwhile
        got = await asyncio.wait_for(reader.read(), 4 * WAKE)
        assert got == payload
        await asyncio.wait_for(done, WAKE)
        assert lent  # (the records did wait in the loop's transport)
        writer.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAKE)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_app_connection_made_raising_ends_the_connection(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    baseline = open_fds()
    app = App("connection_made")
    kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}

    async def peer() -> tuple[int, str]:
        conn = await accept(listener)
        if tls:
            raw = RawTLS(conn, server_ctx(server_cert), server_side=True)
            await raw.handshake()
        try:
            return await recv_until_closed(conn)
        finally:
            conn.close()

    task = asyncio.create_task(peer())
    try:
        await loop.create_connection(
            lambda: slabnet.SlabProtocol(app, **kw), "127.0.0.1", listener.getsockname()[1]
        )
        got, how = await asyncio.wait_for(task, WAKE)
        exc = await asyncio.wait_for(app.lost, WAKE)
    finally:
        loop.set_exception_handler(None)
    assert got == 0 and how in ("eof", "reset")
    assert isinstance(exc, Boom)
    assert [type(e) for e in handler.exceptions()] == [Boom], handler.contexts
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- item 7


@pytest.mark.asyncio
async def test_starttls_cut_by_a_reset_tells_the_app(
    listener: socket.socket, tls_ca: Any
) -> None:
    baseline = open_fds()

    async def peer() -> None:
        conn = await accept(listener)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(conn, b"220 go ahead\r\n")
        hello = await loop.sock_recv(conn, 65536)  # the ClientHello
        assert hello[:1] == b"\x16"
        hard_close(conn)

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection("127.0.0.1", listener.getsockname()[1])
    assert await asyncio.wait_for(reader.readline(), WAKE) == b"220 go ahead\r\n"
    pending = asyncio.create_task(reader.read(100))  # a read started before start_tls
    await asyncio.sleep(0)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(
            writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"), WAKE
        )
    await task
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(pending, WAKE)
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    except ConnectionError:
        pass  # as asyncio: wait_closed() raises what ended the connection
    assert writer.is_closing()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- item 8


@pytest.mark.parametrize("ragged", [None, False], ids=["default", "strict"])
@pytest.mark.asyncio
async def test_fin_without_close_notify_never_drops_what_we_queued(
    server_cert: Any, tls_ca: Any, ragged: bool | None
) -> None:
    # A client writes its request, closes TCP without close_notify, then
    # reads the reply. The server had 4 MiB queued when the FIN arrived:
    # every byte must go out (the FIN ends the peer's direction only).
    size = 4 * 2**20
    payload = os.urandom(size)
    loop = asyncio.get_running_loop()
    wrote = asyncio.Event()
    result: asyncio.Future[tuple[bytes, BaseException | None]] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        request = await reader.readexactly(7)
        writer.write(payload)
        wrote.set()
        try:
            rest = await reader.read()
        except Exception as exc:
            result.set_result((request, exc))
        else:
            result.set_result((request + rest, None))
        writer.close()

    kw = {} if ragged is None else {"ssl_ragged_eof": ragged}
    server = await slabnet.start_server(
        handle, "127.0.0.1", 0, ssl=server_ctx(server_cert), **kw
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, server.sockets[0].getsockname())
        tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
        async with asyncio.timeout(10):
            await tls.handshake()
            await tls.send(tls.seal(b"GET /\r\n"))
            await wrote.wait()
            sock.shutdown(socket.SHUT_WR)  # FIN, no close_notify
            got = await tls.recv_plain(size)
            request, exc = await result
        assert len(got) == size and got == payload
        assert request == b"GET /\r\n"
        if ragged is False:
            assert isinstance(exc, slabnet.TLSTruncatedError), repr(exc)
        else:
            assert exc is None  # read() returned b"" (EOF), as asyncio
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("ragged", [None, False], ids=["default", "strict"])
@pytest.mark.asyncio
async def test_open_connection_accepts_a_ragged_eof_by_default(
    listener: socket.socket, server_cert: Any, tls_ca: Any, ragged: bool | None
) -> None:
    payload = os.urandom(100_000)

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.send(tls.seal(*(payload[i : i + 16384] for i in range(0, len(payload), 16384))))
        tls.sock.shutdown(socket.SHUT_WR)
        await tls.linger()

    task = asyncio.create_task(peer())
    kw = {} if ragged is None else {"ssl_ragged_eof": ragged}
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca),
        server_hostname="localhost", **kw,
    )
    assert await asyncio.wait_for(reader.readexactly(len(payload)), WAKE) == payload
    if ragged is None:
        assert await asyncio.wait_for(reader.read(), WAKE) == b""
    else:
        with pytest.raises(slabnet.TLSTruncatedError):
            await asyncio.wait_for(reader.read(), WAKE)
    writer.close()
    await asyncio.wait_for(task, WAKE + 5)


# ---------------------------------------------------------------- item 14


@pytest.mark.parametrize("where", ["open", "closing", "eof", "lost"])
@pytest.mark.asyncio
async def test_app_exception_reaches_the_exception_handler(
    listener: socket.socket, server_cert: Any, tls_ca: Any, where: str
) -> None:
    # The app's chunk_received (eof_received) raises; the loop's exception
    # handler must get the exception and connection_lost must carry it, in
    # every state of the TLS connection. (Closing: after close() no data is
    # delivered, so the callback left to raise is eof_received.)
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    app = App("chunk_received" if where in ("open", "lost") else "eof_received")
    ready = asyncio.Event()
    reset = asyncio.Event()

    async def peer() -> None:
        # TLS 1.2: no session tickets after the handshake, so the only
        # ciphertext after it is the data (see "lost").
        tls = RawTLS(
            await accept(listener), server_ctx(server_cert, ssl.TLSVersion.TLSv1_2),
            server_side=True,
        )
        await tls.handshake()
        await ready.wait()
        wire = tls.seal(b"x" * 500)
        if where in ("closing", "eof"):
            wire += tls.close_notify()
        await tls.send(wire)
        if where == "lost":
            await reset.wait()
            hard_close(tls.sock)
            return
        await tls.linger()

    task = asyncio.create_task(peer())
    try:
        await loop.create_connection(
            lambda: slabnet.SlabProtocol(app, ssl=client_ctx(tls_ca), server_hostname="localhost"),
            "127.0.0.1", listener.getsockname()[1],
        )
        await asyncio.wait_for(app.made, WAKE)
        if where == "closing":
            app.transport.close()  # TLS shutdown: waiting for the peer's close_notify
        elif where == "lost":
            # What arrives must wait in the engine: the TLS layer is paused
            # and the plain connection under it reads on (as after a
            # STARTTLS whose app resumes the plain transport it still holds).
            app.transport.pause_reading()
            app.transport._lower.resume_reading()
        ready.set()
        if where == "lost":
            engine = app.transport._engine
            async with asyncio.timeout(WAKE):
                while not engine.buffered_ciphertext:
                    await asyncio.sleep(0.005)
            # The peer resets; our next write finds out, and connection_lost
            # delivers what the engine holds before the error (an abort()
            # of our own would deliver nothing more).
            reset.set()
            async with asyncio.timeout(WAKE):
                while not app.lost.done():
                    app.transport.write(b"?")
                    await asyncio.sleep(0.01)
        exc = await asyncio.wait_for(app.lost, WAKE)
        await asyncio.wait_for(task, WAKE + 5)
    finally:
        loop.set_exception_handler(None)
    if where in ("open", "lost"):
        assert app.chunks and app.chunks[0] == b"x" * len(app.chunks[0])
    elif where == "closing":
        assert app.chunks == []  # it came after close(): dropped
    if where == "lost":
        assert isinstance(exc, (ConnectionResetError, BrokenPipeError)), repr(exc)
    else:
        assert isinstance(exc, Boom), repr(exc)
    assert [type(e) for e in handler.exceptions()] == [Boom], handler.contexts


# ---------------------------------------------------------------- item 18


@pytest.mark.parametrize("waiting_in", ["engine", "socket"])
@pytest.mark.asyncio
async def test_close_while_paused_reads_what_arrived(
    listener: socket.socket, server_cert: Any, tls_ca: Any, waiting_in: str
) -> None:
    # Reading is paused; data and the peer's close_notify arrive and wait,
    # in the engine or in the socket. close() must read them: the peer then
    # sends nothing more, and waiting for a read that never comes ended in
    # ShutdownTimeoutError after 30 s. The data is dropped: nothing is
    # delivered after close(), as on a plain connection.
    app = App()
    ready = asyncio.Event()
    sent = asyncio.Event()

    async def peer() -> None:
        tls = RawTLS(
            await accept(listener), server_ctx(server_cert, ssl.TLSVersion.TLSv1_2),
            server_side=True,
        )
        await tls.handshake()
        await ready.wait()
        await tls.send(tls.seal(b"y" * 300) + tls.close_notify())
        sent.set()
        await tls.linger(10)  # until we close

    task = asyncio.create_task(peer())
    loop = asyncio.get_running_loop()
    await loop.create_connection(
        lambda: slabnet.SlabProtocol(app, ssl=client_ctx(tls_ca), server_hostname="localhost"),
        "127.0.0.1", listener.getsockname()[1],
    )
    await asyncio.wait_for(app.made, WAKE)
    app.transport.pause_reading()
    engine = app.transport._engine
    if waiting_in == "engine":
        # The plain connection under the paused TLS layer reads on (as after
        # a STARTTLS whose app resumes the plain transport it still holds).
        app.transport._lower.resume_reading()
    ready.set()
    async with asyncio.timeout(WAKE):
        await sent.wait()
        while waiting_in == "engine" and not engine.buffered_ciphertext:
            await asyncio.sleep(0.005)
    assert not app.chunks
    app.transport.close()
    exc = await asyncio.wait_for(app.lost, WAKE)
    assert exc is None
    assert app.chunks == []
    await asyncio.wait_for(task, WAKE)


class _FailingWrites(ssl.SSLObject):
    """A real SSLObject whose writes fail once ``fail`` is set: a write-side
    ssl.SSLError on a live connection (the engine honours SSLObject
    subclasses, ``SSLContext.sslobject_class``)."""

    fail = False

    def write(self, data: Any) -> int:
        if self.fail:
            raise ssl.SSLError(1, "[SSL] write failed (injected)")
        return super().write(data)


@pytest.mark.asyncio
async def test_close_after_a_write_side_ssl_error_does_not_raise(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    baseline = open_fds()

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.linger()

    task = asyncio.create_task(peer())
    ctx = client_ctx(tls_ca)
    ctx.sslobject_class = _FailingWrites
    try:
        reader, writer = await slabnet.open_connection(
            "127.0.0.1", listener.getsockname()[1], ssl=ctx, server_hostname="localhost"
        )
        writer.get_extra_info("ssl_object").fail = True
        writer.write(b"lost")
        await asyncio.sleep(0.05)  # the end-of-iteration flush fails
        writer.close()  # raised the stored SSLError
        try:
            await asyncio.wait_for(writer.wait_closed(), WAKE)
        except ssl.SSLError:
            pass  # the connection ended with the write's error
        with pytest.raises(ssl.SSLError):
            await asyncio.wait_for(reader.read(), WAKE)
        await asyncio.wait_for(task, WAKE + 5)
    finally:
        loop.set_exception_handler(None)
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_write_side_ssl_error_in_the_flush_ends_the_connection(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    """The end-of-iteration flush fails to encrypt: that error ends the
    connection (every waiter gets it) instead of escaping to the loop as an
    'Exception in callback' and leaving the connection and its waiters
    hanging."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    baseline = open_fds()

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.linger()

    task = asyncio.create_task(peer())
    ctx = client_ctx(tls_ca)
    ctx.sslobject_class = _FailingWrites
    try:
        reader, writer = await slabnet.open_connection(
            "127.0.0.1", listener.getsockname()[1], ssl=ctx, server_hostname="localhost"
        )
        read = asyncio.create_task(reader.read())  # waits for data
        await asyncio.sleep(0)
        writer.get_extra_info("ssl_object").fail = True
        writer.write(b"lost")  # encrypted (and failing) at the end of the iteration
        with pytest.raises(ssl.SSLError, match="injected"):
            await asyncio.wait_for(writer.wait_closed(), WAKE)
        with pytest.raises(ssl.SSLError, match="injected"):
            await asyncio.wait_for(read, WAKE)
        with pytest.raises(ssl.SSLError, match="injected"):
            await writer.drain()
        writer.close()  # no-op, never raises
        await asyncio.wait_for(task, WAKE + 5)
    finally:
        loop.set_exception_handler(None)
    assert handler.contexts == []
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_plaintext_openssl_holds_when_paused_is_delivered(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    # Item 18: can plaintext be stranded when the app pauses while OpenSSL
    # holds decrypted bytes and the incoming BIO is empty (so
    # resume_reading() sees no buffered ciphertext)? TLS 1.3: the server's
    # session tickets and a full 16 KiB data record arrive in one read. The
    # engine plans a batch of the ticket records (they look like data);
    # reading them, OpenSSL goes on into the data record and keeps what did
    # not fit. The app pauses on that first chunk: exactly that state. An
    # app gets nothing after its pause (tests/test_tls_pause.py), so the
    # rest waits in OpenSSL, and the resume must deliver it: the engine's
    # plaintext_waiting counts what OpenSSL holds.
    data = os.urandom(16384)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    at_pause: list[tuple[int, int]] = []

    class Pausing(App):
        def chunk_received(self, chunk: memoryview) -> None:
            super().chunk_received(chunk)
            if len(self.chunks) == 1:
                engine = self.transport._engine
                at_pause.append((engine.buffered_ciphertext, engine.ssl_object.pending()))
                self.transport.pause_reading()
                loop.call_later(0.05, self.transport.resume_reading)
            if sum(map(len, self.chunks)) >= len(data) and not done.done():
                done.set_result(None)

    async def peer() -> None:
        tls = RawTLS(
            await accept(listener), server_ctx(server_cert, ssl.TLSVersion.TLSv1_3),
            server_side=True,
        )
        await tls.handshake(send_last=False)
        await tls.send(tls.seal(data))  # the tickets, then the data: one send
        await tls.linger()

    task = asyncio.create_task(peer())
    app = Pausing()
    await loop.create_connection(
        lambda: slabnet.SlabProtocol(app, ssl=client_ctx(tls_ca), server_hostname="localhost"),
        "127.0.0.1", listener.getsockname()[1],
    )
    try:
        await asyncio.wait_for(done, WAKE)
        assert b"".join(app.chunks) == data
        # The case under test was reached: paused with an empty BIO while
        # OpenSSL held plaintext.
        assert len(at_pause) == 1 and at_pause[0][0] == 0 and at_pause[0][1] > 0, at_pause
    finally:
        app.transport.abort()
        await asyncio.wait_for(task, WAKE + 5)


@pytest.mark.parametrize("record", [1024, 16384])
@pytest.mark.asyncio
async def test_a_ragged_eof_behind_a_paused_reader_keeps_every_byte(
    listener: socket.socket, server_cert: Any, tls_ca: Any, record: int
) -> None:
    # The peer's records and its FIN without close_notify all arrive while
    # the reader is paused (limit=1024: paused after its first chunk). Every
    # byte must come out before EOF.
    payload = os.urandom(64 * 1024)
    sent = asyncio.Event()

    async def peer() -> None:
        tls = RawTLS(await accept(listener), server_ctx(server_cert), server_side=True)
        await tls.handshake()
        await tls.send(tls.seal(*(payload[i : i + record] for i in range(0, len(payload), record))))
        tls.sock.shutdown(socket.SHUT_WR)
        sent.set()
        await tls.linger()

    task = asyncio.create_task(peer())
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca),
        server_hostname="localhost", limit=1024,
    )
    await asyncio.wait_for(sent.wait(), WAKE)
    async with asyncio.timeout(WAKE):  # the loop reads until the reader pauses
        while writer.transport.is_reading():
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # and the FIN lands behind it
    assert await asyncio.wait_for(reader.read(), WAKE) == payload
    writer.close()
    await asyncio.wait_for(task, WAKE + 5)


# The server process of the descriptor-limit tests: a handler (the script)
# behind slabnet.start_server, on the loop named by argv[1].
_SERVER_MAIN = r"""
async def main():
    server = await slabnet.start_server(handle, "127.0.0.1", 0, backlog=1000)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(120)

if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@contextlib.contextmanager
def limited_server(handler_script: str, loop_kind: str) -> Iterator[tuple[int, int]]:
    """A slabnet server process whose descriptor limit is 256: (port, pid)."""
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    server = subprocess.Popen(
        [sys.executable, "-c", handler_script + _SERVER_MAIN, loop_kind],
        stdout=subprocess.PIPE, text=True, preexec_fn=limit,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert server.stdout is not None
    try:
        yield int(server.stdout.readline()), server.pid
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


_STREAMING_SERVER = r"""
import asyncio, sys
import slabnet

async def handle(reader, writer):
    try:
        while line := await reader.readline():
            if line.startswith(b"STREAM"):
                while True:
                    writer.write(b"x" * 65536)
                    await writer.drain()
            writer.write(b"PONG\n")
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
"""


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_server_with_many_stalled_readers_still_accepts(loop_kind: str) -> None:
    """A streaming server (``write(); await drain()``) in a process with a
    descriptor limit of 256, and 200 clients that ask for a stream and never
    read: asyncio's streams hold about 207 descriptors and serve the next
    client. slabnet held two per stalled reader, took all 256, and the next
    clients timed out (its accept() failing with EMFILE). They are served."""
    import time

    stalled: list[socket.socket] = []
    with limited_server(_STREAMING_SERVER, loop_kind) as (port, pid):
        try:
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", port), timeout=WAKE)
                s.sendall(b"STREAM\n")
                stalled.append(s)
            served = False
            deadline = time.monotonic() + 15  # (one sweep a second frees what waits)
            while not served and time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=2) as good:
                        good.sendall(b"PING\n")
                        served = good.recv(5) == b"PONG\n"
                except OSError:
                    time.sleep(0.2)
            assert served, "no new client was served"
            assert len(os.listdir(f"/proc/{pid}/fd")) < 256
        finally:
            for s in stalled:
                s.close()


_BURST_SERVER = r"""
import asyncio, socket, sys
import slabnet

async def handle(reader, writer):
    try:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
        writer.write(b"x" * (1 << 20))  # (far beyond the kernel's buffers: the queue waits)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except ConnectionError:
        pass
"""


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_burst_of_blocked_connections_leaves_accept_its_descriptors(loop_kind: str) -> None:
    """200 clients connect at once to a server with a descriptor limit of
    256 that sends each 1 MiB; they read only once all are connected. Every
    queue blocks at once and each took a duplicate while its number was
    below three quarters of the limit, so the table filled before any
    sweep: uvloop accepts and closes the connections it has no descriptor
    for, and 46 of the 200 clients got nothing (asyncio's streams serve
    all, with about 214 descriptors). A duplicate is now kept only in the
    lower half of the limit, and the first one refused lends every waiting
    queue to the loop's transport (it polled then): all 200 get their
    1 MiB."""
    import selectors
    import time

    clients: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    with limited_server(_BURST_SERVER, loop_kind) as (port, _):
        try:
            for _ in range(200):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
                s.connect(("127.0.0.1", port))
                clients.append(s)
            time.sleep(0.5)  # (reading nothing yet: every queue waits)
            got = {}
            for s in clients:
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
                got[s] = 0
            open_ = len(clients)
            deadline = time.monotonic() + 20
            while open_ and time.monotonic() < deadline:
                for key, _ in sel.select(1):
                    s = key.fileobj  # type: ignore[assignment]
                    try:
                        data = s.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        open_ -= 1
                    else:
                        got[s] += len(data)
            assert open_ == 0, f"{open_} connections still open"
            short = [n for n in got.values() if n != 1 << 20]
            assert short == [], f"{len(short)} of 200 clients got less than 1 MiB"
        finally:
            sel.close()
            for s in clients:
                s.close()
