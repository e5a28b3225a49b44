"""Many busy connections: ``n`` concurrent server-to-client transfers read
by one client process, plain TCP (``record=0``) or TLS 1.3 with ``record``-byte
records.

What a server-side proxy or a fan-in client does: the read path's per-read
costs (reservations, slab turnover, loop iterations) multiplied over many
sockets that are all ready at once, instead of one socket that a single
large read drains.

The server is one process, the same for every client implementation: it
accepts the ``n`` connections (TLS: handshakes done, then the whole transfer
of every connection encrypted up front, one ``SSLObject.write`` per record),
and only then sends to all of them at once from a non-blocking ``selectors``
loop (256 KiB ``send`` calls), so that it is never the bottleneck and no
client sees data before every connection is open.  ``size`` (plain) or
``tls_size`` (TLS) is the total over all connections; each gets ``1/n`` of it.

Bytes are verified, not just counted.  Connection *c* carries the byte
``PATTERN[(offset + shift_c) % PERIOD]`` at stream offset ``offset``, where
``PATTERN`` is a fixed pseudo-random block of a prime ``PERIOD`` of bytes and
``shift_c`` derives from the client's port (both sides see it), so streams
of different connections differ.  The client checks the exact byte count,
the byte at every ``STRIDE``-th stream offset whatever piece it falls in,
and the first byte of every piece that holds such a checkpoint
(``_check``).  A dropped or repeated piece shifts the rest of the stream,
which every later checkpoint sees; bytes from another connection or from an
earlier part of the stream (a stale view into a slab that was written again)
fail the first checkpoint they hold; a wrong byte passes one test with
probability 1/256.  A piece smaller than ``STRIDE`` holds a checkpoint with
probability ``len(piece) / STRIDE``, so a lone stale 1 KiB piece is caught one
time in sixteen, and a recurring one surely.  The cost is one comparison
per piece plus a call per checkpoint: about 0.03 CPU s/GiB with 64 KiB
pieces and 0.07 with 1 KiB pieces on the machine of the README, small
against what any client here spends.

The clock starts when the first piece arrives on any connection and stops
when the last connection has all its bytes; the bytes of that first piece are
not counted (see ``common``).
"""

from __future__ import annotations

import asyncio
import random
import selectors
import socket
from collections.abc import Callable
from typing import Any

from ..common import (
    SERVER_HOSTNAME,
    BlockingTLS,
    GiB,
    KiB,
    MiB,
    Meter,
    accept_handshaken,
    client_ssl_context,
    close_quietly,
    close_writer,
    drain_until_closed,
    import_slabnet,
    open_streams,
    server_ssl_context,
)
from ..core import (
    CPU_PER_GIB,
    MIBPS,
    PEAK_RSS,
    PROTO,
    SLABNET_CHUNKS,
    SLABNET_HELD,
    SLABNET_PROTO,
    SLABNET_READ,
    STREAMS,
    ClientContext,
    Files,
    Metric,
    Params,
    Scenario,
)

