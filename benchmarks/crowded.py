"""A crowded descriptor table: the CPU a server spends on many connections
whose writes wait for slow readers.

    python -m benchmarks.crowded [--runs N] [--n 600] [--soft 1024]

A server process with a soft ``RLIMIT_NOFILE`` of ``--soft`` writes 64 KiB
and ``drain()``s, forever, on each of ``--n`` connections; a client process
(asyncio streams on uvloop, the same for every server measured) reads
8 KiB from each connection every 50 ms, so every server queue waits for
its peer nearly all the time. With ``--n`` above half of ``--soft``,
slabnet's blocked queues may not hold a duplicate descriptor each (see
docs/DESIGN.md, "Writes"): this measures what they cost instead. After a
warm-up, the server's CPU (user + system, ``getrusage``) over a window, as
a share of one core, with the bytes it sent and the descriptors it held.

Each run is a fresh pair of processes, implementations and loops
alternating; medians of ``--runs`` runs, with the slabnet/asyncio ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

IMPLS = ("slabnet", "asyncio")
LOOPS = ("asyncio", "uvloop")
PAYLOAD = 64 * 1024
READ = 8 * 1024
READ_EVERY = 0.05
WARM = 4.0
WINDOW = 8.0


def new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def serve(impl: str) -> None:
    if impl == "slabnet":
        import slabnet

        start: Any = slabnet.start_server
    else:
        start = asyncio.start_server
    sent = 0
    payload = b"x" * PAYLOAD

    async def handler(reader: Any, writer: Any) -> None:
        nonlocal sent
        try:
            while True:
                writer.write(payload)
                await writer.drain()
                sent += PAYLOAD
        except OSError:  # (the client went away)
            writer.close()

    server = await start(handler, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # warmed up
    r0, s0, t0 = resource.getrusage(resource.RUSAGE_SELF), sent, time.monotonic()
    await loop.run_in_executor(None, sys.stdin.readline)  # window over
    r1, s1, t1 = resource.getrusage(resource.RUSAGE_SELF), sent, time.monotonic()
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    print(json.dumps({
        "cpu_pct": 100 * cpu / (t1 - t0),
        "cpu_s_gib": cpu / max(s1 - s0, 1) * 2**30,
        "mib_s": (s1 - s0) / (t1 - t0) / 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
    }), flush=True)
    os._exit(0)  # (the connections stay open: the driver ends the client)


async def clients(port: int, n: int) -> None:
    async def one() -> None:
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        while await reader.read(READ):
            await asyncio.sleep(READ_EVERY)

    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one()))
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # (within the listen backlog)
    await asyncio.gather(*tasks)


def run_once(impl: str, loop: str, n: int, soft: int) -> dict[str, float]:
    me = [sys.executable, "-m", "benchmarks.crowded"]
    srv = subprocess.Popen(
        me + ["--role", "server", "--impl", impl, "--loop", loop, "--soft", str(soft)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert srv.stdin is not None and srv.stdout is not None
    cl = None
    try:
        port = srv.stdout.readline().strip()
        cl = subprocess.Popen(me + ["--role", "client", "--port", port, "--n", str(n)])
        time.sleep(WARM)
        srv.stdin.write("\n")
        srv.stdin.flush()
        time.sleep(WINDOW)
        srv.stdin.write("\n")
        srv.stdin.flush()
        result: dict[str, float] = json.loads(srv.stdout.readline())
        return result
    finally:
        if cl is not None:
            cl.kill()
            cl.wait()
        srv.kill()
        srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=600, help="connections")
    ap.add_argument("--soft", type=int, default=1024, help="the server's soft descriptor limit")
    ap.add_argument("--role", choices=("driver", "server", "client"), default="driver")
    ap.add_argument("--impl", choices=IMPLS)
    ap.add_argument("--loop", choices=LOOPS)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.role == "server":
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.soft, hard))
        new_loop(args.loop).run_until_complete(serve(args.impl))
        return
    if args.role == "client":
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        new_loop("uvloop").run_until_complete(clients(args.port, args.n))
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.runs):
        for loop in LOOPS:
            for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                res = run_once(impl, loop, args.n, args.soft)
                results.setdefault((impl, loop), []).append(res)
                print(f"run {r + 1} {impl:8} {loop:8} " + " ".join(
                    f"{k}={v:.1f}" for k, v in res.items()), flush=True)
    print(f"\n{args.n} connections, soft limit {args.soft}, medians of {args.runs}:")
    print(f"{'loop':8} {'impl':8} {'CPU % of a core':>16} {'CPU s/GiB':>10}"
          f" {'MiB/s':>7} {'fds':>5}")

    def med(impl: str, loop: str, key: str) -> float:
        return statistics.median(x[key] for x in results[(impl, loop)])

    for loop in LOOPS:
        for impl in IMPLS:
            print(f"{loop:8} {impl:8} {med(impl, loop, 'cpu_pct'):16.2f}"
                  f" {med(impl, loop, 'cpu_s_gib'):10.2f} {med(impl, loop, 'mib_s'):7.1f}"
                  f" {med(impl, loop, 'fds'):5.0f}")
        share = med("slabnet", loop, "cpu_pct") / med("asyncio", loop, "cpu_pct")
        per_byte = med("slabnet", loop, "cpu_s_gib") / med("asyncio", loop, "cpu_s_gib")
        print(f"{loop:8} slabnet/asyncio: CPU {share:.2f}x, CPU per byte {per_byte:.2f}x")


if __name__ == "__main__":
    main()
