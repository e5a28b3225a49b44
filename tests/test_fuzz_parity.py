"""A seeded differential test of the reader API: slabnet's ``StreamReader``
against asyncio's (``asyncio.StreamReaderProtocol`` on the same loop, so on
uvloop its transports), over loopback, plain and TLS.

Each seed picks a byte stream with separators planted (runs of them,
multi-byte ones cut across segments, a partial one at the end), a
segmentation, a reader ``limit`` (small ones too: LimitOverrunError, and
flow control pausing and resuming the reads) and a sequence of reader ops;
both readers get the same segments and run the same ops, and every op's
outcome (bytes, exception type, attributes and message) must be the same.

Lockstep. The peer sends a segment only once the reader's side has read
every byte sent (the client socket's receive queue is empty, and over TLS
every complete record's plaintext has reached the reader) and the op task
is waiting for data: so each op sees the same bytes on both sides, and the
result depends on no timing. Segments are at most 1 KiB, the smallest read
either side makes (slabnet's sizer and its paused read), so each arrives in
one read. Over TLS the segments are cuts of the ciphertext anywhere:
record headers split, records byte by byte, several records at once.

``read_chunk()`` has no asyncio counterpart: the asyncio side reads as many
bytes with ``read(n)`` (the chunk's length, from slabnet's run), so only the
bytes are compared. The streams end with the peer's FIN (TLS: with or
without close_notify), so the deliberate differences of README's list
(data before a stored error; a cancelled ``read()`` keeping its bytes) do
not arise: the cancelled ops here are single reads that wait.
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import sys
from typing import Any

import pytest

import slabnet
from conftest import RawTLS, client_ctx, server_ctx, unread, until

WAKE = 10.0  # seconds a lockstep wait may take
SEPS = [b"\n", b"\r\n", b"--boundary--", b"ab", b"\n\n"]
LIMITS = [1, 2, 3, 5, 8, 16, 64, 100, 1000, 65536]
SEGMENT_MAX = 1024  # see the module docstring
Op = tuple[Any, ...]


# ------------------------------------------------------------------ a case


def make_case(seed: int, tls: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    n = rng.choice([0, rng.randint(1, 300), rng.randint(300, 6000)])
    data = bytearray(rng.choice(b"ab\r\n-x") for _ in range(n))
    for _ in range(rng.randint(0, 1 + n // 40)):
        at = rng.randint(0, len(data))
        data[at:at] = rng.choice(SEPS + [b"\n" * rng.randint(2, 5), b"\r\n" * 3])
    if rng.random() < 0.3:
        data += rng.choice(SEPS)[: rng.randint(1, 4)]
    limit = rng.choice(LIMITS)
    return {
        "data": bytes(data),
        "limit": limit,
        # (Over TLS the cuts may not depend on the ciphertext's bytes,
        # which differ from run to run: "headers" instead of "straddle".)
        "style": rng.choice(["tiny", "limit", "random", "headers" if tls else "straddle"]),
        "records": rng.choice(["tiny", "random", "full"]),
        "ending": rng.choice(["close_notify", "fin"]) if tls else "fin",
        "ops": make_ops(rng, limit),
        "rng": rng,
    }


def make_ops(rng: random.Random, limit: int) -> list[Op]:
    ops: list[Op] = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.15:
            ops.append(("read", rng.choice([0, 1, 2, rng.randint(1, 100), limit, limit + 1])))
        elif r < 0.30:
            ops.append(("readline",))
        elif r < 0.47:
            ops.append(("readuntil", rng.choice(SEPS)))
        elif r < 0.55 and sys.version_info >= (3, 13):
            ops.append(("readuntil", tuple(rng.sample(SEPS, rng.randint(1, 3)))))
        elif r < 0.68:
            n = rng.choice([0, 1, rng.randint(1, 50), limit, 2 * limit + 3])
            ops.append(("readexactly", n))
        elif r < 0.74:
            ops.append(("at_eof",))
        elif r < 0.82:
            ops.append(("lines", rng.randint(1, 10)))
        elif r < 0.92:
            ops.append(("read_chunk",))
        else:
            ops.append(("cancel", rng.choice([
                ("read", 100), ("readline",), ("readuntil", rng.choice(SEPS)),
                ("readexactly", rng.randint(1, 3 * limit)),
            ])))
    ops.append(("read", -1))
    return ops


def segments(
    wire: bytes, style: str, rng: random.Random, record_ends: list[int]
) -> list[bytes]:
    out = []
    pos = 0
    while pos < len(wire):
        if style == "tiny":
            k = 1 if rng.random() < 0.8 else rng.randint(1, 40)
        elif style == "limit":
            k = rng.choice([1, 2, 3, 5, 16, 64, 100, 1000, 1024])
        elif style == "straddle":  # cut inside the next multi-byte separator
            found = [(i, s) for s in SEPS[1:] if (i := wire.find(s, pos + 1)) != -1]
            if found:
                i, sep = min(found)
                k = i - pos + rng.randint(1, len(sep) - 1)
            else:
                k = SEGMENT_MAX
        elif style == "headers":  # up to 1 to 4 bytes into the next record's header
            end = next((e for e in record_ends if e > pos), len(wire))
            k = end - pos + rng.randint(1, 4)
        else:
            k = rng.randint(1, SEGMENT_MAX)
        k = min(k, SEGMENT_MAX, len(wire) - pos)
        out.append(wire[pos : pos + k])
        pos += k
    return out


def seal(
    tls: RawTLS, data: bytes, style: str, rng: random.Random
) -> tuple[bytes, list[tuple[int, int]]]:
    """The ciphertext of ``data`` in records of the style's sizes, and for
    each record (its end in the ciphertext, plaintext up to its end)."""
    wire = bytearray()
    ends = []
    pos = 0
    while pos < len(data):
        k = {"tiny": rng.randint(1, 8), "random": rng.randint(1, 3000), "full": 16384}[style]
        wire += tls.seal(data[pos : pos + k])
        pos = min(len(data), pos + k)
        ends.append((len(wire), pos))
    return bytes(wire), ends


# ------------------------------------------------------------------ ops


def outcome_of(exc: BaseException) -> tuple[Any, ...]:
    if isinstance(exc, asyncio.IncompleteReadError):
        return ("IncompleteReadError", exc.partial, exc.expected, str(exc))
    if isinstance(exc, asyncio.LimitOverrunError):
        return ("LimitOverrunError", exc.consumed, exc.args)
    if isinstance(exc, ValueError):
        return ("ValueError", str(exc))
    return (type(exc).__name__,)


class Watch:
    """What the lockstep sees of one reader: bytes it was fed, whether an
    op waits for data, whether a cancel op is at work (send nothing then)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.received = 0
        self.busy = False
        # (On the instance: the protocols call reader._feed_chunk / feed_data.)
        name = "_feed_chunk" if isinstance(reader, slabnet.StreamReader) else "feed_data"
        feed = getattr(reader, name)

        def counting(data: Any) -> None:
            self.received += len(data)
            feed(data)

        setattr(reader, name, counting)

    def waiting(self) -> bool:
        waiter = self.reader._waiter
        return waiter is not None and not waiter.done()


