"""Retention: how much memory do kept chunks pin?

The server sends ``size`` bytes as ``piece``-byte TLS records (or, with
``tls=0``, ``piece``-byte pieces of plain TCP), ``per_send`` of them per
``send`` with a ``pace_us`` pause in between, so every read carries only a
few records.  The client keeps one chunk in ``keep_every`` (a slabnet chunk
memoryview, or the ``bytes`` asyncio hands over) and drops the rest, closes
the connection and collects garbage, then reports

* ``retained_ratio``: memory still allocated (tracemalloc, against a
  baseline taken after a warm-up connection) divided by the bytes of the
  kept chunks; 1.0 means the kept chunks pin nothing else;
* ``rss_delta_mib``: the same difference in resident memory (coarse).

A chunk that is a view into a shared slab pins the whole slab: that is what
this scenario catches (seed 000).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import tracemalloc
from typing import Any

from ..common import (
    KiB,
    MiB,
    BlockingTLS,
    accept,
    client_ssl_context,
    close_quietly,
    close_writer,
    current_rss_bytes,
    drain_until_closed,
    import_slabnet,
    is_tls,
    open_streams,
    payload,
    read_count,
    server_ssl_context,
    SERVER_HOSTNAME,
)
from ..core import (
    PROTO,
    SLABNET_CHUNKS,
    SLABNET_PROTO,
    SLABNET_READ,
    STREAMS,
    ClientContext,
    Files,
    Impl,
    Metric,
    Params,
    Scenario,
)

WARMUP_BYTES = 64 * KiB


def _send_paced(listener: socket.socket, params: Params, files: Files, size: int) -> None:
    conn = accept(listener)
    piece, per_send = int(params["piece"]), int(params["per_send"])
    pause = float(params["pace_us"]) / 1e6
    data = payload(piece)
    tls = BlockingTLS(conn, server_ssl_context(files)) if is_tls(params) else None
    if tls:
        tls.handshake()
    try:
        remaining = size
        while remaining > 0:
            batch = []
            for _ in range(per_send):
                n = min(piece, remaining)
                if n <= 0:
                    break
                batch.append(data[:n])
                remaining -= n
            if tls:
                for part in batch:
                    tls.obj.write(part)  # one record per piece
                tls.flush()
            else:
                conn.sendall(b"".join(batch))
            if pause:
                time.sleep(pause)
    except (BrokenPipeError, ConnectionResetError):
        pass
    if tls:
        tls.wait_close()
    else:
        drain_until_closed(conn)
    close_quietly(conn)


def serve(listener: socket.socket, params: Params, files: Files) -> None:
    _send_paced(listener, params, files, WARMUP_BYTES)
    _send_paced(listener, params, files, int(params["size"]))


class _Keeper:
    """Keeps one piece in ``every``."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.seen = 0
        self.kept: list[Any] = []

    def __call__(self, piece: Any) -> None:
        if self.seen % self.every == 0:
            self.kept.append(piece)
        self.seen += 1

    @property
    def kept_bytes(self) -> int:
        return sum(len(k) for k in self.kept)


class _KeepingProtocol(asyncio.Protocol):
    def __init__(self, keeper: _Keeper, target: int) -> None:
        self.keeper = keeper
        self.target = target
        self.received = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.keeper(data)
        self.received += len(data)
        if self.received >= self.target and not self.done.done():
            self.done.set_result(None)

    def chunk_received(self, chunk: memoryview) -> None:  # as SlabProtocol's app
        self.data_received(chunk)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError(f"closed after {self.received} bytes"))


async def _transfer(ctx: ClientContext, nbytes: int, keeper: _Keeper) -> None:
    api, tls = ctx.impl.api, is_tls(ctx.params)
    if api in ("proto", "slabnet-proto"):
        loop = asyncio.get_running_loop()
        proto = _KeepingProtocol(keeper, nbytes)
        kwargs: dict[str, Any] = {}
        if tls:
            kwargs = {"ssl": client_ssl_context(ctx.files), "server_hostname": SERVER_HOSTNAME}
        if api == "slabnet-proto":
            slabnet = import_slabnet()
            factory: Any = lambda: slabnet.SlabProtocol(proto)  # noqa: E731
        else:
            factory = lambda: proto  # noqa: E731
        transport, _ = await loop.create_connection(factory, ctx.host, ctx.port, **kwargs)
        try:
            await proto.done
        finally:
            transport.close()
    else:
        reader, writer = await open_streams(ctx, tls)
        try:
            received, _ = await read_count(reader, api, nbytes, 64 * KiB, sink=keeper)
            if received < nbytes:
                raise ConnectionError(f"EOF after {received} of {nbytes} bytes")
        finally:
            await close_writer(writer)
    # Let the loop run the connection_lost callbacks that free buffers.
    for _ in range(5):
        await asyncio.sleep(0)


async def client(ctx: ClientContext) -> dict[str, Any]:
    tracemalloc.start()
    every = int(ctx.params["keep_every"])
    await _transfer(ctx, WARMUP_BYTES, _Keeper(every))
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    rss0 = current_rss_bytes()
    keeper = _Keeper(every)
    await _transfer(ctx, int(ctx.params["size"]), keeper)
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - base
    rss1 = current_rss_bytes()
    kept = keeper.kept_bytes
    return {
        "retained_ratio": retained / kept if kept else float("nan"),
        "retained_kib": retained / KiB,
        "kept_kib": kept / KiB,
        "rss_delta_mib": (rss1 - rss0) / MiB,
        "chunks": keeper.seen,
        "avg_chunk": int(ctx.params["size"]) / max(keeper.seen, 1),
    }


def _impl_filter(impl: Impl, params: Params) -> bool:
    # SlabProtocol is the plain-TCP building block; TLS goes through streams.
    return not (impl.api == "slabnet-proto" and is_tls(params))


SCENARIO = Scenario(
    name="retention",
    title="Retention: memory pinned by kept chunks",
    doc=__doc__ or "",
    params={
        "tls": [1, 0],
        "size": [3 * MiB],
        "piece": [320],
        "per_send": [4],
        "pace_us": [100],
        "keep_every": [50],
    },
    quick={"size": [256 * KiB]},
    impls=SLABNET_CHUNKS + SLABNET_READ[:1] + SLABNET_PROTO + STREAMS + PROTO,
    impl_filter=_impl_filter,
    client=client,
    server=serve,
    metrics=(
        Metric("retained_ratio", "retained/kept", "lower", "{:.2f}"),
        Metric("retained_kib", "retained KiB", "lower", "{:.0f}"),
        Metric("kept_kib", "kept KiB", "lower", "{:.0f}"),
        Metric("rss_delta_mib", "RSS delta MiB", "lower", "{:.2f}"),
        Metric("avg_chunk", "bytes/chunk", "lower", "{:.0f}"),
    ),
    plot_x="tls",
    plot_metrics=("retained_ratio",),
)
