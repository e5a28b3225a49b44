"""What the httpx scenarios share (not a scenario itself).

Clients: ``slabnet-httpx/LOOP`` is ``httpx.AsyncClient`` over
``slabnet.contrib.httpx.AsyncSlabnetTransport``; ``httpx/LOOP`` is
``httpx.AsyncClient`` over ``httpx.AsyncHTTPTransport`` (httpcore's anyio
backend: asyncio's transports under anyio's TLS over ``ssl.MemoryBIO``).
Same TLS context, same pool limits, HTTP/1.1, same requests.

Servers are blocking ``ssl.SSLSocket`` code speaking just enough HTTP/1.1
(request heads without bodies, ``Content-Length`` responses, keep-alive),
except where the idle scenario needs a thousand connections at once.
httpx is imported in the client only: the driver imports this module too.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

from ..common import KiB, SlabnetUnavailable, client_ssl_context, payload
from ..core import ClientContext, Impl, Params

#: Every wait of a client (connect, read, pool): generous, so that a slow
#: shared machine fails no run, and bounded by the driver's ``dur`` anyway.
TIMEOUT = 60.0


#: The ``loops`` parameter: the loops to run on, comma-separated. ``--quick``
#: runs the asyncio loop only, so that its smoke run of these three
#: scenarios (a fresh client and server process per run) stays short.
LOOPS_PARAM = {"loops": ["asyncio,uvloop"]}
LOOPS_QUICK = {"loops": ["asyncio"]}


def on_loops(impl: Impl, params: Params) -> bool:
    return impl.loop in str(params.get("loops", impl.loop)).split(",")


def url(ctx: ClientContext, path: str = "/") -> str:
    return f"https://{ctx.host}:{ctx.port}{path}"


def make_client(ctx: ClientContext, ssl_context: ssl.SSLContext | None = None,
                connections: int = 100) -> Any:
    """An ``httpx.AsyncClient`` for the implementation, keeping up to
    ``connections`` connections alive."""
    import httpx

    verify = ssl_context or client_ssl_context(ctx.files)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                          keepalive_expiry=TIMEOUT)
    transport: Any
    if ctx.impl.api == "slabnet-httpx":
        try:
            from slabnet.contrib.httpx import AsyncSlabnetTransport
        except ImportError as exc:
            raise SlabnetUnavailable(f"slabnet.contrib.httpx: {exc}") from exc
        transport = AsyncSlabnetTransport(verify=verify, limits=limits)
    elif ctx.impl.api == "httpx":
        transport = httpx.AsyncHTTPTransport(verify=verify, limits=limits)
    else:
        raise ValueError(f"no httpx client for {ctx.impl.api!r}")
    return httpx.AsyncClient(transport=transport, timeout=TIMEOUT)


def response_head(length: int) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def read_head(conn: socket.socket | ssl.SSLSocket, buf: bytearray) -> bool:
    """Read one request head (no body) into ``buf``'s front and drop it;
    False at EOF."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            del buf[: end + 4]
            return True
        try:
            data = conn.recv(64 * KiB)
        except (ConnectionResetError, ssl.SSLError):
            return False
        if not data:
            return False
        buf += data


def body(n: int) -> bytes:
    return payload(n)
