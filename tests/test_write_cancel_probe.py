"""The write path under cancellation and failure, on real sockets, on both
loops: what an ``await`` of a ``WriteRequest`` leaves behind once it has
raised, and flow-control callbacks of the app that raise a BaseException
that is not an exit (``CancelledError``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import weakref
from typing import Any

import pytest

import slabnet
from conftest import SMALL_BUF, Handler, RawTLS, client_ctx, server_ctx, shrink, wait_acked

WAKE = 5.0  # seconds any wait may take before the test fails
PAYLOAD = 4 * 1024 * 1024


async def blocked_writer(
    listener: socket.socket,
) -> tuple[slabnet.StreamWriter, socket.socket, slabnet.WriteRequest]:
    """A slabnet client whose peer reads nothing, and the pending request
    of a write far larger than the two kernels hold."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    shrink(sock)
    sock.setblocking(False)
    await loop.sock_connect(sock, listener.getsockname())
    _, writer = await slabnet.open_connection(sock=sock)
    peer, _ = await loop.sock_accept(listener)
    req = writer.write(os.urandom(PAYLOAD))
    assert req is not None and not req.done()
    return writer, peer, req


class Payload(bytearray):
    """An awaiter's own buffer (weakly referenceable)."""


async def peer_sees_the_end(sock: socket.socket) -> None:
    """Read (and drop) until the connection ends: FIN or RST."""
    loop = asyncio.get_running_loop()
    try:
        while await loop.sock_recv(sock, 65536):
            pass
    except ConnectionResetError:
        pass


def tear_down(loop: asyncio.AbstractEventLoop, raw: Any, sock: Any) -> None:
    """The end of a test that set an exception handler and may have made a
    transport (``raw``) and accepted its peer (``sock``): None if not."""
    loop.set_exception_handler(None)
    if raw is not None:
        raw.abort()
    if sock is not None:
        sock.close()


def traceback_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


@pytest.mark.asyncio
async def test_a_failed_write_request_awaited_again_keeps_no_earlier_awaiter(
    small_listener: socket.socket,
) -> None:
    """A request that failed raised its error (the connection's, kept by
    the transport and the queue too) with a bare ``raise``, so every await
    added its frames to that one exception's traceback: after 20 awaits by
    20 coroutines it was 40 entries long and held all 20 frames, and with
    them each coroutine's locals (here a 1 MiB buffer each), for as long as
    the request or the connection lived, garbage collection or not. An
    asyncio future re-raises its exception with the traceback it was set
    with; so does a request now: at most the last awaiter's frames are
    kept, as by a future."""
    writer, peer, req = await blocked_writer(small_listener)
    alive: list[weakref.ref[Payload]] = []

    async def send_or_give_up() -> None:
        payload = Payload(1024 * 1024)  # what the app keeps while it waits
        alive.append(weakref.ref(payload))
        try:
            await req
        except ConnectionAbortedError:
            pass

    try:
        writer.transport.abort()
        lengths = []
        for _ in range(20):
            await asyncio.wait_for(send_or_give_up(), WAKE)
            exc = req.exception()
            assert isinstance(exc, slabnet.LocalAbortError)
            lengths.append(traceback_length(exc))
            del exc
        gc.collect()
        kept = sum(ref() is not None for ref in alive)
        assert kept <= 1, f"{kept} awaiters' buffers kept by the request's error"
        assert lengths[-1] == lengths[0], lengths
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    finally:
        peer.close()


@pytest.mark.asyncio
async def test_a_failed_write_request_still_raises_its_own_error(
    small_listener: socket.socket,
) -> None:
    """(The same exception object each time, as from a future.)"""
    writer, peer, req = await blocked_writer(small_listener)
    try:
        writer.transport.abort()
        seen: list[Any] = []
        for _ in range(3):
            with pytest.raises(slabnet.LocalAbortError) as info:
                await asyncio.wait_for(req, WAKE)
            seen.append(info.value)
        assert seen[0] is seen[1] is seen[2] is req.exception()
        await asyncio.wait_for(writer.wait_closed(), WAKE)
    finally:
        peer.close()


