"""The outgoing byte queue and write requests (sans-IO).

Theory of operation
-------------------
Most stream writes complete synchronously (the kernel takes all the bytes
at once), so nothing should be allocated to track them. slabnet's
write path therefore hands back a ``WriteRequest`` only when bytes have to
wait for the socket, and ``None`` otherwise.

``OutQueue`` is the bookkeeping behind that: an ordered deque of read-only
byte views waiting for the kernel, the count of bytes ever queued and ever
sent (so a request is "the bytes up to stream position N"), and the requests
that are awaited. The shell calls ``sent(n)`` after each ``send`` or
``sendmsg`` and gets back whether everything went; awaited requests whose
position has been reached complete in order. Partial sends leave a sliced
view at the head -- slicing a ``memoryview`` copies nothing.

A request is a position on its queue's stream, and its state follows from
the queue's progress (``sent_total``, ``error``): the queue holds only the
requests someone awaits. Most are never awaited (asyncio code calls
``write()`` and then ``drain()``), so a connection whose peer stops
reading does not hold one object per write for as long as it waits.

Small writes that wait for the socket are copied into one growing
``bytearray`` at the tail (``append_small``), sealed into the deque when
the shell next takes ``buffers()``: 64 KiB queued in 100-byte writes is one
buffer, not 655 views. The shell's gathered writes live in regions of a
pool the whole loop shares (``_pool``): ``gather`` copies each right after
the queue's last, while no other queue carved the pool in between, so a
connection's small writes of one iteration are one region (a "run", kept
as a view of the whole pool and its bounds until it is sealed into the
deque, the pool exported meanwhile). ``own_pooled`` copies those left
behind when the socket fills, since one region held pins its whole pool
while the pool's other regions are the other connections' writes.

Buffers are gathered for one ``sendmsg`` (``buffers()``), capped at
``IOV_MAX`` entries: Linux refuses more than 1024 iovecs in one call (uio.h
UIO_MAXIOV).
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Generator
from typing import Any, Final

from ._pool import BufferPool, is_pooled

__all__ = ["IOV_MAX", "OutQueue", "WriteRequest"]

IOV_MAX: Final = 1024


class WriteRequest:
    """Bytes that were queued because the socket could not take them yet.

    Awaiting it returns once those bytes were handed to the kernel, or raises
    the error that broke the connection first. It exists only for writes that
    did not complete synchronously.

    Each ``await`` waits on a future of its own, made when it starts: an
    awaiter that is cancelled (say by a ``wait_for`` timeout) cancels only
    itself, and the bytes stay queued for every other awaiter and later one.
    """

    __slots__ = ("nbytes", "_end", "_queue", "_loop", "_exc", "_tb", "_done", "_waiters")

    def __init__(
        self, nbytes: int, end: int, queue: OutQueue | None = None, loop: Any = None
    ) -> None:
        self.nbytes = nbytes
        self._end = end  # stream position the kernel must have taken
        # The queue whose progress decides it (OutQueue.request, .track);
        # None until then (a TLS layer's request before encryption).
        self._queue = queue
        # The connection's event loop (None: no shell, as in the tests of
        # this module): an await's future is its, so that a task of another
        # loop is told so at once (as by asyncio's drain()) instead of
        # waiting on a future that this loop's thread completes.
        self._loop = loop
        self._exc: BaseException | None = None
        self._tb: Any = None  # _exc's traceback when it finished us (see __await__)
        self._done = False
        # The futures of the awaits in progress: None until the first await
        # (most requests are never awaited), then a list.
        self._waiters: list[Any] | None = None

    def done(self) -> bool:
        if not self._done:
            self._settle()
        return self._done

    def exception(self) -> BaseException | None:
        if not self._done:
            self._settle()
        return self._exc

    def _settle(self) -> None:
        """Finish if the queue's progress decides it already."""
        queue = self._queue
        if queue is not None:
            if queue.sent_total >= self._end:
                self._finish(None)
            elif queue.error is not None:
                self._finish(queue.error)

    def _finish(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self._exc = exc
        if exc is not None:
            self._tb = exc.__traceback__
        self._queue = None
        waiters = self._waiters
        if waiters:
            self._waiters = None
            for waiter in waiters:
                if not waiter.done():
                    if exc is None:
                        waiter.set_result(None)
                    else:
                        waiter.set_exception(exc)

    def __await__(self) -> Generator[Any, None, None]:
        if not self._done:
            self._settle()
        if not self._done:
            import asyncio  # the shell's loop; this module stays sans-IO

            waiter = (self._loop or asyncio.get_running_loop()).create_future()
            waiters = self._waiters
            if waiters is None:
                waiters = self._waiters = []
                queue = self._queue
                if queue is not None:
                    queue._wait(self)  # from now on the queue finishes it
            waiters.append(waiter)
            try:
                yield from waiter.__await__()
            finally:
                # A cancelled awaiter leaves; repeated timeouts do not pile up.
                waiters = self._waiters
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
        elif self._exc is not None:
            # With the traceback it had when it finished us, as a future
            # re-raises its exception: a bare raise would add this await's
            # frames to the traceback of an error that the connection
            # keeps, so every await would keep its awaiter's frames, and
            # their locals, for as long as the connection lived.
            raise self._exc.with_traceback(self._tb)

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<WriteRequest nbytes={self.nbytes} {state}>"


class OutQueue:
    """Bytes waiting for the socket, in order.

    Most connections never queue anything (their writes go straight to the
    kernel), and an empty ``deque`` costs about 760 bytes: both deques are
    made on first use, so an idle connection pays for neither.
    """

    __slots__ = (
        "_bufs", "_tail", "_run", "_run_start", "_run_end", "pooled", "queued", "sent_total",
        "end", "error", "_requests", "lent",
    )

    def __init__(self) -> None:
        self._bufs: collections.deque[memoryview] | None = None
        # Small writes queued since the last buffers(), copied: after _bufs.
        self._tail: bytearray | None = None
        # Small writes gathered since the last buffers(), in one region of
        # the shared write pool (gather): a view of the whole pool, which
        # keeps it exported, and the region's bounds. After _bufs.
        self._run: memoryview | None = None
        self._run_start = 0
        self._run_end = 0
        self.pooled = False  # a view of the shared write pool may be queued
        self.queued = 0  # bytes waiting
        self.lent = 0  # of them, handed to another transport to send (lend)
        self.sent_total = 0  # bytes handed to the kernel, ever
        self.end = 0  # stream position after the last queued byte
        self.error: BaseException | None = None  # what dropped the queue (fail)
        # The awaited requests, by position (see WriteRequest.__await__).
        self._requests: list[WriteRequest] | None = None

    def __bool__(self) -> bool:
        return self.queued > 0

    def append(self, view: memoryview) -> None:
        n = view.nbytes
        if n:
            if self._run is not None:
                self._seal_run()
            if self._tail is not None:
                self._seal()
            self._push(view)
            self.queued += n
            self.end += n

    def _push(self, view: memoryview) -> None:
        bufs = self._bufs
        if bufs is None:
            bufs = self._bufs = collections.deque()
        bufs.append(view)

    def gather(self, pool: BufferPool, data: bytes | memoryview, n: int) -> None:
        """Queue a copy of ``data`` (``n`` bytes, below the pool's
        ``small_limit``) in the shared write pool: right after the last one
        gathered, in one region, while no other connection carved the pool
        since. A connection's small writes of one iteration are then one
        buffer, not a view each."""
        run = self._run
        if run is None or not pool.grow(run.obj, self._run_end, data, n):  # type: ignore[arg-type]
            if run is not None:
                self._seal_run()
            if self._tail is not None:
                self._seal()
            buf, start = pool.carve(n)
            run = memoryview(buf)  # (exported before the pool is next asked)
            # The copy first: if it raises, the region is left unused and
            # the queue is as it was, not pointing at a region of earlier
            # bytes (another connection's, once the pool is reused).
            run[start : start + n] = data
            self._run = run
            self._run_start = start
            self._run_end = start + n
            self.pooled = True
        else:
            self._run_end += n
        self.queued += n
        self.end += n

    def _seal_run(self) -> None:
        run = self._run
        self._run = None
        if run is not None:
            self._push(run[self._run_start : self._run_end])

    def append_small(self, data: bytes | memoryview) -> None:
        """Queue a copy of ``data``, in one buffer with the other small
        writes queued since the shell last took ``buffers()``."""
        if self._run is not None:
            self._seal_run()
        tail = self._tail
        if tail is None:
            self._tail = bytearray(data)
        else:
            tail += data
        n = len(data)  # (a memoryview of bytes: one byte per item)
        self.queued += n
        self.end += n

    def _seal(self) -> None:
        tail = self._tail
        self._tail = None
        if tail:
            self._push(memoryview(tail))  # (never grown again)

    def own_pooled(self) -> None:
        """Replace the queued views of the shared write pool by copies (one
        ``bytes`` for each run of them): a waiting region would pin its
        whole pool for as long as the peer takes to read."""
        if not self.pooled:
            return
        self.pooled = False
        if self._run is not None:
            self._seal_run()
        bufs = self._bufs
        if not bufs:
            return
        kept: collections.deque[memoryview] = collections.deque()
        run: list[memoryview] = []
        for view in bufs:
            if is_pooled(view):
                run.append(view)
                continue
            if run:
                kept.append(memoryview(b"".join(run)))
                run = []
            kept.append(view)
        if run:
            kept.append(memoryview(b"".join(run)))
        self._bufs = kept

    def passed(self, nbytes: int) -> None:
        """Account for bytes sent directly, without ever being queued."""
        self.end += nbytes
        self.sent_total += nbytes

    def request(self, nbytes: int, loop: Any = None) -> WriteRequest:
        """A request for the bytes queued so far (the last ``nbytes`` of
        them), of the connection on ``loop``; the queue keeps it only once
        it is awaited."""
        return WriteRequest(nbytes, self.end, self, loop)

    def track(self, req: WriteRequest) -> None:
        """Make ``req`` complete once everything queued so far is sent."""
        req._end = self.end
        req._queue = self
        req._settle()
        if not req._done and req._waiters is not None:
            self._wait(req)

    def _wait(self, req: WriteRequest) -> None:
        reqs = self._requests
        if reqs is None:
            self._requests = [req]
        elif reqs[-1]._end <= req._end:
            reqs.append(req)
        else:
            bisect.insort(reqs, req, key=_end_of)

    def buffers(self) -> list[memoryview]:
        if self._run is not None:
            self._seal_run()
        if self._tail is not None:
            self._seal()
        bufs = self._bufs
        if bufs is None:
            return []
        if len(bufs) <= IOV_MAX:
            return list(bufs)
        return list(itertools.islice(bufs, IOV_MAX))

    def sent(self, nbytes: int) -> bool:
        """Record that the kernel took ``nbytes`` of ``buffers()``; True if
        the queue is empty."""
        bufs = self._bufs
        left = nbytes
        while left:
            assert bufs is not None
            head = bufs[0]
            size = head.nbytes
            if left >= size:
                bufs.popleft()
                left -= size
            else:
                bufs[0] = head[left:]
                break
        return self._advance(nbytes)

    def lend(self) -> list[memoryview]:
        """Every buffer queued, for another transport to send, in order.
        Their bytes still count as queued (``queued``, ``lent``) and their
        requests stay pending until ``repaid()``; what is queued meanwhile
        goes after them."""
        if self._run is not None:
            self._seal_run()
        if self._tail is not None:
            self._seal()
        bufs = self._bufs
        self._bufs = None
        self.lent = self.queued
        return list(bufs) if bufs else []

    def repaid(self) -> bool:
        """The other transport sent every lent byte; True if the queue is empty."""
        n = self.lent
        self.lent = 0
        return self._advance(n)

    def _advance(self, nbytes: int) -> bool:
        self.queued -= nbytes
        self.sent_total += nbytes
        reqs = self._requests
        if reqs:
            k = bisect.bisect_right(reqs, self.sent_total, key=_end_of)
            if k:
                finished = reqs[:k]
                del reqs[:k]
                if not reqs:
                    self._requests = None  # (an idle connection keeps no list)
                for req in finished:
                    req._finish(None)
        return not self.queued

    def fail(self, exc: BaseException) -> None:
        """Drop every queued byte; requests not done raise ``exc``."""
        if self.error is None:
            self.error = exc
        self._bufs = None
        self._tail = None
        self._run = None
        self.queued = 0
        self.lent = 0
        reqs = self._requests
        self._requests = None
        for req in reqs or ():
            req._finish(exc)


def _end_of(req: WriteRequest) -> int:
    return req._end
