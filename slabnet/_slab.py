"""Read buffers: one per read, sized from what the connection's recent reads
returned, recycled through a per-loop free list, and kept only while the
application holds a view of them.

Theory of operation
-------------------
A plain TCP read asks for a buffer before it knows how many bytes will
arrive: asyncio's selector loop calls ``BufferedProtocol.get_buffer(-1)`` and
uvloop passes libuv's suggestion of 65536; both accept a buffer of any size.
Each connection's ``ReadSizer`` chooses the size from its recent reads, as
Netty's ``AdaptiveRecvByteBufAllocator`` does: a table of sizes from 1 KiB to
256 KiB (asyncio's own read size), starting at 64 KiB; four times larger
after a read that filled its buffer, half after two reads in a row that
would have fitted the next smaller size. A bulk stream reads 256 KiB from
its second read on; a trickle settles on the smallest size that holds its
reads.

``ReadSlab.reserve_for(sizer)`` hands the loop a buffer of that size, and
``commit(nbytes)`` turns the bytes that arrived into the chunk:

* a read that filled at least three quarters of its buffer becomes a
  read-only ``memoryview`` of it -- zero copies after the kernel's;
* a shorter read is copied into an exact-size ``bytes`` and the buffer goes
  straight back to the free list.

Every chunk has a buffer to itself (no two reads share one), so a kept chunk
pins only its own buffer: at most a third more than its own bytes.

A read below 64 KiB gets a fresh buffer; buffers of 64 KiB and more
("slabs"), whose allocation costs a 64-256 KiB ``memset`` and page faults,
are recycled. Each ReadSlab keeps, per size, the slabs it handed out,
oldest first, and a stack of slabs known to be free.
A reservation looks at the oldest slabs handed out (up to ``_PROBES``): the
first one free again is reused, a viewed one goes to the back of the line;
failing that a free slab is taken, or a new one made. So the list grows to
what the loop's busy connections hold at once -- each holds a read or two
while its application works on them -- and then no read allocates. A second
free slab found behind the reused one moves to the free stack, so the line
stays as long as the demand; ``trim`` releases the free slabs no read took
since the previous trim, and of the sizes no read used for an interval
keeps at most ``_IDLE_KEEP`` bytes, what a loop kept before reads were
sized. The list
holds at most ``_HELD_MAX`` bytes. Given its loop, a ReadSlab keeps one
timer on it (per loop, not per connection) that trims while the list holds
more than ``_IDLE_KEEP``, and asks the C allocator to return free memory to
the system once the trims released 1 MiB (``_return_free_memory``).

Liveness. A slab must never be written while a view of it is alive. Every
``memoryview`` made from a ``bytearray`` (and anything that exports a buffer
from one: a slice, a cast, ``numpy.frombuffer``) counts as an export of the
``bytearray``, and CPython refuses to resize a ``bytearray`` while it has
exports. ``_exported`` asks exactly that: it shrinks the slab by one byte
and grows it back (both inside the allocation: no copy, no ``realloc``), and
a ``BufferError`` means a view is alive. So the answer comes from the object
itself, with no per-chunk bookkeeping on the hot path and nothing calibrated
that a refactor or another interpreter could silently invalidate. A slab the
user keeps past the trim, or past the list's bound, is forgotten by the
ReadSlab and freed with its last view.

TLS ciphertext never pins a slab: it is read into one lending buffer per
ReadSlab (``reserve_lent``) and copied into the TLS engine before the loop
callback returns (``consume``).

Accounting. ``memory_stats()`` reports what is really pinned: a slab with a
live view counts in full, because CPython cannot free part of a ``bytearray``
that has exports. It asks ``_exported`` about the slabs of its own thread's
loops; a slab of another thread's loop must not be resized under it, so for
those (if any) one ``gc.get_referrers`` pass over the heap looks for the
buffer objects (``managedbuffer``) that every view of a slab goes through.

This module never touches a socket, and an event loop only to ask for the
trim timer: ``ReadSizer`` and ``ReadSlab`` are tested without either.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Final, Protocol, cast

__all__ = [
    "DEFAULT_SLAB_SIZE",
    "LEND_SIZE",
    "READ_SIZES",
    "MemoryStats",
    "ReadSizer",
    "ReadSlab",
    "memory_stats",
]

#: libuv's suggested read size (and Node's slab size); a selector-loop read
#: (``get_buffer(-1)``) through ``reserve`` counts as a read of this size, and
#: a new connection's first read is this large.
DEFAULT_SLAB_SIZE: Final = 65536

#: The sizes a ReadSizer chooses from, doubling from 1 KiB (below that a
#: buffer costs less than the object that holds the read) to 256 KiB
#: (asyncio's own ``recv`` size: larger reads no longer cut the client CPU
#: per byte on loopback, and a kept chunk could pin more).
READ_SIZES: Final = tuple(1024 << i for i in range(9))

#: Size of the buffer behind ``ReadSlab.reserve_lent``: reads that are only
#: lent (TLS ciphertext, copied into the engine at once) come in reads of
#: four slabs, asyncio's SSL read size.  Measured with ``python -m benchmarks
#: --filter tls_s2c``: 128 KiB cut client CPU per GiB by about 7 % against
#: 64 KiB; 256 KiB cut it by another 1-2 % at 1 KiB records and 4-8 % at
#: 16 KiB (fewer reads: less kernel work per byte), once a whole read is
#: delivered to a stream even when it pauses during it (see TLSTransport).
LEND_SIZE: Final = 4 * DEFAULT_SLAB_SIZE

#: Free slabs an idle ReadSlab keeps: four 64 KiB slabs, what the loop kept
#: before reads were sized, so an idle process holds no more than it did.
_IDLE_KEEP: Final = 4 * DEFAULT_SLAB_SIZE

#: The most a ReadSlab's lists hold (slabs in use by connections and free
#: ones): 256 busy connections reading 256 KiB each. A slab still viewed when
#: the list is full is forgotten (freed with its last view) instead.
_HELD_MAX: Final = 256 * READ_SIZES[-1]

#: The smallest read size served by a recycled slab; a smaller read gets a
#: buffer of its own. Below 64 KiB a fresh buffer costs a small ``malloc``
#: and ``memset``, less than keeping a slab of every size a connection's
#: reads pass through (a connection whose reads shrink from 64 KiB to 1 KiB
#: would leave 63 KiB of slabs behind until the next trim).
_SLAB_MIN: Final = DEFAULT_SLAB_SIZE

#: How many of the oldest slabs handed out a reservation looks at before it
#: takes a free one: a connection's application may still hold its last
#: chunk while the loop reads for the others, so the oldest is not always
#: free; a look costs two C calls, a new 256 KiB slab about a hundred
#: microseconds of zeroing and page faults.
_PROBES: Final = 4

#: Seconds between trims while a ReadSlab holds more than ``_IDLE_KEEP``: a
#: free slab unused for that long is released.
TRIM_INTERVAL: Final = 1.0

#: Bytes of slabs a ReadSlab's trims release before it asks the C allocator
#: to return its free memory to the system (``_return_free_memory``).
_RETURN_AFTER: Final = 4 * READ_SIZES[-1]


class _Sealed(bytearray):
    """A buffer slabnet fills once and from then on only lends out as
    read-only views: a read's own buffer, a TLS chunk, the stream reader's
    coalesced small chunks. No one can change its bytes any more, so the
    write path may queue a view of it without a copy (as it does for
    ``bytes``); a plain ``bytearray`` behind a read-only view may still be
    changed by whoever made it."""

    __slots__ = ()


class _Slab(bytearray):
    """A recycled read buffer; weakly referenceable for accounting. Rewritten
    only once ``_exported`` says no view of it is left."""

    __slots__ = ("__weakref__", "used", "owner")

    used: int  # bytes of the chunk last handed out from it
    owner: int  # the thread that reads into it (threading.get_ident())


def _exported(buf: bytearray) -> bool:
    """True while any export of ``buf`` (a ``memoryview`` of it, or of one of
    its views) is alive.

    Only for a buffer that no other thread may be reading into: the probe
    resizes ``buf`` for a moment. Its contents are left as they were except
    the last byte, which is unspecified: callers only ask about buffers whose
    bytes nobody needs any more.
    """
    try:
        buf.pop()  # refused while an export exists
    except BufferError:
        return True
    buf.append(0)
    return False


def _viewed(slabs: list[_Slab]) -> set[int]:
    """ids of the ``slabs`` that a live view refers to, found without
    touching them (safe from any thread): a view refers to its object
    through a ``managedbuffer``, which the garbage collector tracks."""
    ids = {id(s) for s in slabs}
    found: set[int] = set()
    for ref in gc.get_referrers(*slabs):
        if type(ref).__name__ != "managedbuffer":
            continue
        for obj in gc.get_referents(ref):
            if id(obj) in ids:
                found.add(id(obj))
    return found


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim  # (the process's own libc)
    except (ImportError, OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return cast("Callable[[int], int]", trim)


def _return_free_memory() -> None:
    """Ask the C allocator to give its free pages back to the system.

    A freed slab goes back to ``malloc``, not always to the system: glibc
    serves a 256 KiB ``bytearray`` from its heap once a process has freed a
    larger buffer (its mmap threshold rises to that size), and memory freed
    between blocks still in use stays resident until ``malloc_trim``
    returns it. A burst of 64 MiB of kept chunks left 10-67 MB resident
    after the trims had released every slab of it. One call after a trim
    has released ``_RETURN_AFTER`` bytes or more: it walks the free lists
    (about a millisecond; 3-5 ms after a 64 MiB burst), at most once per
    ``TRIM_INTERVAL``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# Every slab alive in the process, by id. (A WeakSet would hash the
