"""StreamReader hardening: trickled bytes, tiny chunks, straddling
separators, bytes-like separators, cancellation.

Behaviour is checked against asyncio's own ``StreamReader`` fed the same
bytes the same way, where asyncio is the reference; the reader's work is
measured by counting (profiler events, bytes searched), never by timing.
Every test runs on the asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import sys
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import pytest

import slabnet
from slabnet import _streams

Reader = Any  # asyncio.StreamReader or slabnet.StreamReader
Op = Callable[[Reader], Awaitable[Any]]

HEADER = b"GET /index.html HTTP/1.1\r\nHost: example.com\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"


async def outcome(call: Awaitable[Any]) -> tuple[Any, ...]:
    try:
        value = await call
    except asyncio.IncompleteReadError as e:
        return ("IncompleteReadError", e.partial, e.expected)
    except asyncio.LimitOverrunError as e:
        return ("LimitOverrunError", e.consumed, str(e))
    except (ValueError, TypeError, RuntimeError) as e:
        return (type(e).__name__, str(e) if isinstance(e, ValueError) else "")
    return ("ok", bytes(value) if isinstance(value, memoryview) else value)


async def play(
    cls: type, pieces: Sequence[bytes], ops: Sequence[Op], *, limit: int = 2**16,
    eof: bool = True,
) -> list[tuple[Any, ...]]:
    """Feed ``pieces`` one at a time while ``ops`` run one after the other in
    a task, letting the task run after every piece (so a waiting read wakes
    once per piece); then EOF. Returns each op's outcome and what is left."""
    reader = cls(limit=limit)
    results: list[tuple[Any, ...]] = []

    async def run_ops() -> None:
        for op in ops:
            results.append(await outcome(op(reader)))

    task = asyncio.ensure_future(run_ops())
    async with asyncio.timeout(5):
        await asyncio.sleep(0)
        for piece in pieces:
            reader.feed_data(piece)
            await asyncio.sleep(0)
        if eof:
            reader.feed_eof()
        await task
        results.append(("rest", await reader.read() if eof else b""))
    return results


async def same_as_asyncio(
    pieces: Sequence[bytes], ops: Sequence[Op], **kw: Any
) -> list[tuple[Any, ...]]:
    want = await play(asyncio.StreamReader, pieces, ops, **kw)
    got = await play(slabnet.StreamReader, pieces, ops, **kw)
    assert got == want
    return got


def splits(data: bytes) -> list[list[bytes]]:
    """``data`` whole, byte by byte, and cut in two and three at every offset."""
    out = [[data], [data[i : i + 1] for i in range(len(data))]]
    for i in range(1, len(data)):
        out.append([data[:i], data[i:]])
        for j in range(i + 1, len(data)):
            out.append([data[:i], data[i:j], data[j:]])
    return out


# ------------------------------------------------------------ 1. linear search


def reader_work(run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[int]]:
    """Count profiler events (calls and returns, Python and C) made by code
    in slabnet/_streams.py while ``run`` runs: the reader's work, whatever
    the loop does around it."""
    target = _streams.__file__

    async def measure() -> int:
        count = 0

        def prof(frame: FrameType, event: str, arg: Any) -> None:
            nonlocal count
            if frame.f_code.co_filename == target:
                count += 1

        sys.setprofile(prof)
        try:
            await run()
        finally:
            sys.setprofile(None)
        return count

    return measure


async def trickle_readuntil(n: int, sep: bytes) -> slabnet.StreamReader:
    """A readuntil that wakes once for each of ``n`` one-byte chunks."""
    reader = slabnet.StreamReader(limit=2**20)
    task = asyncio.ensure_future(reader.readuntil(sep))
    async with asyncio.timeout(30):
        await asyncio.sleep(0)
        for _ in range(n):
            reader.feed_data(b"x")
            await asyncio.sleep(0)
        assert not task.done()
        reader.feed_data(sep)
        assert await task == b"x" * n + sep
    return reader


@pytest.mark.asyncio
@pytest.mark.parametrize("sep", [b"\n", b"\r\n\r\n", b"--boundary--"])
async def test_readuntil_work_is_linear_in_trickled_chunks(sep: bytes) -> None:
    n = 100

    async def small() -> None:
        await trickle_readuntil(n, sep)

    async def large() -> None:
        await trickle_readuntil(4 * n, sep)

    work_n = await reader_work(small)()
    work_4n = await reader_work(large)()
    # Linear work grows 4x; a search that re-walks every buffered chunk at
    # each wake-up grows 16x (base commit: ~14x).
    assert work_4n < 5 * work_n, (work_n, work_4n)
    # And the bytes the search looked at: the new byte plus len(sep) - 1 of
    # overlap per wake-up.
    reader = await trickle_readuntil(4 * n, sep)
    assert reader._examined <= (4 * n + 2) * len(sep)


