"""The loop's and the interpreter's lifecycle around open connections.

``KeyboardInterrupt`` and ``SystemExit`` raised by app code that slabnet
calls synchronously leave the loop (asyncio's transports let them out of
``run_forever``; uvloop's catch them in its read callback and fail the
transport with them). Either way the connection's state must stay
consistent: running the loop again goes on from where it stopped, and
closing it neither hangs nor raises inside slabnet.

Each test makes and closes a loop of its own, so each is parametrized over
both loop kinds here (the project's automatic loop parametrization applies
to pytest-asyncio tests only).
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import socket
import ssl
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

import slabnet
from conftest import hard_close

LOOPS = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(uvloop.new_event_loop, id="uvloop"),
]

WAKE = 3.0  # seconds: a wait that a working connection ends in milliseconds


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
    new: Callable[[], asyncio.AbstractEventLoop] = request.param
    lp = new()
    try:
        yield lp
    finally:
        if not lp.is_closed():
            # uvloop's close() hangs when its ResourceWarning for a handle
            # still open is an error (as pyproject makes warnings): recorded
            # here, and reported.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                lp.close()
            assert [str(w.message) for w in caught] == []


def slabnet_handles(loop: asyncio.AbstractEventLoop) -> list[Any]:
    """slabnet's callbacks still scheduled on an asyncio loop (uvloop does
    not show its queue: empty there). The ReadSlab's trim timer is the
    loop's, not a connection's (one per loop, by design), and is left out, as is the
    timer that tells the loop's resources it closed (``_LoopEnd``)."""
    handles = list(getattr(loop, "_scheduled", [])) + list(getattr(loop, "_ready", []))
    return [
        h for h in handles
        if not h.cancelled() and "slabnet" in repr(h)
        and "ReadSlab._on_timer" not in repr(h) and "_LoopEnd" not in repr(h)
    ]


class Recorder(slabnet.ChunkProtocol):
    """An app protocol that records what it gets; ``interrupt(n)`` makes its
    ``n``-th chunk raise KeyboardInterrupt (after recording it)."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.data = bytearray()
        self.chunks = 0
        self.interrupt_at = 0
        self.interrupt_after = 0  # and every chunk after this one raises
        self.pause_at = 0
        self.lost: asyncio.Future[BaseException | None] | None = None
        self.grew: asyncio.Event | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.lost = asyncio.get_running_loop().create_future()
        self.grew = asyncio.Event()

    def chunk_received(self, chunk: memoryview) -> None:
        self.data += chunk
        self.chunks += 1
        assert self.grew is not None
        self.grew.set()
        if self.chunks == self.pause_at:
            self.transport.pause_reading()
        if self.chunks == self.interrupt_at or 0 < self.interrupt_after < self.chunks:
            raise KeyboardInterrupt("from chunk_received")

    def connection_lost(self, exc: BaseException | None) -> None:
        assert self.lost is not None
        if not self.lost.done():
            self.lost.set_result(exc)

    async def until(self, size: int) -> None:
        assert self.grew is not None
        while len(self.data) < size:
            self.grew.clear()
            await asyncio.wait_for(self.grew.wait(), WAKE)


def run(loop: asyncio.AbstractEventLoop, aw: Any) -> Any:
    return loop.run_until_complete(asyncio.wait_for(aw, WAKE))


def test_interrupt_in_chunk_received_of_held_bytes_leaves_reading_on(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """KeyboardInterrupt from the chunk a resume_reading() delivers (bytes
    a read made while paused held, on the selector loop) left the socket
    paused for good: the connection never read again. asyncio's transport
    reads on after it; so does slabnet now."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer: socket.socket | None = None
    app = Recorder()
    app.pause_at = 1
    app.interrupt_at = 2
    try:
        async def connect() -> None:
            await loop.create_connection(
                lambda: slabnet.SlabProtocol(app), *listener.getsockname()
            )

        run(loop, connect())
        tr = app.transport
        peer, _ = listener.accept()
        peer.sendall(b"a" * 10)
        run(loop, app.until(10))
        assert not tr.is_reading()
        peer.sendall(b"b" * 10)  # held by a read made while paused, or left in the socket

        async def settle() -> None:
            for _ in range(20):  # (iterations, not time: the read happens in one)
                await asyncio.sleep(0)

        run(loop, settle())
        tr.resume_reading()
        interrupted = False
        try:
            run(loop, app.until(20))
        except KeyboardInterrupt:
            interrupted = True  # asyncio's loop: out of run_forever, as its own transports
        assert bytes(app.data) == b"a" * 10 + b"b" * 10
        assert app.lost is not None
        if not interrupted:
            # uvloop fails the transport with it, as for its own protocols.
            assert isinstance(run(loop, asyncio.shield(app.lost)), KeyboardInterrupt)
        else:
            # The loop runs again: the connection reads on, and closes.
            peer.sendall(b"c" * 10)
            run(loop, app.until(30))
            assert bytes(app.data).endswith(b"c" * 10)
            tr.close()
            assert run(loop, asyncio.shield(app.lost)) is None
        assert slabnet_handles(loop) == []
    finally:
        if peer is not None:
            peer.close()
        listener.close()


