"""Resource limits and lifecycle faults on the paths other than TCP (limits
audit): Unix sockets, TLS over Unix sockets, ``start_tls()`` upgrades and
``sock=`` streams, each against asyncio's own streams on the same loop.

Probed: a process out of descriptors (at accept, at connect, during an
upgrade), a caller cancelled at every await, a peer that resets at each
stage of a TLS handshake, a server closed with handshakes in progress, the
handshake and shutdown timeouts, and an app callback that raises. Each test
bounds every wait and checks that no descriptor, task or logged error is
left behind where asyncio leaves none.

A Unix socket has no RST: a peer that closes with bytes it has not read
resets the connection (ECONNRESET), which is what ``hard_close`` of a socket
with unread input amounts to here.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import re
import resource
import socket
import ssl
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import slabnet
from conftest import Handler, RawTLS, client_ctx, fds_settle, hard_close, open_fds, server_ctx
from test_conn_hardening import _fill_descriptors
from test_unix_streams import WAIT, both, outcome_of, sockdir, until_readable  # noqa: F401 (a fixture)


def _tasks() -> int:
    return len(asyncio.all_tasks())


async def _settled(baseline: int) -> int:
    """Descriptors left once closes that were handed to the loop are done."""
    await asyncio.sleep(0.05)
    gc.collect()
    return await fds_settle(baseline)


def _logged(handler: Handler) -> list[tuple[str, str]]:
    return [(c["message"], type(c.get("exception")).__name__) for c in handler.contexts]


async def _ends(sock: socket.socket, timeout: float = 3.0) -> str:
    """How a raw peer sees the connection end: "eof", "reset" or "open"."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while await loop.sock_recv(sock, 65536):
                pass
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"
    return "eof"


# ---------------------------------------------------------------- descriptors

