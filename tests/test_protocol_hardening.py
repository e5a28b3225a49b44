"""The protocol layer with asyncio's own protocol kinds as the app, on real
sockets, plain and TLS, on both loops.

slabnet reads more at a time than an asyncio ``BufferedProtocol``'s buffer
may take (a whole 256 KiB read, a 16 KiB TLS chunk), so it fills the app's
buffers one after the other. Each buffer must be asked for only while the
transport still reads for that app, as the loops ask for one per read: not
while it is paused (its buffer is full), not after ``close()``/``abort()``,
not after ``set_protocol()`` switched to another app. And an app callback
that raises ends the connection at once.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any, cast

import pytest

import slabnet

pytestmark = pytest.mark.timeout(60)

WAKE = 10.0  # seconds any wait may take before the test fails
TOTAL = 2 * 1024 * 1024
DATA = os.urandom(TOTAL)


async def sending_server(data: bytes, server_ssl: ssl.SSLContext | None) -> asyncio.Server:
    """An asyncio streams server that sends ``data``, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for i in range(0, len(data), 65536):
                writer.write(data[i : i + 65536])
                await writer.drain()
            writer.close()
            await writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass  # (the client aborted)

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl)


async def connect(app: asyncio.BaseProtocol, port: int, client_ssl: ssl.SSLContext | None) -> None:
    loop = asyncio.get_running_loop()
    made = loop.create_future()
    await loop.create_connection(
        lambda: slabnet.SlabProtocol(
            app, ssl=client_ssl, server_hostname="localhost" if client_ssl else None,
            handshake_waiter=made,
        ),
        "127.0.0.1", port,
    )
    await asyncio.wait_for(made, WAKE)


def contexts(tls: bool, request: pytest.FixtureRequest) -> tuple[Any, Any]:
    if not tls:
        return None, None
    return request.getfixturevalue("tls_server_context"), request.getfixturevalue("tls_client_context")


class NotesLoss:
    """``lost``: a future of the argument ``connection_lost`` gets."""

    def __init__(self) -> None:
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class FixedBuffer(asyncio.BufferedProtocol):
    """A 4 KiB buffer; full, it pauses reading until a later callback has
    taken its bytes (the usual flow control of a BufferedProtocol)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.buf = bytearray(4096)
        self.filled = 0
        self.got = bytearray()
        self.at_eof: int | None = None
        self.lost: asyncio.Future[BaseException | None] = loop.create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == len(self.buf):
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self.take)

    def take(self) -> None:
        self.got += self.buf[: self.filled]
        self.filled = 0
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.at_eof = len(self.got) + self.filled
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.got += self.buf[: self.filled]
        self.filled = 0
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_buffered_protocol_that_pauses_when_full_gets_every_byte(
    tls: bool, request: pytest.FixtureRequest,
) -> None:
    """slabnet asked the paused app for another buffer, got an empty one,
    raised RuntimeError and ended the connection (plain: after 4 KiB of
    2 MiB). Every byte comes, and the EOF after the last one."""
    server_ssl, client_ssl = contexts(tls, request)
    server = await sending_server(DATA, server_ssl)
    try:
        app = FixedBuffer()
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        assert await asyncio.wait_for(app.lost, WAKE) is None
        assert len(app.got) == TOTAL
        assert bytes(app.got) == DATA
        assert app.at_eof == TOTAL  # the EOF came after the last byte
    finally:
        server.close()


class SmallBuffers(asyncio.BufferedProtocol):
    """Its buffers are 1,000 bytes: each read fills many."""

    def __init__(self) -> None:
        self.calls = 0
        self.buf = bytearray(1000)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)


class Counting(SmallBuffers):
    """``how`` the transport after the first buffer."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def buffer_updated(self, nbytes: int) -> None:
        self.calls += 1
        if self.calls == 1:
            getattr(self.transport, self.how)()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("how", ["close", "abort"])
async def test_nothing_is_delivered_after_close_or_abort_from_buffer_updated(
    tls: bool, how: str, request: pytest.FixtureRequest,
) -> None:
    """slabnet went on filling the app's buffers to the end of the read:
    over 100 more buffer_updated() calls (plain), 13 over TLS."""
    server_ssl, client_ssl = contexts(tls, request)
    server = await sending_server(DATA, server_ssl)
    try:
        app = Counting(how)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        await asyncio.wait_for(app.lost, WAKE)
        assert app.calls == 1
    finally:
        server.close()


