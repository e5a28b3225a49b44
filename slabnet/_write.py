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
that wait on positions. The shell calls ``sent(n)`` after each ``send`` or
``sendmsg`` and gets back whether everything went; requests whose position
has been reached complete in order. Partial sends leave a sliced view at the
head -- slicing a ``memoryview`` copies nothing.

Buffers are gathered for one ``sendmsg`` (``buffers()``), capped at
``IOV_MAX`` entries: Linux refuses more than 1024 iovecs in one call (uio.h
UIO_MAXIOV).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Generator
from typing import Any, Final

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

    __slots__ = ("nbytes", "_end", "_exc", "_done", "_waiters")

    def __init__(self, nbytes: int, end: int) -> None:
        self.nbytes = nbytes
        self._end = end  # stream position the kernel must have taken
        self._exc: BaseException | None = None
        self._done = False
        # The futures of the awaits in progress: None until the first await
        # (most requests are never awaited), then a list.
        self._waiters: list[Any] | None = None

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._exc

    def _finish(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self._exc = exc
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
            import asyncio  # the shell's loop; this module stays sans-IO

            waiter = asyncio.get_running_loop().create_future()
            waiters = self._waiters
            if waiters is None:
                waiters = self._waiters = []
            waiters.append(waiter)
            try:
                yield from waiter.__await__()
            finally:
                # A cancelled awaiter leaves; repeated timeouts do not pile up.
                waiters = self._waiters
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
        elif self._exc is not None:
            raise self._exc

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<WriteRequest nbytes={self.nbytes} {state}>"


class OutQueue:
    """Bytes waiting for the socket, in order.

    Most connections never queue anything (their writes go straight to the
    kernel), and an empty ``deque`` costs about 760 bytes: both deques are
    made on first use, so an idle connection pays for neither.
    """

    __slots__ = ("_bufs", "queued", "sent_total", "end", "_requests")

    def __init__(self) -> None:
        self._bufs: collections.deque[memoryview] | None = None
        self.queued = 0  # bytes waiting
        self.sent_total = 0  # bytes handed to the kernel, ever
        self.end = 0  # stream position after the last queued byte
        self._requests: collections.deque[WriteRequest] | None = None

    def __bool__(self) -> bool:
        return self.queued > 0

    def append(self, view: memoryview) -> None:
        n = view.nbytes
        if n:
            bufs = self._bufs
            if bufs is None:
                bufs = self._bufs = collections.deque()
            bufs.append(view)
            self.queued += n
            self.end += n

    def passed(self, nbytes: int) -> None:
        """Account for bytes sent directly, without ever being queued."""
        self.end += nbytes
        self.sent_total += nbytes

    def request(self, nbytes: int) -> WriteRequest:
        """A request for the bytes queued so far (the last ``nbytes`` of them)."""
        req = WriteRequest(nbytes, self.end)
        self._wait(req)
        return req

    def track(self, req: WriteRequest) -> None:
        """Make ``req`` complete once everything queued so far is sent."""
        req._end = self.end
        if self.sent_total >= self.end:
            req._finish(None)
        else:
            self._wait(req)

    def _wait(self, req: WriteRequest) -> None:
        reqs = self._requests
        if reqs is None:
            reqs = self._requests = collections.deque()
        reqs.append(req)

    def buffers(self) -> list[memoryview]:
        bufs = self._bufs
        if bufs is None:
            return []
        if len(bufs) <= IOV_MAX:
            return list(bufs)
        return list(itertools.islice(bufs, IOV_MAX))

    def sent(self, nbytes: int) -> bool:
        """Record that the kernel took ``nbytes``; True if the queue is empty."""
        self.queued -= nbytes
        self.sent_total += nbytes
        bufs = self._bufs
        while nbytes:
            assert bufs is not None
            head = bufs[0]
            size = head.nbytes
            if nbytes >= size:
                bufs.popleft()
                nbytes -= size
            else:
                bufs[0] = head[nbytes:]
                break
        reqs = self._requests
        if reqs:
            done = self.sent_total
            while reqs and reqs[0]._end <= done:
                reqs.popleft()._finish(None)
            if not reqs:
                self._requests = None  # (an idle connection keeps no deque)
        return not self.queued

    def fail(self, exc: BaseException) -> None:
        """Drop every queued byte; pending requests raise ``exc``."""
        self._bufs = None
        self.queued = 0
        reqs = self._requests
        self._requests = None
        while reqs:
            reqs.popleft()._finish(exc)
