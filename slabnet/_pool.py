"""Small-write pool: carves the buffers that small writes are copied into
out of shared pools (64 KiB by default), so one loop iteration's small
writes sit in a few contiguous regions.

Theory of operation
-------------------
Node's ``Buffer.allocUnsafe`` carves small buffers out of a shared pool
instead of asking the allocator for each one; a request is small when
``size < poolSize >>> 1`` (strictly), and the pool grew from 8 KiB to 64 KiB
so that allocations up to 32 KiB -- HTTP frames, stream chunks, the 4 KiB
page size itself -- are covered (what that was worth is in
``benchmarks/README.md``).

slabnet uses the same rule for the write path: a small write is copied into
pooled space, so that all the small writes of one loop iteration sit in a
few contiguous regions and go out with one ``sendmsg``. Offsets are rounded
up to 8 bytes, as Node's pool aligns them, so a view handed out can be
reinterpreted with any native width.

A region is a writable ``memoryview`` of the pool; the pool itself is
forgotten when exhausted and freed with the last region. When a pool is
exhausted and none of its regions is alive any more, it is rewound and
reused instead of reallocated (the same export test as the read slab
uses), so a steady stream of small writes allocates nothing.

This module is sans-IO.
"""

from __future__ import annotations

from typing import Final

from ._slab import _exported

__all__ = ["DEFAULT_POOL_SIZE", "BufferPool", "is_pooled"]

#: Node's Buffer.poolSize default since it was raised from 8 KiB.
DEFAULT_POOL_SIZE: Final = 65536

#: Node aligns pool offsets to 8 bytes (alignPool in lib/buffer.js).
_ALIGN: Final = 8


class _PoolBuffer(bytearray):
    """One pool: regions of it are views of this."""

    __slots__ = ()


def is_pooled(view: memoryview) -> bool:
    """True if ``view`` is a region of a pool (it keeps the pool alive)."""
    return type(view.obj) is _PoolBuffer


class BufferPool:
    """Carves small buffers out of shared ``pool_size`` pools."""

    __slots__ = (
        "_pool_size", "_pool", "_offset", "small_limit", "pools_allocated", "pools_reused"
    )

    #: Allocations strictly below this many bytes come from the pool
    #: (``pool_size >> 1``, as Node's ``size < (Buffer.poolSize >>> 1)``).
    small_limit: int

    def __init__(self, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self._pool_size = 0
        self.small_limit = 0
        self._pool: bytearray | None = None
        self._offset = 0
        self.pools_allocated = 0
        self.pools_reused = 0
        self.pool_size = pool_size

    @property
    def pool_size(self) -> int:
        """Size of each pool; allocations below half of it are pooled."""
        return self._pool_size

    @pool_size.setter
    def pool_size(self, value: int) -> None:
        if not isinstance(value, int) or value < 2 * _ALIGN:
            raise ValueError(f"pool_size must be an int >= {2 * _ALIGN}, got {value!r}")
        if value != self._pool_size:
            # Like assigning Buffer.poolSize: takes effect with the next pool.
            self._pool_size = value
            self.small_limit = value >> 1
            self._pool = None
            self._offset = 0

    def alloc(self, nbytes: int) -> memoryview:
        """Return a writable buffer of exactly ``nbytes`` bytes.

        Pooled when ``nbytes < pool_size >> 1``; a buffer of its own
        otherwise. The contents are unspecified (like ``allocUnsafe``).
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes >= self.small_limit:
            return memoryview(bytearray(nbytes))
        pool, off = self.carve(nbytes)
        return memoryview(pool)[off : off + nbytes]

    def carve(self, nbytes: int) -> tuple[bytearray, int]:
        """Reserve ``nbytes`` (below ``small_limit``) of the current pool
        as :meth:`alloc` does, without making a view: return the pool and
        where the region starts. The caller must export the pool (view it)
        before it next calls this pool, or the region may be handed out
        again; it may extend the region with :meth:`grow`."""
        off = self._offset
        pool = self._pool
        if pool is None or off + nbytes > self._pool_size:
            pool = self._new_pool()
            off = 0
        self._offset = (off + nbytes + _ALIGN - 1) & -_ALIGN
        return pool, off

    def grow(self, pool: bytearray, end: int, data: bytes | memoryview, nbytes: int) -> bool:
        """Copy ``data`` (``nbytes``) right after the region of ``pool``
        that ends at ``end``, if that region is still the last carved and
        the pool has room: True, and the region is ``nbytes`` longer.
        Else False, having done nothing."""
        if pool is not self._pool or self._offset != (end + _ALIGN - 1) & -_ALIGN:
            return False
        stop = end + nbytes
        if stop > self._pool_size:
            return False
        pool[end:stop] = data
        self._offset = (stop + _ALIGN - 1) & -_ALIGN
        return True

    def _new_pool(self) -> bytearray:
        pool = self._pool
        self._offset = 0
        if pool is not None and len(pool) == self._pool_size and not _exported(pool):
            # Reuse the exhausted pool: no region of it is alive.
            self.pools_reused += 1
            return pool
        self._pool = pool = _PoolBuffer(self._pool_size)
        self.pools_allocated += 1
        return pool

    @property
    def offset(self) -> int:
        """Where the next pooled allocation starts in the current pool."""
        return self._offset

    def __repr__(self) -> str:
        return f"<BufferPool pool_size={self._pool_size} offset={self._offset}>"
