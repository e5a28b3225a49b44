"""httpx: memory of a pool holding ``n`` idle keep-alive HTTPS connections.

The client sends ``n`` GETs at once on one ``httpx.AsyncClient`` (its pool
allowed ``n`` connections, all kept alive), so the pool opens ``n``
connections; each gets a small response and goes back to the pool, idle.
Reported: the growth of the client's resident memory (VmRSS) per connection,
from a baseline taken after a warm-up request on another client (imports,
the TLS context, the loop's buffers) to the pool of ``n`` idle connections
(after session tickets were read and garbage collected): RSS includes
OpenSSL's allocations and what the allocator keeps of the handshakes'
transient buffers; kernel socket buffers are not counted. ``trimmed``: the
same after glibc's ``malloc_trim(0)`` at both ends, memory the connections
hold rather than the allocator's free pages.

The server holds every connection: asyncio's own TLS server in the server
process, the same for both clients.

``n`` is 300 by default, not 1000: httpcore's pool (both clients) costs
time cubic in the number of idle connections while it fills (every request
that finishes walks every connection, and for each idle one counts all of
them), so 1000 kept the client busy for about 110 s, over the run limit;
300 take a few seconds. ``--set n=1000 --set dur=400`` measures the
thousand: RSS per connection came out within 1 KiB of the 300's (slabnet
68.4 against 67.5 KiB, the default backend 73.2 against 73.6); the trimmed
figure is lower at 1000 (36 and 46 KiB) for both.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import socket
import ssl
from typing import Any

from ..common import (
    KiB, client_ssl_context, current_rss_bytes, raise_nofile_limit, server_ssl_context,
)
from ..core import HTTPX, ClientContext, Files, Metric, Params, Scenario
from .httpx_common import (
    LOOPS_PARAM, LOOPS_QUICK, body, make_client, on_loops, response_head, url,
)

BODY = 100  # bytes per response: the responses are not what is measured


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    raise_nofile_limit()
    asyncio.run(_serve(listener, int(params["n"]) + 1, server_ssl_context(files)))


async def _serve(listener: socket.socket, expected: int, ctx: ssl.SSLContext) -> None:
    """Answer every request of ``expected`` connections, until all closed."""
    response = response_head(BODY) + body(BODY)
    closed = 0
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal closed
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(response)
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()
            closed += 1
            if closed >= expected:
                done.set()

    server = await asyncio.start_server(handle, sock=listener, ssl=ctx, backlog=4096)
    async with server:
        await done.wait()


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


async def client(ctx: ClientContext) -> dict[str, Any]:
    raise_nofile_limit()
    n = int(ctx.params["n"])
    target = url(ctx, "/idle")
    tls = client_ssl_context(ctx.files)
    async with make_client(ctx, tls) as warm:
        await warm.get(target)
    pool = make_client(ctx, tls, connections=n)
    await asyncio.sleep(0.05)
    gc.collect()
    rss0 = current_rss_bytes()
    _trim()
    trimmed0 = current_rss_bytes()
    responses = await asyncio.gather(*(pool.get(target) for _ in range(n)))
    streams = {id(r.extensions["network_stream"]) for r in responses}
    if len(streams) != n:
        raise RuntimeError(f"{n} requests went over {len(streams)} connections, not {n}")
    del responses
    await asyncio.sleep(0.2)  # session tickets, callbacks
    gc.collect()
    rss1 = current_rss_bytes()
    _trim()
    trimmed1 = current_rss_bytes()
    # Not closed: the process exits, the kernel closes the sockets.
    return {
        "rss_per_conn_kib": (rss1 - rss0) / n / KiB,
        "rss_trimmed_per_conn_kib": (trimmed1 - trimmed0) / n / KiB,
    }


SCENARIO = Scenario(
    name="httpx_idle",
    title="httpx: idle keep-alive HTTPS connections in the pool, memory per connection",
    doc=__doc__ or "",
    params={"n": [300], **LOOPS_PARAM},
    quick={"n": [20], **LOOPS_QUICK},
    impls=HTTPX,
    impl_filter=on_loops,
    client=client,
    server=serve,
    metrics=(
        Metric("rss_per_conn_kib", "RSS KiB/conn", "lower", "{:.1f}"),
        Metric("rss_trimmed_per_conn_kib", "RSS KiB/conn after malloc_trim", "lower", "{:.1f}"),
    ),
    plot_metrics=("rss_per_conn_kib", "rss_trimmed_per_conn_kib"),
)
