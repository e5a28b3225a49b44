"""Child-process entry point: ``python -m benchmarks.worker JSON``.

The JSON names the role (``server`` or ``client``), the scenario, the
parameters and the certificate files.  A server gets its listening socket as
an inherited file descriptor (the driver binds 127.0.0.1:0, so the client can
connect while the server process is still starting).  A client prints one
JSON object on stdout: the scenario's metrics plus ``peak_rss_mib``.

Exit codes: 0 ok, 1 crash (traceback on stderr), 3 slabnet not available.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .common import SlabnetUnavailable, peak_rss_mib
from .core import HEAP_ENV, ClientContext, Files, impl_by_name
from .scenarios import get_scenario

EXIT_UNAVAILABLE = 3

#: The block :func:`settle_heap` frees (it must be larger than asyncio's 256 KiB reads).
HEAP_SETTLE_BYTES = 1 << 20


def settle_heap() -> None:
    """Put glibc's malloc into the state of a process that has run a while
    (``--heap settled``, the default; ``--heap pinned`` measures the other
    state, see the driver).

    glibc serves blocks above its mmap threshold (128 KiB at start) with
    mmap/munmap, and raises the threshold to the size of the first such
    block that is freed.  asyncio's SSL transport asks ``SSLObject.read``
    for 256 KiB per record: in a process that never freed a large block,
    every record pays an mmap, page faults and an munmap (asyncio's SSL
    Protocol at 16 KiB records: 1.41 CPU-s/GiB, against 0.44-0.68 once the
    threshold is raised).  Which state a worker started in depended on what
    its imports happened to allocate, and flipped with unrelated code
    changes, so every worker frees one 1 MiB block first, as any process
    that once read a large file or response has.
    """
    block = bytearray(HEAP_SETTLE_BYTES)
    del block


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if loop == "asyncio":
        return None
    raise ValueError(f"unknown loop {loop!r}")


def run_server(spec: dict[str, Any]) -> None:
    scenario = get_scenario(spec["scenario"])
    assert scenario.server is not None, f"{scenario.name} has no Python server"
    listener = socket.socket(fileno=spec["fd"])
    scenario.server(listener, spec["params"], Files(**spec["files"]))


def run_client(spec: dict[str, Any]) -> dict[str, Any]:
    scenario = get_scenario(spec["scenario"])
    impl = impl_by_name(spec["impl"])
    ctx = ClientContext(impl=impl, params=spec["params"], port=spec["port"], files=Files(**spec["files"]))
    with asyncio.Runner(loop_factory=_loop_factory(impl.loop)) as runner:
        result: dict[str, Any] = runner.run(scenario.client(ctx))
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    if os.environ.get(HEAP_ENV, "settled") == "settled":
        settle_heap()
    try:
        if spec["role"] == "server":
            run_server(spec)
        else:
            result = run_client(spec)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
    except SlabnetUnavailable as exc:
        print(f"slabnet unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