# ------------------------------------------------ pause_writing()/resume_writing() that cancel


class CancelsInFlowControl(asyncio.Protocol):
    """An app whose ``pause_writing()`` or ``resume_writing()`` raises
    CancelledError (say, the ``result()`` of a future that was cancelled)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls: list[str] = []
        self.transport: asyncio.Transport | None = None
        self.made: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUF)
        self.transport = transport
        self.made.set_result(None)

    def pause_writing(self) -> None:
        self.calls.append("pause_writing")
        if self.where == "pause_writing":
            raise asyncio.CancelledError("the app's own")

    def resume_writing(self) -> None:
        self.calls.append("resume_writing")
        if self.where == "resume_writing":
            raise asyncio.CancelledError("the app's own")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


@pytest.mark.parametrize("where", ["pause_writing", "resume_writing"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_a_flow_control_callback_that_raises_cancelled_error_is_reported_and_ends_nothing(
    server_cert: Any, tls_ca: Any, tls: bool, where: str,
) -> None:
    """asyncio's transports report any exception of ``pause_writing()`` or
    ``resume_writing()`` but SystemExit and KeyboardInterrupt to the loop's
    exception handler, and write on. slabnet's caught only Exception: a
    CancelledError from ``pause_writing()`` came out of ``write()``, to a
    caller that had cancelled nothing, and one from ``resume_writing()``
    left the flush that had emptied the queue before the close() that
    waited for it: the peer read every byte and then waited for the end
    for good (until this test's 5 s). Now it is reported once, in asyncio's
    words, and the connection goes on: every byte, then the end."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    reading = asyncio.Event()
    got: asyncio.Future[bytes] = loop.create_future()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reading.wait()
        try:
            got.set_result(await reader.read())
        except Exception as exc:
            got.set_exception(exc)
        writer.close()

    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUF)
    listening.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(
        peer, sock=listening, ssl=server_ctx(server_cert) if tls else None)
    app = CancelsInFlowControl(where)
    kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    payload = os.urandom(PAYLOAD)
    try:
        async with asyncio.timeout(WAKE):
            raw, _ = await loop.create_connection(
                lambda: slabnet.SlabProtocol(app, **kw), *listening.getsockname())
            await app.made
        transport = app.transport
        assert transport is not None
        # (Resumed only once the queue is empty: by the flush that empties
        # it, which is also the one that ends the connection after close().)
        transport.set_write_buffer_limits(64 * 1024, 0)
        try:
            transport.write(payload)
            transport.write(b"tail")
            assert app.calls == ["pause_writing"]
            transport.close()
            reading.set()
            async with asyncio.timeout(WAKE):
                assert await got == payload + b"tail"
                assert await app.lost is None
        finally:
            raw.abort()
        assert app.calls == ["pause_writing", "resume_writing"]
        assert [c["message"] for c in handler.contexts] == [f"protocol.{where}() failed"]
        exc = handler.exceptions()[0]
        assert isinstance(exc, asyncio.CancelledError) and exc.args == ("the app's own",)
    finally:
        server.close()
        loop.set_exception_handler(None)


# ------------------------------------------------ a data callback that cancels


