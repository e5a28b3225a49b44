"""Paced frames: ``n`` connections, each sending one ``wsize``-byte frame per
loop iteration (``write``, ``await drain()``, then ``await asyncio.sleep(0)``),
``frames`` frames in all, plain TCP and TLS.

What a voice, TTS or media server does: a task per connection writes one
small frame on each tick of its timer, so no write follows a read and no
two writes of a connection share an iteration.  The cost that counts is the
CPU per frame on the sending side.  ``sleep(0)`` stands for the timer: it
gives each frame an iteration of its own without the timer's cost, which
every implementation would pay alike.

The server is one process, the same for every client: it accepts the ``n``
connections (TLS: each handshake done over an ``SSLObject``), then reads all
of them from a non-blocking ``selectors`` loop and checks every frame: frame
*i* of a connection starts with its number *i* and its connection's client
port and is otherwise the byte ``i % 251`` repeated, so a lost, repeated,
reordered or merged frame fails.  Once a connection has all of its frames
the server sends it one ``k``.  The clock runs from the first write to the
last ``k``; reported: frames per second and the client's CPU µs per frame.
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import ssl
import struct
import time
from typing import Any

from ..common import (
    BlockingTLS,
    KiB,
    accept_handshaken,
    close_quietly,
    close_writer,
    is_tls,
    open_streams,
    server_ssl_context,
)
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Files, Metric, Params, Scenario

_HEAD = struct.Struct("!IH")  # frame number, client port


def frame(i: int, port: int, wsize: int) -> bytes:
    return _HEAD.pack(i, port) + bytes([i % 251]) * (wsize - _HEAD.size)


def per_connection(params: Params) -> int:
    return max(1, int(params["frames"]) // int(params["n"]))


# ----------------------------------------------------------------- server ----

class BadFrame(Exception):
    pass


class _Receiver:
    """One connection: its bytes, checked a frame at a time."""

    def __init__(
        self, conn: socket.socket, tls: BlockingTLS | None, frames: int, wsize: int
    ) -> None:
        self.conn = conn
        self.tls = tls
        self.port = conn.getpeername()[1]
        self.frames = frames
        self.wsize = wsize
        self.buf = bytearray()
        self.got = 0  # frames checked

    def readable(self) -> bool:
        """Take what the socket has; False at EOF."""
        try:
            data = self.conn.recv(256 * KiB)
        except BlockingIOError:
            return True
        if not data:
            return False
        if self.tls is not None:
            self.tls.incoming.write(data)
            try:
                while piece := self.tls.obj.read(256 * KiB):
                    self.take(piece)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:  # the client's close_notify: answer it
                try:
                    self.tls.obj.unwrap()
                    self.conn.setblocking(True)
                    self.tls.flush()
                except (OSError, ssl.SSLError):
                    pass
                return False
        else:
            self.take(data)
        return True

    def take(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        wsize, off = self.wsize, 0
        while len(buf) - off >= wsize:
            want = frame(self.got, self.port, wsize)
            if buf[off:off + wsize] != want:
                raise BadFrame(f"frame {self.got} of port {self.port} is not the one sent")
            self.got += 1
            off += wsize
        del buf[:off]
        if self.got > self.frames:
            raise BadFrame(f"port {self.port} sent more than {self.frames} frames")

    def done(self) -> bool:
        return self.got == self.frames and not self.buf

    def acknowledge(self) -> None:
        self.conn.setblocking(True)
        if self.tls is not None:
            self.tls.obj.write(b"k")
            self.tls.flush()
        else:
            self.conn.sendall(b"k")
        self.conn.setblocking(False)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    n, wsize = int(params["n"]), int(params["wsize"])
    frames = per_connection(params)
    ctx = server_ssl_context(files) if is_tls(params) else None
    receivers = [
        _Receiver(conn, tls, frames, wsize) for conn, tls in accept_handshaken(listener, n, ctx)
    ]
    sel = selectors.DefaultSelector()
    for r in receivers:
        r.conn.setblocking(False)
        sel.register(r.conn, selectors.EVENT_READ, r)
    left = n
    try:
        while left:
            for key, _ in sel.select():
                r = key.data
                before = r.done()
                try:
                    open_ = r.readable()
                except OSError:
                    open_ = False
                if not before and r.done():
                    r.acknowledge()
                if not open_:
                    # The client closes once it has its ``k`` (or gave up).
                    sel.unregister(r.conn)
                    close_quietly(r.conn)
                    left -= 1
    finally:
        sel.close()
        for r in receivers:
            close_quietly(r.conn)


# ----------------------------------------------------------------- client ----

async def client(ctx: ClientContext) -> dict[str, Any]:
    n, wsize = int(ctx.params["n"]), int(ctx.params["wsize"])
    frames = per_connection(ctx.params)
    pairs = [await open_streams(ctx, is_tls(ctx.params)) for _ in range(n)]

    async def one(reader: Any, writer: Any) -> None:
        port = writer.get_extra_info("sockname")[1]
        pieces = [frame(i, port, wsize) for i in range(frames)]  # (made before the clock)
        await start.wait()
        write, drain, sleep = writer.write, writer.drain, asyncio.sleep
        for piece in pieces:
            write(piece)
            await drain()
            await sleep(0)
        if await reader.readexactly(1) != b"k":
            raise ConnectionError("bad acknowledgement")

    start = asyncio.Event()
    try:
        tasks = [asyncio.ensure_future(one(r, w)) for r, w in pairs]
        await asyncio.sleep(0.05)  # every task made its frames and waits
        cpu0, wall0 = time.process_time(), time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await asyncio.gather(*(close_writer(w) for _, w in pairs))
    total = frames * n
    return {"frames_per_s": total / wall, "cpu_us_per_frame": cpu / total * 1e6}


SCENARIO = Scenario(
    name="frames",
    title="Paced frames on many connections (voice, media)",
    doc=__doc__ or "",
    params={"n": [1, 64], "tls": [0, 1], "wsize": [640], "frames": [100_000]},
    quick={"frames": [2000]},
    impls=SLABNET_WRITER + STREAMS,
    client=client,
    server=serve,
    metrics=(
        Metric("frames_per_s", "frames/s", "higher", "{:.0f}"),
        Metric("cpu_us_per_frame", "CPU µs/frame", "lower", "{:.2f}"),
    ),
    plot_x="n",
    plot_metrics=("frames_per_s", "cpu_us_per_frame"),
)
