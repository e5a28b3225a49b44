"""Request and reply: the client writes a ``size``-byte request and awaits
the ``size``-byte reply before the next one, ``requests`` times on one
connection (after 200 untimed ones), plain TCP and TLS.  What control
channels, RPC and proxies in front of small services do: every round trip
is a read and a write of a few hundred bytes, so what counts is the cost
per operation, not per byte.

The server is ``echo``'s: blocking ``recv_into`` + ``sendall`` (through an
``ssl.SSLSocket`` for TLS).  Both APIs read the reply with
``readexactly(size)``.  Reported: round trips per second (wall clock: the
server's turn included) and the client's CPU time per round trip.
"""

from __future__ import annotations

import time
from typing import Any

from ..common import close_writer, is_tls, open_streams
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Metric, Scenario
from .echo import serve

WARMUP = 200


async def client(ctx: ClientContext) -> dict[str, Any]:
    n, size = int(ctx.params["requests"]), int(ctx.params["size"])
    reader, writer = await open_streams(ctx, is_tls(ctx.params))
    request = b"r" * (size - 1) + b"\n"
    try:
        for _ in range(WARMUP):
            writer.write(request)
            await reader.readexactly(size)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            writer.write(request)
            reply = await reader.readexactly(size)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if reply != request:
            raise ConnectionError("the reply is not the request")
    finally:
        await close_writer(writer)
    return {"ops_per_s": n / wall, "cpu_us_per_op": cpu / n * 1e6}


SCENARIO = Scenario(
    name="rpc",
    title="Request and reply (round trips of small messages)",
    doc=__doc__ or "",
    params={"tls": [0, 1], "size": [100], "requests": [20000]},
    quick={"requests": [500]},
    impls=SLABNET_WRITER + STREAMS,
    client=client,
    server=serve,
    metrics=(
        Metric("ops_per_s", "round trips/s", "higher", "{:.0f}"),
        Metric("cpu_us_per_op", "CPU µs/round trip", "lower", "{:.1f}"),
    ),
    plot_x="tls",
    plot_metrics=("ops_per_s", "cpu_us_per_op"),
)