async def run_op(reader: Any, op: Op, watch: Watch) -> tuple[Any, ...]:
    name = op[0]
    try:
        if name == "read":
            return ("ok", await reader.read(op[1]))
        if name == "readline":
            return ("ok", await reader.readline())
        if name == "readuntil":
            return ("ok", await reader.readuntil(op[1]))
        if name == "readexactly":
            return ("ok", await reader.readexactly(op[1]))
        if name == "at_eof":
            return ("ok", reader.at_eof())
        if name == "read_chunk":
            if isinstance(reader, slabnet.StreamReader):
                return ("ok", bytes(await reader.read_chunk()))
            return ("ok", await reader.read(op[1]))  # (op[1]: the chunk's length)
        if name == "lines":
            lines = []
            async for line in reader:
                lines.append(line)
                if len(lines) == op[1]:
                    break
            return ("ok", lines)
        if name == "cancel":
            # The inner op, cancelled once it waits for data (no segment
            # is sent meanwhile).
            watch.busy = True
            try:
                task = asyncio.ensure_future(run_op(reader, op[1], watch))
                while not (task.done() or watch.waiting()):
                    await asyncio.sleep(0)
                if task.done():
                    return ("done", task.result())
                task.cancel()
                return ("cancelled", await task)
            finally:
                watch.busy = False
    except (Exception, asyncio.CancelledError) as exc:
        return outcome_of(exc)
    raise AssertionError(op)


# ------------------------------------------------------------------ a run


async def play(
    seed: int, slab: bool, ops: list[Op], listener: socket.socket,
    ctx: tuple[ssl.SSLContext, ssl.SSLContext] | None,
) -> list[tuple[Any, ...]]:
    """One reader's run of the seed's case; each op's outcome."""
    case = make_case(seed, ctx is not None)
    rng: random.Random = case["rng"]
    loop = asyncio.get_running_loop()
    host, port = listener.getsockname()
    limit = case["limit"]
    kw: dict[str, Any] = {}
    if ctx is not None:
        kw = {"ssl": ctx[1], "server_hostname": "localhost"}
    opener: Any = slabnet.open_connection if slab else asyncio.open_connection
    opening = asyncio.ensure_future(opener(host, port, limit=limit, **kw))
    peer, _ = await loop.sock_accept(listener)
    peer.setblocking(False)
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        tls = None
        if ctx is not None:
            tls = RawTLS(peer, ctx[0], server_side=True)
            await asyncio.wait_for(asyncio.gather(tls.handshake(), asyncio.shield(opening)), WAKE)
        reader, writer = await asyncio.wait_for(opening, WAKE)
        sock = writer.get_extra_info("socket")
        data: bytes = case["data"]
        if tls is None:
            wire, ends = data, list[tuple[int, int]]()
        else:
            wire, ends = seal(tls, data, case["records"], rng)

        watch = Watch(reader)
        results: list[tuple[Any, ...]] = []

        async def run_ops() -> None:
            for op in ops:
                results.append(await run_op(reader, op, watch))

        task = asyncio.ensure_future(run_ops())
        sent = 0
        try:
            for segment in segments(wire, case["style"], rng, [end for end, _ in ends]):
                await loop.sock_sendall(peer, segment)
                sent += len(segment)
                plain = sent if tls is None else max(
                    [p for end, p in ends if end <= sent], default=0
                )
                # Every complete record read, its plaintext at the reader
                # (buffered, or taken by the op task), the task waiting.
                await until(lambda: task.done() or (
                    unread(sock) == 0 and watch.received >= plain
                    and watch.waiting() and not watch.busy
                ), f"segment up to {sent} read", timeout=WAKE, step=0)
            if tls is not None and case["ending"] == "close_notify":
                await loop.sock_sendall(peer, tls.close_notify())
            peer.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(task, WAKE)
        finally:
            task.cancel()
            writer.close()
        return results
    finally:
        peer.close()