class CancelsOnSecondData(asyncio.Protocol):
    """Pauses reading on its first bytes; raises CancelledError (its own,
    say the ``result()`` of a cancelled future) on the next ones."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.events: list[object] = []
        self.first: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[BaseException | None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.events.append(len(data))
        if not self.first.done():
            assert self.transport is not None
            self.transport.pause_reading()
            self.first.set_result(None)
            return
        raise asyncio.CancelledError("the app's own")

    def eof_received(self) -> None:
        self.events.append("eof")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append("lost")
        self.lost.set_result(exc)


class CancelsOnSecondBuffer(CancelsOnSecondData, asyncio.BufferedProtocol):
    """The same, as a BufferedProtocol with 100-byte buffers."""

    def get_buffer(self, sizehint: int) -> bytearray:
        self.buf = bytearray(100)
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self.buf[:nbytes]))


@pytest.mark.parametrize("cls", [CancelsOnSecondData, CancelsOnSecondBuffer])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_a_data_callback_that_raises_cancelled_error_ends_the_connection_with_it(
    listener: socket.socket, server_cert: Any, tls_ca: Any, tls: bool, cls: type,
) -> None:
    """The loops' transports re-raise only SystemExit and KeyboardInterrupt
    from ``data_received()``/``buffer_updated()``; any other exception,
    CancelledError too, is the app's failure: reported once, and the
    connection ends with it (``connection_lost(exc)``). slabnet treated
    every BaseException as an exit: raised in the delivery of bytes that
    came while reading was paused, it escaped to the loop as a callback's
    error and the connection lived on (the app got the EOF and a clean
    connection_lost(None) later); from a BufferedProtocol, the rest of the
    read was delivered again and again, each call raising and reported,
    and the peer never saw the end."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    app = cls()
    kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    raw: Any = None
    sock: Any = None
    try:
        async with asyncio.timeout(WAKE):
            opening = asyncio.ensure_future(loop.create_connection(
                lambda: slabnet.SlabProtocol(app, **kw), *listener.getsockname()))
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            peer = RawTLS(sock, server_ctx(server_cert), server_side=True) if tls else None
            if peer is not None:
                await peer.handshake()
            raw, _ = await opening
            wire = peer.seal if peer is not None else (lambda data: data)
            await loop.sock_sendall(sock, wire(b"a" * 10))
            await app.first  # reading is paused now
            await loop.sock_sendall(sock, wire(b"b" * 1000))
            await wait_acked(sock, WAKE)
            for _ in range(4):  # (the loop reads them, if it reads meanwhile)
                await asyncio.sleep(0)
            assert app.transport is not None
            app.transport.resume_reading()
            exc = await app.lost
            await peer_sees_the_end(sock)
        assert isinstance(exc, asyncio.CancelledError) and exc.args == ("the app's own",)
        assert [c.get("exception") for c in handler.contexts] == [exc]
        name = "data_received" if cls is CancelsOnSecondData else "buffer_updated"
        assert handler.contexts[0]["message"] == f"slabnet: protocol.{name}() failed"
        assert app.events == [10, 1000 if cls is CancelsOnSecondData else 100, "lost"]
    finally:
        tear_down(loop, raw, sock)


class CancelsWhenMade(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raise asyncio.CancelledError("the app's own")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


@pytest.mark.asyncio
async def test_a_tls_connection_made_that_raises_cancelled_error_is_reported_under_its_name(
    listener: socket.socket, server_cert: Any, tls_ca: Any,
) -> None:
    """Over TLS the app's connection_made() runs inside the read that ends
    the handshake: a CancelledError from it was reported as the failure
    of whatever delivered that read (the loop's "Fatal error:
    protocol.buffer_updated() call failed."), not of the app's method."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    app = CancelsWhenMade()
    raw: Any = None
    sock: Any = None
    try:
        async with asyncio.timeout(WAKE):
            opening = asyncio.ensure_future(loop.create_connection(
                lambda: slabnet.SlabProtocol(
                    app, ssl=client_ctx(tls_ca), server_hostname="localhost"),
                *listener.getsockname()))
            sock, _ = await loop.sock_accept(listener)
            peer = RawTLS(sock, server_ctx(server_cert), server_side=True)
            await peer.handshake()
            raw, _ = await opening
            exc = await app.lost
            await peer_sees_the_end(sock)
        assert isinstance(exc, asyncio.CancelledError) and exc.args == ("the app's own",)
        assert [c.get("exception") for c in handler.contexts] == [exc]
        assert handler.contexts[0]["message"] == "slabnet: protocol.connection_made() failed"
    finally:
        tear_down(loop, raw, sock)
