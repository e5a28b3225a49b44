"""Idle connections: memory per open, idle client connection.

The client opens one warm-up connection, takes a baseline, then opens ``n``
more (``batch`` at a time) and waits for them to settle (TLS 1.3 session
tickets read); it reports the growth per connection in Python allocations
(tracemalloc) and in resident memory (RSS: includes OpenSSL's allocations; kernel
socket buffers are not counted).  The server is a blocking
accept loop that holds every connection (TLS handshake done) and sends
nothing.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc
from typing import Any

from ..common import (
    KiB,
    SERVER_HOSTNAME,
    accept,
    client_ssl_context,
    close_quietly,
    close_writer,
    current_rss_bytes,
    drain_until_closed,
    is_tls,
    open_streams,
    raise_nofile_limit,
    server_ssl_context,
)
from ..core import PROTO, SLABNET_WRITER, STREAMS, ClientContext, Files, Metric, Params, Scenario


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    raise_nofile_limit()
    ctx = server_ssl_context(files) if is_tls(params) else None
    conns: list[socket.socket] = []
    for _ in range(int(params["n"]) + 1):
        conn: socket.socket = accept(listener)
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        conns.append(conn)
    drain_until_closed(conns[-1])
    for conn in conns:
        close_quietly(conn)


async def _open(ctx: ClientContext) -> Any:
    """One idle connection; returns what must be kept alive."""
    tls = is_tls(ctx.params)
    if ctx.impl.api == "proto":
        kwargs: dict[str, Any] = {}
        if tls:
            kwargs = {"ssl": client_ssl_context(ctx.files), "server_hostname": SERVER_HOSTNAME}
        transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, ctx.host, ctx.port, **kwargs)
        return transport
    return await open_streams(ctx, tls)


def _close(conn: Any) -> None:
    if isinstance(conn, tuple):
        conn[1].close()
    else:
        conn.close()


async def client(ctx: ClientContext) -> dict[str, Any]:
    raise_nofile_limit()
    tracemalloc.start()
    n, batch = int(ctx.params["n"]), int(ctx.params["batch"])
    warmup = await _open(ctx)
    await asyncio.sleep(0.05)
    gc.collect()
    base, rss0 = tracemalloc.get_traced_memory()[0], current_rss_bytes()
    conns: list[Any] = []
    while len(conns) < n:
        k = min(batch, n - len(conns))
        conns += await asyncio.gather(*(_open(ctx) for _ in range(k)))
    await asyncio.sleep(0.2)  # session tickets, callbacks
    gc.collect()
    traced, rss1 = tracemalloc.get_traced_memory()[0], current_rss_bytes()
    for conn in conns + [warmup]:
        _close(conn)  # not awaited: the process exits, the server holds on
    return {
        "traced_per_conn_kib": (traced - base) / n / KiB,
        "rss_per_conn_kib": (rss1 - rss0) / n / KiB,
    }


SCENARIO = Scenario(
    name="idle",
    title="Idle connections: memory per connection",
    doc=__doc__ or "",
    params={"tls": [0, 1], "n": [1000], "batch": [100]},
    quick={"n": [20]},
    impls=SLABNET_WRITER + STREAMS + PROTO,
    client=client,
    server=serve,
    metrics=(
        Metric("traced_per_conn_kib", "tracemalloc KiB/conn", "lower", "{:.2f}"),
        Metric("rss_per_conn_kib", "RSS KiB/conn", "lower", "{:.1f}"),
    ),
    plot_x="tls",
    plot_metrics=("traced_per_conn_kib", "rss_per_conn_kib"),
)
