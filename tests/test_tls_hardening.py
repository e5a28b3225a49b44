"""TLS hardening: memory bounds of both BIOs, split invalid headers, the
handshake timeout's message.

Engine tests run two ``TLSEngine`` objects joined in memory (no loop).
Stream tests run slabnet over real loopback sockets on both loops, against
slabnet itself or a ``conftest.RawTLS`` peer whose wire bytes the test picks.

A ``MemoryBIO`` keeps the largest size it ever grew to, and OpenSSL allocates
it with its own ``malloc`` calls, which ``tracemalloc`` does not see.  Two
measures stand in: :class:`PeakBIO`, a stand-in for the engine's BIO objects
that forwards every call to the real BIO and remembers the most it was seen
to hold (after every write into the incoming BIO, and at every ``pending``
query and ``read`` of the outgoing one, which together see each high point,
since only OpenSSL writes there); and, on glibc, ``mallinfo2()``, the bytes
the C heap has in use, for what a large write leaves allocated.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import gc
import hashlib
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

import pytest

import slabnet
from conftest import (
    ForgedTLS12, RawTLS, client_ctx, forgeable, openssl_like, records, recv_exactly, server_ctx,
    shrink,
)
from test_writer_hardening import WAKE
from slabnet._errors import TLSRecordError
from slabnet._records import MAX_LENGTH_TLS12
from slabnet._tls import _DRAIN_AT, _LEND_LOW, LEND_PIECE, MAX_FRAGMENT, TLSEngine, TLSState

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])

#: The most a record of either version takes on the wire (header included).
LARGEST_RECORD = 5 + MAX_LENGTH_TLS12
#: What the incoming BIO may hold at once: a lent piece on top of less than
#: one batch, plus the record OpenSSL may have begun (as in test_tls_engine).
INCOMING_BOUND = LEND_PIECE + _LEND_LOW + LARGEST_RECORD
#: The outgoing BIO's bound; the write side's target is 256 KiB retained.
OUTGOING_BOUND = 160 * 1024
RETAINED_BOUND = 256 * 1024


class PeakBIO:
    """Forwards to a ``MemoryBIO`` and remembers the most it held."""

    __slots__ = ("bio", "peak")

    def __init__(self, bio: ssl.MemoryBIO) -> None:
        self.bio = bio
        self.peak = 0

    def write(self, data: Any) -> int:
        n = self.bio.write(data)
        self.peak = max(self.peak, self.bio.pending)
        return n

    @property
    def pending(self) -> int:
        n = self.bio.pending
        self.peak = max(self.peak, n)
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.bio.read(size)
        self.peak = max(self.peak, len(data))
        return data


def watch(engine: TLSEngine) -> tuple[PeakBIO, PeakBIO]:
    """Put PeakBIOs in place of the engine's BIOs (the SSLObject keeps the
    real ones); returns (incoming, outgoing)."""
    inc = PeakBIO(engine._incoming)
    out = PeakBIO(engine._outgoing)
    engine._incoming = inc  # type: ignore[assignment]
    engine._outgoing = out  # type: ignore[assignment]
    return inc, out


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[TLSEngine]:
    """Every TLSEngine made during the test, with its BIOs watched."""
    engines: list[TLSEngine] = []
    init = TLSEngine.__init__

    def watched_init(self: TLSEngine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        watch(self)
        engines.append(self)

    monkeypatch.setattr(TLSEngine, "__init__", watched_init)
    return engines


def peaks(engine: TLSEngine) -> tuple[int, int]:
    inc, out = engine._incoming, engine._outgoing
    assert isinstance(inc, PeakBIO) and isinstance(out, PeakBIO)
    return inc.peak, out.peak


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]


def _heap_in_use() -> Callable[[], int] | None:
    """glibc's count of heap bytes in use (mmapped blocks included), which
    sees OpenSSL's allocations; None on other C libraries."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        gc.collect()
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


