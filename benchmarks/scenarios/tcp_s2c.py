"""Plain TCP, server to client: how fast can the client take bytes in?

The server is a blocking socket that ``sendall``s ``size`` bytes in
``sendchunk``-byte calls, so it is never the bottleneck; the client reads
them with each implementation's read API and is the process measured.
"""

from __future__ import annotations

import socket
from typing import Any

from ..common import KiB, MiB, accept, close_quietly, drain_until_closed, receive, send_repeated
from ..core import (
    PROTO,
    SLABNET_CHUNKS,
    SLABNET_PROTO,
    SLABNET_READ,
    STREAMS,
    ClientContext,
    Files,
    Params,
    Scenario,
)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    conn = accept(listener)
    send_repeated(conn, int(params["size"]), int(params["sendchunk"]))
    drain_until_closed(conn)
    close_quietly(conn)


async def client(ctx: ClientContext) -> dict[str, Any]:
    return await receive(ctx, int(ctx.params["size"]), tls=False)


SCENARIO = Scenario(
    name="tcp_s2c",
    title="Plain TCP, server to client",
    doc=__doc__ or "",
    params={"size": [512 * MiB], "sendchunk": [1 * MiB], "readsize": [64 * KiB], "rcvbuf": [0]},
    quick={"size": [4 * MiB]},
    impls=SLABNET_CHUNKS + SLABNET_READ + SLABNET_PROTO + STREAMS + PROTO,
    client=client,
    server=serve,
)