class Switching(SmallBuffers):
    """Switches the transport to ``new`` in its first buffer_updated()."""

    def __init__(self, new: asyncio.BaseProtocol) -> None:
        super().__init__()
        self.new = new
        self.got = bytearray()

    def buffer_updated(self, nbytes: int) -> None:
        self.calls += 1
        self.got += self.buf[:nbytes]
        if self.calls == 1:
            self.transport.set_protocol(self.new)

    def connection_lost(self, exc: BaseException | None) -> None:
        pass


class SwitchingChunks(slabnet.ChunkProtocol):
    """The same, as a ChunkProtocol (its chunks are whole TLS chunks)."""

    def __init__(self, new: asyncio.BaseProtocol) -> None:
        self.new = new
        self.calls = 0
        self.got = bytearray()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def chunk_received(self, chunk: memoryview) -> None:
        self.calls += 1
        self.got += chunk
        if self.calls == 1:
            self.transport.set_protocol(self.new)


class Collecting(asyncio.Protocol):
    def __init__(self) -> None:
        self.got = bytearray()
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.got += data

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("old", [Switching, SwitchingChunks], ids=["buffered", "chunks"])
async def test_set_protocol_from_a_data_callback_sends_the_rest_to_the_new_protocol(
    tls: bool, old: type, request: pytest.FixtureRequest,
) -> None:
    """An upgrade (HTTP to WebSocket) switches protocols in the middle of a
    read: every later byte goes to the new protocol, in order. slabnet
    went on filling the old BufferedProtocol's buffers to the end of the
    read, and over TLS handed the old ChunkProtocol the rest of the read's
    chunks."""
    server_ssl, client_ssl = contexts(tls, request)
    server = await sending_server(DATA, server_ssl)
    try:
        new = Collecting()
        app = old(new)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        await asyncio.wait_for(new.lost, WAKE)
        assert app.calls == 1
        assert len(app.got) + len(new.got) == TOTAL
        assert bytes(app.got + new.got) == DATA
    finally:
        server.close()


class SwitchingAndPausing(Switching):
    """Switches to ``new`` and pauses reading in the first buffer_updated()
    that filled its buffer (more of that read follows: a TLS connection's
    first chunk may be shorter); a ``call_soon`` callback resumes (after
    telling ``new``)."""

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buf[:nbytes]
        if not self.calls and nbytes == len(self.buf):
            self.calls += 1
            self.transport.set_protocol(self.new)
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self.resume)

    def resume(self) -> None:
        self.new.paused = False  # type: ignore[attr-defined]
        self.transport.resume_reading()


class CollectingUnlessPaused(Collecting):
    """Notes each ``data_received()`` made while its transport was paused."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = True
        self.while_paused = 0

    def data_received(self, data: bytes) -> None:
        self.while_paused += self.paused
        super().data_received(data)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_switch_made_while_pausing_sends_the_rest_only_after_the_resume(
    tls: bool, request: pytest.FixtureRequest,
) -> None:
    """A BufferedProtocol switches to a new protocol and pauses reading in
    one buffer_updated(): the rest of the read went to the new protocol
    at once, while paused (the switch was looked at before the pause).
    As the loops do, it now comes only after resume_reading()."""
    server_ssl, client_ssl = contexts(tls, request)
    server = await sending_server(DATA, server_ssl)
    try:
        new = CollectingUnlessPaused()
        app = SwitchingAndPausing(new)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        await asyncio.wait_for(new.lost, WAKE)
        assert app.calls == 1 and new.while_paused == 0
        assert bytes(app.got + new.got) == DATA
    finally:
        server.close()


class Failing(slabnet.ChunkProtocol):
    """Its chunk_received raises; a callback it scheduled first then looks
    at the transport and writes."""

    def __init__(self) -> None:
        self.closing_after: bool | None = None
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def chunk_received(self, chunk: memoryview) -> None:
        asyncio.get_running_loop().call_soon(self.later)
        raise RuntimeError("app bug")

    def later(self) -> None:
        self.closing_after = self.transport.is_closing()
        self.transport.write(b"AFTER")

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.asyncio
async def test_a_raising_chunk_received_ends_the_plain_connection_at_once() -> None:
    """The loops end their transport at once when a protocol's data
    callback raises (is_closing() True, later writes dropped). slabnet's
    transport stayed open until the loop's transport called
    connection_lost an iteration later, and a write made meanwhile reached
    the peer."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    got: asyncio.Future[bytes] = loop.create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * 1000)
        await writer.drain()
        data = b""
        try:
            while part := await reader.read(1000):
                data += part
        except ConnectionError:
            pass
        got.set_result(data)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        app = Failing()
        await connect(app, server.sockets[0].getsockname()[1], None)
        exc = await asyncio.wait_for(app.lost, WAKE)
        assert isinstance(exc, RuntimeError) and str(exc) == "app bug"
        assert await asyncio.wait_for(got, WAKE) == b""
        assert app.closing_after is True
        assert [type(c.get("exception")) for c in errors] == [RuntimeError]
    finally:
        loop.set_exception_handler(None)
        server.close()


