"""httpx: one large HTTPS download, streamed with ``aiter_bytes()``.

The server (a blocking ``ssl.SSLSocket``, TLS 1.3) answers one GET with
``size`` bytes in ``sendall`` calls of ``sendchunk`` bytes (OpenSSL cuts
them into 16 KiB records). The client is ``httpx.AsyncClient`` on slabnet
(``slabnet-httpx``) or on httpx's default backend (``httpx``), reading the
body with ``async for part in response.aiter_bytes()``; the clock starts
after the first part, as for every transfer here.
"""

from __future__ import annotations

import socket
from typing import Any

from ..common import KiB, MiB, Meter, accept, close_quietly, drain_until_closed, server_ssl_context
from ..core import HTTPX, ClientContext, Files, Params, Scenario
from .httpx_common import (
    LOOPS_PARAM, LOOPS_QUICK, body, make_client, on_loops, read_head, response_head, url,
)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    conn = server_ssl_context(files).wrap_socket(accept(listener), server_side=True)
    size, chunk = int(params["size"]), int(params["sendchunk"])
    piece = memoryview(body(chunk))
    try:
        if read_head(conn, bytearray()):
            conn.sendall(response_head(size))
            remaining = size
            while remaining > 0:
                n = min(chunk, remaining)
                conn.sendall(piece[:n])
                remaining -= n
            drain_until_closed(conn)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        close_quietly(conn)


async def client(ctx: ClientContext) -> dict[str, Any]:
    size = int(ctx.params["size"])
    meter = Meter()
    received = counted = 0
    async with make_client(ctx) as c:
        async with c.stream("GET", url(ctx, "/download")) as response:
            async for part in response.aiter_bytes():
                if received:
                    counted += len(part)
                else:
                    meter.start()
                received += len(part)
        meter.stop()
    if received != size:
        raise ConnectionError(f"received {received} of {size} bytes")
    return meter.result(counted)


SCENARIO = Scenario(
    name="httpx_download",
    title="httpx: one large HTTPS download",
    doc=__doc__ or "",
    params={"size": [256 * MiB], "sendchunk": [256 * KiB], **LOOPS_PARAM},
    quick={"size": [4 * MiB], **LOOPS_QUICK},
    impls=HTTPX,
    impl_filter=on_loops,
    client=client,
    server=serve,
    plot_metrics=("mibps", "cpu_s_per_gib"),
)