# bytearray's contents.)
_all_slabs: dict[int, weakref.ref[_Slab]] = {}


def _track(slab: _Slab) -> None:
    key = id(slab)
    _all_slabs[key] = weakref.ref(slab, lambda _ref: _all_slabs.pop(key, None))


class _Counters:
    __slots__ = (
        "reads",
        "read_bytes",
        "reserved_bytes",
        "zero_copy",
        "copies",
        "bytes_copied",
        "own_buffers",
        "own_buffer_bytes",
        "slabs_allocated",
        "slabs_recycled",
        "slabs_released",
        "lent",
    )

    reads: int
    read_bytes: int
    reserved_bytes: int
    zero_copy: int
    copies: int
    bytes_copied: int
    own_buffers: int
    own_buffer_bytes: int
    slabs_allocated: int
    slabs_recycled: int
    slabs_released: int
    lent: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


_counters = _Counters()


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Read-buffer memory of this process, as ``memory_stats()`` found it.

    Byte counts are buffer sizes, not including the few dozen bytes of each
    Python object header.
    """

    #: slabs alive in the process (on a free list, in use, or pinned by views)
    slabs_live: int
    #: bytes held by those slabs
    slab_bytes: int
    #: bytes of slabs that have at least one live view: really pinned memory
    pinned_bytes: int
    #: bytes of the chunks those slabs were read for (a kept slice of a
    #: chunk counts the whole chunk: its slab holds all of it)
    chunk_bytes_live: int
    #: pinned bytes beyond those chunks: the unread end of their slabs
    pinned_unused_bytes: int
    #: bytes of slabs with no live view, kept for reuse
    idle_bytes: int
    #: reads committed or consumed since start
    reads: int
    #: bytes those reads brought
    read_bytes: int
    #: bytes reserved for them (the sum of the buffers' sizes)
    reserved_bytes: int
    #: reads handed out as zero-copy slab views
    zero_copy_reads: int
    #: reads copied out because they wasted more than 1/4 of their reservation
    copies: int
    bytes_copied: int
    #: reads into a buffer of their own (``reserve`` with a size no slab has)
    own_buffers: int
    own_buffer_bytes: int
    slabs_allocated: int
    #: reservations served by a slab from a free list
    slabs_recycled: int
    #: slabs the free lists released (trimmed) or forgot (still viewed)
    slabs_released: int
    #: slabs on the ReadSlabs' lists (free or in use) and their bytes: the
    #: free lists' size, bounded by ``_HELD_MAX`` per loop
    held_slabs: int
    held_bytes: int
    #: reads lent to a copying consumer (TLS ciphertext) without a chunk
    lent_reads: int


def memory_stats() -> MemoryStats:
    """Account for every slab in the process (all loops, all threads)."""
    slab_bytes = pinned = live_chunks = idle = 0
    slabs = [s for s in (ref() for ref in list(_all_slabs.values())) if s is not None]
    read_slabs = [r for r in (ref() for ref in list(_read_slabs.values())) if r is not None]
    me = threading.get_ident()
    foreign = [s for s in slabs if s.owner != me]
    viewed = _viewed(foreign) if foreign else set()
    for slab in slabs:
        size = len(slab)
        slab_bytes += size
        if (_exported(slab) if slab.owner == me else id(slab) in viewed):
            pinned += size
            live_chunks += slab.used
        else:
            idle += size
    del slabs
    c = _counters
    return MemoryStats(
        slabs_live=len(_all_slabs),
        slab_bytes=slab_bytes,
        pinned_bytes=pinned,
        chunk_bytes_live=live_chunks,
        pinned_unused_bytes=pinned - live_chunks,
        idle_bytes=idle,
        reads=c.reads,
        read_bytes=c.read_bytes,
        reserved_bytes=c.reserved_bytes,
        zero_copy_reads=c.zero_copy,
        copies=c.copies,
        bytes_copied=c.bytes_copied,
        own_buffers=c.own_buffers,
        own_buffer_bytes=c.own_buffer_bytes,
        slabs_allocated=c.slabs_allocated,
        slabs_recycled=c.slabs_recycled,
        slabs_released=c.slabs_released,
        held_slabs=sum(r._count() for r in read_slabs),
        held_bytes=sum(r._held for r in read_slabs),
        lent_reads=c.lent,
    )


class ReadSizer:
    """The read size of one connection (sans-IO): ``size`` for the next
    read, ``record(nbytes)`` after it.

    Grows two steps of ``READ_SIZES`` (four times) after a read that filled
    its buffer, and shrinks one step (half) after two reads in a row that
    the next smaller size would have held; never below ``READ_SIZES[0]`` nor
    above ``READ_SIZES[-1]``.
    """

    __slots__ = ("index", "size", "_short")

    def __init__(self, size: int = DEFAULT_SLAB_SIZE) -> None:
        if size not in READ_SIZES:
            raise ValueError(f"read size must be one of {READ_SIZES}, got {size}")
        self.index = READ_SIZES.index(size)
        self.size = size
        self._short = False  # the last read would have fitted one step down

    def record(self, nbytes: int) -> None:
        """Take in that the read made at ``size`` brought ``nbytes``."""
        i = self.index
        if nbytes >= self.size:
            if i < len(READ_SIZES) - 1:
                self.index = i = min(i + 2, len(READ_SIZES) - 1)
                self.size = READ_SIZES[i]
            self._short = False
        elif i and nbytes <= READ_SIZES[i - 1]:
            if self._short:
                self.index = i - 1
                self.size = READ_SIZES[i - 1]
                self._short = False
            else:
                self._short = True
        else:
            self._short = False

    def __repr__(self) -> str:
        return f"<ReadSizer size={self.size}>"


class _Loop(Protocol):
    def call_later(self, delay: float, callback: Callable[[], object], /) -> object: ...

    def is_closed(self) -> bool: ...


class _Pool:
    """The slabs of one size a ReadSlab holds."""

    __slots__ = ("size", "out", "free", "low", "takes")

    def __init__(self, size: int) -> None:
        self.size = size
        #: slabs handed out to reads, oldest first; some may be free by now
        self.out: collections.deque[_Slab] = collections.deque()
        #: slabs known to be free, taken last in, first out
        self.free: list[_Slab] = []
        #: the fewest free slabs since the last trim: that many went unused
        self.low = 0
        #: reservations served since the last trim (none: the pool is idle)
        self.takes = 0


# Every ReadSlab alive in the process, for memory_stats(), by id: a dict,
# not a WeakSet, as _all_slabs, so that a snapshot of it (list() of its
# values, one call in C) cannot meet another thread's loop adding its own.
_read_slabs: dict[int, weakref.ref[ReadSlab]] = {}


class ReadSlab:
    """One per event loop, shared by every connection on it.

    Call order for each read: ``reserve_for(sizer)`` (or ``reserve(hint)``,
    or ``reserve_lent()``) returns a writable view to read into; then either
    ``commit(nbytes)`` with ``nbytes > 0``, which returns the chunk (or
    ``consume(nbytes)`` after ``reserve_lent``), or nothing at all (the read
    failed or hit EOF: the reservation is simply abandoned, and the next
    ``reserve`` starts over).

    With ``loop``, a ReadSlab that holds more than it would when idle asks
    the loop (held by weak reference) to call ``trim`` every
    ``TRIM_INTERVAL`` seconds until it no longer does.
    """

    __slots__ = (
        "size",
        "_pools",
        "_pool",
        "_buf",
        "_sizer",
        "_reserved",
        "_lend",
        "_lending",
        "_held",
        "_loop",
        "_timer",
        "_released",
        "__weakref__",
    )

    def __init__(self, size: int = DEFAULT_SLAB_SIZE, *, loop: _Loop | None = None) -> None:
        if size <= 0:
            raise ValueError(f"slab size must be positive, got {size}")
        #: the size ``reserve(-1)`` reserves
        self.size: Final = size
        self._pools = {s: _Pool(s) for s in READ_SIZES if s >= _SLAB_MIN}
        # The pending reservation: its pool (None: a buffer of its own, or
        # the lending buffer), its buffer, its sizer, its size (0: none).
        self._pool: _Pool | None = None
        self._buf: bytearray | None = None
        self._sizer: ReadSizer | None = None
        self._reserved = 0
        # The lending buffer of reserve_lent(), made on first use, and
        # whether the pending reservation is in it.
        self._lend: memoryview | None = None
        self._lending = False
        self._held = 0  # bytes of the slabs in the pools
        self._loop: weakref.ref[_Loop] | None = None if loop is None else weakref.ref(loop)
        self._timer = False
        self._released = 0  # bytes the timer's trims released, not yet returned
        key = id(self)
        _read_slabs[key] = weakref.ref(self, lambda _ref: _read_slabs.pop(key, None))

    # ------------------------------------------------ reservations

    def reserve_for(self, sizer: ReadSizer) -> memoryview:
        """Return a buffer of ``sizer.size`` bytes for the next read;
        ``commit`` tells ``sizer`` what the read brought."""
        self._sizer = sizer
        self._lending = False
        size = sizer.size
        if size >= _SLAB_MIN:
            return self._take(self._pools[size])
        return self._own(size)

    def reserve(self, hint: int) -> memoryview:
        """Return a writable buffer of ``hint`` bytes (``size`` for -1; one
        byte for 0) for the next read: a slab for a size of ``READ_SIZES``
        from 64 KiB up, otherwise a buffer of its own."""
        if hint < 0:
            hint = self.size
        elif hint == 0:
            hint = 1
        self._sizer = None
        self._lending = False
        pool = self._pools.get(hint)
        if pool is not None:
            return self._take(pool)
        return self._own(hint)

    def _own(self, hint: int) -> memoryview:
        self._pool = None
        self._reserved = hint
        _counters.reserved_bytes += hint
        self._buf = own = _Sealed(hint)
        return memoryview(own)

    def _take(self, pool: _Pool) -> memoryview:
        size = pool.size
        self._pool = pool
        self._reserved = size
        pool.takes += 1
        c = _counters
        c.reserved_bytes += size
        out = pool.out
        for _ in range(min(len(out), _PROBES)):
            slab = out[0]
            out.rotate(-1)  # now the newest, whether reused or still viewed
            if not _exported(slab):
                c.slabs_recycled += 1
                if len(out) > 1 and not _exported(out[0]):
                    # Two free in a row: the list holds more than the
                    # connections use; the next one waits on the free stack.
                    pool.free.append(out.popleft())
                self._buf = slab
                return memoryview(slab)
            if self._held >= _HELD_MAX:
                out.pop()  # still viewed and the list is full: forget it
                self._forget(slab)
        free = pool.free
        if free:
            slab = free.pop()
            if len(free) < pool.low:
                pool.low = len(free)
            c.slabs_recycled += 1
            out.append(slab)
        else:
            slab = self._new_slab(pool)
        self._buf = slab
        return memoryview(slab)

    def reserve_lent(self) -> memoryview:
        """Reserve the lending buffer (``LEND_SIZE`` bytes) for a read whose
        bytes ``consume`` will lend to a consumer that copies them before
        returning to the loop (TLS ciphertext going into the engine's BIO).

        Nothing read there can outlive the loop callback, so one buffer per
        ReadSlab serves every connection, and it can be larger than a slab:
        each read then brings four slabs' bytes for one loop iteration.
        """
        buf = self._lend
        if buf is None:
            buf = self._lend = memoryview(bytearray(LEND_SIZE))
        self._reserved = LEND_SIZE
        self._pool = None
        self._buf = None
        self._sizer = None
        self._lending = True
        _counters.reserved_bytes += LEND_SIZE
        return buf

    def commit(self, nbytes: int) -> memoryview:
        """Turn the first ``nbytes`` of the reservation into a read-only chunk."""
        if self._lending:
            raise RuntimeError("commit() of a reserve_lent() reservation: consume() it")
        reserved = self._end_reservation(nbytes, "commit", "committed")
        buf = self._buf
        self._buf = None
        sizer = self._sizer
        if sizer is not None:
            sizer.record(nbytes)
        c = _counters
        if nbytes * 4 < reserved * 3:
            # Wastes more than a quarter: copy out; the slab is free at once.
            c.copies += 1
            c.bytes_copied += nbytes
            data = memoryview(buf)[:nbytes].tobytes()  # type: ignore[arg-type]
            pool = self._pool
            if pool is not None:
                out = pool.out
                if out and out[-1] is buf:
                    pool.free.append(out.pop())
            return memoryview(data)
        view = memoryview(buf)  # type: ignore[arg-type]
        chunk = (view if nbytes == reserved else view[:nbytes]).toreadonly()
        if self._pool is None:
            c.own_buffers += 1
            c.own_buffer_bytes += reserved
            return chunk
        c.zero_copy += 1
        buf.used = nbytes  # type: ignore[union-attr]
        return chunk

    def consume(self, nbytes: int) -> memoryview:
        """Lend the first ``nbytes`` of a ``reserve_lent`` reservation to a
        caller that copies them before returning (the TLS engine's incoming
        BIO).

        Nothing is allocated, copied or advanced: the next ``reserve_lent``
        reuses the buffer, so the view must be dropped before then. This is
        how ciphertext passes through without ever pinning a slab.
        """
        if not self._lending:
            raise RuntimeError("consume() without a pending reserve_lent()")
        self._end_reservation(nbytes, "consume", "consumed")
        _counters.lent += 1
        self._lending = False
        return self._lend[:nbytes]  # type: ignore[index]

    def _end_reservation(self, nbytes: int, verb: str, past: str) -> int:
        """Check ``nbytes`` against the pending reservation and close it."""
        reserved = self._reserved
        if not 0 < nbytes <= reserved:
            if not reserved:
                raise RuntimeError(f"{verb}() without a pending reserve()")
            raise ValueError(f"{past} {nbytes} bytes of a {reserved}-byte reservation")
        self._reserved = 0
        c = _counters
        c.reads += 1
        c.read_bytes += nbytes
        return reserved

    # ------------------------------------------------ the free lists

    def _new_slab(self, pool: _Pool) -> _Slab:
        size = pool.size
        new = _Slab(size)
        new.used = 0
        new.owner = threading.get_ident()
        _track(new)
        c = _counters
        c.slabs_allocated += 1
        if self._held + size > _HELD_MAX:
            return new  # not kept: freed with its chunk
        pool.out.append(new)
        self._held += size
        if self._held > _IDLE_KEEP and not self._timer:
            self._start_timer()
        return new

    def _forget(self, slab: _Slab) -> None:
        """Count ``slab`` out of the lists (the caller drops it); it is freed
        at once, or with its last view."""
        self._held -= len(slab)
        _counters.slabs_released += 1

    def trim(self) -> bool:
        """Release the free slabs that went unused since the last trim.

        A pool that served no reservation since the last trim is idle,
        whatever the loop's other reads did (reads below ``_SLAB_MIN``, TLS
        ciphertext, the other sizes): its free slabs beyond ``_IDLE_KEEP``
        bytes in all (the largest kept) are released and the ones still
        viewed forgotten. Otherwise only those of its free stack that no read
        took are, and the slabs handed out that are free again join the
        stack (they go at the next trim if no read takes them). So a loop
        that had a burst of bulk reads and now carries only small ones --
        keepalives, a signalling trickle -- returns to what an idle one
        holds. Returns whether the lists still hold more than
        ``_IDLE_KEEP`` bytes.

        Ends a pending reservation, which on a loop can only be one that was
        abandoned (a read is reserved and committed in one loop callback):
        a ``commit`` after ``trim`` raises ``RuntimeError``.
        """
        self._reserved = 0
        self._buf = None
        self._lending = False
        keep = _IDLE_KEEP
        for pool in sorted(self._pools.values(), key=lambda p: -p.size):
            free = pool.free
            if not pool.takes:
                for slab in pool.out:
                    if _exported(slab):
                        self._forget(slab)  # the application keeps it
                    else:
                        free.append(slab)
                pool.out.clear()
                n = min(len(free), keep // pool.size)
                keep -= n * pool.size
                drop = len(free) - n
            else:
                drop = pool.low
                pool.takes = 0
            for slab in free[:drop]:
                self._forget(slab)
            del free[:drop]
            if pool.out:
                # Slabs handed out and free again wait in ``out`` until a
                # reservation finds them, one per read: after a burst, a
                # connection that went on reading this size once a second
                # released the burst's slabs at that pace (tens of MB for
                # minutes). They join the free stack, and those no read
                # takes before the next trim go then.
                viewed: collections.deque[_Slab] = collections.deque()
                for slab in pool.out:
                    (viewed if _exported(slab) else free).append(slab)
                pool.out = viewed
            pool.low = len(free)
        return self._held > _IDLE_KEEP

    def release(self) -> None:
        """Forget every slab and the lending buffer, for a loop that has
        closed: no read comes again, and its timer is gone, so nothing would
        trim. (A closed loop lives on while anything refers to it -- a
        future, a task, a lock bound to it, a frame of a traceback -- and
        with it its resources.) A slab still viewed is freed with its last
        view. The ReadSlab stays usable: what a later read takes, it makes
        anew."""
        self._reserved = 0
        self._buf = None
        self._lending = False
        self._lend = None
        held = self._held
        for pool in self._pools.values():
            for slab in (*pool.out, *pool.free):
                self._forget(slab)
            pool.out.clear()
            pool.free.clear()
            pool.low = pool.takes = 0
        if held >= _RETURN_AFTER:
            _return_free_memory()

    def _start_timer(self) -> None:
        loop = None if self._loop is None else self._loop()
        if loop is None or loop.is_closed():
            return
        self._timer = True
        loop.call_later(TRIM_INTERVAL, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = False
        held = self._held
        more = self.trim()
        self._released += held - self._held
        if self._released >= _RETURN_AFTER:
            self._released = 0
            _return_free_memory()
        if more:
            self._start_timer()

    def _count(self) -> int:
        return sum(len(p.out) + len(p.free) for p in self._pools.values())

    def __repr__(self) -> str:
        return f"<ReadSlab size={self.size} held={self._count()} slabs, {self._held} bytes>"
