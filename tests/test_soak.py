"""Soak: many concurrent connections, random sizes, checked end to end.

Every connection sends a random payload (8-byte length, then the bytes in
random-sized writes); the server hashes what it reads, echoes it chunk by
chunk and then sends its SHA-256; the client hashes the echo. Both digests
must equal the payload's: nothing lost, duplicated or reordered, in either
direction. Afterwards the process is back to its socket count.

The default run is short. A long run by hand::

    SLABNET_SOAK_CONNECTIONS=1000 .venv/bin/python -m pytest tests/test_soak.py -s

prints connections, bytes, duration and peak RSS for each loop and mode.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import resource
import ssl
import struct
import time
from typing import Any

import pytest

import slabnet
from conftest import fds_settle, open_fds

CONNECTIONS = int(os.environ.get("SLABNET_SOAK_CONNECTIONS", "200"))
MAX_PAYLOAD = int(os.environ.get("SLABNET_SOAK_MAX_BYTES", str(256 * 1024)))
SEED = int(os.environ.get("SLABNET_SOAK_SEED", "20240607"))
TIMEOUT = 30 + CONNECTIONS * 0.2  # seconds for the whole run


async def _serve(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
    try:
        (size,) = struct.unpack("!Q", await reader.readexactly(8))
        digest = hashlib.sha256()
        left = size
        while left:
            chunk = await reader.read_chunk()
            if not chunk:
                raise AssertionError(f"EOF with {left} of {size} bytes missing")
            if len(chunk) > left:
                raise AssertionError("more bytes than announced")
            left -= len(chunk)
            digest.update(chunk)
            writer.write(chunk)
            await writer.drain()
        writer.write(digest.digest())
        await writer.drain()
        await reader.read()  # until the client closes
    finally:
        writer.close()


async def _client(i: int, port: int, ctx: ssl.SSLContext | None) -> int:
    rng = random.Random(SEED + i)
    size = rng.randrange(0, MAX_PAYLOAD + 1)
    payload = rng.randbytes(size)
    reader, writer = await slabnet.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost" if ctx else None
    )

    async def send() -> None:
        writer.write(struct.pack("!Q", size))
        pos = 0
        while pos < size:
            n = min(size - pos, rng.choice((1, 17, 512, 1500, 4096, 16384, 65536, 200_000)))
            writer.write(payload[pos : pos + n])
            pos += n
            if rng.random() < 0.3:
                await writer.drain()
        await writer.drain()

    async def receive() -> tuple[bytes, bytes]:
        echo = hashlib.sha256()
        left = size
        while left:
            chunk = await reader.read_chunk()
            assert chunk, f"connection {i}: EOF with {left} echo bytes missing"
            take = chunk[:left]
            echo.update(take)
            left -= len(take)
            if len(chunk) > len(take):  # the digest came in the same chunk
                rest = bytes(chunk[len(take) :])
                return echo.digest(), rest + await reader.readexactly(32 - len(rest))
        return echo.digest(), await reader.readexactly(32)

    try:
        _, (echoed, server_digest) = await asyncio.gather(send(), receive())
    finally:
        writer.close()
    expected = hashlib.sha256(payload).digest()
    assert server_digest == expected, f"connection {i}: the server got different bytes"
    assert echoed == expected, f"connection {i}: the echo differs"
    try:
        await writer.wait_closed()
    except (ConnectionError, ssl.SSLError):
        pass
    return size


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.asyncio
async def test_soak_concurrent_connections(
    tls_server_context: ssl.SSLContext, tls_client_context: ssl.SSLContext,
    loop_name: str, tls: bool,
) -> None:
    baseline = open_fds()
    server = await slabnet.start_server(
        _serve, "127.0.0.1", 0, ssl=tls_server_context if tls else None,
        backlog=max(128, CONNECTIONS),
    )
    port = server.sockets[0].getsockname()[1]
    start = time.monotonic()
    sizes = await asyncio.wait_for(
        asyncio.gather(*(
            _client(i, port, tls_client_context if tls else None) for i in range(CONNECTIONS)
        )),
        TIMEOUT,
    )
    duration = time.monotonic() - start
    server.close()
    await server.wait_closed()
    assert len(sizes) == CONNECTIONS
    assert await fds_settle(baseline, timeout=10) <= baseline
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = sum(sizes)
    print(
        f"\nsoak {loop_name} {'tls' if tls else 'plain'}: {CONNECTIONS} connections,"
        f" {total} bytes each way ({total / 2**20:.1f} MiB), {duration:.2f} s,"
        f" peak RSS {peak_rss_mib:.0f} MiB"
    )