def for_asyncio(ops: list[Op], slab_results: list[tuple[Any, ...]]) -> list[Op]:
    """The ops for asyncio's reader: read_chunk() as read(len(chunk))."""
    out = []
    for op, res in zip(ops, slab_results):
        if op[0] == "read_chunk":
            out.append(("read_chunk", len(res[1]) if res[0] == "ok" and res[1] else 1))
        else:
            out.append(op)
    return out


async def check_seed(
    seed: int, listener: socket.socket, ctx: tuple[ssl.SSLContext, ssl.SSLContext] | None
) -> None:
    ops = make_case(seed, ctx is not None)["ops"]
    got = await play(seed, True, ops, listener, ctx)
    want = await play(seed, False, for_asyncio(ops, got), listener, ctx)
    assert len(got) == len(ops) and len(want) == len(ops)
    for i, (op, g, w) in enumerate(zip(ops, got, want)):
        assert g == w, f"seed {seed}: op {i} {op!r}: slabnet {g!r}, asyncio {w!r}"


SEEDS = range(48)


@pytest.mark.asyncio
async def test_reader_ops_match_asyncio_over_plain_tcp(listener: socket.socket) -> None:
    for seed in SEEDS:
        await check_seed(seed, listener, None)


@pytest.mark.asyncio
async def test_reader_ops_match_asyncio_over_tls(
    listener: socket.socket, server_cert: Any, tls_ca: Any
) -> None:
    ctx = (server_ctx(server_cert), client_ctx(tls_ca))
    for seed in SEEDS:
        await check_seed(seed, listener, ctx)


# ------------------------------------------------------------------ found by the fuzz


@pytest.mark.asyncio
@pytest.mark.parametrize("lib, end", [
    (slabnet, "close_notify"), (asyncio, "close_notify"), (slabnet, "bad_record"),
], ids=["slabnet", "asyncio", "slabnet-bad-record"])
async def test_the_end_behind_the_client_finished_reaches_a_paused_reader(
    lib: Any, end: str, server_cert: Any, tls_ca: Any
) -> None:
    """A TLS 1.3 client's Finished, 5000 bytes of data and its close_notify
    (or a record that cannot be valid) in one segment: the read that
    completes the server's handshake brings the data and the end too. The
    reader (limit 16) pauses during the data, and slabnet delivered the
    rest of that read only if some of it was still ciphertext; the engine
    had taken in the end with the record before it, so ``read()`` waited
    for ever (for more bytes from a peer that waits for the answer).
    asyncio's reader gets the data, then EOF; slabnet's, after an invalid
    record, ``TLSRecordError`` from ``read()`` to EOF (the body is not
    complete) with the data still buffered, where ``read(n)`` returns it
    (asyncio's drops the data before the error: README's deliberate
    differences)."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[list[Any]] = loop.create_future()

    async def handler(reader: Any, writer: Any) -> None:
        reads: list[Any] = []
        try:
            while data := await reader.read():
                reads.append(data)
            reads.append(b"")
        except Exception as exc:
            reads.append(type(exc))
            if lib is slabnet:
                reads.append(await reader.read(10_000))
        outcome.set_result(reads)
        writer.close()

    server = await lib.start_server(
        handler, "127.0.0.1", 0, limit=16, ssl=server_ctx(server_cert)
    )
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, server.sockets[0].getsockname())
        tls = RawTLS(sock, client_ctx(tls_ca), server_side=False, server_hostname="localhost")
        async with asyncio.timeout(WAKE):
            await tls.handshake(send_last=False)  # the client's Finished is kept
        assert tls.obj.version() == "TLSv1.3"
        wire = tls.outgoing.read() + tls.seal(b"x" * 5000)
        wire += tls.close_notify() if end == "close_notify" else b"\x99\x03\x03\x00\x10" + bytes(16)
        await tls.send(wire)
        reads = await asyncio.wait_for(outcome, WAKE)
        if end == "close_notify":
            assert reads == [b"x" * 5000, b""]
        else:
            assert reads == [slabnet.TLSRecordError, b"x" * 5000]
    finally:
        sock.close()
        server.close()