heap_in_use = _heap_in_use()


# ---------------------------------------------------------------- engine pairs


def engine_contexts(server_cert: Any, tls_ca: Any, version: ssl.TLSVersion) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    return client_ctx(tls_ca, version), server_ctx(server_cert, version)


def make_pair(cctx: ssl.SSLContext, sctx: ssl.SSLContext) -> tuple[TLSEngine, TLSEngine]:
    """A client and a server engine with the handshake done."""
    c = TLSEngine(cctx, server_hostname="localhost")
    s = TLSEngine(sctx, server_side=True)
    for _ in range(10):
        cdone = c.do_handshake()
        s.receive_data(c.data_to_send())
        sdone = s.do_handshake()
        c.receive_data(s.data_to_send())
        if cdone and sdone:
            break
    assert c.read_chunk() is None  # TLS 1.3: take the session tickets
    assert c.state is TLSState.OPEN and s.state is TLSState.OPEN
    return c, s


def read_all(engine: TLSEngine, wire: bytes, step: int = 262144) -> bytes:
    """Lend `wire` to `engine` by reads of `step` bytes; the plaintext."""
    got = []
    for off in range(0, len(wire), step):
        engine.lend_data(memoryview(wire)[off : off + step])
        while (chunk := engine.read_chunk()) is not None and chunk:
            got.append(bytes(chunk))
        engine.release_lent()
    return b"".join(got)


# ---------------------------------------------------------------- item 11


