"""Idle connections: memory and descriptors per open, idle connection,
held by a server (``side=server``, the default) or by a client
(``side=client``); plain TCP and TLS.

``side=server``: the process measured is a server on the implementation's
loop, made with its API (``slabnet.start_server``, ``asyncio.start_server``,
or ``loop.create_server`` with a bare ``asyncio.Protocol`` for ``proto``),
whose handler waits in ``reader.read(65536)`` as a server waits for the next
request.  The peer is a *connector*, the same process for every
implementation: told over a control connection, it opens connections to
the measured server with blocking sockets from ``CONNECTOR_THREADS``
threads (TLS: the handshake through an ``SSLObject``, which is then dropped,
so the connector holds only the socket) and holds them, sending nothing.
The server takes its baseline after one warm-up connection is up, then the
connector opens ``n`` more, ``batch`` at a time (each batch accepted
before the next is asked for), and the server measures again once it has
accepted them all (TLS: handshakes done) and its TLS 1.3 session tickets
have gone out.

``side=client``: the process measured opens a warm-up connection, takes a
baseline, opens ``n`` more (``batch`` at a time, with the implementation's
client API) to a blocking server that accepts and holds them.

Both report, per connection and after ``gc.collect()``:

* ``rss_per_conn_kib``: growth of the process's ``VmRSS`` (``/proc/self/status``):
  every page touched, Python's heap, OpenSSL's and uvloop's C allocations
  alike; pages allocated but never written (uvloop's 256 KiB TLS read buffer)
  do not count, nor do kernel socket buffers.
* ``fds_per_conn``: growth of the process's open descriptors (``/proc/self/fd``).
* ``traced_per_conn_kib``: the Python allocations (tracemalloc) of each of
  ``traced`` further connections opened after that measurement: the share
  of the RSS that is Python objects and buffers.  They are traced apart
  because tracemalloc's own tables (two to four KiB per connection, more
  than ``get_tracemalloc_memory()`` accounts for) would be counted in the
  RSS, and it makes opening connections several times slower.

``n`` = 10,000 needs more descriptors than the usual soft limit: both
processes raise theirs to the hard limit (``ulimit -Hn``); an implementation
that needs more descriptors per connection than that allows fails its run
(the error names the limit).  Each run's server listens on a new port, so
its ``n`` connections from 127.0.0.1 need ``n`` ephemeral ports, not more.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import socket
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

from ..common import (
    SERVER_HOSTNAME,
    BlockingTLS,
    KiB,
    accept,
    client_ssl_context,
    close_quietly,
    drain_until_closed,
    import_slabnet,
    is_tls,
    open_streams,
    raise_nofile_limit,
    server_ssl_context,
)
from ..core import PROTO, SLABNET_WRITER, STREAMS, ClientContext, Files, Metric, Params, Scenario

#: Threads of the connector: enough that handshakes overlap (each waits a
#: round trip for the measured server), few enough to stay out of its way on
#: two cores.
CONNECTOR_THREADS = 8
#: Listen backlog of the measured servers (the same for all; ``batch``
#: stays below it).
BACKLOG = 1024
#: Longest wait for the connector's answer to a batch, and for one of its
#: connections.
STEP_TIMEOUT = 60.0
#: A server that accepts no connection for this long has failed (a batch
#: of TLS handshakes takes about a second on a busy 2-core machine).
STALL = 10.0
#: Time for what follows a handshake (TLS 1.3 session tickets, callbacks)
#: before a measurement.
SETTLE = 0.1


# ----------------------------------------------------------- measurement ----

class _Snapshot:
    """The process's resident memory and descriptors, after a full collection."""

    def __init__(self) -> None:
        gc.collect()
        self.rss = _vm_rss_bytes()
        self.fds = len(os.listdir("/proc/self/fd"))


def _vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


def _nofile() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"{len(os.listdir('/proc/self/fd'))} descriptors open, limit {soft} (hard {hard})"


