"""Small-write bursts: ``burst`` writes of ``wsize`` bytes in one loop
iteration, then one ``await writer.drain()``; plain TCP and TLS.

This is the pattern where per-iteration coalescing pays (a protocol encoder
that emits many small frames).  Server and clock as in ``c2s``.
"""

from __future__ import annotations

from typing import Any

from ..common import KiB, MiB, is_tls, send, serve_sink
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Scenario


async def client(ctx: ClientContext) -> dict[str, Any]:
    p = ctx.params
    return await send(ctx, int(p["size"]), int(p["wsize"]), tls=is_tls(p), burst=int(p["burst"]))


SCENARIO = Scenario(
    name="burst",
    title="Small-write bursts, client to server",
    doc=__doc__ or "",
    params={"burst": [64], "wsize": [1 * KiB], "tls": [0, 1], "size": [64 * MiB]},
    quick={"size": [1 * MiB]},
    impls=SLABNET_WRITER + STREAMS,
    client=client,
    server=serve_sink,
    plot_x="tls",
)