async def lines_behind_chunks(n: int) -> None:
    """``n`` chunks of 1,100 bytes (eleven 100-byte lines each: above the
    size that is joined on arrival) buffered before anyone reads, then
    every line read with readline, as a handler busy elsewhere would."""
    line = b"l" * 99 + b"\n"
    reader = slabnet.StreamReader(limit=2**24)
    for _ in range(n):
        reader.feed_data(line * 11)
    reader.feed_eof()
    async with asyncio.timeout(30):
        for _ in range(11 * n):
            assert await reader.readline() == line
        assert await reader.readline() == b""


@pytest.mark.asyncio
async def test_readline_work_does_not_grow_with_buffered_chunks() -> None:
    """Each readline (and readuntil) search starts at the front of the
    buffer; finding the chunk that holds its start must not walk the whole
    chunk queue, or reading out N buffered chunks costs N * N and a peer
    that sends many 1 KiB segments to a busy handler stalls the loop
    (seconds of CPU for a few MiB). Work for 4x the chunks grows 4x, not
    16x (14x on the commit before this test)."""
    n = 60
    work_n = await reader_work(lambda: lines_behind_chunks(n))()
    work_4n = await reader_work(lambda: lines_behind_chunks(4 * n))()
    assert work_4n < 5 * work_n, (work_n, work_4n)


@pytest.mark.asyncio
async def test_header_sent_one_byte_per_segment() -> None:
    """A peer sends a header one byte per TCP segment: the server's readuntil
    returns it whole, and its search looked at each byte a bounded number of
    times."""
    got: asyncio.Future[tuple[bytes, bytes, int, int]] = asyncio.Future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            examined = reader._examined
            body = await reader.readexactly(4)
            got.set_result((head, body, examined, reader._size))
        except BaseException as e:  # pragma: no cover - reported below
            got.set_exception(e)
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(10):
            for i in range(len(HEADER)):
                await loop.sock_sendall(sock, HEADER[i : i + 1])
                await asyncio.sleep(0)
            await loop.sock_sendall(sock, b"body")
            head, body, examined, left = await got
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
    assert head == HEADER
    assert body == b"body"
    assert left == 0
    assert examined <= 4 * len(HEADER) + 16


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["whole", "bytes"])
async def test_limits_and_errors_match_asyncio(mode: str) -> None:
    """LimitOverrunError (consumed offsets, data left buffered), readline's
    ValueError and discarding, IncompleteReadError's partial: as asyncio,
    with the data arriving whole or one byte per wake-up."""

    def feed(data: bytes) -> list[bytes]:
        return [data] if mode == "whole" else [data[i : i + 1] for i in range(len(data))]

    def until(sep: bytes) -> Op:
        return lambda r: r.readuntil(sep)

    def line() -> Op:
        return lambda r: r.readline()

    def exactly(n: int) -> Op:
        return lambda r: r.readexactly(n)

    cases: list[tuple[bytes, list[Op]]] = [
        # No separator within the limit: nothing consumed, readable again.
        (b"0123456789abcdefghij\r\n\r\nrest", [until(b"\r\n\r\n"), exactly(3), until(b"\r\n\r\n")]),
        # Separator found, but past the limit.
        (b"0123456789abcd\r\n\r\nxyz", [until(b"\r\n\r\n"), until(b"\r\n\r\n")]),
        # Exactly at the limit (10 bytes before the separator), and one past.
        (b"0123456789\r\n0123456789a\r\n", [until(b"\r\n"), until(b"\r\n")]),
        (b"012345678\r\n\r\n", [until(b"\r\n\r\n")]),
        # readline: an over-long line is discarded with its newline...
        (b"0123456789abcdef\nnext\n", [line(), line()]),
        # ... or the whole buffer without one.
        (b"0123456789abcdefghijklmnopqrstuvwxyz", [line(), line()]),
        # EOF inside a separator: the partial holds its start.
        (b"abc\r\n\r", [until(b"\r\n\r\n")]),
        (b"ab", [line()]),
    ]
    for data, ops in cases:
        await same_as_asyncio(feed(data), ops, limit=10)


# ------------------------------------------------------------ 2. memory


