"""What a kept chunk costs beyond its bytes, whatever the read path did.

    python -m benchmarks.chunk_floor [--size BYTES] [--n N]

The ``retention`` scenario divides the memory still allocated (tracemalloc)
by the bytes of the chunks the client kept. A chunk that owns its buffer
(the policy for every read below the slab size, every TLS chunk included)
can pin no neighbour, so what is left above 1.0 is the chunk's own objects:
for slabnet a read-only ``memoryview`` with its managed buffer over a
``bytes`` (or a sealed ``bytearray``) of exactly the chunk's length; for
asyncio a ``bytes``. This allocates ``N`` of each shape, as kept in a list,
and reports tracemalloc's bytes per object and the ratio at ``size`` bytes a
chunk (1280 is what the ``retention`` scenario's reads carry: four 320-byte
records). No socket, no event loop, no TLS: a floor for any chunk of that
shape on this interpreter.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any


def _per_object(make: Callable[[int], Any], size: int, n: int) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [make(size) for _ in range(n)]
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return (after - before) / n


def _view_of_bytes(size: int) -> memoryview:
    return memoryview(bytes(size))  # slabnet's TLS chunk: memoryview(read(n))


def _readonly_view_of_bytearray(size: int) -> memoryview:
    return memoryview(bytearray(size)).toreadonly()  # a plain read's own buffer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chunk_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1280, help="bytes per chunk (default 1280)")
    parser.add_argument("--n", type=int, default=20000, help="chunks allocated per shape")
    args = parser.parse_args(argv)
    print(f"Python {sys.version.split()[0]}, {args.size}-byte chunks, {args.n} of each kept in a list")
    print(f"| chunk shape | bytes allocated per chunk | retained/kept |")
    print(f"|---|---:|---:|")
    for name, make in (
        ("bytes (asyncio's data_received, streams)", bytes),
        ("memoryview(bytes) (slabnet TLS chunk)", _view_of_bytes),
        ("memoryview(bytearray).toreadonly() (slabnet own-buffer read)", _readonly_view_of_bytearray),
    ):
        per = _per_object(make, args.size, args.n)
        print(f"| {name} | {per:.0f} | {per / args.size:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
