"""Handshake faults, compared with asyncio's streams: the peer's FIN or
reset at byte offsets all through the handshake's flights, client and
server side, TLS 1.2 and 1.3; records that have no place in a handshake.

Real loopback sockets, real TLS (trustme certificates), raw peers whose
bytes the test cuts (``conftest.RawTLS``). No sleep-length luck: each cut
is sent, then the socket closed; the connection's end is awaited.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest

import slabnet
from conftest import Handler, RawTLS, client_ctx, fds_settle, hard_close, open_fds, server_ctx

WAKE = 5.0  # seconds any wait may take before the test fails
VERSIONS = pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls12", "tls13"]
)
CUTS = pytest.mark.parametrize("cut", ["fin", "rst"])


def offsets(n: int) -> list[int]:
    """Every offset in the first records' headers and just past them, then
    a stride through the rest, and the last bytes: 0 <= offset < n."""
    return sorted({*range(min(n, 12)), *range(12, n, 257), *range(max(n - 6, 0), n)})


def cut_off(sock: socket.socket, how: str) -> None:
    if how == "rst":
        hard_close(sock)
    else:
        sock.close()


async def first_flight(peer: RawTLS) -> bytes:
    """What ``peer`` sends next in its handshake (not sent yet)."""
    try:
        peer.obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return peer.outgoing.read()


@VERSIONS
@CUTS
@pytest.mark.asyncio
async def test_server_flight_cut_anywhere_fails_the_client_clearly(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, cut: str
) -> None:
    # asyncio's open_connection raises ConnectionResetError for a FIN or a
    # reset anywhere in the server's flight; so must slabnet's, promptly,
    # reporting nothing to the loop and leaving no descriptor behind.
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    baseline = open_fds()
    n, off, tried = 1, 0, 0
    try:
        while off < n:
            opening = asyncio.ensure_future(slabnet.open_connection(
                *listener.getsockname(), ssl=client_ctx(tls_ca, version),
                server_hostname="localhost",
            ))
            conn, _ = await loop.sock_accept(listener)
            peer = RawTLS(conn, server_ctx(server_cert, version), server_side=True)
            async with asyncio.timeout(WAKE):
                await peer._pull()  # the ClientHello
            flight = await first_flight(peer)
            n = len(flight)
            off = min(off, n - 1)  # (an ECDSA signature's length varies)
            if off:
                await loop.sock_sendall(conn, flight[:off])
            cut_off(conn, cut)
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(WAKE):
                    await opening
            tried += 1
            off = next((o for o in offsets(n) if o > off), n)
    finally:
        loop.set_exception_handler(None)
    assert tried > 15
    assert handler.contexts == []
    assert await fds_settle(baseline) <= baseline


@VERSIONS
@CUTS
@pytest.mark.asyncio
async def test_client_flights_cut_anywhere_leave_the_server_serving(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion, cut: str
) -> None:
    # Both client flights (the ClientHello; the Finished and what precedes
    # it) cut at offsets all through them: the server never calls the
    # handler, reports nothing (asyncio reports a failed handshake only in
    # debug mode), releases each connection, and serves the next client.
    loop = asyncio.get_running_loop()
    handler = Handler()
    loop.set_exception_handler(handler)
    handled: list[bytes] = []

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        handled.append(await reader.read(5))
        writer.write(b"hello")
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=server_ctx(server_cert, version))
    addr = server.sockets[0].getsockname()
    baseline = open_fds()
    tried = 0
    try:
        for flight_no in (1, 2):
            n, off = 1, 0
            while off < n:
                sock = socket.socket()
                sock.setblocking(False)
                await loop.sock_connect(sock, addr)
                peer = RawTLS(sock, client_ctx(tls_ca, version), server_side=False,
                              server_hostname="localhost")
                flight = await first_flight(peer)
                if flight_no == 2:
                    await loop.sock_sendall(sock, flight)
                    async with asyncio.timeout(WAKE):
                        while not (flight := await first_flight(peer)):
                            await peer._pull()
                n = len(flight)
                off = min(off, n - 1)
                if off:
                    await loop.sock_sendall(sock, flight[:off])
                cut_off(sock, cut)
                tried += 1
                off = next((o for o in offsets(n) if o > off), n)
        # A good client still gets served.
        async with asyncio.timeout(WAKE):
            reader, writer = await asyncio.open_connection(
                *addr, ssl=client_ctx(tls_ca, version), server_hostname="localhost"
            )
            writer.write(b"ping!")
            assert await reader.read() == b"hello"
            writer.close()
    finally:
        loop.set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert tried > 15
    assert handled == [b"ping!"]
    assert handler.contexts == []
    assert await fds_settle(baseline) <= baseline


@VERSIONS
@pytest.mark.parametrize(
    ("first", "expected"),
    [
        (b"\x17\x03\x03\x00\x20" + bytes(32), "UNEXPECTED_MESSAGE"),  # data before any hello
        (b"\x15\x03\x03\x00\x02\x02\x28", "HANDSHAKE_FAILURE"),  # a fatal alert instead
        (b"\x80\x2e\x01\x00\x02" + bytes(45), "content type 128"),  # an SSLv2 hello
    ],
    ids=["data", "alert", "sslv2"],
)
@pytest.mark.asyncio
async def test_records_out_of_place_in_the_handshake_fail_clearly(
    listener: socket.socket, server_cert: Any, tls_ca: Any, version: ssl.TLSVersion,
    first: bytes, expected: str,
) -> None:
    # As asyncio does: an ssl.SSLError that names the problem, at once (no
    # wait for the handshake timeout).
    loop = asyncio.get_running_loop()
    baseline = open_fds()
    opening = asyncio.ensure_future(slabnet.open_connection(
        *listener.getsockname(), ssl=client_ctx(tls_ca, version), server_hostname="localhost",
        ssl_handshake_timeout=WAKE * 2,
    ))
    conn, _ = await loop.sock_accept(listener)
    try:
        await loop.sock_recv(conn, 65536)  # the ClientHello
        await loop.sock_sendall(conn, first)
        with pytest.raises(ssl.SSLError) as info:
            async with asyncio.timeout(WAKE):
                await opening
    finally:
        conn.close()
    assert expected in str(info.value), repr(info.value)
    assert await fds_settle(baseline) <= baseline