def heap_of_fed(cls: type, n: int) -> int:
    """Bytes still allocated after feeding ``n`` one-byte chunks to a new reader."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reader = cls()
        for i in range(n):
            reader.feed_data(bytes((i & 0x7F,)))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del reader
    return held


@pytest.mark.asyncio
async def test_tiny_chunks_heap_within_4x_of_asyncio() -> None:
    n = 5000
    reference = heap_of_fed(asyncio.StreamReader, n)
    held = heap_of_fed(slabnet.StreamReader, n)
    # Base commit: ~1,565 KiB against asyncio's ~6 KiB.
    assert held <= 4 * reference, (held, reference)
    # And the bytes are all there, in order.
    reader = slabnet.StreamReader()
    for i in range(n):
        reader.feed_data(bytes((i & 0x7F,)))
    assert await reader.readexactly(n) == bytes(i & 0x7F for i in range(n))


@asynccontextmanager
async def served_reader() -> AsyncIterator[tuple[slabnet.StreamReader, socket.socket]]:
    """A slabnet server's reader of one connection, and the client's socket
    (non-blocking, Nagle off: each send is a segment of its own)."""
    ready: asyncio.Future[slabnet.StreamReader] = asyncio.Future()
    done = asyncio.Event()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        ready.set_result(reader)
        await done.wait()
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        async with asyncio.timeout(5):
            reader = await ready
        yield reader, sock
    finally:
        done.set()
        sock.close()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_tiny_segments_over_tcp_heap_bounded() -> None:
    """2,000 one-byte TCP segments buffered unread hold about what asyncio's
    buffer of the same bytes holds, not 2,000 chunk objects."""
    n = 2000
    reference = heap_of_fed(asyncio.StreamReader, n)
    loop = asyncio.get_running_loop()
    async with served_reader() as (reader, sock):
        tracemalloc.start()
        try:
            async with asyncio.timeout(20):
                # The first byte: the loop's read slab gets allocated, and the
                # reader holds it as is (nothing was buffered).
                await loop.sock_sendall(sock, b"z")
                while not reader._size:
                    await asyncio.sleep(0)
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                for i in range(1, n):
                    await loop.sock_sendall(sock, b"z")
                    while reader._size <= i:  # one read per segment
                        await asyncio.sleep(0)
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - before
                tracemalloc.stop()
                assert await reader.readexactly(n) == b"z" * n
        finally:
            tracemalloc.stop()
    # The loop's own transient allocations get a fixed allowance; 2,000
    # queued chunk objects would be ~640 KB.
    assert held <= 4 * reference + 32 * 1024, (held, reference)


@pytest.mark.asyncio
async def test_read_to_eof_of_tiny_segments_holds_about_their_bytes() -> None:
    """read() to EOF from a peer that sends a byte per segment: the read in
    progress held a view and a bytes object for each byte, ~220 bytes per
    byte, 9x what asyncio's read() holds (3.3x on uvloop). Runs of small
    chunks are now copied into one buffer; big chunks are kept as they came,
    and the order holds."""
    n = 3000
    loop = asyncio.get_running_loop()
    big = os.urandom(200_000)
    async with served_reader() as (reader, sock), asyncio.timeout(20):
        task = asyncio.ensure_future(reader.read())

        async def one_segment(data: bytes) -> None:
            # One read per segment, each taken by read() before the next.
            reads = slabnet.memory_stats().reads
            await loop.sock_sendall(sock, data)
            while slabnet.memory_stats().reads == reads or reader._size or not reader._waiter:
                await asyncio.sleep(0)

        for _ in range(30):  # the read size comes down to its floor meanwhile
            await one_segment(b"<")
        tracemalloc.start()
        try:
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(n):
                await one_segment(b"z")
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        await loop.sock_sendall(sock, big)
        await loop.sock_sendall(sock, b">")
        sock.shutdown(socket.SHUT_WR)
        assert await task == b"<" * 30 + b"z" * n + big + b">"
    # 3,000 views and bytes objects would be ~650 KB; the loop's own
    # transient allocations get a fixed allowance.
    assert held <= 8 * n + 32 * 1024, held


@pytest.mark.asyncio
async def test_big_chunks_still_zero_copy_and_views_never_change() -> None:
    reader = slabnet.StreamReader()
    big = bytearray(b"B" * 65536)
    reader.feed_data(b"a")  # alone: kept as it came
    reader.feed_data(b"b")  # buffered behind it: coalesced
    reader.feed_data(b"c")
    reader._feed_chunk(memoryview(big).toreadonly())  # as the transport does
    reader.feed_data(b"d")
    chunks = [await reader.read_chunk() for _ in range(4)]
    assert [bytes(c) for c in chunks] == [b"a", b"bc", bytes(big), b"d"]
    assert chunks[2].obj is big  # handed on, not copied
    assert all(c.readonly for c in chunks)
    # A view of coalesced bytes is never written after it was handed out.
    reader.feed_data(b"e")
    reader.feed_data(b"f")
    reader.feed_data(b"g")
    first = await reader.read_chunk()
    reader.feed_data(b"h")
    reader.feed_data(b"i")
    second = await reader.read_chunk()
    reader.feed_data(b"j")
    assert bytes(first) == b"e"
    assert bytes(second) == b"fghi" and second.readonly
    assert bytes(chunks[1]) == b"bc" and bytes(chunks[3]) == b"d"
    with pytest.raises(TypeError):
        second[0] = 0  # type: ignore[index]


# ------------------------------------------------------------ 3. straddling


@pytest.mark.asyncio
async def test_self_overlapping_separator_after_consumed_bytes() -> None:
    """The issue's repro: the first hit in the straddle window starts in
    bytes already consumed; the real one right after must still be found."""
    for cls in (asyncio.StreamReader, slabnet.StreamReader):
        reader = cls()
        reader.feed_data(b"line\r\n\r")
        reader.feed_data(b"\n\r\nnext message...")
        async with asyncio.timeout(1):
            assert await reader.readuntil(b"\r\n") == b"line\r\n"
            assert await reader.readuntil(b"\r\n\r\n") == b"\r\n\r\n"
        reader.feed_eof()
        assert await reader.read() == b"next message..."


@pytest.mark.asyncio
async def test_separators_split_at_every_offset() -> None:
    """Self-overlapping separators, fed whole, byte by byte and cut in two
    and three at every offset: the same messages as asyncio."""
    data = b"a\r\n\r\n\r\nb\r\n\r\r\n\r\nc\r\n"
    ops: list[Op] = [
        lambda r: r.readuntil(b"\r\n"),
        lambda r: r.readuntil(b"\r\n\r\n"),
        lambda r: r.readuntil(b"\r\n\r\n"),
        lambda r: r.readuntil(b"\n\r"),
        lambda r: r.readline(),
    ]
    for pieces in splits(data):
        await same_as_asyncio(pieces, ops)
    data = b"xabab-ababa-abababx"
    ops = [lambda r: r.readuntil(b"abab"), lambda r: r.readuntil(b"aba"),
           lambda r: r.readuntil(b"ababx")]
    for pieces in splits(data):
        await same_as_asyncio(pieces, ops)


@pytest.mark.asyncio
async def test_find_matches_bytes_find_for_every_layout() -> None:
    """The search against ``bytes.find`` for every start offset, with the
    buffer made of big chunks, coalesced tails and a partly consumed first
    chunk."""
    data = b"\r\n\r\nab\r\n\rab\n\r\n\r\nabab"
    for pieces in splits(data):
        for consumed in (0, 1, 3):
            reader = slabnet.StreamReader()
            for i, piece in enumerate(pieces):
                if i % 2:
                    reader.feed_data(piece)  # coalesced if data is buffered
                else:
                    reader._feed_chunk(memoryview(piece))
                    if reader._tail:
                        reader._seal_tail()
            if consumed:
                reader._take(consumed)
            rest = data[consumed:]
            for sep in (b"\r\n\r\n", b"\n", b"ab\r", b"abab", b"\n\r\n\r\n"):
                for start in range(len(rest) + 1):
                    assert reader._find(sep, start) == rest.find(sep, start), (
                        pieces, consumed, sep, start,
                    )


# ------------------------------------------------------------ 4. bytes-like


@pytest.mark.asyncio
async def test_bytes_like_separators() -> None:
    data = [b"one\r\ntwo\r", b"\nthree\r\n", b"four"]
    await same_as_asyncio(data, [
        lambda r: r.readuntil(bytearray(b"\r\n")),
        lambda r: r.readuntil(memoryview(b"\r\n")),
        lambda r: r.readuntil(memoryview(b"xx\r\nxx")[2:4]),
        lambda r: r.readuntil("\r\n"),  # not bytes-like: TypeError
        lambda r: r.readuntil(bytearray()),  # empty: ValueError
    ])


# ------------------------------------------------------------ 5. cancellation


@pytest.mark.asyncio
async def test_cancelled_read_to_eof_raises_and_keeps_its_bytes() -> None:
    """The error and the cancellation arrive together: the cancellation
    wins, and the bytes read so far stay buffered, before the error."""
    reader = slabnet.StreamReader()
    reader.feed_data(b"abc")
    task = asyncio.ensure_future(reader.read())
    await asyncio.sleep(0)  # it took b"abc" and waits for more
    reader.set_exception(ConnectionResetError("reset"))
    task.cancel()
    async with asyncio.timeout(2):
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ConnectionResetError):
            await reader.read()  # to EOF: the error; the bytes stay buffered
        assert await reader.read(100) == b"abc"
        with pytest.raises(ConnectionResetError):
            await reader.read(100)


@pytest.mark.asyncio
async def test_expired_timeout_around_read_to_eof_raises() -> None:
    loop = asyncio.get_running_loop()
    reader = slabnet.StreamReader()
    reader.feed_data(b"abc")
    scope: asyncio.Future[Any] = loop.create_future()

    async def read_all() -> bytes:
        async with asyncio.timeout(None) as cm:
            scope.set_result(cm)
            return await reader.read()

    task = asyncio.ensure_future(read_all())
    async with asyncio.timeout(2):
        cm = await scope
        await asyncio.sleep(0)
        cm.reschedule(loop.time() - 1)  # expires on the next loop iteration
        reader.set_exception(ConnectionResetError("reset"))
        with pytest.raises(TimeoutError):
            await task
        assert await reader.read(100) == b"abc"


READS: dict[str, Op] = {
    "read": lambda r: r.read(),
    "read_n": lambda r: r.read(100),
    "readexactly": lambda r: r.readexactly(9),
    "readuntil": lambda r: r.readuntil(b"\r\n\r\n"),
    "readline": lambda r: r.readline(),
    "read_chunk": lambda r: r.read_chunk(),
    "readinto": lambda r: r.readinto(bytearray(100)),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(READS))
async def test_cancelled_reads_lose_no_bytes(name: str) -> None:
    """Cancel each read at each of its awaits: every byte fed before stays
    buffered for the next read."""
    pieces = [b"ab", b"\r\n", b"\r", b"cd", b"\n"]
    for cut in range(len(pieces) + 1):
        reader = slabnet.StreamReader()
        task = asyncio.ensure_future(READS[name](reader))
        async with asyncio.timeout(2):
            await asyncio.sleep(0)
            for piece in pieces[:cut]:
                reader.feed_data(piece)
                await asyncio.sleep(0)
            if task.done():
                assert cut > 0
                task.result()  # completed normally: nothing to check
                continue
            # Also the case where data arrives in the same iteration as
            # the cancellation: the read must not consume it.
            reader.feed_data(b"!")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            reader.feed_eof()
            assert await reader.read() == b"".join(pieces[:cut]) + b"!"


@pytest.mark.asyncio
async def test_timed_out_read_over_tcp_keeps_its_bytes() -> None:
    """A read() to EOF that times out half-way: the bytes that had arrived
    come out of the next read()."""
    go = asyncio.Event()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(b"first half, ")
        await go.wait()
        writer.write(b"second half")
        writer.close()

    server = await slabnet.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await slabnet.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(5):
            while reader._size < 12:
                await asyncio.sleep(0.001)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await reader.read()
            go.set()
            assert await reader.read() == b"first half, second half"
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_tuple_of_bytes_like_separators() -> None:
    """Python 3.13's tuple of separators, bytes-like ones included, trickled
    and with small limits: as asyncio. Before 3.13 asyncio has no tuples, and
    neither has slabnet."""
    seps: list[Any] = [
        (b"cd|", b"\r\n"), (bytearray(b"\r\n"), memoryview(b"|")),
        (b"\r\n\r\n", b"zz"), (b"\r\n\r\n", b"\n\r"), (b"|", b"q|"),
    ]
    if sys.version_info < (3, 13):
        with pytest.raises(TypeError):
            await slabnet.StreamReader().readuntil(seps[0])
        return
    data = b"ab|cd\r\nxyz0123456789abcdefg\r\n\r\nq|\n\r\r\n\r\n"
    ops: list[Op] = [lambda r, s=s: r.readuntil(s) for s in seps]  # type: ignore[misc]
    for limit in (5, 10, 2**16):
        for pieces in splits(data)[: 2 + len(data)]:
            await same_as_asyncio(pieces, ops, limit=limit)
