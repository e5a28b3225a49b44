"""Streams: asyncio conformance, zero-copy reads, byte-exact transfers.

Every test runs on the asyncio loop and on uvloop (slabnet's pytest plugin,
``slabnet_loops`` in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

import slabnet

Script = Sequence[bytes | float]  # bytes to send, or a pause in seconds
Outcome = list[tuple[Any, ...]]


async def scripted_server(script: Script) -> tuple[asyncio.Server, int]:
    """A plain asyncio server that plays ``script`` and then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for step in script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                writer.write(step)
                await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def outcome(call: Awaitable[Any]) -> tuple[Any, ...]:
    try:
        value = await call
    except asyncio.IncompleteReadError as e:
        return ("IncompleteReadError", e.partial, e.expected)
    except asyncio.LimitOverrunError as e:
        return ("LimitOverrunError", e.consumed, str(e))
    except (ValueError, TypeError, RuntimeError) as e:
        return (type(e).__name__,)
    return ("ok", bytes(value) if isinstance(value, memoryview) else value)


Steps = Callable[[Any], list[Awaitable[Any]]]


async def conformance(script: Script, steps: Callable[[Any], Any], limit: int = 2**16) -> None:
    """Run the same reads through asyncio and slabnet; results must match."""
    results: dict[str, Outcome] = {}
    for name, opener in (
        ("asyncio", asyncio.open_connection),
        ("slabnet", slabnet.open_connection),
    ):
        server, port = await scripted_server(script)
        reader, writer = await opener("127.0.0.1", port, limit=limit)
        out: Outcome = []
        await steps(reader, out)
        out.append(("at_eof", reader.at_eof()))
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        results[name] = out
    assert results["slabnet"] == results["asyncio"]


@pytest.mark.asyncio
async def test_readuntil_separator_split_across_chunks() -> None:
    script = [b"hello wo", 0.03, b"rld\r", 0.03, b"\nrest", 0.03, b" of it"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readuntil(b"\r\n")))
        out.append(await outcome(r.read()))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_long_separator_split_over_three_chunks() -> None:
    script = [b"aaa--", 0.03, b"-", 0.03, b"-==bbb--==", 0.03, b"tail"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readuntil(b"----==")))
        out.append(await outcome(r.readuntil(b"--==")))
        out.append(await outcome(r.readuntil(b"--==")))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_readexactly_hits_eof_in_the_middle() -> None:
    script = [b"0123456789", 0.03, b"abc"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readexactly(4)))
        out.append(await outcome(r.readexactly(100)))
        out.append(await outcome(r.readexactly(1)))
        out.append(await outcome(r.read(10)))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_limit_overrun_on_readuntil_and_readline() -> None:
    script = [b"x" * 40, 0.03, b"y" * 40, 0.03, b"\nnext line\n", b"z" * 5 + b"\n"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readuntil(b"\n")))
        out.append(await outcome(r.readline()))
        out.append(await outcome(r.readline()))
        out.append(await outcome(r.readline()))
        out.append(await outcome(r.readline()))

    await conformance(script, steps, limit=16)


@pytest.mark.asyncio
async def test_separator_found_beyond_limit() -> None:
    script = [b"k" * 30 + b"\n" + b"short\n"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readuntil(b"\n")))
        out.append(await outcome(r.readexactly(31)))
        out.append(await outcome(r.readline()))

    await conformance(script, steps, limit=16)


@pytest.mark.asyncio
async def test_lines_iteration_and_partial_last_line() -> None:
    script = [b"one\ntw", 0.03, b"o\nthree\nfour"]

    async def steps(r: Any, out: Outcome) -> None:
        lines = [line async for line in r]
        out.append(("lines", lines))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_read_sizes_and_eof() -> None:
    script = [b"abcdef", 0.03, b"ghijkl", 0.03, b"mnop"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readexactly(3)))
        out.append(await outcome(r.read(2)))
        out.append(await outcome(r.read(0)))
        out.append(await outcome(r.readexactly(7)))
        out.append(await outcome(r.read(-1)))
        out.append(await outcome(r.read(5)))
        out.append(await outcome(r.readline()))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_bad_arguments_raise_the_same_errors() -> None:
    script = [b"data\n"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readexactly(-1)))
        out.append(await outcome(r.readuntil(b"")))
        # No separator at all: ValueError on every version (before 3.13
        # asyncio takes the empty tuple's length for a separator's).
        out.append(await outcome(r.readuntil(())))
        out.append(await outcome(r.readline()))

    await conformance(script, steps)


@pytest.mark.asyncio
async def test_tuple_separators() -> None:
    script = [b"abcd|rest\r\n", 0.03, b"x"]

    async def steps(r: Any, out: Outcome) -> None:
        out.append(await outcome(r.readuntil((b"cd|", b"\r\n"))))
        out.append(await outcome(r.readuntil((b"\r\n", b"zz"))))

    if sys.version_info >= (3, 13):
        await conformance(script, steps)
    else:
        server, port = await scripted_server(script)
        r, w = await slabnet.open_connection("127.0.0.1", port)
        with pytest.raises(TypeError, match="3.13"):
            await r.readuntil((b"cd|", b"\r\n"))
        w.close()
        server.close()


