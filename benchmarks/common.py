"""Helpers shared by the scenarios' servers and clients (worker side).

Servers are plain blocking socket code, one connection at a time, so that
every implementation of a configuration faces the same, fast peer and the
measurement is of the client alone.  Clients are coroutines run on the loop
their implementation names.

Measurement rule for transfers (``Meter``): a server-to-client client starts
its clock when the first piece of data has been consumed and counts only the
bytes after it.  That keeps connection set-up, the TLS handshake and the
server's pre-encryption out of the window, and is the same rule for every
implementation.  A client-to-server client starts before its first write and
stops when the server has acknowledged the last byte.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from .core import ClientContext, Files, Params

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------- slabnet ----

class SlabnetUnavailable(RuntimeError):
    """slabnet (or its streams API) is not importable yet."""


def import_slabnet() -> Any:
    """Import slabnet, or raise SlabnetUnavailable if its API has not landed.

    Only a missing package or a missing ``open_connection`` counts as
    "unavailable"; anything else that breaks later is a crash.
    """
    try:
        import slabnet
    except ImportError as exc:
        raise SlabnetUnavailable(f"import slabnet failed: {exc}") from exc
    if not hasattr(slabnet, "open_connection"):
        raise SlabnetUnavailable("slabnet has no open_connection yet")
    return slabnet


# ------------------------------------------------------------ measurement ----

def peak_rss_mib() -> float:
    """Peak resident memory of this process image.

    Not ``getrusage().ru_maxrss``: Linux carries that over exec() from the
    forked parent, so every worker would report the driver's peak.
    ``VmHWM`` belongs to the current address space.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return float("nan")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """Wall clock and process CPU time (user + system, all threads) around
    a transfer."""

    __slots__ = ("_wall0", "_cpu0", "wall", "cpu")

    def __init__(self) -> None:
        self._wall0 = self._cpu0 = 0.0
        self.wall = self.cpu = 0.0

    def start(self) -> None:
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    def stop(self) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.cpu = time.process_time() - self._cpu0

    def result(self, nbytes: int) -> dict[str, float]:
        wall = max(self.wall, 1e-9)
        return {
            "mibps": nbytes / MiB / wall,
            "cpu_s_per_gib": self.cpu / (nbytes / GiB) if nbytes else float("nan"),
            "seconds": self.wall,
            "cpu_seconds": self.cpu,
            "bytes": nbytes,
        }


# -------------------------------------------------------------------- TLS ----

SERVER_HOSTNAME = "localhost"


def client_ssl_context(files: Files) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=files.ca_pem)


def server_ssl_context(files: Files) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(files.server_pem)
    return ctx