@VERSIONS
def test_handshake_last_read_with_a_burst_is_lent_by_pieces(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    # The side that finishes its handshake first sends data at once behind
    # its last flight (TLS 1.3: the client, behind its Finished; TLS 1.2: the
    # server, behind its ChangeCipherSpec and Finished), and all of it comes
    # in one 256 KiB read.  The handshake takes that read lent, like every
    # later read: the BIO never holds more than a piece and one batch.
    cctx, sctx = engine_contexts(server_cert, tls_ca, version)
    c = TLSEngine(cctx, server_hostname="localhost")
    s = TLSEngine(sctx, server_side=True)
    payload = os.urandom(250_000)
    sides = [c, s]
    wire = b""
    for turn in range(10):
        engine = sides[turn % 2]
        if wire:
            engine.receive_data(wire)
        if engine.do_handshake():
            engine.write(payload)
            wire = engine.data_to_send()
            receiver = sides[(turn + 1) % 2]
            break
        wire = engine.data_to_send()
    else:
        raise AssertionError("the handshake did not finish")
    assert receiver is (s if version is TLS13 else c)
    assert len(wire) > 250_000
    inc, _ = watch(receiver)
    lent = bytearray(wire)
    receiver.lend_data(memoryview(lent))
    assert receiver.do_handshake()
    got = []
    while (chunk := receiver.read_chunk()) is not None:
        got.append(bytes(chunk))
    receiver.release_lent()
    lent[:] = bytes(len(lent))  # the lender reuses its buffer
    assert b"".join(got) == payload
    assert 0 < inc.peak <= INCOMING_BOUND, inc.peak


@pytest.fixture(scope="module")
def long_chain() -> tuple[Any, Any]:
    """A CA and a leaf certificate 90 intermediates below it: the server's
    Certificate message is about 47 KiB, more than one lent piece."""
    import trustme

    ca = trustme.CA(path_length=95)
    issuer = ca
    for _ in range(90):
        issuer = issuer.create_child_ca()
    return ca, issuer.issue_cert("localhost")


@VERSIONS
def test_handshake_flight_longer_than_a_piece_is_taken_in_one_call(
    long_chain: tuple[Any, Any], version: ssl.TLSVersion
) -> None:
    # Every flight is lent, as the shell lends every read: do_handshake()
    # moves piece after piece into the BIO until OpenSSL has what it needs,
    # so one call takes the whole flight and answers it.
    ca, leaf = long_chain
    cctx, sctx = client_ctx(ca, version), server_ctx(leaf, version)
    c = TLSEngine(cctx, server_hostname="localhost")
    s = TLSEngine(sctx, server_side=True)
    incoming = [watch(c)[0], watch(s)[0]]
    sides = [c, s]
    assert not c.do_handshake()
    wire = c.data_to_send()
    longest = 0
    for turn in range(1, 10):
        engine = sides[turn % 2]
        lent = bytearray(wire)
        engine.lend_data(memoryview(lent))
        done = engine.do_handshake()
        # Nothing of the flight is left over for a later call.
        assert engine.buffered_ciphertext == 0, (turn, engine.buffered_ciphertext)
        engine.release_lent()
        lent[:] = bytes(len(lent))
        longest = max(longest, len(wire))
        wire = engine.data_to_send()
        if done and c.state is TLSState.OPEN and s.state is TLSState.OPEN:
            break
        assert wire, turn  # each flight is answered at once
    else:
        raise AssertionError("the handshake did not finish")
    # The long flight went in by pieces: at most a piece on top of the
    # start of a record OpenSSL was waiting to complete.
    assert longest > LEND_PIECE
    assert max(bio.peak for bio in incoming) <= LEND_PIECE + LARGEST_RECORD
    s.write(b"after")  # behind the server's last output (TLS 1.3 tickets)
    assert read_all(c, wire + s.data_to_send()) == b"after"


async def _tls13_client_finished_with_burst(
    port: int, tls_ca: Any, payload: bytes
) -> None:
    """A RawTLS client whose Finished goes out in one send with `payload`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    # Room for the whole burst on our side, so that one send hands it all
    # to the kernel and the server finds it there in one read.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    tls = RawTLS(sock, client_ctx(tls_ca, TLS13), server_side=False, server_hostname="localhost")
    await tls.handshake(send_last=False)
    finished = tls.outgoing.read()
    pieces = [payload[i : i + MAX_FRAGMENT] for i in range(0, len(payload), MAX_FRAGMENT)]
    await tls.send(finished + tls.seal(*pieces))
    await tls.send(tls.close_notify())
    await tls.linger()


@pytest.mark.asyncio
async def test_server_handshake_finished_with_a_burst(
    server_cert: Any, tls_ca: Any, watched: list[TLSEngine]
) -> None:
    payload = os.urandom(1 << 20)
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            received.set_result(await reader.read())
        except Exception as exc:  # pragma: no cover - reported by the test
            received.set_exception(exc)
        writer.close()

    listener = socket.create_server(("127.0.0.1", 0))
    # A receive buffer that holds a whole 256 KiB read, set before accept.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    server = await slabnet.start_server(handle, sock=listener, ssl=server_ctx(server_cert, TLS13))
    try:
        async with asyncio.timeout(10):
            await asyncio.gather(
                _tls13_client_finished_with_burst(listener.getsockname()[1], tls_ca, payload),
                received,
            )
    finally:
        server.close()
        await server.wait_closed()
    assert hashlib.sha256(received.result()).digest() == hashlib.sha256(payload).digest()
    [engine] = watched
    incoming, _ = peaks(engine)
    assert 0 < incoming <= INCOMING_BOUND, incoming


@pytest.mark.asyncio
async def test_client_handshake_finished_with_a_burst(
    listener: socket.socket, server_cert: Any, tls_ca: Any, watched: list[TLSEngine]
) -> None:
    # TLS 1.2: the server's Finished comes last, and it may send data behind
    # it at once; the client's handshake ends with that read.
    payload = os.urandom(1 << 20)
    loop = asyncio.get_running_loop()

    async def peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        tls = RawTLS(conn, server_ctx(server_cert, TLS12), server_side=True)
        await tls.handshake(send_last=False)
        finished = tls.outgoing.read()
        pieces = [payload[i : i + MAX_FRAGMENT] for i in range(0, len(payload), MAX_FRAGMENT)]
        await tls.send(finished + tls.seal(*pieces))
        await tls.send(tls.close_notify())
        await tls.linger()

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.setblocking(False)
    async with asyncio.timeout(10):
        task = asyncio.create_task(peer())
        await loop.sock_connect(sock, listener.getsockname())
        reader, writer = await slabnet.open_connection(
            sock=sock, ssl=client_ctx(tls_ca, TLS12), server_hostname="localhost"
        )
        got = await reader.read()
        writer.close()
        await writer.wait_closed()
        await task
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    [engine] = watched
    incoming, _ = peaks(engine)
    assert 0 < incoming <= INCOMING_BOUND, incoming


# ---------------------------------------------------------------- item 12


def _many_buffers() -> list[Any]:
    """8 MiB as many buffers: small ones, pieces of a record, odd sizes, a
    large bytearray and a memoryview of 4-byte items."""
    bufs: list[Any] = []
    for i in range(1500):
        bufs.append(os.urandom(100 + i % 4000))
    for _ in range(100):
        bufs.append(memoryview(os.urandom(MAX_FRAGMENT + 17)))
    bufs.append(bytearray(os.urandom(2 << 20)))
    bufs.append(memoryview(array.array("I", os.urandom(1 << 20))))
    total = sum(memoryview(b).nbytes for b in bufs)
    bufs.append(os.urandom((8 << 20) - total))
    return bufs


@VERSIONS
@pytest.mark.parametrize("how", ["write", "write_many"])
def test_large_writes_keep_the_outgoing_bio_small(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, how: str
) -> None:
    c, s = make_pair(*engine_contexts(server_cert, tls_ca, version))
    _, out = watch(s)
    # Warm up (OpenSSL's own buffers), then measure what one 8 MiB write,
    # or a writelines of 8 MiB in many buffers, leaves allocated.
    s.write(b"warm-up")
    assert read_all(c, s.data_to_send()) == b"warm-up"
    out.peak = 0
    if how == "write":
        bufs: list[Any] = [os.urandom(8 << 20)]
    else:
        bufs = _many_buffers()
    expected = hashlib.sha256(b"".join(bytes(memoryview(b).cast("B")) for b in bufs)).digest()
    before = heap_in_use() if heap_in_use is not None else 0
    if how == "write":
        s.write(bufs[0])
    else:
        s.write_many(bufs)
    wire = s.data_to_send()
    # What the write left allocated, besides the ciphertext we now hold.
    retained = (heap_in_use() - before - len(wire)) if heap_in_use is not None else 0
    del bufs
    assert hashlib.sha256(read_all(c, wire)).digest() == expected
    del wire
    assert 0 < out.peak <= OUTGOING_BOUND, out.peak
    assert retained < RETAINED_BOUND, retained // 1024


@VERSIONS
def test_data_to_send_many_hands_out_pieces_in_order(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    c, s = make_pair(*engine_contexts(server_cert, tls_ca, version))
    assert s.data_to_send_many() == []
    payload = os.urandom(3 << 20)
    s.write(b"first")
    s.write(payload)
    s.write(b"last")
    pieces = s.data_to_send_many()
    assert len(pieces) > 3 and all(pieces)
    assert all(len(p) <= OUTGOING_BOUND for p in pieces)
    assert s.data_to_send_many() == [] and s.data_to_send() == b""
    assert read_all(c, b"".join(pieces)) == b"first" + payload + b"last"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["write", "writelines"])
async def test_stream_large_writes_keep_the_outgoing_bio_small(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
    watched: list[TLSEngine], how: str,
) -> None:
    if how == "write":
        bufs: list[Any] = [os.urandom(8 << 20)]
    else:
        bufs = _many_buffers()
    data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    digests: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        digests.set_result(hashlib.sha256(await reader.readexactly(len(data))).digest())
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=tls_server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(20):
            reader, writer = await slabnet.open_connection(
                "127.0.0.1", port, ssl=tls_client_context, server_hostname="localhost"
            )
            if how == "write":
                writer.write(bufs[0])
            else:
                writer.writelines(bufs)
            await writer.drain()
            assert await reader.read() == b"ok"
            writer.close()
            await writer.wait_closed()
            assert await digests == hashlib.sha256(data).digest()
    finally:
        server.close()
        await server.wait_closed()
    assert len(watched) == 2
    for engine in watched:
        _, outgoing = peaks(engine)
        assert 0 < outgoing <= OUTGOING_BOUND, outgoing


# ---------------------------------------------------------------- item 16


BAD_HEADERS = {
    "type": (b"\x63\x03\x03\x00\x20", "unknown content type 99"),
    "version": (b"\x17\x09\x09\x00\x20", "major byte 9"),
    "length": (b"\x17\x03\x03\x7f\xff", "above the limit"),
}


def _good_then_bad(s: TLSEngine, header: bytes) -> tuple[bytes, bytes, bytes]:
    """(plaintext, its ciphertext, ciphertext + invalid header + junk)."""
    plain = b"".join(bytes([48 + i % 10]) * 1500 for i in range(30))
    for i in range(0, len(plain), 1500):
        s.write(plain[i : i + 1500])
    good = s.data_to_send()
    return plain, good, good + header + bytes(64)


@VERSIONS
@pytest.mark.parametrize("kind", sorted(BAD_HEADERS))
@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, "bytewise"])
@pytest.mark.parametrize("feed", ["lend_data", "receive_data"])
@pytest.mark.parametrize("drain", ["each", "end"])
def test_invalid_header_split_across_reads(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, kind: str, cut: Any,
    feed: str, drain: str,
) -> None:
    # Whole (cut 0) or split after 1..4 of its 5 bytes, or one byte a read;
    # the records are read after each read, or only after the last (an app
    # that paused): every byte in front of the header is delivered, then
    # TLSRecordError.
    c, s = make_pair(*engine_contexts(server_cert, tls_ca, version))
    header, words = BAD_HEADERS[kind]
    plain, good, wire = _good_then_bad(s, header)
    if cut == "bytewise":
        reads = [good] + [wire[i : i + 1] for i in range(len(good), len(good) + 5)]
        reads.append(wire[len(good) + 5 :])
    else:
        split = len(good) + cut
        reads = [wire[:split], wire[split:]]
    offset = c._scanner.fed + len(good)  # the bad header's stream offset
    got = []
    error: TLSRecordError | None = None
    for data in reads:
        if feed == "lend_data":
            c.lend_data(memoryview(bytearray(data)))
        else:
            c.receive_data(data)
        if drain == "end" and data is not reads[-1]:
            c.release_lent()
            continue
        try:
            while (chunk := c.read_chunk()) is not None:
                assert chunk
                got.append(bytes(chunk))
        except TLSRecordError as exc:
            error = exc
            break
        finally:
            c.release_lent()
        # The engine's count of what it holds never goes negative.
        assert c.buffered_ciphertext >= 0
    assert b"".join(got) == plain
    assert error is not None
    assert f"offset {offset}:" in str(error) and words in str(error)
    assert c.state is TLSState.BROKEN
    with pytest.raises(TLSRecordError):
        c.read_chunk()
    assert 0 <= c.buffered_ciphertext <= 4


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", [1, 2, 3, 4])
async def test_stream_invalid_header_split_across_reads(
    listener: socket.socket, server_cert: Any, tls_ca: Any, cut: int
) -> None:
    loop = asyncio.get_running_loop()
    plain = os.urandom(40_000)
    header = b"\x63\x03\x03\x00\x20"
    sent_first: asyncio.Future[None] = loop.create_future()
    go_on: asyncio.Future[None] = loop.create_future()

    async def peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, TLS13), server_side=True)
        await tls.handshake()
        first = tls.seal(plain[:20_000], plain[20_000:]) + header[:cut]
        await tls.send(first)
        sent_first.set_result(None)
        await go_on
        await tls.send(header[cut:] + bytes(32))
        await tls.linger()

    async with asyncio.timeout(10):
        task = asyncio.create_task(peer())
        reader, writer = await slabnet.open_connection(
            "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca, TLS13),
            server_hostname="localhost",
        )
        assert await reader.readexactly(len(plain)) == plain
        # Wait until the engine has taken in the start of the header, so
        # that its end comes with another read.
        engine = writer.transport._engine  # type: ignore[attr-defined]
        await sent_first
        while len(engine._scanner._partial) < cut:
            await asyncio.sleep(0.005)
        assert len(engine._scanner._partial) == cut
        go_on.set_result(None)
        with pytest.raises(TLSRecordError, match="unknown content type 99"):
            await reader.read()
        writer.close()
        await task


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", [1, 2, 3, 4])
async def test_stream_invalid_header_split_during_handshake(
    listener: socket.socket, server_cert: Any, tls_ca: Any, cut: int,
    watched: list[TLSEngine],
) -> None:
    # The server's ServerHello (a good record), then an invalid header in
    # two reads: OpenSSL must never see it, the client gets TLSRecordError.
    loop = asyncio.get_running_loop()
    header = b"\x17\x09\x09\x00\x20"
    go_on: asyncio.Future[None] = loop.create_future()

    async def peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        tls = RawTLS(conn, server_ctx(server_cert, TLS13), server_side=True)
        await tls._pull()
        with pytest.raises(ssl.SSLWantReadError):
            tls.obj.do_handshake()
        flight = tls.outgoing.read()
        ctype, off, size = records(flight)[0]
        assert ctype == 22  # ServerHello
        await tls.send(flight[off : off + size] + header[:cut])
        await go_on
        await tls.send(header[cut:] + bytes(32))
        await tls.linger()

    async with asyncio.timeout(10):
        task = asyncio.create_task(peer())
        connect = asyncio.create_task(slabnet.open_connection(
            "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca, TLS13),
            server_hostname="localhost",
        ))
        while not watched or len(watched[0]._scanner._partial) < cut:
            await asyncio.sleep(0.005)
        assert len(watched[0]._scanner._partial) == cut
        go_on.set_result(None)
        with pytest.raises(TLSRecordError, match="major byte 9"):
            await connect
        await task


# ---------------------------------------------------------------- item 17


@pytest.mark.asyncio
async def test_handshake_timeout_message_is_asyncios(
    listener: socket.socket, tls_ca: Any
) -> None:
    loop = asyncio.get_running_loop()
    accepted: list[socket.socket] = []

    async def silent() -> None:
        conn, _ = await loop.sock_accept(listener)
        accepted.append(conn)  # never answers the ClientHello

    task = asyncio.create_task(silent())
    try:
        async with asyncio.timeout(5):
            with pytest.raises(slabnet.HandshakeTimeoutError) as info:
                await slabnet.open_connection(
                    "127.0.0.1", listener.getsockname()[1], ssl=client_ctx(tls_ca),
                    server_hostname="localhost", ssl_handshake_timeout=0.2,
                )
            await task
    finally:
        for conn in accepted:
            conn.close()
    # What asyncio's sslproto says, word for word, and the same types.
    assert str(info.value) == (
        "SSL handshake is taking longer than 0.2 seconds: aborting the connection"
    )
    assert isinstance(info.value, ConnectionAbortedError)
    assert isinstance(info.value, TimeoutError)


# ------------------------------------------------ answers nobody reads


def test_renegotiation_refusals_keep_the_outgoing_bio_small(
    server_cert: Any, tls_ca: Any, tmp_path: Any
) -> None:
    # OpenSSL 3 servers refuse a client's TLS 1.2 renegotiation with a
    # 31-byte no_renegotiation alert per ClientHello header, and a record
    # may pack 4096 of those 4-byte headers: 7.75 bytes of answers per byte
    # read. The engine took them out of the outgoing BIO only after the
    # whole read (its write side does so every 64 KiB), so one 240 KiB read
    # grew the BIO to 1.8 MiB, which a MemoryBIO keeps for the life of the
    # connection. Now they are taken out between the reads of a batch.
    keylog = str(tmp_path / "keylog")
    c = TLSEngine(forgeable(client_ctx(tls_ca), keylog), server_hostname="localhost")
    s = TLSEngine(server_ctx(server_cert, TLS12), server_side=True)
    flight = b""
    while not (c.do_handshake() and s.state is TLSState.OPEN):
        s.receive_data(c.data_to_send())
        s.do_handshake()
        out = s.data_to_send()
        flight = flight or out
        c.receive_data(out)
    _, outgoing = watch(s)
    forged = ForgedTLS12(keylog, flight)
    per_record = MAX_FRAGMENT // 4
    n_records = 15  # 240 KiB: one read of the loop's lending buffer
    wire = b"".join(forged.seal(22, b"\x01\0\0\0" * per_record) for _ in range(n_records))
    wire += forged.seal(23, b"data after them")
    s.lend_data(memoryview(wire))
    got = []
    while (chunk := s.read_chunk()) is not None:
        got.append(bytes(chunk))
    s.release_lent()
    answers = b"".join(s.data_to_send_many())
    assert got == [b"data after them"]
    refusals = records(answers)
    assert len(refusals) == n_records * per_record  # one alert for each
    assert {ctype for ctype, _, _ in refusals} == {21}
    # At most _DRAIN_AT plus the answers to one SSL_read: every complete
    # record in the BIO, which holds less than LEND_PIECE plus _LEND_LOW.
    bound = _DRAIN_AT + (LEND_PIECE + _LEND_LOW) * 31 // 4
    assert outgoing.peak <= bound, (outgoing.peak, bound, len(answers))


@pytest.mark.asyncio
async def test_key_update_requests_nobody_reads_stop_the_reads(
    small_listener: socket.socket, tls_ca: Any, tls_server_context: ssl.SSLContext,
) -> None:
    # A TLS 1.3 peer may ask for a KeyUpdate in every record, and each
    # request gets one of ours (RFC 8446 4.6.3). A peer that asked without
    # ever reading made our answers queue without bound, 27 bytes per
    # request at its sending rate, while the app wrote nothing (asyncio's
    # and uvloop's SSL transports do the same). Once ANSWERS_MAX bytes of
    # answers wait behind a paused queue, reading stops until the peer
    # takes some; then it goes on, and every byte the peer sent arrives.
    from slabnet._tls_transport import ANSWERS_MAX


    loop = asyncio.get_running_loop()
    served: asyncio.Future[slabnet.StreamWriter] = loop.create_future()
    received: asyncio.Future[int] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        served.set_result(writer)
        n = 0
        while chunk := await reader.read_chunk():
            n += len(chunk)
        received.set_result(n)
        writer.close()

    server = await slabnet.start_server(handle, sock=small_listener, ssl=tls_server_context)
    sock = socket.socket()
    shrink(sock)
    await loop.sock_connect(sock, small_listener.getsockname())
    peer = RawTLS(sock, client_ctx(tls_ca, TLS13), server_side=False, server_hostname="localhost")
    try:
        async with asyncio.timeout(WAKE):
            await peer.handshake()
            transport = (await served).transport
        sent = 0
        for _ in range(3000):  # far more answers than any socket buffers take
            wire = b""
            for _ in range(10):
                peer.request_key_update()
                wire += peer.seal(b"k")
                sent += 1
            async with asyncio.timeout(WAKE):
                await peer.send(wire)
                await asyncio.sleep(0)
            if not transport.is_reading():
                break
        queued = transport.get_write_buffer_size()
        assert not transport.is_reading(), f"still reading, {queued} bytes queued"
        low, high = transport.get_write_buffer_limits()
        assert queued <= low + ANSWERS_MAX + 64 * 1024, queued
        # The peer reads (and drops) our answers: the reads go on.
        async with asyncio.timeout(WAKE):
            while not transport.is_reading():
                await loop.sock_recv(sock, 65536)
            await peer.send(peer.close_notify())
            drained = asyncio.create_task(peer.linger())
            assert await received == sent
            await drained
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


# ------------------------------------------------- plaintext where TLS belongs


@pytest.mark.asyncio
async def test_a_plain_server_answering_the_hello_fails_as_openssl_says(tls_ca: Any) -> None:
    # A client dials an HTTP port with TLS, and the server answers the
    # ClientHello with an HTTP error. asyncio raises OpenSSL's
    # "[SSL: WRONG_VERSION_NUMBER]" (code falls back to plaintext on that
    # reason); slabnet's scanner refuses the header before OpenSSL sees it,
    # and its TLSRecordError had no reason, library or errno: e.reason was
    # an AttributeError inside the except block.
    loop = asyncio.get_running_loop()
    outcomes = []
    for lib in (asyncio, slabnet):
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen()
            ls.setblocking(False)

            async def http_server() -> None:
                conn, _ = await loop.sock_accept(ls)
                with conn:
                    assert await loop.sock_recv(conn, 65536)  # the ClientHello
                    await loop.sock_sendall(conn, b"HTTP/1.1 400 Bad Request\r\n\r\n")
                    await loop.sock_recv(conn, 65536)  # until the client goes

            async with asyncio.timeout(WAKE):
                server = asyncio.create_task(http_server())
                with pytest.raises(ssl.SSLError) as info:
                    await lib.open_connection(
                        "127.0.0.1", ls.getsockname()[1], ssl=client_ctx(tls_ca),
                        server_hostname="localhost",
                    )
                await server
        outcomes.append(openssl_like(info.value))
    assert outcomes[1] == outcomes[0] == ("WRONG_VERSION_NUMBER", "SSL", ssl.SSL_ERROR_SSL, True)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "request_line, reason",
    [(b"GET / HTTP/1.1\r\n", "HTTP_REQUEST"), (b"CONNECT a:443 HTTP/1.1\r\n", "HTTPS_PROXY_REQUEST")],
    ids=["GET", "CONNECT"],
)
async def test_an_http_request_where_starttls_belongs_fails_as_openssl_says(
    server_cert: Any, request_line: bytes, reason: str
) -> None:
    # A server upgrades with STARTTLS and the client sends an HTTP request
    # instead of its ClientHello: OpenSSL's reason names it.
    loop = asyncio.get_running_loop()
    outcomes = []
    for lib in (asyncio, slabnet):
        failed: asyncio.Future[BaseException] = loop.create_future()

        async def handle(reader: Any, writer: Any) -> None:
            assert await reader.readline() == b"STARTTLS\n"
            writer.write(b"GO\n")
            await writer.drain()
            try:
                await writer.start_tls(server_ctx(server_cert))
            except Exception as exc:
                failed.set_result(exc)
            writer.close()

        server = await lib.start_server(handle, "127.0.0.1", 0)
        try:
            async with asyncio.timeout(WAKE):
                with socket.socket() as sock:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, server.sockets[0].getsockname())
                    await loop.sock_sendall(sock, b"STARTTLS\n")
                    assert await recv_exactly(sock, 3, WAKE) == b"GO\n"
                    await loop.sock_sendall(sock, request_line + b"Host: a\r\n\r\n")
                    exc = await failed
        finally:
            server.close()
            await asyncio.wait_for(server.wait_closed(), WAKE)
        outcomes.append(openssl_like(exc))
    assert outcomes[1] == outcomes[0] == (reason, "SSL", ssl.SSL_ERROR_SSL, True)
