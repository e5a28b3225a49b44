"""httpx: many small requests on one keep-alive HTTPS connection.

The client sends ``requests`` GETs one after another on one connection
(after one untimed request that connects) and reads each ``body``-byte
response whole; the server (a blocking ``ssl.SSLSocket``) answers each
request head at once. Reported: requests per second (wall clock: includes
the server's turn) and the client's CPU time per request.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from ..common import KiB, accept, close_quietly, server_ssl_context
from ..core import HTTPX, ClientContext, Files, Metric, Params, Scenario
from .httpx_common import (
    LOOPS_PARAM, LOOPS_QUICK, body, make_client, on_loops, read_head, response_head, url,
)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    conn = server_ssl_context(files).wrap_socket(accept(listener), server_side=True)
    n = int(params["body"])
    response = response_head(n) + body(n)
    buf = bytearray()
    try:
        while read_head(conn, buf):
            conn.sendall(response)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        close_quietly(conn)


async def client(ctx: ClientContext) -> dict[str, Any]:
    n, size = int(ctx.params["requests"]), int(ctx.params["body"])
    target = url(ctx, "/small")
    async with make_client(ctx) as c:
        await c.get(target)  # connects; not timed
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            response = await c.get(target)
            if len(response.content) != size:
                raise ConnectionError(f"a response of {len(response.content)} bytes, not {size}")
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"req_per_s": n / wall, "cpu_us_per_req": cpu / n * 1e6}


SCENARIO = Scenario(
    name="httpx_requests",
    title="httpx: small requests on one keep-alive HTTPS connection",
    doc=__doc__ or "",
    params={"requests": [5000], "body": [1 * KiB], **LOOPS_PARAM},
    quick={"requests": [200], **LOOPS_QUICK},
    impls=HTTPX,
    impl_filter=on_loops,
    client=client,
    server=serve,
    metrics=(
        Metric("req_per_s", "requests/s", "higher", "{:.0f}"),
        Metric("cpu_us_per_req", "CPU µs/request", "lower", "{:.0f}"),
    ),
    plot_metrics=("req_per_s", "cpu_us_per_req"),
)
