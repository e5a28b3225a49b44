"""The per-loop read slab.

Theory of operation
-------------------
A plain TCP read asks for a buffer before it knows how many bytes will
arrive: asyncio's selector loop calls ``BufferedProtocol.get_buffer(-1)`` and
uvloop passes libuv's suggestion of 65536. Giving every read a fresh 64 KiB
``bytearray`` costs an allocation and a 64 KiB memset per read, and then a
copy into an exact-size ``bytes`` when the read came back short. Node.js
removed that cost (seed 002) with a shared slab:

* a read whose suggested size is at least the slab size reserves that many
  bytes from the current slab (a fresh or recycled slab when the current one
  lacks room);
* when the read returns, ``commit`` hands out a read-only ``memoryview`` of
  the bytes that arrived and advances the slab -- zero copies after the
  kernel's -- *unless* the read used less than three quarters of its
  reservation: then the bytes are copied into an exact-size ``bytes`` and the
  slab is rewound, so a trickle of small reads never pins a slab.

Seed 000 adds the other half: a read suggested *smaller* than the slab (every
TLS record is one) gets its own exact-size buffer, so that one chunk kept for
seconds pins only itself, never 64 KiB plus its neighbours.

Liveness. A slab region must never be written while a view of it is alive.
Every ``memoryview`` made from a ``bytearray`` (and anything that exports a
buffer from one: a slice, a cast, ``numpy.frombuffer``) counts as an export
of the ``bytearray``, and CPython refuses to resize a ``bytearray`` while it
has exports. ``_exported`` asks exactly that: it shrinks the slab by one byte
and grows it back (both inside the allocation: no copy, no ``realloc``), and
a ``BufferError`` means a view is alive. So the answer comes from the object
itself, with no per-chunk bookkeeping on the hot path and nothing calibrated
that a refactor or another interpreter could silently invalidate. A slab with
no export is recycled instead of reallocated; a slab pinned by the user is
forgotten by the ``ReadSlab`` once it is no longer among the few it caches and
is freed with the last view.

Accounting. ``memory_stats()`` reports what is really pinned: a slab with any
live view counts in full, because CPython cannot free part of a ``bytearray``
that has exports. It asks ``_exported`` about the slabs of its own thread's
loops; a slab of another thread's loop must not be resized under it, so for
those (if any) one ``gc.get_referrers`` pass over the heap looks for the
buffer objects (``managedbuffer``) that every view of a slab goes through.
Bytes referenced by live chunks are tracked with one weak
reference per zero-copy chunk (one per 48 KiB or more of data), so the report
can show pinned-but-unused bytes next to them.

This module is sans-IO: it never touches a socket or an event loop.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from typing import Final

__all__ = ["DEFAULT_SLAB_SIZE", "LEND_SIZE", "MemoryStats", "ReadSlab", "memory_stats"]

#: Node's StreamReadSlab size (seed 002) and libuv's suggested read size; a
#: selector-loop read (``get_buffer(-1)``) counts as a read of this size.
DEFAULT_SLAB_SIZE: Final = 65536

#: Size of the buffer behind ``ReadSlab.reserve_lent``: reads that are only
#: lent (TLS ciphertext, copied into the engine at once) come in reads of
#: four slabs, asyncio's SSL read size.  Measured with ``python -m benchmarks
#: --filter tls_s2c``: 128 KiB cut client CPU per GiB by about 7 % against
#: 64 KiB; 256 KiB cut it by another 1-2 % at 1 KiB records and 4-8 % at
#: 16 KiB (fewer reads: less kernel work per byte), once a whole read is
#: delivered even when the app pauses during it (see SlabTransport).
LEND_SIZE: Final = 4 * DEFAULT_SLAB_SIZE

#: How many recyclable slabs a ReadSlab keeps. A consumer iterating chunks
#: holds the previous chunk while the next read lands, and a stream reader may
#: queue up to twice its limit (128 KiB by default), so four slabs cover the
#: steady state of both without allocating; more would only hold idle memory.
_SLAB_CACHE: Final = 4


class _Sealed(bytearray):
    """A buffer slabnet fills once and from then on only lends out as
    read-only views: a read's own buffer, a TLS chunk, the stream reader's
    coalesced small chunks. No one can change its bytes any more, so the
    write path may queue a view of it without a copy (as it does for
    ``bytes``); a plain ``bytearray`` behind a read-only view may still be
    changed by whoever made it."""

    __slots__ = ()


class _Slab(bytearray):
    """A slab: a ``bytearray`` that can be weakly referenced for accounting."""

    __slots__ = ("__weakref__", "chunks", "owner")

    chunks: list[tuple[weakref.ref[memoryview], int]]
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


# Every slab alive in the process, by id. (A WeakSet would hash the
# bytearray's contents.)
_all_slabs: dict[int, weakref.ref[_Slab]] = {}


def _track(slab: _Slab) -> None:
    key = id(slab)
    _all_slabs[key] = weakref.ref(slab, lambda _ref: _all_slabs.pop(key, None))


class _Counters:
    __slots__ = (
        "reads",
        "zero_copy",
        "copies",
        "bytes_copied",
        "own_buffers",
        "own_buffer_bytes",
        "slabs_allocated",
        "slabs_recycled",
        "lent",
    )

    def __init__(self) -> None:
        self.reads = 0
        self.zero_copy = 0
        self.copies = 0
        self.bytes_copied = 0
        self.own_buffers = 0
        self.own_buffer_bytes = 0
        self.slabs_allocated = 0
        self.slabs_recycled = 0
        self.lent = 0


_counters = _Counters()


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Read-buffer memory of this process, as ``memory_stats()`` found it.

    Byte counts are buffer sizes, not including the few dozen bytes of each
    Python object header.
    """

    #: slabs alive in the process (cached for reuse or pinned by views)
    slabs_live: int
    #: bytes held by those slabs
    slab_bytes: int
    #: bytes of slabs that have at least one live view: really pinned memory
    pinned_bytes: int
    #: bytes of zero-copy chunks still referenced by the application
    chunk_bytes_live: int
    #: pinned bytes not covered by a live chunk (slab space kept alive only
    #: because a neighbour is)
    pinned_unused_bytes: int
    #: bytes of slabs with no live view, kept for reuse
    idle_bytes: int
    #: reads committed since start
    reads: int
    #: reads handed out as zero-copy slab views
    zero_copy_reads: int
    #: reads copied out because they wasted more than 1/4 of their reservation
    copies: int
    bytes_copied: int
    #: reads that got their own buffer (suggested size below the slab size)
    own_buffers: int
    own_buffer_bytes: int
    slabs_allocated: int
    slabs_recycled: int
    #: reads lent to a copying consumer (TLS ciphertext) without a chunk
    lent_reads: int