@pytest.mark.asyncio
async def test_read_chunk_is_zero_copy_and_readonly() -> None:
    payload = os.urandom(300_000)
    server, port = await scripted_server([payload])
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    got = bytearray()
    views = 0
    while chunk := await reader.read_chunk():
        assert isinstance(chunk, memoryview) and chunk.readonly
        if isinstance(chunk.obj, bytearray):
            views += 1  # a view of the loop's slab: no copy was made
        got += chunk
    assert got == payload
    assert views >= 1
    assert (await reader.read_chunk()) == b""
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_chunks_iterator_and_readinto() -> None:
    payload = os.urandom(200_000)
    server, port = await scripted_server([payload[:1000], 0.02, payload[1000:]])
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    first = bytearray(10)
    assert await reader.readinto(first) == 10
    got = bytearray(first)
    async for chunk in reader.chunks():
        got += chunk
    assert got == payload
    assert await reader.readinto(bytearray(5)) == 0
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_concurrent_reads_raise_runtime_error() -> None:
    server, port = await scripted_server([0.2, b"late"])
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    first = asyncio.ensure_future(reader.read(10))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="already waiting"):
        await reader.read(10)
    assert await first == b"late"
    writer.close()
    server.close()


async def _transfer(total: int, write_size: int, use_ssl: Any = None, **kw: Any) -> None:
    block = os.urandom(write_size)
    total -= total % write_size
    expected = hashlib.sha256()
    sent = 0
    while sent < total:
        expected.update(block)
        sent += write_size

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        for _ in range(total // write_size):
            writer.write(block)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await slabnet.start_server(handle, "127.0.0.1", 0, ssl=use_ssl)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port, **kw)
    h = hashlib.sha256()
    n = 0
    async for chunk in reader.chunks():
        h.update(chunk)
        n += len(chunk)
    assert n == total
    assert h.hexdigest() == expected.hexdigest()
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_256_mib_byte_exact_large_writes() -> None:
    await _transfer(256 * 2**20, 1 << 20)


@pytest.mark.asyncio
async def test_byte_exact_small_writes() -> None:
    await _transfer(8 * 2**20, 1024)


@pytest.mark.asyncio
async def test_tls_byte_exact(tls_server_context: Any, tls_client_context: Any) -> None:
    await _transfer(
        32 * 2**20, 100_000, use_ssl=tls_server_context,
        ssl=tls_client_context, server_hostname="localhost",
    )


@pytest.mark.asyncio
async def test_echo_server_fixture_round_trip(echo_server: tuple[str, int]) -> None:
    reader, writer = await slabnet.open_connection(*echo_server)
    data = os.urandom(1_000_000)
    writer.write(data)
    writer.write_eof()
    assert await reader.read() == data
    writer.close()
    await writer.wait_closed()


@pytest.mark.asyncio
async def test_slow_consumer_pauses_reading_and_memory_stays_bounded() -> None:
    block = b"s" * 65536

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            for _ in range(2000):  # 125 MiB if it all went through
                writer.write(block)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limit = 2**16
    reader, writer = await slabnet.open_connection("127.0.0.1", port, limit=limit)
    await reader.readexactly(10)
    async with asyncio.timeout(10):  # the sender keeps pushing; we do not read
        while writer.transport.is_reading():
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # and reading stays paused
    assert not writer.transport.is_reading()
    buffered = reader._size
    assert buffered <= 2 * limit + 65536
    stats = slabnet.memory_stats()
    assert stats.pinned_bytes <= 8 * 65536 + stats.idle_bytes
    # Reading resumes once drained, and everything arrives.
    total = 10
    async for chunk in reader.chunks():
        total += len(chunk)
    assert total == 2000 * 65536
    writer.close()
    server.close()


@pytest.mark.asyncio
async def test_unix_socket_round_trip(tmp_path: Any) -> None:
    path = str(tmp_path / "s.sock")

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(b"unix:" + await reader.readline())
        await writer.drain()
        writer.close()

    server = await slabnet.start_unix_server(handle, path)
    reader, writer = await slabnet.open_unix_connection(path)
    writer.write(b"hello\n")
    assert await reader.read() == b"unix:hello\n"
    assert reader.at_eof()
    writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_loops_are_both_exercised(loop_name: str) -> None:
    loop = asyncio.get_running_loop()
    assert loop_name in ("asyncio", "uvloop")
    assert ("uvloop" in type(loop).__module__) == (loop_name == "uvloop")


def test_public_api_covers_asyncio_streams() -> None:
    """Migration is one import: every public name of asyncio's streams exists."""
    for ours, theirs in (
        (slabnet.StreamReader, asyncio.StreamReader),
        (slabnet.StreamWriter, asyncio.StreamWriter),
    ):
        missing = {n for n in dir(theirs) if not n.startswith("_")} - set(dir(ours))
        assert not missing, f"{ours.__name__} lacks {sorted(missing)}"
    for name in ("open_connection", "start_server", "open_unix_connection", "start_unix_server"):
        assert callable(getattr(slabnet, name))
