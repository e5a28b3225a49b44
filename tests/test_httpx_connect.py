"""How the httpcore backend connects to a host with several addresses
(RFC 8305's Happy Eyeballs, as httpcore's anyio backend connects): real
sockets on loopback, both loops. Only the name lookup is given: addresses
that behave as a broken IPv6 route (SYNs dropped) and a working one.

The backend used one ``open_connection(host, port)``, which neither loop
races: an address that drops SYNs took the whole connect timeout, and every
request failed with ``ConnectTimeout`` where httpx's default backend moved
on to the next address after 250 ms.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import pytest
import pytest_asyncio

from slabnet.contrib.httpcore import SlabnetBackend, _connect_racing

from conftest import fds_settle, open_fds

WAKE = 3.0  # seconds: far more than one attempt delay (0.25 s)


@pytest_asyncio.fixture
async def dropping() -> AsyncIterator[tuple[str, int]]:
    """An address whose SYNs go unanswered: a listener whose accept queue is
    full (it never accepts). Checked: a connect to it does not complete."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        address = listener.getsockname()
        for _ in range(8):  # (what the queue holds completes; the rest waits)
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            fillers.append(filler)
        probe = socket.socket()
        probe.setblocking(False)
        fillers.append(probe)
        probe.connect_ex(address)
        _, writable, _ = select.select([], [probe], [], 0.5)
        assert not writable, "the accept queue took another connection"
        yield address
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@pytest_asyncio.fixture
async def accepting() -> AsyncIterator[tuple[str, int]]:
    listener = socket.create_server(("127.0.0.1", 0))
    yield listener.getsockname()
    listener.close()


def closed_port() -> tuple[str, int]:
    """An address that refuses (nothing listens there any more)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = sock.getsockname()
    sock.close()
    return address


def resolver(*addresses: tuple[str, int]) -> Any:
    async def resolve(host: str, port: int, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", a) for a in addresses]
    return resolve


@pytest.mark.asyncio
async def test_an_address_that_drops_syns_is_passed_by_after_the_delay(
    dropping: tuple[str, int], accepting: tuple[str, int]
) -> None:
    baseline = open_fds()
    sock = await asyncio.wait_for(
        _connect_racing("dual.test", 80, None, resolve=resolver(dropping, accepting)), WAKE
    )
    try:
        assert sock.getpeername() == accepting
    finally:
        sock.close()
    assert await fds_settle(baseline) <= baseline  # the losing attempt closed its socket


@pytest.mark.asyncio
async def test_an_address_that_refuses_moves_on_at_once(accepting: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    # A delay no test waits for: only the refusal may start the next attempt.
    sock = await asyncio.wait_for(
        _connect_racing("dual.test", 80, None, delay=60.0,
                        resolve=resolver(closed_port(), accepting)), WAKE
    )
    try:
        assert sock.getpeername() == accepting
        assert loop.time() - start < WAKE
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_when_every_address_fails_each_reason_is_given() -> None:
    baseline = open_fds()
    both = r"could not connect to dual\.test:80: \[Errno 111\] .*; \[Errno 111\] "
    with pytest.raises(OSError, match=both):
        await asyncio.wait_for(
            _connect_racing("dual.test", 80, None, resolve=resolver(closed_port(), closed_port())),
            WAKE,
        )
    with pytest.raises(ConnectionRefusedError):  # one address: its own error
        await asyncio.wait_for(
            _connect_racing("dual.test", 80, None, resolve=resolver(closed_port())), WAKE
        )
    assert await fds_settle(baseline) <= baseline


@pytest.mark.asyncio
async def test_a_timeout_while_attempts_run_leaves_no_socket(dropping: tuple[str, int]) -> None:
    baseline = open_fds()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.6):  # (two attempts started, both waiting)
            await _connect_racing("dual.test", 80, None, resolve=resolver(dropping, dropping))
    assert await fds_settle(baseline) <= baseline


@pytest.mark.parametrize("above", [65536, 1 << 20])
@pytest.mark.asyncio
async def test_a_port_above_65535_is_refused_not_wrapped(above: int) -> None:
    # getaddrinfo takes a port modulo 65536: connect_tcp(host, P + 65536)
    # connected to port P and talked to whatever listened there (a URL
    # built with httpcore.URL(port=...) reaches the backend unchecked).
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        with pytest.raises(httpcore.ConnectError, match="port must be 0-65535"):
            await asyncio.wait_for(SlabnetBackend().connect_tcp("127.0.0.1", port + above), WAKE)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    finally:
        listener.close()