async def _measure(connect: Callable[[int], Awaitable[None]], n: int, traced: int) -> dict[str, Any]:
    """Open one warm-up connection, then ``n`` measured in RSS and
    descriptors, then ``traced`` more measured by tracemalloc."""
    await connect(1)  # first-connection costs (imports, caches) stay in the baseline
    await asyncio.sleep(SETTLE)
    before = _Snapshot()
    t0 = time.perf_counter()
    await connect(n)
    seconds = time.perf_counter() - t0
    await asyncio.sleep(SETTLE)
    after = _Snapshot()
    result = {
        "rss_per_conn_kib": (after.rss - before.rss) / n / KiB,
        "fds_per_conn": (after.fds - before.fds) / n,
        "open_seconds": seconds,
    }
    if traced:
        tracemalloc.start()
        try:
            gc.collect()
            base = tracemalloc.get_traced_memory()[0]
            await connect(traced)
            await asyncio.sleep(SETTLE)
            gc.collect()
            result["traced_per_conn_kib"] = (tracemalloc.get_traced_memory()[0] - base) / traced / KiB
        finally:
            tracemalloc.stop()
    return result


# ------------------------------------------------ side=server: connector ----

def _open_many(port: int, count: int, tls: Any) -> list[socket.socket]:
    """``count`` connections to 127.0.0.1:``port`` from ``CONNECTOR_THREADS``
    threads; TLS handshakes done (``tls`` is a client context or None)."""
    out: list[socket.socket] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(k):
                if errors:
                    return
                conn = socket.create_connection(("127.0.0.1", port), timeout=STEP_TIMEOUT)
                out.append(conn)
                if tls is not None:
                    BlockingTLS(conn, tls, server_hostname=SERVER_HOSTNAME).handshake()
        except BaseException as exc:
            errors.append(exc)

    threads = min(CONNECTOR_THREADS, count)
    workers = [threading.Thread(target=work, args=(count // threads + (i < count % threads),))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        for conn in out:
            close_quietly(conn)
        raise ConnectionError(f"connector: {len(out)} of {count} opened: "
                              f"{type(errors[0]).__name__}: {errors[0]}")
    return out


def _connect_on_demand(listener: socket.socket, params: Params, files: Files) -> None:
    """The connector: ``open PORT COUNT`` lines on the control connection
    open connections (answer ``opened``, or ``error ...``); EOF closes them
    all."""
    raise_nofile_limit()
    tls = client_ssl_context(files) if is_tls(params) else None
    control = accept(listener)
    held: list[socket.socket] = []
    with control.makefile("rb") as lines:
        for line in lines:
            cmd, port, count = line.decode().split()
            assert cmd == "open", cmd
            try:
                held += _open_many(int(port), int(count), tls)
                control.sendall(b"opened\n")
            except ConnectionError as exc:
                control.sendall(f"error {exc}\n".encode())
    for conn in held:
        close_quietly(conn)
    close_quietly(control)


# ---------------------------------------------- side=server: the server ----

class _Accepted:
    """Counts accepted connections (after the TLS handshake) and holds what
    keeps them open."""

    def __init__(self) -> None:
        self.held: list[Any] = []  # transports
        self._waiter: tuple[int, asyncio.Future[None]] | None = None

    def add(self, transport: Any) -> None:
        self.held.append(transport)
        if self._waiter and len(self.held) >= self._waiter[0] and not self._waiter[1].done():
            self._waiter[1].set_result(None)

    async def until(self, count: int) -> None:
        """Wait until ``count`` connections are accepted; fail if none
        comes for ``STALL`` seconds (out of descriptors, say)."""
        while len(self.held) < count:
            seen = len(self.held)
            fut = asyncio.get_running_loop().create_future()
            self._waiter = (count, fut)
            try:
                await asyncio.wait_for(fut, STALL)
            except asyncio.TimeoutError:
                if len(self.held) == seen:
                    raise RuntimeError(f"accepted {seen} of {count} connections, none in the last "
                                       f"{STALL:g} s; {_nofile()}") from None


class _IdleProtocol(asyncio.Protocol):
    def __init__(self, accepted: _Accepted) -> None:
        self.accepted = accepted

    def connection_made(self, transport: Any) -> None:
        self.accepted.add(transport)


async def _start_server(ctx: ClientContext, accepted: _Accepted) -> Any:
    ssl = server_ssl_context(ctx.files) if is_tls(ctx.params) else None
    api = ctx.impl.api
    if api == "proto":
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _IdleProtocol(accepted), "127.0.0.1", 0, ssl=ssl,
                                        backlog=BACKLOG)

    async def handler(reader: Any, writer: Any) -> None:
        accepted.add(writer.transport)
        try:
            await reader.read(64 * KiB)  # as a server waiting for a request
        except Exception:  # the run tears everything down with abort()
            pass

    if api == "slabnet":
        return await import_slabnet().start_server(handler, "127.0.0.1", 0, ssl=ssl, backlog=BACKLOG)
    return await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ssl, backlog=BACKLOG)


async def _server_side(ctx: ClientContext) -> dict[str, Any]:
    raise_nofile_limit()
    n, batch = int(ctx.params["n"]), int(ctx.params["batch"])
    accepted = _Accepted()
    server = await _start_server(ctx, accepted)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)  # to the connector

    async def connect(count: int) -> None:
        # In batches, each accepted before the next: on loopback a plain
        # connect() completes in the kernel, and a connector that ran ahead
        # would overflow the accept queue (SYNs dropped, retried after 1 s).
        for done in range(0, count, batch):
            k = min(batch, count - done)
            target = len(accepted.held) + k
            writer.write(f"open {port} {k}\n".encode())
            await accepted.until(target)
            answer = (await asyncio.wait_for(reader.readline(), STEP_TIMEOUT)).decode().strip()
            if answer != "opened":
                raise RuntimeError(f"{answer or 'connector closed'}; server: {_nofile()}")

    try:
        result = await _measure(connect, n, int(ctx.params["traced"]))
    finally:
        server.close()
        for transport in accepted.held:
            transport.abort()
        writer.close()
    return result