class RaisingIn(asyncio.BufferedProtocol):
    """An asyncio protocol whose method ``where`` raises on the first read."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.buf = bytearray(65536)
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.where == "get_buffer":
            raise RuntimeError("app bug")
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self.where == "buffer_updated":
            raise RuntimeError("app bug")

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class RaisingData(asyncio.Protocol):
    """A plain asyncio ``Protocol`` whose ``data_received`` raises."""

    def __init__(self) -> None:
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        raise RuntimeError("app bug")

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("where", ["get_buffer", "buffer_updated", "data_received"])
async def test_the_error_report_names_the_method_of_the_app_that_raised(
    tls: bool, where: str, request: pytest.FixtureRequest,
) -> None:
    """The loop's exception handler heard "protocol.chunk_received()
    failed" of an asyncio protocol, which has no such method, whichever of
    its own methods raised. As the loops do, the report names that method
    (get_buffer, buffer_updated or data_received), and the connection ends
    with its error."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    server_ssl, client_ssl = contexts(tls, request)
    server = await sending_server(DATA, server_ssl)
    try:
        app = RaisingData() if where == "data_received" else RaisingIn(where)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        exc = await asyncio.wait_for(app.lost, WAKE)
        assert isinstance(exc, RuntimeError) and str(exc) == "app bug"
        assert [c["message"] for c in errors] == [f"slabnet: protocol.{where}() failed"]
        assert errors[0]["exception"] is exc
    finally:
        loop.set_exception_handler(None)
        server.close()


class WritingTwo(NotesLoss, asyncio.Protocol):
    """Writes one byte, then two 5,000-byte buffers in one ``writelines()``
    above a 1,000 byte high-water mark, then closes; ``pause_writing()`` writes ``b"P"``
    or closes."""

    def __init__(self, in_pause: str) -> None:
        super().__init__()
        self.in_pause = in_pause
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast(asyncio.Transport, transport)
        self.transport = tr
        tr.set_write_buffer_limits(high=1000)
        tr.write(b"W")  # (goes at once; what follows in this iteration is gathered)
        tr.writelines([b"A" * 5000, b"B" * 5000])
        tr.close()  # (if pause_writing() has not: plain, the kernel took it all)

    def pause_writing(self) -> None:
        self.paused = True
        if self.in_pause == "write":
            self.transport.write(b"P")
        else:
            self.transport.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("in_pause", ["write", "close"])
async def test_pause_writing_comes_after_the_whole_writelines(
    tls: bool, in_pause: str, request: pytest.FixtureRequest,
) -> None:
    """Over TLS, ``writelines()`` gathered its buffers one at a time and
    checked the high-water mark after each: the app's ``pause_writing()``
    ran between two buffers of one call. A write made there went out
    between them (the peer got A..P B..), and a ``close()`` made there
    dropped the second buffer, which the call had accepted (the peer got
    A.. and EOF). As with the loops' transports, the whole call comes
    first: A.. B.. then P, or A.. B.. then EOF. (A first write of one
    byte makes the call's buffers wait for the end of the iteration, so
    they count against the mark.)"""
    server_ssl, client_ssl = contexts(tls, request)
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.set_result(await reader.read())
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl)
    try:
        app = WritingTwo(in_pause)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        data = await asyncio.wait_for(got, WAKE)
        assert app.paused or not tls  # (TLS: the call's plaintext counts)
        assert data == b"W" + b"A" * 5000 + b"B" * 5000 + (b"P" if app.paused and in_pause == "write" else b"")
        assert await asyncio.wait_for(app.lost, WAKE) is None
    finally:
        server.close()