class BlockingTLSPeer:
    """A TLS server on a blocking socket: its handshake runs on a thread
    while the test's loop runs the client's; after it, the test sends from
    its own thread while the loop is stopped, so what it sent has all
    arrived before the client reads."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.ctx = ctx
        self.sock: ssl.SSLSocket | None = None
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        raw, _ = self.listener.accept()
        raw.settimeout(WAKE)
        self.sock = self.ctx.wrap_socket(raw, server_side=True)

    def ready(self) -> ssl.SSLSocket:
        self.thread.join(WAKE)
        assert self.sock is not None
        return self.sock

    def connect(
        self, loop: asyncio.AbstractEventLoop, app: Recorder, ctx: ssl.SSLContext
    ) -> ssl.SSLSocket:
        """Connect ``app`` to this peer with TLS (``ctx``, the client's);
        return the peer's socket once its handshake is done. (The loop runs
        meanwhile: it sends the client's last flight.)"""
        async def connect() -> None:
            await loop.create_connection(
                lambda: slabnet.SlabProtocol(app, ssl=ctx, server_hostname="localhost"),
                *self.listener.getsockname(),
            )

        run(loop, connect())
        sock: ssl.SSLSocket = run(loop, loop.run_in_executor(None, self.ready))
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.listener.close()


def test_interrupt_in_tls_chunk_received_delivers_the_rest_later(
    loop: asyncio.AbstractEventLoop,
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """KeyboardInterrupt from the app's first chunk of a TLS read left the
    read's other records in the engine, undelivered until the peer sent
    more: a peer waiting for an answer waited for good. (asyncio's SSL
    transport leaves them so too, in its SSLObject.) slabnet delivers them
    once the loop runs again."""
    peer = BlockingTLSPeer(tls_server_context)
    app = Recorder()
    app.interrupt_at = 1
    try:
        sock = peer.connect(loop, app, tls_client_context)
        # Three 16 KiB chunks, all in the client's socket before it reads.
        payload = bytes(range(256)) * 192
        sock.sendall(payload)
        interrupted = False
        try:
            run(loop, app.until(len(payload)))
        except KeyboardInterrupt:
            interrupted = True  # asyncio's loop: out of run_forever
        assert app.lost is not None
        if interrupted:
            assert 0 < len(app.data) < len(payload)
            run(loop, app.until(len(payload)))  # the peer sends nothing more
            assert bytes(app.data) == payload
            app.transport.write(b"answer")
            assert run(loop, loop.run_in_executor(None, sock.recv, 100)) == b"answer"
            app.transport.close()
            run(loop, loop.run_in_executor(None, sock.unwrap))  # close_notify both ways
            assert run(loop, asyncio.shield(app.lost)) is None
        else:
            # uvloop fails the transport with it, after every byte read.
            assert isinstance(run(loop, asyncio.shield(app.lost)), KeyboardInterrupt)
            assert bytes(app.data) == payload
        assert slabnet_handles(loop) == []
    finally:
        peer.close()


def test_the_loop_stopped_at_every_iteration_completes_handshake_drain_and_close(
    loop: asyncio.AbstractEventLoop,
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """``loop.stop()`` in every iteration of a TLS handshake, a drain of a
    large write and a close_notify exchange, and the loop run again each
    time: every one completes, and nothing of slabnet's is left scheduled."""
    size = 2 << 20
    received: list[int] = []

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        n = 0
        while chunk := await reader.read(1 << 16):
            n += len(chunk)
        received.append(n)
        writer.close()
        await writer.wait_closed()

    async def serve() -> Any:
        return await slabnet.start_server(handler, "127.0.0.1", 0, ssl=tls_server_context)

    server = run(loop, serve())

    async def client() -> None:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await slabnet.open_connection(
            "127.0.0.1", port, ssl=tls_client_context, server_hostname="localhost"
        )
        writer.write(b"x" * size)
        await writer.drain()
        writer.close()  # the server reads to our close_notify, then answers it
        await writer.wait_closed()
        assert await reader.read() == b""

    task = loop.create_task(asyncio.wait_for(client(), WAKE))
    stopping = True
    stopped = False  # in this run (uvloop's stop() is itself a callback)

    def stopper() -> None:
        nonlocal stopped
        if stopping:
            if not stopped:
                stopped = True
                loop.stop()
            loop.call_soon(stopper)

    loop.call_soon(stopper)
    runs = 0
    while not task.done():
        stopped = False
        loop.run_forever()  # about one iteration
        runs += 1
    stopping = False
    task.result()
    assert runs > 5  # (it did stop in the middle of each)
    assert received == [size]
    server.close()
    run(loop, server.wait_closed())
    assert slabnet_handles(loop) == []


RUNNERS = [
    pytest.param(asyncio.run, id="asyncio.run"),
    pytest.param(uvloop.run, id="uvloop.run"),
]


def socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("case", ["plain", "tls", "handshake", "closing", "starttls", "waiting"])
def test_run_returns_with_connections_open(
    runner: Callable[..., Any], case: str,
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """``asyncio.run()``/``uvloop.run()`` (debug mode) returning while
    slabnet connections are open -- plain, TLS, a client in its handshake,
    one whose close_notify waits for an answer, a server with connected
    clients, a STARTTLS in progress, a client whose queue waits for a peer
    that never reads (it waits on a duplicate descriptor of its own, which
    was never closed, then warned of as an unclosed socket the user never
    made): nothing is reported by slabnet's code
    (no exception to the handler, no unraisable exception, no pending
    task destroyed), only ResourceWarnings, and every socket is closed
    once the objects go."""
    gc.collect()  # (what earlier tests left for the collector)
    baseline = socket_fds()
    reports: list[dict[str, Any]] = []
    unraisable: list[Any] = []
    silent = socket.socket()  # accepts, never answers, never reads
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # (inherited)
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    peer: BlockingTLSPeer | None = None
    duplicate: list[int] = []  # the descriptor of the waiting queue
    if case == "closing":
        peer = BlockingTLSPeer(tls_server_context)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: reports.append(ctx))
        kept: list[Any] = []

        async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
            kept.append(writer)
            await reader.read()

        tls = case == "tls"
        server = await slabnet.start_server(
            handler, "127.0.0.1", 0, ssl=tls_server_context if tls else None
        )
        port = server.sockets[0].getsockname()[1]
        if case in ("plain", "tls"):
            kw: dict[str, Any] = (
                {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
            )
            reader, writer = await slabnet.open_connection("127.0.0.1", port, **kw)
            writer.write(b"x" * 100_000)
            kept.append((reader, writer))
        elif case == "handshake":
            kept.append(loop.create_task(slabnet.open_connection(
                *silent.getsockname(), ssl=tls_client_context, server_hostname="localhost",
            )))
            await asyncio.sleep(0.05)  # (connected, in the handshake)
        elif case == "closing":
            assert peer is not None
            reader, writer = await slabnet.open_connection(
                *peer.listener.getsockname(), ssl=tls_client_context,
                server_hostname="localhost",
            )
            await loop.run_in_executor(None, peer.ready)
            writer.close()  # our close_notify: the peer never answers
            kept.append(writer)
        elif case == "waiting":
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
            sock.setblocking(False)
            await loop.sock_connect(sock, silent.getsockname())
            reader, writer = await slabnet.open_connection(sock=sock)
            writer.write(b"x" * (8 << 20))  # far more than both buffers hold
            await asyncio.sleep(0.05)
            assert writer.transport.get_write_buffer_size() > 0
            duplicate.append(writer.transport._dup.fileno())
            kept.append((reader, writer))
        elif case == "starttls":
            reader, writer = await slabnet.open_connection(*silent.getsockname())
            kept.append(loop.create_task(writer.start_tls(
                tls_client_context, server_hostname="localhost"
            )))
            await asyncio.sleep(0.05)
        kept.append(server)

    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner(main(), debug=True)
            gc.collect()
    finally:
        sys.unraisablehook = old_hook
        silent.close()
        if peer is not None:
            peer.close()
    assert [ctx.get("message") for ctx in reports] == []
    assert unraisable == []
    assert {w.category for w in caught} <= {ResourceWarning}, [str(w.message) for w in caught]
    # (slabnet's own descriptor closes silently: the user never made it.)
    assert not [w for w in caught for fd in duplicate if f"fd={fd}," in str(w.message)]
    assert socket_fds() <= baseline


def _run_with_an_incoming_handshake_open(
    runner: Callable[..., Any], start_server: Callable[..., Any],
    tls_server_context: ssl.SSLContext,
) -> tuple[list[str], list[str], int]:
    """Run a TLS server whose one client connects and never says a word,
    and return once its connection waits in the handshake: the ``repr`` of
    each warning of the run and of the collection after it (addresses
    left out), the messages of the loop's exception handler, and how many
    of the sockets that were open at the end of the run are still open."""
    reports: list[str] = []
    client = socket.socket()
    opened: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: reports.append(str(ctx.get("message"))))

        async def handler(reader: Any, writer: Any) -> None:
            raise AssertionError("no handshake, no handler")

        server = await start_server(handler, "127.0.0.1", 0, ssl=tls_server_context)
        before = len(socket_ids())
        client.connect(server.sockets[0].getsockname())
        async with asyncio.timeout(WAKE):
            while len(socket_ids()) <= before:  # (until the server has accepted it)
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)  # (its handshake has begun: it waits for the client)
        opened.extend(socket_ids())

    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner(main())
            gc.collect()
    finally:
        client.close()
    seen = [re.sub(r"0x[0-9a-f]+|fd=[0-9]+|\(.*\)", "*", str(w.message)) for w in caught]
    left = set(opened) & set(socket_ids())
    return seen, reports, len(left)


def socket_ids() -> list[int]:
    """The inodes of the process's open sockets."""
    ids = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            ids.append(int(link[len("socket:["):-1]))
    return ids


@pytest.mark.parametrize("runner", RUNNERS)
def test_run_returns_with_an_incoming_connection_in_its_handshake_as_asyncio(
    runner: Callable[..., Any], tls_server_context: ssl.SSLContext,
) -> None:
    """``asyncio.run()``/``uvloop.run()`` returning while a TLS server's
    incoming connection waits for its client's hello. The asyncio loop
    accepts it in a task that awaits the handshake, which ``asyncio.run()``
    cancels: the connection is closed then, quietly. slabnet's handshake
    had no task, so its socket was left to the collector, which warned of
    it twice (the socket, the loop's transport). uvloop has no such task:
    its ``close()`` warns of the transport, under either library. Either
    way slabnet warns of nothing asyncio's streams do not, reports nothing,
    and leaves no socket open."""
    ours, reports, left = _run_with_an_incoming_handshake_open(
        runner, slabnet.start_server, tls_server_context)
    theirs, _, _ = _run_with_an_incoming_handshake_open(
        runner, asyncio.start_server, tls_server_context)
    assert sorted(ours) == sorted(theirs)
    assert reports == []
    assert left == 0


def test_interrupt_in_the_last_tls_delivery_still_reports_connection_lost(
    loop: asyncio.AbstractEventLoop,
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """When the connection goes, the TLS layer delivers what its engine
    still holds (a paused app's records) before the app's connection_lost.
    A KeyboardInterrupt from that delivery skipped the rest of
    connection_lost: the app never heard that the connection went (a
    stream's reader would wait for good), and the layer stayed READY. Now
    connection_lost follows, as it follows the plain connection's held
    bytes."""
    peer = BlockingTLSPeer(tls_server_context)
    app = Recorder()
    app.pause_at = app.interrupt_at = app.interrupt_after = 1
    try:
        sock = peer.connect(loop, app, tls_client_context)
        sock.sendall(bytes(range(256)) * 192)  # all in the client's socket before it reads
        assert app.lost is not None
        with pytest.raises(KeyboardInterrupt):
            run(loop, app.until(1))
        if not app.lost.done():
            # asyncio's loop: the first chunk's interrupt. The rest waits in
            # the engine, paused, until the peer resets the connection.
            assert app.transport.has_pending_input()
            hard_close(sock)
            peer.sock = None
            with pytest.raises(KeyboardInterrupt):
                run(loop, asyncio.shield(app.lost))
            assert isinstance(run(loop, asyncio.shield(app.lost)), ConnectionResetError)
        else:
            # uvloop failed the transport with the first chunk's interrupt;
            # the second came from connection_lost's delivery.
            assert isinstance(app.lost.result(), KeyboardInterrupt)
        assert app.chunks == 2
        assert app.transport.is_closing()
        assert slabnet_handles(loop) == []
    finally:
        peer.close()


class ClosesOnLastChunk(Recorder):
    """A Recorder that closes its transport from its ``close_at``-th chunk
    (an app that ends the conversation on a message)."""

    close_at = 0

    def chunk_received(self, chunk: memoryview) -> None:
        if self.chunks + 1 == self.close_at:
            self.transport.close()
        super().chunk_received(chunk)


def test_close_in_the_last_tls_delivery_leaves_no_shutdown_timer(
    loop: asyncio.AbstractEventLoop,
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
) -> None:
    """An app that calls close() from a chunk of the TLS layer's last
    delivery (connection_lost delivers what the engine still holds) started
    a shutdown there, and its timer outlived the connection: connection_lost
    had cancelled the handshake/shutdown timer before that delivery. The
    timer then held the layer, its engine and the app for the shutdown
    timeout (30 s by default) after the connection was gone."""
    peer = BlockingTLSPeer(tls_server_context)
    app = ClosesOnLastChunk()
    app.pause_at = app.interrupt_at = 1  # leaves the read's other records held
    app.close_at = 2
    try:
        sock = peer.connect(loop, app, tls_client_context)
        sock.sendall(bytes(range(256)) * 192)  # all in the client's socket before it reads
        assert app.lost is not None
        try:
            run(loop, app.until(1))
        except KeyboardInterrupt:
            # asyncio's loop: the rest waits in the engine, paused, until the
            # peer resets the connection; its last delivery closes.
            assert not app.lost.done()
            hard_close(sock)
            peer.sock = None
            run(loop, asyncio.shield(app.lost))
        # (uvloop caught the interrupt and failed the transport with it:
        # connection_lost's delivery has closed already.)
        assert app.lost.done()
        assert app.chunks == 2
        # No timer of the layer's is left: it would hold the layer, the
        # engine and the app for the shutdown timeout.
        assert app.transport._timer is None
        if isinstance(loop, asyncio.BaseEventLoop):
            # So nothing is left to hold the layer. (uvloop keeps the
            # interrupt it failed the transport with, whose traceback holds
            # the frames of the calls it came from.)
            layer = weakref.ref(app.transport)
            app.transport = app.lost = None  # (the error's traceback)
            gc.collect()
            assert layer() is None, [type(r).__name__ for r in gc.get_referrers(layer())]
    finally:
        peer.close()


class SmallBuffersInterrupted(asyncio.BufferedProtocol):
    """An asyncio ``BufferedProtocol`` with 4 KiB buffers whose third
    ``buffer_updated()`` raises KeyboardInterrupt, after taking its bytes."""

    def __init__(self) -> None:
        self.buf = bytearray(4096)
        self.data = bytearray()
        self.calls = 0
        self.transport: Any = None
        self.lost: asyncio.Future[BaseException | None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.lost = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self.buf[:nbytes]
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt("from buffer_updated")

    def connection_lost(self, exc: BaseException | None) -> None:
        assert self.lost is not None
        if not self.lost.done():
            self.lost.set_result(exc)

    async def until(self, size: int) -> None:
        """Until ``size`` bytes came, or the connection went."""
        assert self.lost is not None
        while len(self.data) < size and not self.lost.done():
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_interrupt_in_buffer_updated_loses_nothing_of_the_read(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """slabnet reads more at a time than an asyncio BufferedProtocol's
    buffer takes (a 64 KiB read, a 16 KiB TLS chunk) and fills its buffers
    one after the other. A KeyboardInterrupt from one buffer_updated()
    dropped the rest of that read: 53,248 of the 65,536 bytes here, and the
    stream went on after the hole (asyncio's transport reads no more than
    the buffer takes, so the rest is still in the socket). Now the rest
    comes first once the loop runs again; where the loop fails the
    transport with the interrupt (uvloop), what came is a clean prefix."""
    payload = bytes(range(256)) * 256  # 64 KiB, in the client's socket before it reads
    app = SmallBuffersInterrupted()
    listener: socket.socket | None = None
    peer: Any = None
    sock: Any
    if tls:
        peer = BlockingTLSPeer(request.getfixturevalue("tls_server_context"))
        ctx = request.getfixturevalue("tls_client_context")

        async def connect() -> None:
            await loop.create_connection(
                lambda: slabnet.SlabProtocol(app, ssl=ctx, server_hostname="localhost"),
                *peer.listener.getsockname(),
            )

        run(loop, connect())
        sock = run(loop, loop.run_in_executor(None, peer.ready))
    else:
        listener = socket.create_server(("127.0.0.1", 0))

        async def connect() -> None:
            await loop.create_connection(lambda: slabnet.SlabProtocol(app), *listener.getsockname())

        run(loop, connect())
        sock, _ = listener.accept()
    try:
        sock.sendall(payload)
        interrupted = False
        try:
            run(loop, app.until(len(payload)))
        except KeyboardInterrupt:
            interrupted = True  # asyncio's loop: out of run_forever
        assert app.lost is not None
        if interrupted:
            assert app.calls == 3
            run(loop, app.until(len(payload)))  # the peer sends nothing more
            assert bytes(app.data) == payload
            app.transport.abort()
            run(loop, asyncio.shield(app.lost))
        else:
            # uvloop failed the transport with it: no hole in what came.
            assert isinstance(run(loop, asyncio.shield(app.lost)), KeyboardInterrupt)
            assert bytes(app.data) == payload[: len(app.data)]
    finally:
        if peer is not None:
            peer.close()
        else:
            sock.close()
        if listener is not None:
            listener.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_write_request_awaited_from_another_loop_says_so(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A WriteRequest awaited by a task of another loop (another thread's)
    made its future on the awaiting loop, and the connection's thread
    completed it from there: nothing ever woke the awaiting loop, so the
    await hung (for good without a timeout), although the peer had every
    byte. asyncio's drain() and slabnet's raise "attached to a different
    loop" at once; so does the request now."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    peer: BlockingTLSPeer | None = None
    if tls:
        peer = BlockingTLSPeer(request.getfixturevalue("tls_server_context"))
        listener.close()
        listener = peer.listener
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    other = asyncio.new_event_loop()
    writer: Any = None
    try:
        async def connect_and_write() -> Any:
            nonlocal writer
            kw: dict[str, Any] = {}
            if tls:
                kw = {"ssl": request.getfixturevalue("tls_client_context"), "server_hostname": "localhost"}
            _, writer = await slabnet.open_connection(*listener.getsockname(), **kw)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
            req = writer.write(b"z" * (16 << 20))  # far beyond what the kernel takes at once
            if req is None:
                # TLS: accepted once encrypted (at once); a write of the
                # next iteration waits behind the ciphertext.
                await asyncio.sleep(0)
                req = writer.write(b"z" * 1000)
            return req

        made = asyncio.run_coroutine_threadsafe(connect_and_write(), loop)
        if peer is not None:
            peer.ready()  # (the handshake, on the peer's thread); then it reads nothing
            req = made.result(WAKE)
        else:
            req = made.result(WAKE)
            accepted, _ = listener.accept()
        assert req is not None

        async def await_it() -> None:
            await req

        with pytest.raises(RuntimeError, match="attached to a different loop"):
            other.run_until_complete(asyncio.wait_for(await_it(), WAKE))
    finally:
        if writer is not None:
            async def end() -> None:
                writer.transport.abort()
                try:
                    await writer.wait_closed()
                except Exception:
                    pass  # (the abort's error)

            asyncio.run_coroutine_threadsafe(end(), loop).result(WAKE)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAKE)
        other.close()
        if peer is not None:
            peer.close()
        else:
            if "accepted" in locals():
                accepted.close()
            listener.close()


def _connect_writer(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest
) -> tuple[Any, socket.socket, Callable[[], None]]:
    """A slabnet stream writer connected to a blocking peer socket (TLS
    if ``tls``); the writer, the peer's socket and what closes the peer."""
    if tls:
        peer = BlockingTLSPeer(request.getfixturevalue("tls_server_context"))
        ctx = request.getfixturevalue("tls_client_context")
        _, writer = run(loop, slabnet.open_connection(
            *peer.listener.getsockname(), ssl=ctx, server_hostname="localhost"))
        sock: socket.socket = run(loop, loop.run_in_executor(None, peer.ready))
        return writer, sock, peer.close
    listener = socket.create_server(("127.0.0.1", 0))
    _, writer = run(loop, slabnet.open_connection(*listener.getsockname()))
    sock, _ = listener.accept()
    sock.settimeout(WAKE)

    def close() -> None:
        sock.close()
        listener.close()

    return writer, sock, close


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        piece = sock.recv(n - len(got))  # (the socket's timeout: WAKE)
        if not piece:
            break
        got += piece
    return got


WORDS = [b"bye;", b"see you;", b"soon;"]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_writes_made_while_the_loop_is_not_running_go_at_once(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """Small writes after the first of an iteration are gathered and sent
    from a callback at its end; written from code that runs between two
    runs of the loop, they waited for a next run, and a loop closed instead
    lost them (``b'bye;'`` of the three here). asyncio's write() hands them
    to the kernel within the call; so does slabnet when no loop runs."""
    writer, sock, close = _connect_writer(loop, tls, request)
    try:
        for word in WORDS:
            writer.write(word)
        # Read before the loop runs again: a blocking peer, as a test's.
        assert _recv_exactly(sock, len(b"".join(WORDS))) == b"".join(WORDS)
        writer.transport.abort()  # (a TLS close would wait for the peer's close_notify)
        run(loop, writer.wait_closed())
    finally:
        close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_writes_made_just_before_the_loop_stops_and_closes_are_sent(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A last word to the peer, then ``loop.stop()`` in the same callback
    (a signal handler's shutdown), then ``loop.close()``: the asyncio loop
    never ran the callback that sends the gathered writes, and the peer got
    ``b'bye;'`` only. The loop drops it unrun as it closes, and the drop
    sends them now, as much as the kernel takes (all of a few bytes)."""
    writer, sock, close = _connect_writer(loop, tls, request)
    try:
        def last_words() -> None:
            for word in WORDS:
                writer.write(word)
            loop.stop()

        loop.call_soon(last_words)
        loop.run_forever()
        with warnings.catch_warnings():
            # (uvloop's close() warns of the connection still open, and
            # hangs when that warning is an error, as pyproject makes it.)
            warnings.simplefilter("ignore", ResourceWarning)
            loop.close()
        assert _recv_exactly(sock, len(b"".join(WORDS))) == b"".join(WORDS)
    finally:
        close()
        # The connection outlives its loop: nothing can close it now (the
        # asyncio loop's abort() raises, as for its own transports), so it
        # goes, unclosed, here rather than in some later test.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del writer, last_words
            gc.collect()


# ------------------------------------------------- a closed loop that lives on


def _sender(sock: socket.socket, data: bytes) -> threading.Thread:
    def send() -> None:
        try:
            sock.sendall(data)
        finally:
            sock.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_closed_loop_that_lives_on_gives_back_its_read_buffers(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A closed loop lives on while anything refers to it (a future or a
    task the application kept, a lock bound to it, a traceback), and with
    it the loop's read slabs: only the loop's trim timer released them, and
    it closed with the loop. 50 loops each kept so by a future held 55-60
    MiB of slabs (``memory_stats().held_bytes``); asyncio's streams hold
    nothing then. Closing the loop now gives back the slabs and the TLS
    lending buffer."""
    size = 4 << 20
    data = os.urandom(size)
    kept: list[memoryview] = []

    async def transfer() -> int:
        got = 0
        if tls:
            peer = BlockingTLSPeer(request.getfixturevalue("tls_server_context"))
            reader, writer = await slabnet.open_connection(
                *peer.listener.getsockname(),
                ssl=request.getfixturevalue("tls_client_context"), server_hostname="localhost")
            sender = _sender(await loop.run_in_executor(None, peer.ready), data)
            listener = peer.listener
        else:
            listener = socket.create_server(("127.0.0.1", 0))
            reader, writer = await slabnet.open_connection(*listener.getsockname())
            sender = _sender(listener.accept()[0], data)
        try:
            async for chunk in reader.chunks():
                got += len(chunk)
                if len(kept) < 16:
                    kept.append(chunk)  # (the lists grow past what an idle loop keeps)
        finally:
            writer.close()
            sender.join(WAKE)
            listener.close()
        return got

    assert run(loop, transfer()) == size
    kept.clear()
    slab = slabnet.get_slab(loop)
    if tls:
        assert slab._lend is not None
    else:
        assert slab._held > 0
    before = slabnet.memory_stats().held_bytes
    lives_on = loop.create_future()
    loop.close()
    assert slab._held == 0 and slab._lend is None, slab
    assert slabnet.memory_stats().held_bytes <= before - slab._held
    del lives_on


def _descriptors_of(ino: int) -> list[int]:
    """This process's descriptors of the socket whose inode is ``ino``."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{name}").st_ino == ino:
                fds.append(int(name))
        except OSError:
            pass
    return fds


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_queue_waiting_when_its_loop_closes_gives_back_its_descriptor(
    loop: asyncio.AbstractEventLoop, tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A write queue that waits for a slow peer waits on a duplicate of the
    socket's descriptor. When the loop closed under it, with the stream
    kept by the application, the duplicate stayed open: one descriptor more
    than asyncio's streams keep, and on uvloop, which closes its own
    descriptor with the loop, a connection that never ended (the peer read
    everything and then waited; uvloop's streams end it). Closing the loop
    closes the duplicate."""
    writer, sock, close = _connect_writer(loop, tls, request)
    try:
        ino = os.fstat(writer.get_extra_info("socket").fileno()).st_ino
        ours = set(_descriptors_of(ino))  # the loop's own

        async def fill() -> None:
            # Until the kernel takes no more and the rest waits: however
            # large the host's socket buffers are.
            for _ in range(1024):
                writer.write(b"q" * (1 << 20))
                await asyncio.sleep(0)
                if writer.transport.get_write_buffer_size():
                    return
            raise AssertionError("the kernel took 1 GiB from a peer that does not read")

        run(loop, fill())
        assert len(_descriptors_of(ino)) == len(ours) + 1  # the queue's duplicate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # (uvloop: still open)
            loop.close()
        assert set(_descriptors_of(ino)) <= ours
        if isinstance(loop, uvloop.Loop):
            # Nothing holds the connection now: the peer reads to its end.
            while sock.recv(1 << 20):
                pass
    finally:
        close()
        # (It outlived its loop, unclosed: it goes here, not in a later test.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del writer
            gc.collect()
