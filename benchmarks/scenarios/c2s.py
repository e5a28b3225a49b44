"""Write path, client to server: ``wsize``-byte writes, each followed by
``await writer.drain()`` (the asyncio idiom), plain TCP and TLS.

The server is a blocking socket (an ``ssl.SSLSocket`` for TLS) that reads
and discards ``size`` bytes, then sends a one-byte acknowledgement; the
client's clock runs from its first write to that acknowledgement.
"""

from __future__ import annotations

from typing import Any

from ..common import KiB, MiB, is_tls, send, serve_sink
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Scenario


async def client(ctx: ClientContext) -> dict[str, Any]:
    p = ctx.params
    return await send(ctx, int(p["size"]), int(p["wsize"]), tls=is_tls(p))


SCENARIO = Scenario(
    name="c2s",
    title="Write path, client to server, by write size",
    doc=__doc__ or "",
    params={"wsize": [1 * KiB, 16 * KiB, 1 * MiB], "tls": [0, 1], "size": [128 * MiB]},
    quick={"size": [2 * MiB]},
    impls=SLABNET_WRITER + STREAMS,
    client=client,
    server=serve_sink,
    plot_x="wsize",
)