class PausingEachChunk(NotesLoss, slabnet.ChunkProtocol):
    """Pauses in every ``chunk_received()`` and resumes from a ``call_soon``
    callback (as an app handing each chunk to a consumer does); notes the
    most ciphertext its TLS transport held undecrypted."""

    def __init__(self, resumes: int) -> None:
        super().__init__()
        self.resumes = resumes
        self.got = bytearray()
        self.most_held = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(slabnet.TLSTransport, transport)

    def chunk_received(self, chunk: memoryview) -> None:
        self.got += chunk
        self.most_held = max(self.most_held, self.transport.get_read_buffer_size())
        self.transport.pause_reading()
        for _ in range(self.resumes):  # (a second one changes nothing for asyncio)
            asyncio.get_running_loop().call_soon(self.transport.resume_reading)


@pytest.mark.asyncio
@pytest.mark.parametrize("resumes", [1, 2], ids=["resume", "resume_twice"])
async def test_a_tls_app_that_pauses_each_chunk_holds_no_more_than_a_read(
    request: pytest.FixtureRequest, resumes: int,
) -> None:
    """The resume came before the loop's next read in the same turn, and
    the TLS layer resumed the plain reads at once, the records it held to
    be delivered by a pump after that read: each turn read 256 KiB,
    delivered a chunk or two and kept the rest behind what it held (a copy
    of it all). Over 8 MiB the layer held 7.5 MiB, CPU grew with the square
    of the stream. The plain reads now resume once what was held is
    delivered: at most a read's worth waits. (An app that resumed twice
    made the second resume the plain reads' at once, with the same result,
    until a second fix.)"""
    server_ssl, client_ssl = contexts(True, request)
    data = os.urandom(8 * 1024 * 1024)
    server = await sending_server(data, server_ssl)
    try:
        app = PausingEachChunk(resumes)
        await connect(app, server.sockets[0].getsockname()[1], client_ssl)
        assert await asyncio.wait_for(app.lost, WAKE) is None
        assert app.got == data
        assert app.most_held <= 512 * 1024, app.most_held
    finally:
        server.close()


class Producer(NotesLoss, asyncio.Protocol):
    """Replies to a request with 200 frames of 1,000 bytes, writing while
    not paused, above a 4,096-byte high-water mark; its ``pause_writing()``
    writes a 40,000-byte notice first. Notes which of its own callbacks
    were running when each flow-control callback came."""

    FRAMES = 200

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.sent = 0
        self.running: list[str] = []
        self.told: list[tuple[str, tuple[str, ...]]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=4096)

    def data_received(self, data: bytes) -> None:
        self.running.append("data_received")
        self.produce()
        self.running.pop()

    def produce(self) -> None:
        while not self.paused and self.sent < self.FRAMES:
            self.transport.write(b"f" * 1000)
            self.sent += 1
        if self.sent == self.FRAMES:
            self.transport.close()

    def pause_writing(self) -> None:
        self.told.append(("pause_writing", tuple(self.running)))
        self.running.append("pause_writing")
        self.transport.write(b"N" * 40000)
        self.running.pop()
        self.paused = True

    def resume_writing(self) -> None:
        self.told.append(("resume_writing", tuple(self.running)))
        self.paused = False
        self.produce()


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_resume_writing_never_comes_inside_the_apps_own_call(
    tls: bool, request: pytest.FixtureRequest,
) -> None:
    """Plain TCP: the write in pause_writing() sent the small writes
    gathered before it, and slabnet told the app to resume from inside
    that write: inside
    its pause_writing(), before the app had noted the pause. The app's
    producer then ran inside itself and sent 249 frames of 200, and it
    took itself for paused with nothing left to resume it. The loops'
    transports tell resume_writing() from their write callbacks only, and
    so does slabnet now: the resume found in an app's call comes from the
    loop. (The TLS rows passed before too: there the plaintext waits for
    the end of the iteration.)"""
    loop = asyncio.get_running_loop()
    server_ssl, client_ssl = contexts(tls, request)
    app = Producer()
    server = await loop.create_server(
        lambda: slabnet.SlabProtocol(app, ssl=server_ssl, server_side=True), "127.0.0.1", 0
    )
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.sockets[0].getsockname()[1], ssl=client_ssl,
            server_hostname="localhost" if tls else None,
        )
        writer.write(b"GET\n")
        got = await asyncio.wait_for(reader.read(), WAKE)
        assert await asyncio.wait_for(app.lost, WAKE) is None
        writer.close()
        assert ("pause_writing", ("data_received",)) in app.told
        assert all(not running for name, running in app.told if name == "resume_writing")
        assert app.sent == Producer.FRAMES and not app.paused
        assert got.replace(b"N", b"") == b"f" * 1000 * Producer.FRAMES
    finally:
        server.close()
