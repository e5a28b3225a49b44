"""The server side against hostile and broken clients (server audit), on
real loopback sockets, on both loops.

Each test bounds every wait, so a hang fails fast, and checks what asyncio's
own server does in the same case, or better: the connection ends, the error
is reported once (or not at all, for a client's fault), nothing is leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import slabnet
from conftest import (
    Boom, Handler, RawTLS, client_ctx, fds_settle, hard_close, open_fds, server_ctx,
)

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])

WAKE = 5.0  # seconds any waiter may take to wake after a fault


async def recv_until_closed(sock: socket.socket, timeout: float = WAKE) -> tuple[bytes, str]:
    """Read until EOF or reset; return (bytes read, "eof" or "reset")."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                return bytes(got), "reset"
            if not data:
                return bytes(got), "eof"
            got += data


# ---------------------------------------------------------------- app errors


@pytest.mark.asyncio
async def test_chunk_received_raising_on_held_bytes_ends_the_connection() -> None:
    # An app that pauses reading as it is made gets the bytes read while it
    # was paused (held, at most 1 KiB) from a callback once it resumes. If
    # its chunk_received raises there, the loop reports the error as it
    # does for a chunk it delivers itself, and the connection must end with
    # it, as then: it stayed open with its socket paused, never read again
    # nor closed, and connection_lost was never called.
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    made: asyncio.Future[slabnet.SlabProtocol] = loop.create_future()
    lost: asyncio.Future[BaseException | None] = loop.create_future()

    class App(slabnet.ChunkProtocol):
        def connection_made(self, transport: Any) -> None:
            transport.pause_reading()

        def chunk_received(self, chunk: memoryview) -> None:
            raise Boom("chunk_received")

        def connection_lost(self, exc: BaseException | None) -> None:
            lost.set_result(exc)

    def factory() -> slabnet.SlabProtocol:
        proto = slabnet.SlabProtocol(App(), loop=loop)
        made.set_result(proto)
        return proto

    server = await loop.create_server(factory, "127.0.0.1", 0)
    baseline = open_fds()
    sock = socket.create_connection(server.sockets[0].getsockname())
    try:
        sock.setblocking(False)
        await loop.sock_sendall(sock, b"hello")
        proto = await asyncio.wait_for(made, WAKE)
        async with asyncio.timeout(WAKE):  # the paused read took the bytes
            while proto._held is None:
                await asyncio.sleep(0.005)
        transport = proto._transport
        assert transport is not None
        transport.resume_reading()
        exc = await asyncio.wait_for(lost, WAKE)
        got, _ = await recv_until_closed(sock)
        assert isinstance(exc, Boom), repr(exc)
        assert got == b""
        errors = handler.exceptions()
        assert len(errors) == 1 and isinstance(errors[0], Boom), handler.contexts
    finally:
        sock.close()
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- TLS shutdown


async def read_to_close_notify(tls: RawTLS, timeout: float = WAKE) -> bytes:
    """Plaintext until the peer's close_notify (which must come)."""
    got = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                got += tls.obj.read(65536)
            except ssl.SSLWantReadError:
                await tls._pull()
            except ssl.SSLZeroReturnError:
                return bytes(got)


@VERSIONS
@pytest.mark.asyncio
async def test_data_after_the_servers_close_does_not_stall_its_shutdown(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    # A server answers (413, say) and closes while its client is still
    # uploading; the client's close_notify comes behind the rest of the
    # upload. The server must read on to that close_notify and drop the
    # data (past what was on its way), as asyncio's does. It delivered all
    # of it to a reader nobody reads any more, which paused reading past
    # its limit: the close_notify was never read, and every such connection
    # was held (socket, buffers) until the shutdown timeout, 30 s by
    # default, then ended with ShutdownTimeoutError.
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[BaseException | None] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"413 too large\n")
        writer.close()
        try:
            await writer.wait_closed()
        except Exception as exc:
            closed.set_result(exc)
        else:
            closed.set_result(None)

    server = await slabnet.start_server(
        handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version),
        ssl_shutdown_timeout=60.0,
    )
    baseline = open_fds()
    sock = socket.create_connection(server.sockets[0].getsockname())
    try:
        tls = RawTLS(sock, client_ctx(tls_ca, version), server_side=False,
                     server_hostname="localhost")
        await tls.handshake()
        # Far more than the reader holds before it pauses (2 x 64 KiB) and
        # than one read of the loop's lending buffer.
        wire = tls.seal(b"POST\n", *[b"u" * 16384] * 128) + tls.close_notify()
        upload = asyncio.create_task(tls.send(wire))
        assert await read_to_close_notify(tls) == b"413 too large\n"
        assert await asyncio.wait_for(closed, WAKE) is None
        await asyncio.wait_for(upload, WAKE)
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


