"""Write path, client to server, in two shapes, plain TCP and TLS:

* ``burst=1``: ``wsize``-byte writes, each followed by ``await
  writer.drain()`` (the asyncio idiom);
* ``burst=64``: 64 writes of ``wsize`` bytes, then one ``drain()`` (a
  protocol encoder emitting many small frames per loop iteration).  Run
  with 1 KiB writes only: with larger ones a drain per write is already the
  cheap case (``--set wsize=`` with ``burst=64`` measures no other size).
* ``lines=1`` (with ``burst=64``, asked for with ``--set lines=1``): the
  64 pieces go in one ``writelines()`` before the ``drain()`` (an encoder
  that returns a list of pieces: a line per item, a header and a body), for
  example ``--set lines=1 --set burst=64 --set wsize=100``.

The server is a blocking socket (an ``ssl.SSLSocket`` for TLS) that reads
and discards ``size`` bytes, then sends a one-byte acknowledgement; the
client's clock runs from its first write to that acknowledgement.
"""

from __future__ import annotations

from typing import Any

from ..common import KiB, MiB, is_tls, send, serve_sink
from ..core import SLABNET_WRITER, STREAMS, ClientContext, Impl, Params, Scenario

#: The largest write the ``burst`` shape is measured with.
BURST_WSIZE = 1 * KiB


async def client(ctx: ClientContext) -> dict[str, Any]:
    p = ctx.params
    return await send(
        ctx, int(p["size"]), int(p["wsize"]), tls=is_tls(p), burst=int(p["burst"]),
        lines=bool(int(p["lines"])),
    )


def _impl_filter(impl: Impl, params: Params) -> bool:
    # A configuration no implementation runs is left out of the plan.
    if int(params["lines"]):
        return int(params["burst"]) > 1 and int(params["wsize"]) <= BURST_WSIZE
    return int(params["burst"]) == 1 or int(params["wsize"]) <= BURST_WSIZE


SCENARIO = Scenario(
    name="c2s",
    title="Write path, client to server, by write size",
    doc=__doc__ or "",
    params={"wsize": [1 * KiB, 16 * KiB, 1 * MiB], "burst": [1, 64], "tls": [0, 1], "size": [128 * MiB],
            "lines": [0]},
    quick={"size": [2 * MiB]},
    impls=SLABNET_WRITER + STREAMS,
    impl_filter=_impl_filter,
    client=client,
    server=serve_sink,
    plot_x="wsize",
)
