"""A closed connection is freed with its last reference, as asyncio's.

Each layer of a connection refers to the next (the stream's transport, the
transport's protocol, the TLS layer's app), and a cycle among them keeps a
closed connection -- over TLS with its SSLObject, OpenSSL's tens of KiB --
until the cyclic garbage collector runs, which for long-lived connections
(promoted to the oldest generation) can be a long time on a busy server.
So these tests turn the collector off and count what is left.

Every test runs on the asyncio loop and on uvloop, on loopback sockets.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import ssl
import weakref
from collections import Counter
from typing import Any

import pytest

import slabnet

#: The per-connection objects of slabnet (and the ssl module's under them).
_KINDS = frozenset({
    "SlabTransport", "SlabProtocol", "TLSTransport", "TLSEngine", "_StreamProtocol",
    "StreamReader", "StreamWriter", "SSLObject",
})


def _alive() -> Counter[str]:
    """Per-connection objects the collector tracks: reachable or in a cycle."""
    return Counter(
        type(o).__name__ for o in gc.get_objects()
        if type(o).__name__ in _KINDS and type(o).__module__.startswith(("slabnet", "ssl"))
    )


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_closed_connections_need_no_garbage_collector(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext
) -> None:
    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(await reader.read(100))
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=tls_server_context if tls else None
    )
    port = server.sockets[0].getsockname()[1]
    kw = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}

    async def exchange() -> None:
        reader, writer = await slabnet.open_connection("127.0.0.1", port, **kw)
        writer.write(b"hello")
        assert await reader.read() == b"hello"
        writer.close()
        await writer.wait_closed()

    try:
        await asyncio.wait_for(exchange(), 5)  # what a loop sets up once
        gc.collect()
        gc.disable()
        try:
            before = _alive()
            for _ in range(10):
                await asyncio.wait_for(exchange(), 5)
            await asyncio.sleep(0.05)  # (the server's handlers end)
            left = _alive() - before
        finally:
            gc.enable()
        assert not left, f"closed connections kept alive by cycles: {dict(left)}"
    finally:
        server.close()
        await server.wait_closed()


class _Recorder(slabnet.ChunkProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self.seen_in_lost: object = "not called"
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        assert self.transport is not None
        self.seen_in_lost = self.transport.get_protocol()
        self.lost.set_result(None)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_the_protocol_is_let_go_after_connection_lost(
    tls: bool, tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext
) -> None:
    # As asyncio's transports: get_protocol() is the protocol up to and
    # during its connection_lost(), None after it.
    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=tls_server_context if tls else None
    )
    kw = {"ssl": tls_client_context, "server_hostname": "localhost"} if tls else {}
    try:
        app = _Recorder()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await asyncio.get_running_loop().create_connection(
            lambda: slabnet.SlabProtocol(app, handshake_waiter=done, **kw),
            *server.sockets[0].getsockname()[:2],
        )
        await asyncio.wait_for(done, 5)
        assert app.transport is not None and app.transport.get_protocol() is app
        app.transport.close()
        await asyncio.wait_for(app.lost, 5)
        assert app.seen_in_lost is app
        assert app.transport.get_protocol() is None
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_an_open_tls_transport_keeps_a_key_sharing_dict(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext
) -> None:
    # An idle TLS connection's memory: CPython's instances of one class
    # share their dicts' key table while each holds at most 30 keys. A 30th
    # attribute on TLSTransport (afdd11b) gave every connection a dict of
    # its own keys, 1.3 KiB more: the idle benchmark's TLS server went from
    # 22.0 to 23.3 KiB per connection. A key-sharing dict is smaller than
    # a plain copy of itself; one with its own keys is not.
    transports: list[asyncio.BaseTransport] = []

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        transports.append(writer.transport)
        await reader.read()
        writer.close()

    server = await slabnet.start_server(handler, "127.0.0.1", 0, ssl=tls_server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.wait_for(slabnet.open_connection(
            "127.0.0.1", port, ssl=tls_client_context, server_hostname="localhost"
        ), 5)
        writer.write(b"x")
        await writer.drain()
        async with asyncio.timeout(5):
            while not transports:
                await asyncio.sleep(0.01)
        for transport in (transports[0], writer.transport):
            attrs = vars(transport)
            assert sys.getsizeof(attrs) < sys.getsizeof(dict(attrs)), sorted(attrs)
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


class _Closer(slabnet.ChunkProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _AppState:
    """What an app's handler refers to (a cache, a model, a pool)."""


@pytest.mark.parametrize("how", ["start_server", "start_unix_server", "app_factory"])
@pytest.mark.asyncio
async def test_a_closed_server_goes_with_its_last_reference(how: str, tmp_path: Any) -> None:
    # On 3.13 (asyncio loop) slabnet gives each Server an abort_clients()
    # that aborts its transports first. That replacement held the Server's
    # own bound method in the Server's __dict__: a cycle, so a closed
    # Server, its protocol factory and all the handler refers to waited for
    # the cyclic collector, where asyncio's Server goes at once.
    state = _AppState()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter,
                      state: _AppState = state) -> None:
        writer.close()

    loop = asyncio.get_running_loop()
    if how == "start_server":
        server = await slabnet.start_server(handler, "127.0.0.1", 0)
    elif how == "start_unix_server":
        server = await slabnet.start_unix_server(handler, str(tmp_path / "s"))
    else:  # a SlabProtocol factory of the app's own: the first connection hooks it
        def factory(state: _AppState = state) -> slabnet.SlabProtocol:
            return slabnet.SlabProtocol(_Closer())

        server = await loop.create_server(factory, "127.0.0.1", 0)
        del factory
    if how != "start_unix_server":
        reader, writer = await asyncio.wait_for(
            slabnet.open_connection(*server.sockets[0].getsockname()[:2]), 5
        )
        await asyncio.wait_for(reader.read(), 5)  # (served: the server hooked)
        writer.close()
        await writer.wait_closed()
    if hasattr(server, "abort_clients"):
        server.abort_clients()  # (still works: and aborts nothing here)
    server.close()
    await asyncio.wait_for(server.wait_closed(), 5)
    gc.collect()
    gc.disable()
    try:
        server_ref, state_ref = weakref.ref(server), weakref.ref(state)
        del server, state, handler
        await asyncio.sleep(0.05)  # (the loop lets go of what it scheduled)
        assert server_ref() is None, "a closed Server kept alive by a cycle"
        assert state_ref() is None
    finally:
        gc.enable()