# ---------------------------------------------------------------- accept path

# A server in a process of its own (the test process keeps its descriptors)
# whose RLIMIT_NOFILE leaves it a few descriptors once it listens. It echoes
# each connection until EOF, prints its port, and prints EMFILE when the
# loop reports an accept that failed for want of a descriptor.
_LIMITED_SERVER = textwrap.dedent("""
    import asyncio, os, resource, ssl, sys
    import slabnet

    loop_name, certfile = sys.argv[1], sys.argv[2]

    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    def report(loop, context):
        print("EMFILE" if "out of system resource" in context["message"]
              else "ERROR " + context["message"], flush=True)

    async def main():
        asyncio.get_running_loop().set_exception_handler(report)
        ctx = None
        if certfile:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(certfile)
        server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=ctx)
        # The lowest limit that leaves 6 descriptors free below it (the
        # open ones need not be contiguous: some may be inherited).
        used = {int(fd) for fd in os.listdir("/proc/self/fd")}
        limit, free = 0, 0
        while free < 6:
            free += limit not in used
            limit += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(3600)

    if loop_name == "uvloop":
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.SelectorEventLoop()
    loop.run_until_complete(main())
""")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_server_serves_again_once_descriptors_free_up(
    loop_name: str, server_cert: Any, tls_ca: Any, tmp_path: Path, tls: bool
) -> None:
    # Clients arrive faster than the server has descriptors: accept() fails
    # with EMFILE (asyncio's loop reports it and retries a second later;
    # libuv accepts and closes the extra ones). Once the clients leave, the
    # server must serve new ones, as asyncio's own server does.
    certfile = ""
    if tls:
        certfile = str(tmp_path / "server.pem")
        server_cert.private_key_and_cert_chain_pem.write_to_path(certfile)
    env = dict(os.environ, PYTHONPATH=str(Path(slabnet.__file__).parent.parent))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _LIMITED_SERVER, loop_name, certfile,
        stdout=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    emfile = asyncio.Event()

    async def follow(first: asyncio.Future[int]) -> None:
        assert proc.stdout is not None
        while line := (await proc.stdout.readline()).decode().strip():
            lines.append(line)
            if not first.done():
                first.set_result(int(line))
            elif line == "EMFILE":
                emfile.set()

    loop = asyncio.get_running_loop()
    first: asyncio.Future[int] = loop.create_future()
    follower = asyncio.create_task(follow(first))
    writers: list[asyncio.StreamWriter] = []
    closed_unserved = asyncio.Event()

    async def client(port: int, timeout: float) -> bool:
        """True once served (the echo came back); False if the server closed
        the connection first (libuv's way out of EMFILE)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx(tls_ca) if tls else None,
                server_hostname="localhost" if tls else None,
            ), timeout)
        except (ConnectionError, ssl.SSLError):
            closed_unserved.set()
            return False
        writers.append(writer)
        writer.write(b"ping")
        try:
            echo = await asyncio.wait_for(reader.read(4), timeout)
        except (ConnectionError, ssl.SSLError):
            echo = b""
        if echo != b"ping":
            closed_unserved.set()
        return echo == b"ping"

    try:
        port = await asyncio.wait_for(first, 3 * WAKE)
        # Five times the descriptors the server has left: EMFILE is certain.
        flood = [asyncio.create_task(client(port, 4 * WAKE)) for _ in range(30)]
        async with asyncio.timeout(2 * WAKE):
            # asyncio's loop reports the failed accept; uvloop closes the
            # connections it cannot keep.
            await asyncio.wait(
                [asyncio.create_task(emfile.wait()), asyncio.create_task(closed_unserved.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        for writer in writers:
            writer.close()
        writers.clear()
        # The descriptors come free as the server sees its clients go; a
        # client that comes before that may be closed unserved (libuv), but
        # the server keeps accepting: a new client is served.
        served = False
        async with asyncio.timeout(4 * WAKE):
            while not (served := await client(port, 4 * WAKE)):
                await asyncio.sleep(0.05)
        assert served, lines
        assert proc.returncode is None, lines
        assert not [line for line in lines if line.startswith("ERROR")], lines
    finally:
        for writer in writers:
            writer.close()
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


# ---------------------------------------------------------- the ssl argument


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("value", [True, False], ids=["True", "False"])
@pytest.mark.asyncio
async def test_a_bool_ssl_for_a_server_is_refused_as_asyncio(
    value: bool, unix: bool, tmp_path: Path
) -> None:
    """A server's ``ssl`` is a context or None. ``ssl=True`` raised
    ValueError (asyncio: TypeError), and ``ssl=False`` started a plain
    server where asyncio refuses it, so a wrong config value went unseen."""

    async def handler(reader: Any, writer: Any) -> None:
        writer.close()

    seen = {}
    for name, mod in (("slabnet", slabnet), ("asyncio", asyncio)):
        try:
            if unix:
                server = await mod.start_unix_server(handler, str(tmp_path / name), ssl=value)
            else:
                server = await mod.start_server(handler, "127.0.0.1", 0, ssl=value)
        except Exception as exc:  # the comparison is the test
            seen[name] = (type(exc).__name__, str(exc))
        else:
            server.close()
            await server.wait_closed()
            seen[name] = ("started", "")
    assert seen["slabnet"] == seen["asyncio"] == (
        "TypeError", "ssl argument must be an SSLContext or None"
    )


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("limit", [0, -1])
@pytest.mark.asyncio
async def test_a_server_limit_that_no_reader_takes_is_refused_before_it_listens(
    limit: int, unix: bool, tmp_path: Path
) -> None:
    """``start_server(limit=0)`` listened, then failed every connection in
    its factory (the StreamReader refuses the limit, as asyncio's): each
    client was accepted and dropped, and on uvloop it waited for good. The
    value is refused at the call instead, with the reader's own words, and
    nothing is left listening."""

    async def handler(reader: Any, writer: Any) -> None:
        writer.close()

    before = open_fds()
    with pytest.raises(ValueError, match="Limit cannot be <= 0"):
        if unix:
            await slabnet.start_unix_server(handler, str(tmp_path / "s"), limit=limit)
        else:
            await slabnet.start_server(handler, "127.0.0.1", 0, limit=limit)
    assert await fds_settle(before) == before
    assert not (tmp_path / "s").exists()


@pytest.mark.asyncio
async def test_a_slab_protocol_under_the_loops_tls_sends_no_plaintext(
    server_cert: Any, tls_ca: Any
) -> None:
    """``loop.create_server(SlabProtocol factory, ssl=ctx)``: the TLS is
    the loop's, and SlabProtocol took the socket of the TCP connection
    under it for its own. What the app wrote went out on it in plaintext,
    past the TLS: a client that completed the handshake read the app's
    bytes unencrypted. The connection is refused now, reported once, and
    nothing the app writes reaches the wire."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    made: list[Any] = []

    class App(slabnet.ChunkProtocol):
        def connection_made(self, transport: Any) -> None:
            made.append(transport)
            transport.write(b"secret")

        def chunk_received(self, chunk: memoryview) -> None:
            made[0].write(b"secret " + bytes(chunk))

    server = await loop.create_server(
        lambda: slabnet.SlabProtocol(App()), "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    sock = socket.create_connection(server.sockets[0].getsockname())
    try:
        tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
        await asyncio.wait_for(tls.handshake(), WAKE)
        await tls.send(tls.seal(b"hello"))
        wire = bytearray()
        async with asyncio.timeout(WAKE):  # until the server ends it (or leaks)
            while b"secret" not in wire:
                try:
                    data = await loop.sock_recv(sock, 65536)
                except ConnectionResetError:
                    break
                if not data:
                    break
                wire += data
        assert b"secret" not in wire
        assert made == []
        (context,) = handler.contexts  # (the loop's report of what connection_made raised)
        assert isinstance(context["exception"], TypeError)
        assert "pass ssl= to SlabProtocol" in str(context["exception"])
    finally:
        sock.close()
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("how", ["tcp", "unix", "accepted"])
@pytest.mark.asyncio
async def test_a_slab_protocol_under_the_loops_tls_makes_the_connect_raise(
    how: str, server_cert: Any, tls_ca: Any, tmp_path: Path
) -> None:
    """``loop.create_connection(SlabProtocol factory, ssl=ctx)`` (or
    ``create_unix_connection``, or ``connect_accepted_socket`` on the server
    side): slabnet refuses the loop's TLS, but reported the refusal to the
    exception handler and aborted the connection after the loop's
    handshake, so the call returned a closed transport, as if it had
    connected. It raises the ``TypeError`` now, as it raises what any
    protocol's ``connection_made`` raises under the loop's TLS (which the
    loop reports too)."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    made: list[Any] = []

    class App(slabnet.ChunkProtocol):
        def connection_made(self, transport: Any) -> None:
            made.append(transport)

    def factory() -> slabnet.SlabProtocol:
        return slabnet.SlabProtocol(App(), server_side=how == "accepted")

    baseline = open_fds()
    client: asyncio.Future[Any] | None = None
    if how == "unix":
        path = str(tmp_path / "s")
        server = await asyncio.start_unix_server(
            lambda r, w: None, path, ssl=server_ctx(server_cert))
        connect = loop.create_unix_connection(
            factory, path, ssl=client_ctx(tls_ca), server_hostname="localhost")
    else:
        server = await asyncio.start_server(
            lambda r, w: None, "127.0.0.1", 0, ssl=server_ctx(server_cert))
        address = server.sockets[0].getsockname()[:2]
        if how == "tcp":
            connect = loop.create_connection(
                factory, *address, ssl=client_ctx(tls_ca), server_hostname="localhost")
        else:
            listener = socket.create_server(("127.0.0.1", 0))
            listener.setblocking(False)
            client = asyncio.ensure_future(asyncio.open_connection(
                *listener.getsockname(), ssl=client_ctx(tls_ca), server_hostname="localhost"))
            with listener:
                sock, _ = await asyncio.wait_for(loop.sock_accept(listener), WAKE)
            connect = loop.connect_accepted_socket(factory, sock, ssl=server_ctx(server_cert))
    try:
        with pytest.raises(TypeError, match="pass ssl= to SlabProtocol"):
            await asyncio.wait_for(connect, WAKE)
        assert made == []
        (context,) = handler.contexts  # the loop's report of it, once
        assert isinstance(context["exception"], TypeError)
    finally:
        if client is not None:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.wait_for(client, WAKE)
                writer.close()
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("debug", [False, True], ids=["quiet", "debug"])
@pytest.mark.asyncio
async def test_a_failed_incoming_handshake_is_reported_in_debug_mode_only(
    debug: bool, server_cert: Any
) -> None:
    """A client that sends garbage instead of a ClientHello: no handler
    ever sees the connection. asyncio's loop tells its exception handler in
    debug mode (``Error on transport creation for incoming connection``),
    and stays quiet otherwise; slabnet stayed quiet in debug mode too."""
    loop = asyncio.get_running_loop()
    async with unserved_tls_server(debug, server_cert) as (server, handler):
        sock = socket.create_connection(server.sockets[0].getsockname())
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\n\r\n")
            data, end = await recv_until_closed(sock)  # the server gives up
        finally:
            sock.close()
        await asyncio.sleep(0.01)
        messages = [c.get("message") for c in handler.contexts]
        if debug:
            assert messages == ["Error on transport creation for incoming connection"]
            assert isinstance(handler.contexts[0]["exception"], ssl.SSLError)
        else:
            assert messages == []


@contextlib.asynccontextmanager
async def unserved_tls_server(
    debug: bool, server_cert: Any
) -> AsyncIterator[tuple[asyncio.Server, Handler]]:
    """A TLS server whose handler must never run (checked on exit), with
    the loop in debug mode or not and its exception handler noting reports."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    was = loop.get_debug()
    loop.set_debug(debug)
    served: list[Any] = []
    server = await slabnet.start_server(
        lambda r, w: served.append(w), "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    try:
        yield server, handler
        assert served == []
    finally:
        loop.set_debug(was)
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_an_incoming_handshake_cut_by_a_reset_is_reported_in_debug_mode(
    server_cert: Any,
) -> None:
    """The client sends part of a ClientHello, then resets. asyncio's loop
    reports it in debug mode, as it reports a handshake that failed
    (``Error on transport creation for incoming connection``, with the
    ``ConnectionResetError``); slabnet reported a failed one (the test
    above) but said nothing of a reset, on both loops."""
    async with unserved_tls_server(True, server_cert) as (server, handler):
        sock = socket.create_connection(server.sockets[0].getsockname())
        sock.sendall(b"\x16\x03\x01\x00\x05")  # a record header, nothing more
        await asyncio.sleep(0.01)
        hard_close(sock)
        async with asyncio.timeout(WAKE):
            while not handler.contexts:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.01)  # (no second report follows)
        assert [c.get("message") for c in handler.contexts] == [
            "Error on transport creation for incoming connection"
        ]
        assert isinstance(handler.contexts[0]["exception"], ConnectionResetError)
