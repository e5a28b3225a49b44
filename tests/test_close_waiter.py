"""``wait_closed()`` and ``drain()`` asked before the connection ends, after
it, or both, against asyncio's streams on the same loop.

A stream connection makes its close future and its list of drain waiters
only when they are first wanted (an idle server's connections are rarely
awaited in either, and the two cost about 250 bytes each), so the outcome a
connection that ended earlier left must reach a waiter that comes later:
``None`` after a FIN or our own close or abort, the error after a reset.
Plain TCP and TLS, both loops (the plugin's ``slabnet_loops``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, hard_close, server_ctx

WAKE = 3.0  # seconds any waiter may take to wake

Opener = Callable[..., Awaitable[tuple[Any, Any]]]
OPENERS: dict[str, Opener] = {"slabnet": slabnet.open_connection, "asyncio": asyncio.open_connection}


async def outcome(aw: Awaitable[Any]) -> str:
    """What awaiting ``aw`` gave, as a name."""
    try:
        result = await asyncio.wait_for(aw, WAKE)
    except asyncio.TimeoutError:
        return "hang"
    except ConnectionError:
        # (drain() after our own abort() raises asyncio's ConnectionResetError,
        # slabnet's LocalAbortError: the error every waiter of an aborted
        # connection gets, see slabnet._errors.)
        return "ConnectionError"
    except Exception as exc:  # the comparison is the test
        return type(exc).__name__
    return repr(result)


async def run(
    impl: str, how: str, when: str, listener: socket.socket, tls: bool, tls_ca: Any, server_cert: Any
) -> list[str]:
    """One connection to a raw peer that ends it ``how``; ``wait_closed()``
    and ``drain()`` asked ``when`` ("before" it ends, "after", or "both")."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    ended = loop.create_future()

    async def peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        raw = None
        if tls:
            raw = RawTLS(conn, server_ctx(server_cert), server_side=True)
            await raw.handshake()
            assert await raw.recv_plain(5) == b"hello"
        else:
            assert await loop.sock_recv(conn, 5) == b"hello"
        if how == "peer_fin":
            if raw is not None:
                await raw.send(raw.close_notify())
            conn.shutdown(socket.SHUT_WR)
        elif how == "peer_reset":
            hard_close(conn)
        ended.set_result(None)
        if how == "peer_reset":
            return
        try:
            async with asyncio.timeout(WAKE):
                if raw is not None:  # answer a close_notify with ours
                    with contextlib.suppress(EOFError):
                        while await raw.recv_plain(65536):
                            pass
                    await raw.send(raw.close_notify())
                else:
                    while await loop.sock_recv(conn, 65536):
                        pass
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()

    task = asyncio.create_task(peer())
    try:
        kwargs: dict[str, Any] = (
            {"ssl": client_ctx(tls_ca), "server_hostname": "localhost"} if tls else {}
        )
        reader, writer = await asyncio.wait_for(
            OPENERS[impl]("127.0.0.1", listener.getsockname()[1], **kwargs), WAKE
        )
        early: list[asyncio.Task[str]] = []
        if when in ("before", "both"):
            early.append(asyncio.create_task(outcome(writer.wait_closed())))
            await asyncio.sleep(0)
        writer.write(b"hello")
        await writer.drain()
        if how == "close":
            writer.close()
        elif how == "abort":
            writer.transport.abort()
        else:
            await asyncio.wait_for(ended, WAKE)
            seen.append("read " + await outcome(reader.read()))
            writer.close()
        seen += ["early " + await t for t in early]
        if when in ("after", "both"):
            seen.append("wait_closed " + await outcome(writer.wait_closed()))
            seen.append("again " + await outcome(writer.wait_closed()))
            seen.append("drain " + await outcome(writer.drain()))
        assert writer.is_closing()
    finally:
        await asyncio.wait_for(task, 2 * WAKE)
    return seen


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("when", ["before", "after", "both"])
@pytest.mark.parametrize("how", ["close", "abort", "peer_fin", "peer_reset"])
@pytest.mark.asyncio
async def test_wait_closed_and_drain_give_what_the_end_left_as_asyncio(
    listener: socket.socket, tls_ca: Any, server_cert: Any, how: str, when: str, tls: bool
) -> None:
    ours = await run("slabnet", how, when, listener, tls, tls_ca, server_cert)
    theirs = await run("asyncio", how, when, listener, tls, tls_ca, server_cert)
    assert ours == theirs
    assert "hang" not in ours
