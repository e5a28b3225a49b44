"""The streams API's parameters and methods used as an application may use
them, against asyncio's streams on the same loop where they differ.

Every test runs on the asyncio loop and on uvloop (``slabnet_loops``), over
loopback sockets, and bounds each wait.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, server_ctx, stream_pair, until

WAKE = 5.0  # seconds any waiter may take to wake

TLS = pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])


@pytest.mark.asyncio
@TLS
async def test_no_byte_is_read_after_the_app_ended_its_reader(
    tls: bool, tls_ca: Any, server_cert: Any
) -> None:
    """An app may end a reader itself: ``feed_eof()`` (no more data) or
    ``set_exception(exc)`` (every read raises ``exc``). Bytes the peer sends
    afterwards are not the reader's: slabnet queued them, so a reader that
    had said EOF (``at_eof()`` true, ``read()`` empty) returned them later,
    and one that had raised the app's error returned them before raising it
    again. asyncio's reads never return them (its default loop fails the
    connection with "feed_data after feed_eof"). Now they are left unread
    (reading stops: the peer's bytes wait in the kernel) and the writer
    still works."""
    for end in ("feed_eof", "set_exception"):
        async with stream_pair(slabnet, tls, tls_ca, server_cert, timeout=WAKE) as (r, w, pr, pw):
            pw.write(b"before")
            async with asyncio.timeout(WAKE):
                assert await r.readexactly(6) == b"before"
                if end == "feed_eof":
                    r.feed_eof()
                    assert r.at_eof()
                    assert await r.read() == b""
                else:
                    r.set_exception(ValueError("the app's"))
                    with pytest.raises(ValueError, match="the app's"):
                        await r.read(100)
                pw.write(b"after")
                await until(
                    lambda: not w.transport.is_reading() or r._buffer, "'after' taken in",
                    timeout=WAKE,
                )
                for _ in range(2):  # (a read must not resume what it stopped)
                    if end == "feed_eof":
                        assert await r.read(100) == b""
                        assert await r.read() == b""
                        assert r.at_eof()
                    else:
                        with pytest.raises(ValueError, match="the app's"):
                            await r.read(100)
                        with pytest.raises(ValueError, match="the app's"):
                            await r.readexactly(1)
                    await asyncio.sleep(0.01)
                w.write(b"still writes")
                assert await pr.readexactly(12) == b"still writes"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("opener", "keyword"),
    [
        ("open_connection", "ssl_session"),
        ("open_connection", "ssl_ragged_eof"),
        ("start_server", "ssl_ragged_eof"),  # (a server resumes no session)
    ],
)
async def test_a_tls_keyword_without_ssl_is_refused(
    keyword: str, opener: str, tls_ca: Any, server_cert: Any
) -> None:
    """``ssl_session=`` without ``ssl=`` was ignored: a caller who forgot
    ``ssl=`` got a plaintext connection where it meant to resume a TLS
    session, with no error (``ssl_ragged_eof=False`` likewise). Both are
    refused now, before anything connects or listens, as asyncio refuses
    ``server_hostname`` and the TLS timeouts without ``ssl``."""
    server = await slabnet.start_server(
        lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    port = server.sockets[0].getsockname()[1]
    try:
        if keyword == "ssl_session":
            async with asyncio.timeout(WAKE):
                r, w = await slabnet.open_connection(
                    "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
                )
                value: Any = w.get_extra_info("ssl_object").session
                w.close()
                await w.wait_closed()
            assert value is not None
        else:
            value = False
        with pytest.raises(ValueError, match=f"^{keyword} is only meaningful with ssl$"):
            if opener == "open_connection":
                await slabnet.open_connection("127.0.0.1", port, **{keyword: value})
            else:
                await slabnet.start_server(lambda r, w: None, "127.0.0.1", 0, **{keyword: value})
    finally:
        server.close()
        async with asyncio.timeout(WAKE):
            await server.wait_closed()


@pytest.mark.asyncio
@pytest.mark.parametrize("refused", ["server_hostname", "session"])
async def test_a_tls_set_up_refused_leaves_the_callers_socket_as_it_was(
    refused: str, tls_ca: Any, server_cert: Any
) -> None:
    """``open_connection(sock=s, ssl=...)`` with a ``server_hostname`` the
    TLS engine refuses (".localhost": UnicodeError, as asyncio's wrap_bio
    raises) or an ``ssl_session`` of another context (ValueError): asyncio
    raises before its transport exists and leaves ``s`` to the caller.
    slabnet made the engine in ``connection_made`` and aborted the loop's
    new transport: ``s`` was closed on the asyncio loop, and on uvloop left
    holding its old descriptor number, which ``s``'s finalizer then closed,
    whatever file had taken that number meanwhile. Now the engine is made
    before connecting, so ``s`` is untouched and still usable."""
    server = await slabnet.start_server(
        lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_ctx(server_cert)
    )
    port = server.sockets[0].getsockname()[1]
    kw: dict[str, Any] = {"server_hostname": "localhost"}
    if refused == "server_hostname":
        kw["server_hostname"] = ".localhost"
        expected: type[BaseException] = UnicodeError
    else:
        # A session of a finished connection of another context.
        async with asyncio.timeout(WAKE):
            r, w = await slabnet.open_connection(
                "127.0.0.1", port, ssl=client_ctx(tls_ca), server_hostname="localhost"
            )
            kw["ssl_session"] = w.get_extra_info("ssl_object").session
            w.close()
            await w.wait_closed()
        expected = ValueError
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        fd = sock.fileno()
        async with asyncio.timeout(WAKE):
            with pytest.raises(expected):
                await slabnet.open_connection(sock=sock, ssl=client_ctx(tls_ca), **kw)
            await asyncio.sleep(0.01)  # (what a loop would close, it has)
        assert sock.fileno() == fd
        os.fstat(fd)  # still open
        assert sock.getpeername()[1] == port  # and still this connection
        # The caller may still use it: here for TLS done right.
        async with asyncio.timeout(WAKE):
            r, w = await slabnet.open_connection(
                sock=sock, ssl=client_ctx(tls_ca), server_hostname="localhost"
            )
            w.close()
            await w.wait_closed()
    finally:
        sock.close()
        server.close()
        async with asyncio.timeout(WAKE):
            await server.wait_closed()