#: Period of the byte pattern: the largest prime below 64 KiB, so that no
#: read or record size (powers of two) lines up with it.
PERIOD = 65521
#: Distance between checked stream offsets: a prime, so the checkpoints
#: fall at every position within records and reads; near 16 KiB, so that
#: even 1 KiB pieces (a ``_check`` call every 16th) cost little.
STRIDE = 16381
#: The pattern (fixed seed: server and client processes build the same one).
PATTERN = random.Random(14).randbytes(PERIOD)
#: Bytes per server ``send`` call, as the other scenarios' servers.
SEND = 256 * KiB
#: The pattern repeated far enough that any piece of up to ``SEND`` bytes,
#: starting anywhere in the period, is one slice of it.
SOURCE = memoryview((PATTERN * (SEND // PERIOD + 2))[: PERIOD + SEND])


class BadData(RuntimeError):
    """The client received bytes the server did not send."""


def shift_of(port: int) -> int:
    """Where connection ``port``'s stream starts in the pattern."""
    return (port * 7919) % PERIOD


def per_connection(params: Params) -> int:
    total = int(params["tls_size"] if int(params["record"]) else params["size"])
    return max(total // int(params["n"]), 1)


# ----------------------------------------------------------------- server ----

class _Sender:
    """One connection of the server: its data (plaintext taken from
    ``SOURCE`` on the fly, or its ciphertext made up front) and how far it is
    sent."""

    __slots__ = ("conn", "shift", "tls", "ciphertext", "size", "sent")

    def __init__(self, conn: socket.socket, shift: int, tls: BlockingTLS | None, size: int) -> None:
        self.conn = conn
        self.shift = shift
        self.tls = tls
        self.ciphertext: memoryview | None = None
        self.size = size
        self.sent = 0

    def encrypt(self, plaintext: int, record: int) -> None:
        assert self.tls is not None
        obj, outgoing = self.tls.obj, self.tls.outgoing
        out = bytearray()
        for off in range(0, plaintext, record):
            start = (off + self.shift) % PERIOD
            obj.write(SOURCE[start:start + min(record, plaintext - off)])
            if outgoing.pending >= 4 * MiB:
                out += outgoing.read()
        out += outgoing.read()
        self.ciphertext = memoryview(out)
        self.size = len(out)

    def piece(self) -> memoryview:
        n = min(SEND, self.size - self.sent)
        if self.ciphertext is not None:
            return self.ciphertext[self.sent:self.sent + n]
        start = (self.sent + self.shift) % PERIOD
        return SOURCE[start:start + n]

    def finish(self) -> None:
        """Wait for the client's close (answer a TLS close_notify), close."""
        self.conn.setblocking(True)
        self.conn.settimeout(10)
        if self.tls is not None:
            self.tls.wait_close()
        else:
            drain_until_closed(self.conn)
        close_quietly(self.conn)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    n, record = int(params["n"]), int(params["record"])
    size = per_connection(params)
    ctx = server_ssl_context(files) if record else None
    senders = [
        _Sender(conn, shift_of(conn.getpeername()[1]), tls, size)
        for conn, tls in accept_handshaken(listener, n, ctx)
    ]
    if record:
        for s in senders:
            s.encrypt(size, record)
    sel = selectors.DefaultSelector()
    for s in senders:
        s.conn.setblocking(False)
        sel.register(s.conn, selectors.EVENT_WRITE, s)
    left = n
    while left:
        for key, _ in sel.select():
            s = key.data
            if s.sent < s.size:
                try:
                    s.sent += s.conn.send(s.piece())
                except BlockingIOError:
                    continue
                except OSError:  # the client is gone: its run fails on its side
                    s.sent = s.size
                if s.sent >= s.size:
                    sel.modify(s.conn, selectors.EVENT_READ, s)
            else:
                # Every connection is closed by the client once it has all of
                # its bytes; one that is readable now has its close waiting.
                sel.unregister(s.conn)
                s.finish()
                left -= 1
    sel.close()


# ----------------------------------------------------------------- client ----

def _check(piece: Any, pos: int, nxt: int, shift: int) -> int:
    """Check the checkpoints from ``nxt`` that fall in ``piece`` (at stream
    offset ``pos``), and its first byte; return the next checkpoint after it.

    Readers call it only for a piece a checkpoint falls in, so a piece
    without one costs a single comparison whatever the API.
    """
    if piece[0] != PATTERN[(pos + shift) % PERIOD]:
        raise BadData(f"wrong first byte of a piece of {len(piece)} at stream offset {pos}")
    end = pos + len(piece)
    while nxt < end:
        if piece[nxt - pos] != PATTERN[(nxt + shift) % PERIOD]:
            raise BadData(f"wrong byte at stream offset {nxt} (piece of {len(piece)} at {pos})")
        nxt += STRIDE
    return nxt


class _Run:
    """The client's one meter over all connections."""

    def __init__(self, n: int) -> None:
        self.meter = Meter()
        self.uncounted = -1  # bytes of the piece that started the meter
        self.left = n
        self.pieces = 0  # pieces the application got, over all connections

    def first_piece(self, n: int) -> None:
        if self.uncounted < 0:
            self.meter.start()
            self.uncounted = n

    def connection_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.meter.stop()


def _finished(pos: int, want: int) -> None:
    if pos < want:
        raise ConnectionError(f"EOF after {pos} of {want} bytes")
    if pos > want:
        raise BadData(f"{pos} bytes received, {want} sent")


async def _read_chunks(reader: Any, want: int, shift: int, run: _Run) -> None:
    pos = nxt = pieces = 0
    async for chunk in reader.chunks():
        pieces += 1
        end = pos + len(chunk)
        if end > nxt:
            nxt = _check(chunk, pos, nxt, shift)
        if not pos:
            run.first_piece(end)
        pos = end
        if pos >= want:
            break
    run.pieces += pieces
    _finished(pos, want)
    run.connection_done()


async def _read_n(reader: Any, want: int, shift: int, run: _Run, readsize: int) -> None:
    pos = nxt = pieces = 0
    read = reader.read
    while pos < want:
        data = await read(readsize)
        if not data:
            break
        pieces += 1
        end = pos + len(data)
        if end > nxt:
            nxt = _check(data, pos, nxt, shift)
        if not pos:
            run.first_piece(end)
        pos = end
    run.pieces += pieces
    _finished(pos, want)
    run.connection_done()


class _CheckingProtocol(asyncio.Protocol):
    """asyncio's raw ``Protocol``: ``data_received`` checks and counts,
    nothing else (the floor for any stream API on the loop)."""

    def __init__(self, want: int, run: _Run) -> None:
        self.want = want
        self.run = run
        self.pos = self.nxt = self.shift = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        # (uvloop's transports don't subclass asyncio.Transport.)
        self.transport = transport
        self.shift = shift_of(transport.get_extra_info("sockname")[1])

    def data_received(self, data: bytes) -> None:
        self.run.pieces += 1
        pos = self.pos
        end = pos + len(data)
        try:
            if end > self.nxt:
                self.nxt = _check(data, pos, self.nxt, self.shift)
            if not pos:
                self.run.first_piece(end)
            self.pos = end
            if end >= self.want:
                _finished(end, self.want)
                if not self.done.done():
                    self.run.connection_done()
                    self.done.set_result(None)
        except Exception as exc:
            self._fail(exc)
            self.transport.abort()

    def eof_received(self) -> bool | None:
        self._fail(ConnectionError(f"EOF after {self.pos} of {self.want} bytes"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError(f"closed after {self.pos} of {self.want} bytes"))

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class _CheckingChunkApp:
    """The app of ``slabnet.SlabProtocol`` (``slabnet-proto``): the same
    checks on each chunk, in the loop callback that read it.

    ``hold`` (``slabnet-held``): also keep each chunk until a callback of
    the next loop iteration drops it, which is as long as a stream's
    consumer task has it at the earliest -- the task runs an iteration after
    the read, when the loop has made every other ready connection's read --
    and pause reading meanwhile, as a stream whose buffer holds a 256 KiB
    chunk does (above twice its 64 KiB limit). So the read path is the same
    as ``slabnet-proto``'s and only the chunks' lifetime differs: what that
    lifetime alone costs.
    """

    def __init__(self, proto: _CheckingProtocol, hold: bool) -> None:
        self._proto = proto
        self._held: list[memoryview] | None = [] if hold else None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: Any) -> None:
        self._proto.connection_made(transport)

    def chunk_received(self, chunk: memoryview) -> None:
        held = self._held
        if held is not None:
            if not held:
                self._proto.transport.pause_reading()
                self._loop.call_soon(self._release)
            held.append(chunk)
        self._proto.data_received(chunk)  # type: ignore[arg-type]

    def _release(self) -> None:
        assert self._held is not None
        self._held.clear()
        transport = self._proto.transport
        if not transport.is_closing():
            transport.resume_reading()

    def eof_received(self) -> bool | None:
        return self._proto.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._proto.connection_lost(exc)


def _factory(proto: _CheckingProtocol, api: str, tls_kwargs: dict[str, Any]) -> Callable[[], Any]:
    if api == "proto":
        return lambda: proto
    slabnet = import_slabnet()
    hold = api == "slabnet-held"
    return lambda: slabnet.SlabProtocol(_CheckingChunkApp(proto, hold), **tls_kwargs)


async def client(ctx: ClientContext) -> dict[str, Any]:
    p = ctx.params
    n, tls = int(p["n"]), bool(int(p["record"]))
    want = per_connection(p)
    api = ctx.impl.api
    run = _Run(n)
    if api in ("proto", "slabnet-proto", "slabnet-held"):
        loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {}
        if tls:
            kwargs = {"ssl": client_ssl_context(ctx.files), "server_hostname": SERVER_HOSTNAME}
        # asyncio's SSL for the raw Protocol; slabnet's TLS inside SlabProtocol.
        loop_kwargs, tls_kwargs = (kwargs, {}) if api == "proto" else ({}, kwargs)
        protos = [_CheckingProtocol(want, run) for _ in range(n)]
        opened = await asyncio.gather(*(
            loop.create_connection(_factory(proto, api, tls_kwargs), ctx.host, ctx.port, **loop_kwargs)
            for proto in protos))
        try:
            await asyncio.gather(*(proto.done for proto in protos))
        finally:
            for transport, _ in opened:
                transport.close()
    else:
        conns = await asyncio.gather(*(open_streams(ctx, tls) for _ in range(n)))
        try:
            readsize = int(p["readsize"])
            await asyncio.gather(*(
                _read_chunks(reader, want, shift_of(writer.get_extra_info("sockname")[1]), run)
                if api == "slabnet-chunks" else
                _read_n(reader, want, shift_of(writer.get_extra_info("sockname")[1]), run, readsize)
                for reader, writer in conns))
        finally:
            await asyncio.gather(*(close_writer(writer) for _, writer in conns))
    result: dict[str, Any] = run.meter.result(want * n - run.uncounted)
    result["pieces"] = run.pieces
    if ctx.impl.is_slabnet:
        stats = import_slabnet().memory_stats()
        result["slabs_allocated"] = stats.slabs_allocated
        result["reads"] = stats.reads
    return result


SCENARIO = Scenario(
    name="busy",
    title="Many busy connections, server to client, one client process",
    doc=__doc__ or "",
    params={
        "n": [1, 64, 256],
        "record": [0, 16 * KiB, 1 * KiB],
        # A few seconds per run on the 2-core machine of the README.
        "size": [1 * GiB],
        "tls_size": [256 * MiB],
        "readsize": [64 * KiB],
    },
    quick={"n": [8], "size": [16 * MiB], "tls_size": [4 * MiB]},
    impls=SLABNET_CHUNKS + SLABNET_READ + STREAMS + PROTO + SLABNET_PROTO + SLABNET_HELD,
    client=client,
    server=serve,
    metrics=(
        MIBPS, CPU_PER_GIB, PEAK_RSS,
        Metric("pieces", "pieces", "lower", "{:.0f}"),
        Metric("slabs_allocated", "slabs allocated", "lower", "{:.0f}"),
        Metric("reads", "slabnet reads", "lower", "{:.0f}"),
    ),
    plot_x="n",
)