# ------------------------------------------------------- side=client ----

def _hold(listener: socket.socket, params: Params, files: Files) -> None:
    """side=client's server: accept and hold every connection (TLS
    handshake done), send nothing, until the last one closes."""
    raise_nofile_limit()
    ctx = server_ssl_context(files) if is_tls(params) else None
    conns: list[socket.socket] = []
    for _ in range(1 + int(params["n"]) + int(params["traced"])):
        conn: socket.socket = accept(listener)
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        conns.append(conn)
    drain_until_closed(conns[-1])
    for conn in conns:
        close_quietly(conn)


async def _open(ctx: ClientContext) -> Any:
    """One idle client connection; returns what must be kept alive."""
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


async def _client_side(ctx: ClientContext) -> dict[str, Any]:
    raise_nofile_limit()
    batch = int(ctx.params["batch"])
    conns: list[Any] = []

    async def connect(count: int) -> None:
        for done in range(0, count, batch):
            conns.extend(await asyncio.gather(*(_open(ctx) for _ in range(min(batch, count - done)))))

    try:
        return await _measure(connect, int(ctx.params["n"]), int(ctx.params["traced"]))
    finally:
        for conn in conns:
            _close(conn)  # not awaited: the process exits, the server holds on


# ------------------------------------------------------------------------

def serve(listener: socket.socket, params: Params, files: Files) -> None:
    if params["side"] == "server":
        _connect_on_demand(listener, params, files)
    else:
        _hold(listener, params, files)


async def client(ctx: ClientContext) -> dict[str, Any]:
    if ctx.params["side"] == "server":
        return await _server_side(ctx)
    return await _client_side(ctx)


SCENARIO = Scenario(
    name="idle",
    title="Idle connections: memory and descriptors per connection",
    doc=__doc__ or "",
    params={"side": ["server"], "tls": [0, 1], "n": [2000, 10000], "batch": [100], "traced": [200]},
    quick={"side": ["server", "client"], "n": [100], "traced": [50]},
    impls=SLABNET_WRITER + STREAMS + PROTO,
    client=client,
    server=serve,
    metrics=(
        Metric("rss_per_conn_kib", "RSS KiB/conn", "lower", "{:.1f}"),
        Metric("fds_per_conn", "fds/conn", "lower", "{:.2f}"),
        Metric("traced_per_conn_kib", "tracemalloc KiB/conn", "lower", "{:.2f}"),
        Metric("open_seconds", "s to open all", "lower", "{:.2f}"),
    ),
    plot_x="tls",
    plot_metrics=("rss_per_conn_kib", "traced_per_conn_kib"),
)