# A Unix server in a process of its own, asyncio's streams or slabnet's,
# whose RLIMIT_NOFILE leaves it 6 descriptors once it listens. It echoes
# each connection until EOF and prints what the loop's exception handler
# is given.
_LIMITED_UNIX_SERVER = textwrap.dedent("""
    import asyncio, os, resource, ssl, sys
    import slabnet

    loop_name, impl_name, path, certfile = sys.argv[1:5]
    impl = slabnet if impl_name == "slabnet" else asyncio

    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    def report(loop, context):
        print("LOG", context["message"], repr(context.get("exception")), flush=True)

    async def main():
        asyncio.get_running_loop().set_exception_handler(report)
        ctx = None
        if certfile:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(certfile)
        await impl.start_unix_server(handle, path, ssl=ctx)
        used = {int(fd) for fd in os.listdir("/proc/self/fd")}
        limit, free = 0, 0
        while free < 6:
            free += limit not in used
            limit += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        print("READY", flush=True)
        await asyncio.sleep(3600)

    if loop_name == "uvloop":
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.SelectorEventLoop()
    loop.run_until_complete(main())
""")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_unix_server_out_of_descriptors_matches_asyncio(
    loop_name: str, server_cert: Any, tls_ca: Any, sockdir: str, tls: bool
) -> None:
    """20 clients at once for a Unix server with 6 descriptors left: the
    ones it cannot accept wait (asyncio's loop: EMFILE, reported, accept
    retried a second later) or are closed unserved (libuv); the server does
    not spin meanwhile, and serves again once they leave. slabnet's server
    does what asyncio's does, and the loop reports nothing else."""
    certfile = ""
    if tls:
        certfile = os.path.join(sockdir, "server.pem")
        server_cert.private_key_and_cert_chain_pem.write_to_path(certfile)
    env = dict(os.environ, PYTHONPATH=str(Path(slabnet.__file__).parent.parent))

    async def scenario(impl: ModuleType, where: str) -> dict[str, Any]:
        path = os.path.join(where, "s")
        log = os.path.join(where, "log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LIMITED_UNIX_SERVER, loop_name, impl.__name__,
                 path, certfile], stdout=out, env=env,
            )
        try:
            async with asyncio.timeout(WAIT):
                while "READY" not in Path(log).read_text():
                    await asyncio.sleep(0.02)
            kw: dict[str, Any] = (
                {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
            )
            writers: list[asyncio.StreamWriter] = []

            async def client() -> bool:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_unix_connection(path, **kw), 2)
                except (OSError, ssl.SSLError):  # (TimeoutError included)
                    return False
                writers.append(writer)
                writer.write(b"ping")
                try:
                    return await asyncio.wait_for(reader.read(4), 2) == b"ping"
                except (OSError, ssl.SSLError):
                    return False

            served = await asyncio.gather(*[client() for _ in range(20)])
            # The server is at its limit now, with clients waiting.
            cpu = _cpu_seconds(proc.pid)
            await asyncio.sleep(1.0)
            cpu = _cpu_seconds(proc.pid) - cpu
            for writer in writers:
                writer.close()
            writers.clear()
            again = False
            async with asyncio.timeout(WAIT):
                while not again:
                    again = await client()
            for writer in writers:
                writer.close()
        finally:
            proc.kill()
            proc.wait()
        lines = Path(log).read_text().splitlines()
        return {
            "served_at_first": 0 < sum(served) < 20,
            "cpu": cpu,
            "served_again": again,
            "logged": sorted({line for line in lines if line != "READY"}),
        }

    seen = await both(scenario, sockdir)
    for impl, got in seen.items():
        assert got["served_at_first"] and got["served_again"], (impl, got)
        assert got["cpu"] < 0.5, (impl, got)  # a spinning loop takes the whole second
    assert seen["slabnet"]["logged"] == seen["asyncio"]["logged"]
    assert all("out of system resource" in line for line in seen["slabnet"]["logged"])


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_open_unix_connection_out_of_descriptors_matches_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """No descriptor left for the client's socket: the same EMFILE error as
    asyncio's, nothing left behind, and the next connect works."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")
        server = await impl.start_unix_server(
            lambda r, w: w.close(), path, ssl=server_ctx(server_cert) if tls else None)
        kw: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        # A first connection, so that what is set up once (the TLS modules,
        # uvloop's spare descriptor) is not what runs out.
        _, writer = await impl.open_unix_connection(path, **kw)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        await asyncio.sleep(0.05)  # (the server's end of it closes too)
        baseline, tasks = open_fds(), _tasks()
        fillers, old = _fill_descriptors(0)
        try:
            try:
                await asyncio.wait_for(impl.open_unix_connection(path, **kw), WAIT)
                outcome: Any = "connected"
            except OSError as exc:
                outcome = outcome_of(exc)
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, old)
        left = await _settled(baseline) <= baseline, _tasks() <= tasks
        reader, writer = await asyncio.wait_for(impl.open_unix_connection(path, **kw), WAIT)
        after = await asyncio.wait_for(reader.read(), WAIT)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        return [outcome, left, after]

    try:
        seen = await both(scenario, sockdir)
    finally:
        loop.set_exception_handler(None)
    assert seen["slabnet"] == seen["asyncio"]
    assert seen["slabnet"] == [("OSError", errno.EMFILE, "[Errno 24] Too many open files"),
                               (True, True), b""]
    assert not handler.contexts


@pytest.mark.asyncio
async def test_start_tls_with_no_descriptor_free_matches_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any
) -> None:
    """An upgrade needs no descriptor: start_tls() on a Unix stream with
    none free completes, and 4 MiB (more than the socket holds, so the
    queue waits, lent to the loop's transport for want of a duplicate) go
    through it whole."""
    payload = os.urandom(4 << 20)

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")

        async def handle(reader: Any, writer: Any) -> None:
            try:
                await reader.readline()
                writer.write(b"go\n")
                await writer.drain()
                await writer.start_tls(server_ctx(server_cert))
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            writer.close()

        server = await impl.start_unix_server(handle, path)
        reader, writer = await impl.open_unix_connection(path)
        writer.write(b"tls\n")
        assert await asyncio.wait_for(reader.readline(), WAIT) == b"go\n"
        fillers, old = _fill_descriptors(0)
        try:
            await asyncio.wait_for(
                writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"), WAIT)
            writer.write(payload)
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 3 * WAIT)
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, old)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        return [echoed == payload, writer.get_extra_info("ssl_object") is not None]

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"] == [True, True]


# ---------------------------------------------------------------- cancellation


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.asyncio
async def test_start_tls_cancelled_at_every_step_leaves_nothing(
    sockdir: str, server_cert: Any, tls_ca: Any, side: str
) -> None:
    """start_tls() over a Unix stream cancelled after 0, 1, 2, ... loop
    iterations, on the client or in a server's handler, until it completes
    first: each raises CancelledError or completes, the connection ends
    (wait_closed() returns: asyncio's hangs there on its own loop after a
    cancelled client upgrade), and no descriptor, task or logged error is
    left (asyncio 3.11 logs the handler's CancelledError)."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    path = os.path.join(sockdir, "s")
    handlers: list[asyncio.Task[Any]] = []
    upgrades: list[str] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await reader.readline()
            writer.write(b"go\n")
            await writer.drain()
            try:
                await asyncio.wait_for(writer.start_tls(server_ctx(server_cert)), WAIT)
            except asyncio.CancelledError:
                upgrades.append("cancelled")
                raise
            upgrades.append("done")
            await reader.read()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await slabnet.start_unix_server(handle, path)
    baseline, tasks = open_fds(), _tasks()
    results: list[str] = []
    try:
        for steps in range(60):
            reader, writer = await slabnet.open_unix_connection(path)
            writer.write(b"tls\n")
            assert await asyncio.wait_for(reader.readline(), WAIT) == b"go\n"
            upgrade = asyncio.ensure_future(
                writer.start_tls(client_ctx(tls_ca), server_hostname="localhost"))
            for _ in range(steps):
                await asyncio.sleep(0)
            (upgrade if side == "client" else handlers[-1]).cancel()
            try:
                await asyncio.wait_for(upgrade, WAIT)
                results.append("done")
            except asyncio.CancelledError:
                results.append("cancelled")
            except (ConnectionError, ssl.SSLError):
                results.append("failed")  # (the server's side gave up)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), WAIT)
            except (ConnectionError, ssl.SSLError):
                pass
            if side == "client" and results[-1] == "done":
                break
            if side == "server" and upgrades and upgrades[-1] == "done":
                break
        else:
            pytest.fail(f"the upgrade never completed before the cancel: {results}")
        assert "cancelled" in (results if side == "client" else upgrades)
        assert await _settled(baseline) <= baseline
        assert _tasks() <= tasks + 1  # (+ the last handler, reading to EOF)
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        loop.set_exception_handler(None)
    assert not handler.contexts, _logged(handler)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_cancelled_waits_over_unix_match_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """drain() with a full queue, readexactly() and wait_closed() over a
    Unix stream, each cancelled: the connection still works (a drain after
    the peer reads returns, a read returns its bytes) and the next
    wait_closed() completes (asyncio's raises CancelledError over TLS: its
    close future was cancelled); nothing is left, nothing logged."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)

    async def scenario(impl: ModuleType, where: str) -> dict[str, Any]:
        path = os.path.join(where, "s")
        gate = asyncio.Event()

        async def handle(reader: Any, writer: Any) -> None:
            await gate.wait()
            try:
                while data := await reader.read(1 << 20):
                    if data.endswith(b"!"):
                        writer.write(b"0123456789")
            except (ConnectionError, ssl.SSLError):
                pass
            writer.close()

        server = await impl.start_unix_server(
            handle, path, ssl=server_ctx(server_cert) if tls else None)
        baseline, tasks = open_fds(), _tasks()
        kw: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        reader, writer = await impl.open_unix_connection(path, **kw)
        seen: dict[str, Any] = {}
        try:
            async with asyncio.timeout(0.5):
                while True:  # until the queue is full and drain() waits
                    writer.write(b"x" * (1 << 20))
                    await writer.drain()
        except TimeoutError:
            seen["drain"] = "timed out"
        gate.set()
        await asyncio.wait_for(writer.drain(), WAIT)
        read = asyncio.ensure_future(reader.readexactly(10))
        await asyncio.sleep(0.05)
        read.cancel()
        seen["readexactly"] = await asyncio.gather(read, return_exceptions=True)
        writer.write(b"!")
        seen["read after"] = await asyncio.wait_for(reader.readexactly(10), WAIT)
        writer.close()
        closing = asyncio.ensure_future(writer.wait_closed())
        await asyncio.sleep(0)
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        try:
            await asyncio.wait_for(writer.wait_closed(), WAIT)
            seen["wait_closed after"] = "done"
        except asyncio.CancelledError:
            seen["wait_closed after"] = "CancelledError"
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        seen["left"] = (await _settled(baseline)) - baseline, _tasks() - tasks
        return seen

    try:
        seen = await both(scenario, sockdir)
    finally:
        loop.set_exception_handler(None)
    got = seen["slabnet"]
    assert got["drain"] == "timed out"
    assert [type(e) for e in got["readexactly"]] == [asyncio.CancelledError]
    assert got["read after"] == b"0123456789"
    assert got["wait_closed after"] == "done"
    assert got["left"][0] <= 0 and got["left"][1] <= 0
    for key in ("drain", "read after"):
        assert got[key] == seen["asyncio"][key]
    assert not handler.contexts, _logged(handler)


# ---------------------------------------------------------------- resets


def _let_go(sock: socket.socket, inode: int) -> None:
    """Forget ``sock`` without closing a descriptor that is no longer its.

    uvloop closes the descriptor of a ``sock=`` connection whose set-up
    failed but leaves the socket object holding its number (asyncio's
    streams on uvloop as slabnet's): closing that object later, or its
    collection, closes whatever descriptor has the number by then -- in a
    loop of attempts, the next attempt's socket (EBADF there)."""
    fd = sock.fileno()
    try:
        ours = fd >= 0 and os.fstat(fd).st_ino == inode
    except OSError:
        ours = False
    if ours:
        sock.close()
    else:
        sock.detach()


def _broken(exc: BaseException) -> str:
    """A reset and an EPIPE as one: which of the two a write or read meets
    first, where the peer left with our bytes unread, is the kernel's
    timing."""
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "reset or EPIPE"
    return type(exc).__name__


_STAGES = ["start", "hello_unread", "hello_read", "flight_sent", "finished_unread", "done"]


async def _tls_server_peer(sock: socket.socket, stage: str, ctx: ssl.SSLContext) -> str:
    """A raw TLS server that resets (closes with input unread, or at once)
    at ``stage`` of the handshake; returns "" or, if the client left
    first, why."""
    try:
        await _tls_server_steps(sock, stage, ctx)
    except ConnectionError as exc:
        return f"the client left first: {exc!r}"
    finally:
        hard_close(sock)
    return ""


async def _tls_server_steps(sock: socket.socket, stage: str, ctx: ssl.SSLContext) -> None:
    tls = RawTLS(sock, ctx, server_side=True)
    if stage != "start":
        await until_readable(sock)  # the ClientHello has come, unread
        if stage != "hello_unread":
            await asyncio.wait_for(tls._pull(), WAIT)
            if stage != "hello_read":
                try:
                    tls.obj.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                await tls.flush()
                if stage != "flight_sent":
                    await until_readable(sock)  # the client's Finished has come
                    if stage == "done":
                        await asyncio.wait_for(tls.handshake(), WAIT)


@pytest.mark.parametrize("over", ["unix", "socketpair", "start_tls"])
@pytest.mark.asyncio
async def test_peer_reset_at_each_handshake_stage_matches_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any, over: str
) -> None:
    """A TLS server peer that resets at each stage of the handshake, over a
    Unix socket, a socketpair (``sock=``) and a ``start_tls()`` upgrade:
    the client gets the error asyncio's gets (the same class; the
    connection, if it was made, fails its first read as asyncio's), at
    once, with nothing left and nothing logged."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)

    async def attempt(impl: ModuleType, where: str, stage: str) -> list[Any]:
        kw: dict[str, Any] = {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"}
        path = os.path.join(where, stage)
        listening = socket.socket(socket.AF_UNIX)
        peer: asyncio.Future[str]
        if over == "socketpair":
            listening.close()
            ours, theirs = socket.socketpair()
            pair = ours, os.fstat(ours.fileno()).st_ino
            peer = asyncio.ensure_future(_tls_server_peer(theirs, stage, server_ctx(server_cert)))
            opening = impl.open_connection(sock=ours, **kw)
        else:
            listening.bind(path)
            listening.listen()
            listening.setblocking(False)

            async def accept() -> str:
                conn, _ = await loop.sock_accept(listening)
                listening.close()
                if over == "start_tls":
                    await loop.sock_sendall(conn, b"go\n")
                return await _tls_server_peer(conn, stage, server_ctx(server_cert))

            peer = asyncio.ensure_future(accept())
            if over == "unix":
                opening = impl.open_unix_connection(path, **kw)
            else:
                async def upgraded() -> Any:
                    reader, writer = await impl.open_unix_connection(path)
                    assert await reader.readline() == b"go\n"
                    try:
                        await writer.start_tls(kw["ssl"], server_hostname="localhost")
                    except BaseException:
                        writer.close()
                        raise
                    return reader, writer
                opening = upgraded()
        started = loop.time()
        try:
            reader, writer = await asyncio.wait_for(opening, WAIT)
        except Exception as exc:
            outcome: list[Any] = [_broken(exc)]
        else:
            try:
                outcome = ["connected", await asyncio.wait_for(reader.read(), WAIT)]
            except Exception as exc:
                outcome = ["connected", _broken(exc)]
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), WAIT)
            except (ConnectionError, ssl.SSLError):
                pass
        outcome.append(await asyncio.wait_for(peer, WAIT))
        if over == "socketpair":
            await asyncio.sleep(0)  # (the loop's close of a failed one)
            _let_go(*pair)
        assert loop.time() - started < 2.0, (stage, outcome)
        return outcome

    async def scenario(impl: ModuleType, where: str) -> dict[str, Any]:
        baseline, tasks = open_fds(), _tasks()
        seen: dict[str, Any] = {stage: await attempt(impl, where, stage) for stage in _STAGES}
        seen["left"] = (await _settled(baseline)) - baseline, _tasks() - tasks
        return seen

    try:
        seen = await both(scenario, sockdir)
    finally:
        loop.set_exception_handler(None)
    assert seen["slabnet"] == seen["asyncio"]
    assert seen["slabnet"]["left"] == (0, 0)
    for stage in ("start", "hello_unread", "hello_read"):
        assert seen["slabnet"][stage] == ["reset or EPIPE", ""], stage
    for stage in ("flight_sent", "finished_unread"):
        assert seen["slabnet"][stage] == ["connected", "reset or EPIPE", ""], stage
    assert seen["slabnet"]["done"] == ["connected", b"", ""]
    assert not handler.contexts, _logged(handler)


_CLIENT_STAGES = ["connect", "hello", "flight_unread", "flight_read", "finished_unread", "done"]


@pytest.mark.asyncio
async def test_clients_reset_mid_handshake_on_a_unix_tls_server_match_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any
) -> None:
    """Raw clients that reset at each stage of the handshake with a TLS
    Unix server: the handler runs only for the ones that finished it, and
    sees what asyncio's sees (a reset, or EOF); nothing is logged, nothing
    left, and the server keeps serving."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)

    async def client(path: str, stage: str) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.setblocking(False)
        await loop.sock_connect(sock, path)
        tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
        upto = _CLIENT_STAGES.index(stage)
        for step in _CLIENT_STAGES[1:upto + 1]:
            if step in ("hello", "finished_unread"):
                try:
                    tls.obj.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                await tls.flush()
                if step == "finished_unread":
                    await until_readable(sock)  # the tickets have come, unread
            elif step == "flight_unread":
                await until_readable(sock)  # the server's flight has come, unread
            elif step == "flight_read":
                await asyncio.wait_for(tls._pull(), WAIT)
            elif step == "done":
                try:
                    await asyncio.wait_for(tls._pull(), 0.5)  # (TLS 1.3 tickets)
                except TimeoutError:
                    pass
        hard_close(sock)

    async def scenario(impl: ModuleType, where: str) -> dict[str, Any]:
        path = os.path.join(where, "s")
        handled: list[Any] = []

        async def handle(reader: Any, writer: Any) -> None:
            try:
                handled.append(await asyncio.wait_for(reader.read(), WAIT))
            except (ConnectionError, ssl.SSLError) as exc:
                handled.append(type(exc).__name__)
            writer.close()

        server = await impl.start_unix_server(handle, path, ssl=server_ctx(server_cert))
        baseline, tasks = open_fds(), _tasks()
        seen: dict[str, Any] = {}

        async def handled_one() -> None:
            async with asyncio.timeout(WAIT):
                while not handled:
                    await asyncio.sleep(0.01)

        for stage in _CLIENT_STAGES:
            await client(path, stage)
            if stage in ("finished_unread", "done"):
                await handled_one()
            else:
                await asyncio.sleep(0.2)  # (time for a handler that should not run)
            seen[stage] = list(handled)
            handled.clear()
        reader, writer = await impl.open_unix_connection(
            path, ssl=client_ctx(tls_ca), server_hostname="localhost")
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        await handled_one()
        seen["served after"] = handled == [b""]
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        seen["left"] = (await _settled(baseline)) - baseline, _tasks() - tasks
        return seen

    try:
        seen = await both(scenario, sockdir)
    finally:
        loop.set_exception_handler(None)
    assert seen["slabnet"] == seen["asyncio"]
    got = seen["slabnet"]
    assert got["connect"] == got["hello"] == got["flight_unread"] == got["flight_read"] == []
    assert got["finished_unread"] == ["ConnectionResetError"]
    assert got["done"] == [b""]
    assert got["served after"] and got["left"][0] <= 0 and got["left"][1] <= 0
    assert not handler.contexts, _logged(handler)


# ---------------------------------------------------------------- server close


@pytest.mark.asyncio
async def test_unix_tls_server_closed_with_handshakes_in_progress_matches_asyncio(
    loop_name: str, sockdir: str, server_cert: Any, tls_ca: Any
) -> None:
    """A TLS Unix server with three clients mid-handshake (one silent, two
    that sent their ClientHello) and two connected: ``close()`` leaves
    them all open, as asyncio's; ``close_clients()`` and ``abort_clients()``
    (3.13, asyncio's loop) end every one of them, handshakes included, and
    wait_closed() returns at once. Nothing is left, nothing logged."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)

    async def one(impl: ModuleType, where: str, how: str) -> dict[str, Any] | None:
        path = os.path.join(where, how)

        async def handle(reader: Any, writer: Any) -> None:
            try:
                await reader.read()
            except (ConnectionError, ssl.SSLError):
                pass
            writer.close()

        server = await impl.start_unix_server(handle, path, ssl=server_ctx(server_cert))
        if how != "close" and not hasattr(server, how):
            server.close()
            await asyncio.wait_for(server.wait_closed(), WAIT)
            return None  # (before 3.13, and uvloop's Server)
        baseline, tasks = open_fds(), _tasks()
        raws: list[RawTLS] = []
        for i in range(3):
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            await loop.sock_connect(sock, path)
            tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
            if i:
                try:
                    tls.obj.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                await tls.flush()
            raws.append(tls)
        clients = [
            await asyncio.wait_for(impl.open_unix_connection(
                path, ssl=client_ctx(tls_ca), server_hostname="localhost"), WAIT)
            for _ in range(2)
        ]
        await asyncio.sleep(0.2)
        if how != "close":
            getattr(server, how)()
        server.close()

        async def client_end(reader: Any) -> Any:
            try:
                return await asyncio.wait_for(reader.read(), 1.0)
            except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
                return type(exc).__name__

        ends = await asyncio.gather(
            *[_ends(tls.sock, 1.0) for tls in raws], *[client_end(r) for r, _ in clients])
        try:
            await asyncio.wait_for(server.wait_closed(), 0.5)
            waited = "returned"
        except TimeoutError:
            waited = "waits"
        for tls in raws:
            tls.sock.close()
        for _, writer in clients:
            writer.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        left = (await _settled(baseline)) - baseline, _tasks() - tasks
        return {"ends": ends, "wait_closed": waited,
                "left": left[0] <= 0 and left[1] <= 0}

    async def scenario(impl: ModuleType, where: str) -> dict[str, Any]:
        return {how: await one(impl, where, how)
                for how in ("close", "close_clients", "abort_clients")}

    try:
        seen = await both(scenario, sockdir)
    finally:
        loop.set_exception_handler(None)
    assert seen["slabnet"] == seen["asyncio"]
    got = seen["slabnet"]
    # (asyncio's Server.wait_closed() waits for the connections from 3.12
    # on; uvloop's never does.)
    waits = loop_name == "asyncio" and sys.version_info >= (3, 12)
    assert got["close"] == {"ends": ["open"] * 3 + ["TimeoutError"] * 2, "left": True,
                            "wait_closed": "waits" if waits else "returned"}
    for how in ("close_clients", "abort_clients"):
        if got[how] is not None:
            assert got[how] == {"ends": ["eof"] * 3 + [b""] * 2,
                                "wait_closed": "returned", "left": True}, how
    assert not handler.contexts, _logged(handler)


# ---------------------------------------------------------------- timeouts


@pytest.mark.asyncio
async def test_tls_timeouts_over_unix_paths(sockdir: str, server_cert: Any, tls_ca: Any) -> None:
    """ssl_handshake_timeout on a Unix server (a silent client, and one that
    sent only its ClientHello: closed after the timeout, as asyncio's), on
    a client over a Unix socket and over a socketpair (HandshakeTimeoutError
    after the timeout; uvloop's streams never time out over ``sock=``), and
    ssl_shutdown_timeout over a socketpair with a peer that never answers
    close_notify (ShutdownTimeoutError, the connection ended)."""
    loop = asyncio.get_running_loop()
    path = os.path.join(sockdir, "s")
    baseline = open_fds()

    server = await slabnet.start_unix_server(
        lambda r, w: w.close(), path, ssl=server_ctx(server_cert), ssl_handshake_timeout=0.5)
    try:
        for hello in (False, True):
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            await loop.sock_connect(sock, path)
            tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
            if hello:
                try:
                    tls.obj.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                await tls.flush()
            started = loop.time()
            assert await _ends(sock) == "eof"
            assert 0.4 < loop.time() - started < 2.0
            sock.close()
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)

    silent = socket.socket(socket.AF_UNIX)
    silent.bind(os.path.join(sockdir, "silent"))
    silent.listen()
    ours, theirs = socket.socketpair()
    try:
        for opening in (
            slabnet.open_unix_connection(
                os.path.join(sockdir, "silent"), ssl=client_ctx(tls_ca),
                server_hostname="localhost", ssl_handshake_timeout=0.5),
            slabnet.open_connection(
                sock=ours, ssl=client_ctx(tls_ca), server_hostname="localhost",
                ssl_handshake_timeout=0.5),
        ):
            started = loop.time()
            with pytest.raises(slabnet.HandshakeTimeoutError):
                await asyncio.wait_for(opening, WAIT)
            assert 0.4 < loop.time() - started < 2.0
    finally:
        silent.close()
        theirs.close()

    ours, theirs = socket.socketpair()
    peer = RawTLS(theirs, server_ctx(server_cert), server_side=True)
    shaking = asyncio.ensure_future(peer.handshake())
    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        sock=ours, ssl=client_ctx(tls_ca), server_hostname="localhost",
        ssl_shutdown_timeout=0.5), WAIT)
    await asyncio.wait_for(shaking, WAIT)
    started = loop.time()
    writer.close()
    with pytest.raises(slabnet.ShutdownTimeoutError):
        await asyncio.wait_for(writer.wait_closed(), WAIT)
    assert 0.4 < loop.time() - started < 2.0
    assert await _ends(theirs) == "eof"
    theirs.close()
    assert await _settled(baseline) <= baseline


# ---------------------------------------------------------------- app errors


class _Oops(Exception):
    """The handler's own bug."""


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("when", ["async", "async_after_a_read"])
@pytest.mark.asyncio
async def test_raising_handler_on_a_unix_server_matches_asyncio(
    sockdir: str, server_cert: Any, tls_ca: Any, tls: bool, when: str
) -> None:
    """A coroutine client_connected_cb that raises (at once, or after a
    read): logged as asyncio logs it ("Unhandled exception in
    client_connected_cb", once), the connection closed, and the server
    serves the next client."""
    loop = asyncio.get_running_loop()

    async def scenario(impl: ModuleType, where: str) -> list[Any]:
        path = os.path.join(where, "s")
        handler = Handler()
        loop.set_exception_handler(handler)
        calls = 0

        async def handle(reader: Any, writer: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                if when == "async_after_a_read":
                    await reader.readline()
                raise _Oops("handler")
            writer.write(await reader.readline())
            writer.close()

        server = await impl.start_unix_server(
            handle, path, ssl=server_ctx(server_cert) if tls else None)
        kw: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        baseline = open_fds()
        got: list[Any] = []
        for _ in range(2):
            reader, writer = await asyncio.wait_for(impl.open_unix_connection(path, **kw), WAIT)
            if when == "async_after_a_read" or _ == 1:
                writer.write(b"hi\n")
            try:
                got.append(await asyncio.wait_for(reader.read(), WAIT))
            except ConnectionError:  # (a close with our line unread: a reset)
                got.append(b"")
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), WAIT)
            except ConnectionError:
                pass
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        loop.set_exception_handler(None)
        got.append([(m, e) for m, e in _logged(handler)])
        got.append((await _settled(baseline)) - baseline <= 0)
        return got

    seen = await both(scenario, sockdir)
    assert seen["slabnet"] == seen["asyncio"]
    assert seen["slabnet"] == [
        b"", b"hi\n", [("Unhandled exception in client_connected_cb", "_Oops")], True]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_sync_handler_raising_on_a_unix_server_ends_its_connection(
    sockdir: str, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """A plain-function client_connected_cb that raises: asyncio logs it
    from the loop's callback and, over plain Unix sockets, leaves the
    connection open for good (the client waits forever); slabnet reports
    it once to the loop's exception handler and ends that connection (the
    client's read ends at once), and serves the next client."""
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    path = os.path.join(sockdir, "s")
    calls = 0

    def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise _Oops("handler")

        async def answer() -> None:
            writer.write(await reader.readline())
            writer.close()

        tasks.append(loop.create_task(answer()))

    tasks: list[asyncio.Task[None]] = []
    server = await slabnet.start_unix_server(
        handle, path, ssl=server_ctx(server_cert) if tls else None)
    kw: dict[str, Any] = (
        {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
    )
    baseline = open_fds()
    try:
        try:
            reader, writer = await asyncio.wait_for(
                slabnet.open_unix_connection(path, **kw), WAIT)
        except ConnectionError:
            pass  # (over TLS the abort may come before the handshake's end)
        else:
            try:
                assert await asyncio.wait_for(reader.read(), WAIT) == b""
            except ConnectionError:
                pass  # ended by an abort: a reset
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), WAIT)
            except ConnectionError:
                pass
        reader, writer = await asyncio.wait_for(slabnet.open_unix_connection(path, **kw), WAIT)
        writer.write(b"hi\n")
        assert await asyncio.wait_for(reader.read(), WAIT) == b"hi\n"
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), WAIT)
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
        loop.set_exception_handler(None)
    assert _logged(handler) == [("slabnet: protocol.connection_made() failed", "_Oops")]
    assert await _settled(baseline) <= baseline


# ---------------------------------------------------------------- loop close

# A Unix server and one client, asyncio's streams or slabnet's, plain or
# TLS, left open when the loop closes; then everything is collected. Prints
# the warnings and what the loop's exception handler got, one per line.
_LEFT_OPEN = textwrap.dedent("""
    import asyncio, gc, os, re, ssl, sys, warnings
    import slabnet

    loop_name, impl_name, path, certfile, cafile = sys.argv[1:6]
    impl = slabnet if impl_name == "slabnet" else asyncio
    seen = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *args, **kw: seen.append(
        f"{category.__name__}: {message}")
    if loop_name == "uvloop":
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.SelectorEventLoop()
    loop.set_exception_handler(lambda loop, context: seen.append("LOG " + context["message"]))
    keep = []

    async def main():
        server_ctx = client_ctx = None
        kw = {}
        if certfile:
            server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_ctx.load_cert_chain(certfile)
            client_ctx = ssl.create_default_context(cafile=cafile)
            kw = {"ssl": client_ctx, "server_hostname": "localhost"}

        async def handle(reader, writer):
            keep.append(writer)
            await reader.read()

        keep.append(await impl.start_unix_server(handle, path, ssl=server_ctx))
        reader, writer = await impl.open_unix_connection(path, **kw)
        keep.append(writer)
        writer.write(b"x")
        await asyncio.sleep(0.1)

    loop.run_until_complete(main())
    loop.close()
    del keep[:]
    gc.collect()
    for line in seen:
        print(re.sub(r"0x[0-9a-f]+|fd=[0-9]+|/tmp/[^ >,']*", "*", line))
""")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_loop_closed_with_unix_connections_open_warns_as_asyncio(
    loop_name: str, sockdir: str, server_cert: Any, tls_ca: Any, tls: bool
) -> None:
    """The loop closed with a Unix server and a connection (plain or TLS)
    still open, then everything collected: the loop's transports warn as
    they do under asyncio's streams, each of the two writers warns once
    (asyncio's say "loop is closed", slabnet's "unclosed <StreamWriter
    ...>"), the handler's task is reported destroyed, as with asyncio, and
    nothing raises."""
    certfile = cafile = ""
    if tls:
        certfile = os.path.join(sockdir, "server.pem")
        server_cert.private_key_and_cert_chain_pem.write_to_path(certfile)
        cafile = os.path.join(sockdir, "ca.pem")
        tls_ca.cert_pem.write_to_path(cafile)
    env = dict(os.environ, PYTHONPATH=str(Path(slabnet.__file__).parent.parent))

    async def scenario(impl: ModuleType, where: str) -> list[str]:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _LEFT_OPEN, loop_name, impl.__name__,
             os.path.join(where, "s"), certfile, cafile],
            capture_output=True, text=True, env=env, timeout=WAIT,
        )
        assert done.returncode == 0 and not done.stderr, done.stderr
        return done.stdout.splitlines()

    seen = await both(scenario, sockdir)

    def of_the_loop(lines: list[str]) -> list[str]:
        # (A socket's repr names the addresses it can still get: whether a
        # Unix socket shows its laddr or raddr there depends on which end
        # the collector reached first, in either library.)
        return sorted(re.sub(r", [lr]addr=\S*?(?=[,>])", "", line) for line in lines
                      if "StreamWriter" not in line and "SSLProtocolTransport" not in line
                      and "loop is closed" not in line)

    # Which objects warn, and how often, follows the collector's order (an
    # unclosed transport's socket may warn by itself, or not): slabnet's
    # run warns of nothing asyncio's does not.
    assert set(of_the_loop(seen["slabnet"])) <= set(of_the_loop(seen["asyncio"]))
    assert "LOG Task was destroyed but it is pending!" in seen["slabnet"]
    writers = [line for line in seen["slabnet"] if "StreamWriter" in line]
    assert len(writers) == 2 and all(w.startswith("ResourceWarning: unclosed <StreamWriter")
                                     for w in writers), seen["slabnet"]
    assert sum("loop is closed" in line for line in seen["asyncio"]) >= 1
