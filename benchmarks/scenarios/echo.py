"""Echo pipe (as Node's ``net-pipe``): the client writes ``size`` bytes in
``wsize``-byte writes (with ``drain``) while it reads the echo back; the
clock stops when the last echoed byte has arrived.  Plain TCP and TLS.

The server echoes with blocking ``recv_into`` + ``sendall`` (through an
``ssl.SSLSocket`` for TLS).  slabnet reads with ``reader.chunks()``, asyncio
with ``reader.read(readsize)``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

from ..common import (
    KiB,
    MiB,
    Meter,
    accept,
    close_quietly,
    close_writer,
    is_tls,
    open_streams,
    payload,
    read_count,
    server_ssl_context,
)
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Files, Params, Scenario


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    conn: socket.socket = accept(listener)
    if is_tls(params):
        conn = server_ssl_context(files).wrap_socket(conn, server_side=True)
    buf = bytearray(256 * KiB)
    view = memoryview(buf)
    try:
        while n := conn.recv_into(buf):
            conn.sendall(view[:n])
        if isinstance(conn, ssl.SSLSocket):
            conn.unwrap()  # answer the client's close_notify
    except (ConnectionResetError, BrokenPipeError):
        pass
    close_quietly(conn)


async def client(ctx: ClientContext) -> dict[str, Any]:
    p = ctx.params
    size, wsize = int(p["size"]), int(p["wsize"])
    reader, writer = await open_streams(ctx, is_tls(p))
    data = payload(wsize)

    async def pump() -> None:
        remaining = size
        while remaining > 0:
            n = min(wsize, remaining)
            writer.write(data if n == wsize else data[:n])
            remaining -= n
            await writer.drain()

    meter = Meter()
    meter.start()
    writing = asyncio.create_task(pump())
    try:
        received, _ = await read_count(reader, ctx.impl.api, size, int(p["readsize"]))
        meter.stop()
        if received < size and writing.done():
            writing.result()  # the writer's error explains the short read
        if received < size:
            raise ConnectionError(f"EOF after {received} of {size} echoed bytes")
        await writing
    finally:
        writing.cancel()
        await close_writer(writer)
    return meter.result(size)


SCENARIO = Scenario(
    name="echo",
    title="Echo pipe (write and read back)",
    doc=__doc__ or "",
    params={"tls": [0, 1], "wsize": [64 * KiB], "readsize": [64 * KiB], "size": [256 * MiB]},
    quick={"size": [2 * MiB]},
    impls=SLABNET_WRITER + STREAMS,
    client=client,
    server=serve,
    plot_x="tls",
)
