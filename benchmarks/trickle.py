"""Trickled bytes: the CPU and memory a one-byte-at-a-time peer costs a reader.

    python -m benchmarks.trickle [--runs N]

Two CPU measurements, slabnet's ``StreamReader`` against asyncio's, on the
asyncio loop and on uvloop:

* ``feed``: a ``readuntil(b"\\r\\n\\r\\n")`` is waiting while ``FEED_CHUNKS``
  one-byte chunks are fed, the reader woken after each (``sleep(0)``); then
  the separator. CPU of the whole process for that loop: the reader's
  search, its buffering and the loop's wake-ups, nothing else.
* ``socket``: a peer thread sends a ``SOCKET_BYTES``-byte header one byte per
  TCP segment (``TCP_NODELAY``, paced so that each segment is read on its
  own) to a loopback server of the implementation measured, whose handler
  does the same ``readuntil``. CPU of the loop's thread (``thread_time``)
  from the handler's start to the header's return: socket reads, the
  transport and the reader; the peer's own CPU is not counted.

Each run is a fresh subprocess, the implementations and loops alternating,
so no run inherits another's heap or caches; medians of ``--runs`` runs are
printed with the slabnet/asyncio ratio. Then the heap, with ``tracemalloc``,
of ``HEAP_CHUNKS`` one-byte chunks fed to each reader and left buffered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Coroutine
from typing import Any

#: Chunks fed in ``feed``: the issue's measurement (asyncio ~0.1 s of CPU).
FEED_CHUNKS = 10_000
#: Header bytes sent one per segment in ``socket``: well under the 64 KiB
#: limit, and about half a second of pacing per run.
SOCKET_BYTES = 3_000
#: Pause between the peer's one-byte sends: long enough that the loop reads
#: each segment alone on an idle machine, short enough to keep a run brief.
PACE = 100e-6
#: The buffered-heap test of the hardening issue.
HEAP_CHUNKS = 5_000

SEP = b"\r\n\r\n"
IMPLS = ("asyncio", "slabnet")
LOOPS = ("asyncio", "uvloop")


def reader_class(impl: str) -> Any:
    if impl == "slabnet":
        import slabnet

        return slabnet.StreamReader
    return asyncio.StreamReader


def start_server(impl: str) -> Any:
    if impl == "slabnet":
        import slabnet

        return slabnet.start_server
    return asyncio.start_server


def run_on(loop: str, main: Callable[[], Coroutine[Any, Any, float]]) -> float:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


# ------------------------------------------------------------ child side


async def bench_feed(impl: str) -> float:
    reader = reader_class(impl)(limit=2**20)
    task = asyncio.ensure_future(reader.readuntil(SEP))
    await asyncio.sleep(0)
    start = time.process_time()
    for _ in range(FEED_CHUNKS):
        reader.feed_data(b"x")
        await asyncio.sleep(0)
    reader.feed_data(SEP)
    head = await task
    cpu = time.process_time() - start
    assert len(head) == FEED_CHUNKS + len(SEP)
    return cpu


def send_trickle(port: int, header: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(header)):
            sock.sendall(header[i : i + 1])
            time.sleep(PACE)
        sock.recv(1)  # until the server closes


async def bench_socket(impl: str) -> float:
    header = b"X-Pad: " + b"p" * (SOCKET_BYTES - 7 - len(SEP)) + SEP
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def handle(reader: Any, writer: Any) -> None:
        start = time.thread_time()
        head = await reader.readuntil(SEP)
        cpu = time.thread_time() - start
        assert head == header, len(head)
        done.set_result(cpu)
        writer.close()

    server = await start_server(impl)(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    peer = threading.Thread(target=send_trickle, args=(port, header))
    peer.start()
    try:
        return await asyncio.wait_for(done, 60)
    finally:
        await asyncio.to_thread(peer.join)
        server.close()
        await server.wait_closed()


def child(impl: str, loop: str) -> None:
    feed = run_on(loop, lambda: bench_feed(impl))
    sock = run_on(loop, lambda: bench_socket(impl))
    print(json.dumps({"feed": feed, "socket": sock}))


# ------------------------------------------------------------ parent side


def heap_of_buffered(impl: str, n: int) -> int:
    cls = reader_class(impl)  # imported before tracing starts

    async def measure() -> float:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        reader = cls()
        for i in range(n):
            reader.feed_data(bytes((i & 0x7F,)))
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert len(await reader.readexactly(n)) == n
        return held

    return int(asyncio.run(measure()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trickle")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "LOOP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    cpu: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.runs):
        for loop in LOOPS:
            for impl in IMPLS:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.trickle", "--child", impl, loop],
                    check=True, capture_output=True, text=True, timeout=120,
                ).stdout
                for scenario, seconds in json.loads(out).items():
                    cpu.setdefault((scenario, loop, impl), []).append(seconds)
    print(f"CPU seconds, median of {args.runs} runs (fresh process each)")
    print(f"{'scenario':<34} {'loop':<8} {'asyncio':>9} {'slabnet':>9} {'ratio':>6}")
    labels = {
        "feed": f"feed {FEED_CHUNKS:,} x 1 B, readuntil",
        "socket": f"socket {SOCKET_BYTES:,} x 1 B segments",
    }
    for scenario in ("feed", "socket"):
        for loop in LOOPS:
            a = statistics.median(cpu[scenario, loop, "asyncio"])
            s = statistics.median(cpu[scenario, loop, "slabnet"])
            print(f"{labels[scenario]:<34} {loop:<8} {a:>9.3f} {s:>9.3f} {s / a:>6.2f}")
    a_heap = heap_of_buffered("asyncio", HEAP_CHUNKS)
    s_heap = heap_of_buffered("slabnet", HEAP_CHUNKS)
    print(
        f"heap of {HEAP_CHUNKS:,} buffered 1 B chunks (tracemalloc): "
        f"asyncio {a_heap / 1024:.1f} KiB, slabnet {s_heap / 1024:.1f} KiB, "
        f"ratio {s_heap / a_heap:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