def memory_stats() -> MemoryStats:
    """Account for every slab in the process (all loops, all threads)."""
    slab_bytes = pinned = live_chunks = idle = 0
    slabs = [s for s in (ref() for ref in list(_all_slabs.values())) if s is not None]
    me = threading.get_ident()
    foreign = [s for s in slabs if s.owner != me]
    viewed = _viewed(foreign) if foreign else set()
    for slab in slabs:
        size = len(slab)
        slab_bytes += size
        if (_exported(slab) if slab.owner == me else id(slab) in viewed):
            pinned += size
            for ref, length in slab.chunks:
                if ref() is not None:
                    live_chunks += length
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
        zero_copy_reads=c.zero_copy,
        copies=c.copies,
        bytes_copied=c.bytes_copied,
        own_buffers=c.own_buffers,
        own_buffer_bytes=c.own_buffer_bytes,
        slabs_allocated=c.slabs_allocated,
        slabs_recycled=c.slabs_recycled,
        lent_reads=c.lent,
    )


class ReadSlab:
    """One per event loop, shared by every connection on it.

    Call order for each read: ``reserve(hint)`` returns a writable view to
    read into; then either ``commit(nbytes)`` with ``nbytes > 0``, which returns
    the chunk, or nothing at all (the read failed or hit EOF: the reservation
    is simply abandoned, and the next ``reserve`` starts over).
    """

    __slots__ = ("size", "_slabs", "_cur", "_offset", "_reserved", "_own", "_lend", "_lending")

    def __init__(self, size: int = DEFAULT_SLAB_SIZE) -> None:
        if size <= 0:
            raise ValueError(f"slab size must be positive, got {size}")
        self.size: Final = size
        self._slabs: list[_Slab] = []  # cached slabs; _slabs[_cur] is current
        self._cur = -1
        self._offset = 0
        self._reserved = 0  # size of the pending reservation, 0 if none
        # The pending reservation's own buffer, or None for a slab region.
        # A slab region is not referenced here: an abandoned reservation
        # (the read failed or hit EOF) must not pin the slab.
        self._own: _Sealed | None = None
        # The lending buffer of reserve_lent(), made on first use, and
        # whether the pending reservation is in it.
        self._lend: memoryview | None = None
        self._lending = False

    def reserve(self, hint: int) -> memoryview:
        """Return a writable buffer of at least one byte for the next read."""
        if hint < 0:
            hint = DEFAULT_SLAB_SIZE
        elif hint == 0:
            hint = 1
        self._reserved = hint
        self._lending = False
        if hint != self.size:
            # Seed 000: a read suggested smaller than the slab owns its
            # buffer; so does one larger than any slab. Same waste rule.
            self._own = own = _Sealed(hint)
            return memoryview(own)
        self._own = None
        if self._cur < 0 or self._offset + hint > self.size:
            self._next_slab()
        off = self._offset
        return memoryview(self._slabs[self._cur])[off : off + hint]

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
        self._own = None
        self._lending = True
        return buf

    def commit(self, nbytes: int) -> memoryview:
        """Turn the first ``nbytes`` of the reservation into a read-only chunk."""
        if self._lending:
            raise RuntimeError("commit() of a reserve_lent() reservation: consume() it")
        reserved = self._end_reservation(nbytes, "commit", "committed")
        own = self._own
        self._own = None
        c = _counters
        if own is not None:
            region = memoryview(own)[:nbytes]
        else:
            slab = self._slabs[self._cur]
            off = self._offset
            region = memoryview(slab)[off : off + nbytes]
        if nbytes * 4 < reserved * 3:
            # Wastes more than a quarter: copy out, keep the slab position.
            c.copies += 1
            c.bytes_copied += nbytes
            return memoryview(region.tobytes())
        chunk = region.toreadonly()
        if own is not None:
            c.own_buffers += 1
            c.own_buffer_bytes += reserved
            return chunk
        c.zero_copy += 1
        slab.chunks.append((weakref.ref(chunk), nbytes))
        self._offset = off + nbytes
        return chunk

    def consume(self, nbytes: int) -> memoryview:
        """Lend the first ``nbytes`` of the reservation to a caller that
        copies them before returning (the TLS engine's incoming BIO).

        Nothing is allocated, copied or advanced: the next ``reserve`` reuses
        the region, so the view must be dropped before then. This is how
        ciphertext passes through the slab without ever pinning it.
        """
        self._end_reservation(nbytes, "consume", "consumed")
        _counters.lent += 1
        if self._lending:
            self._lending = False
            return self._lend[:nbytes]  # type: ignore[index]
        own = self._own
        if own is not None:
            self._own = None
            return memoryview(own)[:nbytes]
        off = self._offset
        return memoryview(self._slabs[self._cur])[off : off + nbytes]

    def _end_reservation(self, nbytes: int, verb: str, past: str) -> int:
        """Check ``nbytes`` against the pending reservation and close it."""
        reserved = self._reserved
        if not 0 < nbytes <= reserved:
            if not reserved:
                raise RuntimeError(f"{verb}() without a pending reserve()")
            raise ValueError(f"{past} {nbytes} bytes of a {reserved}-byte reservation")
        self._reserved = 0
        _counters.reads += 1
        return reserved

    def _next_slab(self) -> None:
        slabs = self._slabs
        cur = self._cur
        for i, slab in enumerate(slabs):
            if i != cur and not _exported(slab):
                slab.chunks.clear()
                _counters.slabs_recycled += 1
                self._cur = i
                self._offset = 0
                return
        new = _Slab(self.size)
        new.chunks = []
        new.owner = threading.get_ident()
        _track(new)
        _counters.slabs_allocated += 1
        if len(slabs) >= _SLAB_CACHE:
            # Forget the oldest slab other than the current one; its views
            # keep it alive as long as the application holds them.
            del slabs[0 if cur != 0 else 1]
        slabs.append(new)
        self._cur = len(slabs) - 1
        self._offset = 0

    def __repr__(self) -> str:
        return (
            f"<ReadSlab size={self.size} cached={len(self._slabs)}"
            f" offset={self._offset}>"
        )
