"""ReadSlab and BufferPool: sans-IO policy tests (no sockets, no loop)."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slabnet
from slabnet import BufferPool, ReadSlab
from slabnet._write import OutQueue

SLAB = 65536


def fill(view: memoryview, data: bytes) -> None:
    view[: len(data)] = data


def test_selector_hint_reserves_a_whole_slab_and_hands_out_a_view() -> None:
    slab = ReadSlab()
    buf = slab.reserve(-1)
    assert len(buf) == SLAB and not buf.readonly
    fill(buf, b"x" * 60000)
    chunk = slab.commit(60000)
    assert chunk.readonly
    assert len(chunk) == 60000
    # Zero copy: the chunk is a view of the slab, not an exact-size buffer.
    assert isinstance(chunk.obj, bytearray) and len(chunk.obj) == SLAB


def test_read_wasting_more_than_a_quarter_is_copied_and_rewinds() -> None:
    slab = ReadSlab()
    before = slabnet.memory_stats()
    buf = slab.reserve(65536)
    fill(buf, b"a" * 100)
    chunk = slab.commit(100)
    assert bytes(chunk) == b"a" * 100
    assert isinstance(chunk.obj, bytes) and len(chunk.obj) == 100
    # The slab was rewound: the next reservation starts at the same place.
    buf2 = slab.reserve(65536)
    assert len(buf2) == SLAB
    fill(buf2, b"b" * 65536)
    chunk2 = slab.commit(65536)
    assert bytes(chunk) == b"a" * 100  # the copy is independent of the slab
    assert bytes(chunk2) == b"b" * 65536
    after = slabnet.memory_stats()
    assert after.copies == before.copies + 1
    assert after.zero_copy_reads == before.zero_copy_reads + 1


def test_exactly_three_quarters_is_not_copied() -> None:
    slab = ReadSlab()
    buf = slab.reserve(-1)
    fill(buf, b"z" * (SLAB * 3 // 4))
    chunk = slab.commit(SLAB * 3 // 4)
    assert isinstance(chunk.obj, bytearray)
    buf = slab.reserve(-1)
    chunk2 = slab.commit(SLAB * 3 // 4 - 1)
    assert isinstance(chunk2.obj, bytes)
    del buf


def test_odd_hint_owns_an_exact_size_buffer() -> None:
    # A size no slab has gets a buffer of its own; no read shares one.
    slab = ReadSlab()
    buf = slab.reserve(320)
    assert len(buf) == 320
    fill(buf, b"r" * 320)
    chunk = slab.commit(320)
    assert len(chunk.obj) == len(chunk) == 320


def test_idle_slab_is_recycled_not_reallocated() -> None:
    slab = ReadSlab()
    before = slabnet.memory_stats()
    for _ in range(100):
        buf = slab.reserve(-1)
        fill(buf, b"q" * SLAB)
        del buf
        chunk = slab.commit(SLAB)
        del chunk
    after = slabnet.memory_stats()
    assert after.slabs_allocated - before.slabs_allocated <= 2
    assert after.slabs_recycled - before.slabs_recycled >= 98


def test_kept_chunk_pins_its_slab_and_stats_say_so() -> None:
    gc.collect()
    base = slabnet.memory_stats()
    slab = ReadSlab()
    buf = slab.reserve(-1)
    fill(buf, b"k" * 50000)
    kept = slab.commit(50000)[10:20]  # a slice keeps the slab alive too
    del buf
    for _ in range(10):
        b = slab.reserve(-1)
        fill(b, b"n" * SLAB)
        del b
        slab.commit(SLAB)
    stats = slabnet.memory_stats()
    # The kept slice pins a full slab; it is reported as pinned.
    assert stats.pinned_bytes - base.pinned_bytes >= SLAB
    assert bytes(kept) == b"k" * 10
    del kept
    gc.collect()
    assert slabnet.memory_stats().pinned_bytes <= base.pinned_bytes


def test_release_forgets_every_slab_and_keeps_viewed_bytes_intact() -> None:
    """``release()`` (the loop closed) empties the lists, free and viewed
    slabs alike, and the lending buffer; a kept chunk still shows its bytes
    and no later read writes into its slab."""
    slab = ReadSlab()
    kept = []
    for i in range(6):
        buf = slab.reserve(-1)
        fill(buf, bytes([i]) * SLAB)
        del buf
        chunk = slab.commit(SLAB)
        if i % 2:
            kept.append(chunk)
        del chunk
    slab.reserve_lent()  # (TLS ciphertext's buffer, made on first use)
    slab.consume(10)
    assert slab._held > 0 and slab._lend is not None
    slab.release()
    assert slab._held == 0 and slab._lend is None
    assert "held=0 slabs, 0 bytes" in repr(slab)
    for _ in range(6):
        buf = slab.reserve(-1)
        fill(buf, b"\xff" * SLAB)
        del buf
        slab.commit(SLAB)
    assert [bytes(c) for c in kept] == [bytes([i]) * SLAB for i in (1, 3, 5)]


def test_commit_without_reserve_and_bad_sizes_raise() -> None:
    slab = ReadSlab()
    with pytest.raises(RuntimeError, match="without a pending reserve"):
        slab.commit(1)
    slab.reserve(-1)
    with pytest.raises(ValueError, match="65537 bytes of a 65536-byte"):
        slab.commit(65537)
    with pytest.raises(ValueError):
        ReadSlab(0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([-1, 65536, 1024, 320, 100000]),
            st.integers(min_value=1, max_value=65536),
            st.booleans(),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_property_kept_chunks_never_change_and_bytes_come_in_order(
    reads: list[tuple[int, int, bool]],
) -> None:
    slab = ReadSlab()
    kept: list[tuple[memoryview, bytes]] = []
    stream = bytearray()
    out = bytearray()
    counter = 0
    for hint, want, keep in reads:
        buf = slab.reserve(hint)
        n = min(want, len(buf))
        data = bytes((counter + i) % 251 for i in range(n))
        counter += n
        buf[:n] = data
        del buf
        chunk = slab.commit(n)
        stream += data
        out += chunk
        assert chunk.readonly
        if keep:
            kept.append((chunk, data))
        del chunk
        for view, expected in kept:
            assert view == expected
    assert out == stream


def test_pool_carves_small_allocations_aligned() -> None:
    pool = BufferPool()
    a = pool.alloc(5)
    b = pool.alloc(100)
    assert len(a) == 5 and len(b) == 100
    assert a.obj is b.obj  # same pool
    assert pool.offset % 8 == 0
    a[:] = b"hello"
    b[:] = b"x" * 100
    assert bytes(a) == b"hello"


def test_pool_threshold_is_strictly_below_half() -> None:
    pool = BufferPool(pool_size=65536)
    assert pool.small_limit == 32768
    small = pool.alloc(32767)
    big = pool.alloc(32768)
    assert len(small.obj) == 65536
    assert len(big.obj) == 32768  # its own buffer


def test_pool_size_is_settable_and_new_pool_when_exhausted() -> None:
    pool = BufferPool(pool_size=64)
    assert pool.small_limit == 32
    first = pool.alloc(30)  # 0..30, next offset aligned to 32
    second = pool.alloc(30)  # 32..62, next offset 64: pool exhausted
    third = pool.alloc(30)
    assert first.obj is second.obj
    assert third.obj is not first.obj
    pool.pool_size = 8192
    assert pool.small_limit == 4096
    with pytest.raises(ValueError):
        pool.pool_size = 3


def test_pool_reuses_an_exhausted_pool_whose_regions_are_gone() -> None:
    pool = BufferPool(pool_size=1024)
    for _ in range(100):
        r = pool.alloc(500)
        r[:] = b"p" * 500
        del r
    assert pool.pools_allocated <= 2
    assert pool.pools_reused >= 40


def test_pool_never_reuses_a_pool_with_a_live_region() -> None:
    pool = BufferPool(pool_size=1024)
    kept = pool.alloc(500)
    kept[:] = b"K" * 500
    for _ in range(50):
        r = pool.alloc(500)
        r[:] = b"o" * 500
        del r
    assert bytes(kept) == b"K" * 500


def test_a_queue_gathers_its_small_writes_into_one_region() -> None:
    pool = BufferPool(pool_size=1024)
    mine, other = OutQueue(), OutQueue()
    for i in range(3):
        mine.gather(pool, bytes([i]) * 10, 10)  # 30 bytes, contiguous
    assert [bytes(b) for b in mine.buffers()] == [b"\0" * 10 + b"\1" * 10 + b"\2" * 10]
    mine.sent(30)
    # Another queue carves in between: each gathers a region of its own.
    mine.gather(pool, b"a", 1)
    other.gather(pool, b"b", 1)
    mine.gather(pool, b"c", 1)
    assert [bytes(b) for b in mine.buffers()] == [b"a", b"c"]
    assert [bytes(b) for b in other.buffers()] == [b"b"]
    assert pool.offset % 8 == 0


def test_pool_grow_refuses_past_the_pool_or_after_another_carve() -> None:
    pool = BufferPool(pool_size=64)
    buf, start = pool.carve(20)
    view = memoryview(buf)  # (the caller's export)
    assert pool.grow(buf, start + 20, b"x" * 20, 20)  # 20..40
    assert not pool.grow(buf, start + 40, b"y" * 30, 30)  # would end past 64
    assert pool.offset == 40
    other, at = pool.carve(8)
    assert other is buf and at == 40
    assert not pool.grow(buf, start + 40, b"z", 1)  # no longer the last region
    del view


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # which queue
            st.sampled_from(["gather", "big", "send"]),
            st.integers(1, 40),  # bytes written, or sent
        ),
        max_size=80,
    )
)
def test_gathered_writes_of_interleaved_queues_keep_their_bytes(
    steps: list[tuple[int, str, int]],
) -> None:
    # Three connections share one small pool: whatever order they gather,
    # queue large writes and send in, each stream is what it wrote, and no
    # queued byte is overwritten by another's write (pool reuse included).
    pool = BufferPool(pool_size=128)
    queues = [OutQueue() for _ in range(3)]
    written = [bytearray() for _ in range(3)]
    sent = [0, 0, 0]
    counter = 0
    for which, op, n in steps:
        q = queues[which]
        counter += 1
        data = bytes((counter + k) % 251 for k in range(n))
        if op == "gather":
            q.gather(pool, data, n)  # (n < small_limit, 64)
        elif op == "big":
            q.append(memoryview(data))
        else:
            bufs = q.buffers()
            pending = b"".join(bytes(b) for b in bufs)
            assert pending == written[which][sent[which] : sent[which] + len(pending)]
            take = min(n, len(pending))
            q.sent(take)
            sent[which] += take
            continue
        written[which] += data
    for which, q in enumerate(queues):
        rest = b"".join(bytes(b) for b in q.buffers())
        assert rest == written[which][sent[which] :]
        assert q.queued == len(rest)


def test_reserve_lent_uses_one_lending_buffer_and_no_slab() -> None:
    from slabnet._slab import LEND_SIZE

    slab = ReadSlab()
    before = slabnet.memory_stats()
    buf = slab.reserve_lent()
    assert len(buf) == LEND_SIZE == 4 * slab.size
    fill(buf, b"t" * LEND_SIZE)
    del buf
    lent = slab.consume(LEND_SIZE)
    assert bytes(lent[-3:]) == b"ttt"
    del lent
    # A lent reservation is never a chunk.
    slab.reserve_lent()
    with pytest.raises(RuntimeError, match="consume"):
        slab.commit(10)
    # Abandoned (the read failed): the next reserve() is an ordinary one.
    buf = slab.reserve(-1)
    fill(buf, b"p" * 65536)
    del buf
    chunk = slab.commit(65536)
    assert bytes(chunk[:2]) == b"pp"
    # The same buffer every time; no slab was made for the lent reads.
    assert slab.reserve_lent().obj is slab.reserve_lent().obj
    after = slabnet.memory_stats()
    assert after.lent_reads == before.lent_reads + 1
    assert after.slabs_allocated == before.slabs_allocated + 1  # the commit's


def test_consume_lends_the_lending_buffer_without_copying() -> None:
    slab = ReadSlab()
    before = slabnet.memory_stats()
    buf = slab.reserve_lent()
    fill(buf, b"c" * 5000)
    del buf
    lent = slab.consume(5000)
    assert bytes(lent) == b"c" * 5000
    copied = bytes(lent)  # what the TLS engine does with it
    del lent
    # Not kept: the next lent read lands on the same bytes.
    buf = slab.reserve_lent()
    fill(buf, b"d" * 10)
    del buf
    assert bytes(slab.consume(10)) == b"d" * 10
    assert copied == b"c" * 5000
    after = slabnet.memory_stats()
    assert after.lent_reads == before.lent_reads + 2
    assert after.copies == before.copies  # consume never copies
    assert after.slabs_allocated == before.slabs_allocated
    with pytest.raises(RuntimeError, match="consume"):
        slab.consume(1)
    # Only lent reservations are consumed: a slab read becomes a chunk.
    slab.reserve(-1)
    with pytest.raises(RuntimeError, match="reserve_lent"):
        slab.consume(1)


def _derive(chunk: memoryview, how: int) -> memoryview:
    """A view that outlives ``chunk`` and shares its slab: a slice, a view of
    a view, a cast, or a cast of a slice of a view."""
    if how == 0:
        return chunk[1:]
    if how == 1:
        return memoryview(memoryview(chunk))
    if how == 2:
        return chunk.cast("B", (len(chunk),))
    return memoryview(chunk[: len(chunk) // 2 or 1]).cast("c")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=49152, max_value=65536),  # zero-copy reads
            st.sampled_from([None, 0, 1, 2, 3]),  # keep nothing, or a derived view
            st.integers(min_value=0, max_value=5),  # drop a kept view after k reads
        ),
        min_size=1,
        max_size=40,
    )
)
def test_property_slabs_with_derived_views_are_never_recycled(
    reads: list[tuple[int, int | None, int]],
) -> None:
    """Only derived views are kept (the chunk itself is dropped at once), and
    some are dropped later: a slab is reused only when none is left, and
    ``memory_stats`` counts exactly the slabs that are still viewed."""
    slab = ReadSlab()
    kept: list[tuple[memoryview, bytes, int]] = []
    for step, (n, how, life) in enumerate(reads):
        buf = slab.reserve(-1)
        buf[:n] = bytes([step % 251]) * n
        del buf
        chunk = slab.commit(n)
        if how is not None:
            view = _derive(chunk, how)
            kept.append((view, bytes(view), step + life))
        del chunk
        kept = [k for k in kept if k[2] >= step]  # drop those whose life ended
        for view, expected, _ in kept:
            assert bytes(view) == expected
    kept_slabs = {id(v.obj): v.obj for v, _, _ in kept}
    assert slabnet.memory_stats().pinned_bytes >= len(kept_slabs) * SLAB


def test_stats_from_another_thread_see_views_without_touching_slabs() -> None:
    import threading

    gc.collect()
    base = slabnet.memory_stats().pinned_bytes
    slab = ReadSlab()
    buf = slab.reserve(-1)
    buf[:SLAB] = b"t" * SLAB
    del buf
    kept = slab.commit(SLAB)[5:9].cast("c")
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(slabnet.memory_stats().pinned_bytes))
    worker.start()
    worker.join(10)
    assert seen == [base + SLAB]
    assert kept.tobytes() == b"tttt"
    del kept
    gc.collect()
    worker = threading.Thread(target=lambda: seen.append(slabnet.memory_stats().pinned_bytes))
    worker.start()
    worker.join(10)
    assert seen[1] == base


def test_pool_sees_a_region_kept_only_through_a_cast() -> None:
    pool = BufferPool(pool_size=1024)
    region = pool.alloc(504)
    region[:] = b"C" * 504
    kept = region.cast("Q")  # 63 eight-byte items over the same bytes
    del region
    for _ in range(20):
        r = pool.alloc(500)
        r[:] = b"o" * 500
        del r
    assert kept.tobytes() == b"C" * 504


def test_memory_stats_while_another_threads_loop_makes_its_read_slab() -> None:
    """``memory_stats()`` counts the slabs of every loop in every thread,
    and a loop started in another thread makes its ``ReadSlab`` whenever
    it likes. The registry was a WeakSet, iterated in Python: a ReadSlab
    made meanwhile raised "RuntimeError: Set changed size during
    iteration" out of memory_stats() (13-27 times in 5,000 asyncio.run()
    calls of four threads, in a probe). Made deterministic here: a trace
    function makes a ReadSlab at every line run inside the call, as a
    thread switch could."""
    import sys

    made: list[ReadSlab] = []
    busy = False

    def tracer(frame: object, event: str, arg: object) -> object:
        nonlocal busy
        if event == "line" and not busy:
            busy = True
            try:
                made.append(ReadSlab())
            finally:
                busy = False
        return tracer

    keep = ReadSlab()
    keep.commit(len(keep.reserve(-1)))  # (a slab on its list: held_slabs >= 1)
    sys.settrace(tracer)
    try:
        stats = slabnet.memory_stats()
    finally:
        sys.settrace(None)
    assert made, "the tracer made no ReadSlab: the test tested nothing"
    assert stats.held_slabs >= 1
    del made
    gc.collect()
    assert slabnet.memory_stats().held_slabs >= 1