def payload(n: int) -> bytes:
    """n bytes of a repeating, non-zero pattern."""
    pattern = bytes(range(1, 256))
    return (pattern * (n // len(pattern) + 1))[:n]


class BlockingTLS:
    """An ``SSLObject`` over a blocking socket through MemoryBIOs: server
    side (so the server can encrypt records without sending them), or client
    side with a `server_hostname`."""

    def __init__(
        self, conn: socket.socket, ctx: ssl.SSLContext, server_hostname: str | None = None
    ) -> None:
        self.conn = conn
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self.incoming, self.outgoing,
            server_side=server_hostname is None, server_hostname=server_hostname,
        )

    def handshake(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
                data = self.conn.recv(64 * KiB)
                if not data:
                    raise ConnectionError("peer closed during the TLS handshake") from None
                self.incoming.write(data)
        self.flush()

    def flush(self) -> None:
        pending = self.outgoing.read()
        if pending:
            self.conn.sendall(pending)

    def encrypt(self, size: int, record: int) -> bytes:
        """Ciphertext of ``size`` plaintext bytes in records of ``record``
        bytes (one ``SSLObject.write`` per record; record <= 16 KiB)."""
        return encrypt_records(self.obj, self.outgoing, size, record)

    def wait_close(self) -> None:
        """Read until the client's close_notify (answer it) or TCP EOF."""
        try:
            while data := self.conn.recv(64 * KiB):
                self.incoming.write(data)
                try:
                    while self.obj.read(64 * KiB):
                        pass
                except ssl.SSLWantReadError:
                    continue
                except ssl.SSLZeroReturnError:
                    pass
                # An empty read (or SSLZeroReturnError) is the close_notify.
                try:
                    self.obj.unwrap()
                except ssl.SSLError:
                    pass
                self.flush()
                return
        except (OSError, ssl.SSLError):
            pass


def encrypt_records(obj: ssl.SSLObject, outgoing: ssl.MemoryBIO, size: int, record: int) -> bytes:
    piece = memoryview(payload(record))
    parts: list[bytes] = []
    remaining = size
    while remaining > 0:
        n = min(record, remaining)
        obj.write(piece[:n])
        remaining -= n
        if outgoing.pending >= 4 * MiB:
            parts.append(outgoing.read())
    parts.append(outgoing.read())
    return b"".join(parts)


def memory_tls_pair(files: Files) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.SSLObject, ssl.MemoryBIO]:
    """A client and a server SSLObject joined in memory, handshake done.

    Returns (client, client_incoming, server, server_outgoing).
    """
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ssl_context(files).wrap_bio(c_in, c_out, server_hostname=SERVER_HOSTNAME)
    server = server_ssl_context(files).wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for key, obj in (("c", client), ("s", server)):
            if not done[key]:
                try:
                    obj.do_handshake()
                    done[key] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done["c"] and done["s"]:
            break
    else:
        raise RuntimeError("in-memory TLS handshake did not finish")
    # Let the client consume the TLS 1.3 session tickets.
    try:
        client.read(1)
    except ssl.SSLWantReadError:
        pass
    return client, c_in, server, s_out


# --------------------------------------------------------- blocking server ----

def accept(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def accept_handshaken(
    listener: socket.socket, n: int, ctx: ssl.SSLContext | None
) -> list[tuple[socket.socket, BlockingTLS | None]]:
    """Accept ``n`` connections, one after the other, each with its TLS
    handshake done through a server-side ``BlockingTLS`` if ``ctx``."""
    accepted = []
    for _ in range(n):
        conn = accept(listener)
        tls = None
        if ctx is not None:
            tls = BlockingTLS(conn, ctx)
            tls.handshake()
        accepted.append((conn, tls))
    return accepted


def send_in_chunks(conn: socket.socket, data: bytes | memoryview, chunk: int) -> None:
    """``sendall`` of ``data`` in ``chunk``-byte calls; stops quietly when the
    client has gone (a client may close as soon as it has what it needs)."""
    view = memoryview(data)
    try:
        for off in range(0, len(view), chunk):
            conn.sendall(view[off:off + chunk])
    except (BrokenPipeError, ConnectionResetError):
        pass


def send_repeated(conn: socket.socket, size: int, chunk: int) -> None:
    """Send ``size`` bytes in ``chunk``-byte sendall calls of one buffer."""
    view = memoryview(payload(chunk))
    remaining = size
    try:
        while remaining > 0:
            n = min(chunk, remaining)
            conn.sendall(view[:n])
            remaining -= n
    except (BrokenPipeError, ConnectionResetError):
        pass


def drain_until_closed(conn: socket.socket | ssl.SSLSocket, limit: int | None = None) -> int:
    """Read and discard until EOF (or ``limit`` bytes); return the count."""
    buf = bytearray(256 * KiB)
    total = 0
    try:
        while limit is None or total < limit:
            want = len(buf) if limit is None else min(len(buf), limit - total)
            n = conn.recv_into(buf, want)
            if not n:
                # A TLS peer that sent close_notify waits for ours.
                if isinstance(conn, ssl.SSLSocket):
                    conn.unwrap()
                break
            total += n
    except (ConnectionResetError, ssl.SSLError, OSError):
        pass
    return total


def close_quietly(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


# --------------------------------------------------------------- clients ----

def is_tls(params: Params) -> bool:
    return bool(params.get("tls", 0))


async def open_streams(ctx: ClientContext, tls: bool) -> tuple[Any, Any]:
    """(reader, writer) from slabnet or asyncio, as the implementation says."""
    kwargs: dict[str, Any] = {}
    if tls:
        kwargs = {"ssl": client_ssl_context(ctx.files), "server_hostname": SERVER_HOSTNAME}
    if ctx.impl.is_slabnet:
        slabnet = import_slabnet()
        reader, writer = await slabnet.open_connection(ctx.host, ctx.port, **kwargs)
    else:
        reader, writer = await asyncio.open_connection(ctx.host, ctx.port, **kwargs)
    set_rcvbuf(writer.get_extra_info("socket"), int(ctx.params.get("rcvbuf", 0)))
    return reader, writer


def set_rcvbuf(sock: Any, rcvbuf: int) -> None:
    if rcvbuf and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)


async def close_writer(writer: Any) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 2)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        pass


class _CountingProtocol(asyncio.Protocol):
    """Counts bytes and nothing else: the floor for an asyncio client.

    The first ``data_received`` starts the meter (see module docstring)."""

    def __init__(self, target: int, meter: Meter, request: bytes) -> None:
        self.target = target
        self.meter = meter
        self.request = request
        self.received = 0
        self.counted = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        # (uvloop's transports don't subclass asyncio.Transport.)
        self.transport = transport
        if self.request:
            transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self._count(len(data))

    def _count(self, n: int) -> None:
        if self.received == 0:
            self.meter.start()
        else:
            self.counted += n
        self.received += n
        if self.received >= self.target and not self.done.done():
            self.meter.stop()
            self.done.set_result(None)

    def eof_received(self) -> bool | None:
        self._fail(ConnectionError(f"EOF after {self.received} of {self.target} bytes"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError(f"closed after {self.received} of {self.target} bytes"))

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class _CountingChunkApp:
    """App protocol for ``slabnet.SlabProtocol``: counts chunk bytes."""

    def __init__(self, proto: _CountingProtocol) -> None:
        self._proto = proto

    def connection_made(self, transport: Any) -> None:
        self._proto.connection_made(transport)

    def chunk_received(self, chunk: memoryview) -> None:
        self._proto._count(len(chunk))

    def eof_received(self) -> bool | None:
        return self._proto.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._proto.connection_lost(exc)


async def receive(ctx: ClientContext, nbytes: int, *, tls: bool, request: bytes = b"") -> dict[str, Any]:
    """Connect, optionally send ``request``, receive ``nbytes`` with the
    implementation's read API; return the Meter's result.

    APIs: ``slabnet-chunks`` (``reader.chunks()``), ``slabnet-read`` and
    ``streams`` (``reader.read(readsize)``), ``proto`` (asyncio.Protocol that
    counts), ``slabnet-proto`` (``slabnet.SlabProtocol`` wrapping a counting app).
    """
    api = ctx.impl.api
    meter = Meter()
    readsize = int(ctx.params.get("readsize", 64 * KiB))
    if api in ("proto", "slabnet-proto"):
        loop = asyncio.get_running_loop()
        proto = _CountingProtocol(nbytes, meter, request)
        factory: Callable[[], asyncio.BaseProtocol]
        if api == "slabnet-proto":
            slabnet = import_slabnet()
            factory = lambda: slabnet.SlabProtocol(_CountingChunkApp(proto))  # noqa: E731
        else:
            factory = lambda: proto  # noqa: E731
        kwargs: dict[str, Any] = {}
        if tls:
            kwargs = {"ssl": client_ssl_context(ctx.files), "server_hostname": SERVER_HOSTNAME}
        transport, _ = await loop.create_connection(factory, ctx.host, ctx.port, **kwargs)
        set_rcvbuf(transport.get_extra_info("socket"), int(ctx.params.get("rcvbuf", 0)))
        try:
            await proto.done
        finally:
            transport.close()
        return meter.result(proto.counted)

    reader, writer = await open_streams(ctx, tls)
    if request:
        writer.write(request)
    try:
        received, counted = await read_count(reader, api, nbytes, readsize, meter)
        if received < nbytes:
            raise ConnectionError(f"EOF after {received} of {nbytes} bytes")
    finally:
        await close_writer(writer)
    return meter.result(counted)


async def read_count(
    reader: Any,
    api: str,
    nbytes: int,
    readsize: int,
    meter: Meter | None = None,
    sink: Callable[[Any], None] | None = None,
) -> tuple[int, int]:
    """Read ``nbytes`` (or to EOF) from a stream reader: ``reader.chunks()``
    for ``slabnet-chunks`` and ``slabnet`` (the slabnet idiom), else
    ``reader.read(readsize)``.  Every piece read goes to ``sink`` if given.

    With a ``meter``, it is started after the first piece and stopped at the
    end; returns (bytes received, bytes received after the first piece).
    """
    received = counted = 0
    if api in ("slabnet-chunks", "slabnet"):
        async for chunk in reader.chunks():
            if sink:
                sink(chunk)
            n = len(chunk)
            if received == 0:
                if meter:
                    meter.start()
            else:
                counted += n
            received += n
            if received >= nbytes:
                break
    elif api in ("streams", "slabnet-read"):
        read = reader.read
        while received < nbytes:
            data = await read(readsize)
            if not data:
                break
            if sink:
                sink(data)
            if received == 0:
                if meter:
                    meter.start()
            else:
                counted += len(data)
            received += len(data)
    else:
        raise ValueError(f"no read loop for {api!r}")
    if meter:
        meter.stop()
    return received, counted


async def send(
    ctx: ClientContext, size: int, wsize: int, *, tls: bool, burst: int = 1, lines: bool = False
) -> dict[str, Any]:
    """Write ``size`` bytes in ``wsize``-byte writes, ``burst`` writes per
    ``drain()`` (with ``lines``, as one ``writelines()`` of ``burst``
    pieces), then wait for the server's one-byte acknowledgement that it
    has received them all.  Works for asyncio and slabnet streams alike."""
    reader, writer = await open_streams(ctx, tls)
    data = payload(wsize)
    meter = Meter()
    try:
        meter.start()
        remaining = size
        write, drain = writer.write, writer.drain
        if lines:
            pieces = [data] * burst
            while remaining >= wsize * burst:
                writer.writelines(pieces)
                remaining -= wsize * burst
                await drain()
        while remaining > 0:
            for _ in range(burst):
                if remaining <= 0:
                    break
                n = min(wsize, remaining)
                write(data if n == wsize else data[:n])
                remaining -= n
            await drain()
        ack = await reader.readexactly(1)
        meter.stop()
        if ack != b"k":
            raise ConnectionError(f"bad acknowledgement {ack!r}")
    finally:
        await close_writer(writer)
    return meter.result(size)


def raise_nofile_limit() -> None:
    """Lift the soft limit on open files to the hard one (idle connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve_sink(listener: socket.socket, params: Params, files: Files) -> None:
    """Server for client-to-server scenarios: receive ``size`` bytes (TLS if
    ``tls``), send one ``k`` byte, then wait for the client to close."""
    conn: socket.socket = accept(listener)
    if is_tls(params):
        conn = server_ssl_context(files).wrap_socket(conn, server_side=True)
    size = int(params["size"])
    got = drain_until_closed(conn, size)
    if got == size:
        conn.sendall(b"k")
        drain_until_closed(conn)
    close_quietly(conn)
