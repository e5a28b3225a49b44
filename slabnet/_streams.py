"""asyncio-compatible streams over slabnet transports: a StreamReader that
queues the transport's chunks instead of copying them, and its writer.

Theory of operation
-------------------
asyncio's ``StreamReader`` keeps one ``bytearray``: every read is copied into
it (``extend``), every ``read``/``readexactly`` copies out of it again and
shifts the rest (``del buf[:n]``). slabnet's reader keeps the chunks it was
given -- views of the loop's read slab, or TLS chunks that own their bytes --
in a deque, with an offset into the first one:

* ``read_chunk()`` / ``chunks()`` hand those views on: no copy at all;
* ``read(n)``, ``readexactly``, ``readuntil`` and ``readline`` build their
  ``bytes`` result with one ``b"".join`` of views, so each byte is copied at
  most once after the kernel's copy;
* ``readinto(buf)`` copies straight into the caller's buffer.

Small chunks are the exception. A queued chunk costs a few hundred bytes of
objects whatever its length, so a peer trickling one byte per segment would
make each buffered byte cost hundreds of times its size. A chunk shorter than
``_COALESCE_BELOW`` that arrives while data is already buffered is copied
into an owned ``bytearray``, the *tail*, which logically follows the queue.
The tail is never exported while it can still grow: a read that needs its
bytes first *seals* it (moves it into the queue as a read-only view and
starts a fresh one), so a view once handed out is never written again. A
consumer that keeps up finds nothing buffered when a chunk arrives and gets
every chunk as it came, copied or not.

Searching for a separator uses ``re`` on the views (``re`` accepts any
buffer) and ``bytearray.find`` on the tail, so nothing is copied to search
either; only a separator that straddles a chunk boundary is looked for in a
small window of ``len(sep) - 1`` bytes each side. The search is incremental,
as asyncio's: ``readuntil`` remembers how far it has searched and, on each
wake-up, looks only at the new bytes plus ``len(sep) - 1`` of overlap,
finding its starting chunk by walking back from the newest one. A peer that
sends a header one byte at a time costs linear time, not quadratic.

Errors and EOF never overtake data: a reader whose connection broke hands
out every byte that arrived before the error, then raises it. (asyncio
raises a stored exception at once, even with data buffered.) A call that
asks for a whole unit -- ``read()`` to EOF, ``readexactly(n)``, a
``readuntil``/``readline`` whose separator has not arrived -- is the
exception to the order: the error means the unit will never be complete,
so it raises the error, as asyncio's does, and the bytes stay buffered,
where ``read(n)``, ``read_chunk()`` and ``readinto`` still hand them out.
Were the bytes returned instead, a body read to EOF over a connection that
was reset, or over TLS that was truncated with ``ssl_ragged_eof=False``,
would look complete (the error would come only from a next call that a
read to EOF never makes).

Cancellation never loses bytes: every read consumes only after its last
await, and a cancelled ``read()`` (to EOF) puts back what it had gathered,
so the next read sees every byte. (asyncio's ``read()`` drops them.)

Flow control matches asyncio: reading pauses when more than twice ``limit``
bytes are buffered and resumes at ``limit`` or below.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl as _ssl
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Final, cast

from ._errors import LocalAbortError
from ._slab import _Sealed
from ._tls_transport import TLSTransport, check_ssl_timeout
from ._transport import (
    ChunkProtocol, SlabProtocol, SlabTransport, _abort_ours_first, awaiting_handshake,
)

#: What a stream runs over: a plain connection, or the TLS layer on one.
_Transport = SlabTransport | TLSTransport
from ._write import WriteRequest

__all__ = [
    "StreamReader",
    "StreamWriter",
    "open_connection",
    "open_unix_connection",
    "start_server",
    "start_unix_server",
]

#: asyncio.streams._DEFAULT_LIMIT: 64 KiB.
_DEFAULT_LIMIT: Final = 2**16

_EMPTY: Final = memoryview(b"")

ClientConnectedCallback = Callable[
    ["StreamReader", "StreamWriter"], "Awaitable[None] | None"
]


#: Chunks shorter than this are copied into one owned buffer (the "tail")
#: when data is already buffered, instead of being queued one by one: a
#: queued chunk costs a few hundred bytes of objects whatever its length
#: (memoryview, its managed buffer, the bytes header, a deque slot; see the
#: trickle benchmark in benchmarks/README.md). Below 1 KiB that overhead is
#: over a third of the payload, and copying so few bytes costs less than the
#: objects it saves. A consumer that keeps up (nothing buffered
#: when a chunk arrives) still gets every chunk as it came.
_COALESCE_BELOW: Final = 1024

#: Before 3.13 asyncio's StreamReaderProtocol keeps a server connection's
#: writer until the connection is lost; from 3.13 on it keeps no reference.
_KEEP_SERVER_WRITER: Final = sys.version_info < (3, 13)

_BytesLike = bytes | bytearray | memoryview


class _BufferCopy(bytes):
    """What ``StreamReader._buffer`` returns: a ``bytes`` copy of the unread
    bytes that takes ``copy[0:0] = data`` and puts ``data`` back in front
    of them in the reader, and ``copy.clear()``, which discards them in the
    reader (the copy itself does not change)."""

    _reader: StreamReader

    def __new__(cls, data: bytes, reader: StreamReader) -> _BufferCopy:
        self = super().__new__(cls, data)
        self._reader = reader
        return self

    def __setitem__(self, key: slice, value: _BytesLike) -> None:
        if not (
            isinstance(key, slice)
            and key.start in (None, 0) and key.stop == 0 and key.step is None
        ):
            raise TypeError(_ONLY_PUT_BACK)
        self._reader._put_back(value)

    def __delitem__(self, key: slice) -> None:
        raise TypeError(_ONLY_PUT_BACK)

    def clear(self) -> None:
        """Discard every unread byte in the reader, as ``clear()`` on
        asyncio's bytearray does (aiosmtpd drops the plaintext left after
        STARTTLS so, RFC 3207 section 4.2); a paused reader reads on."""
        self._reader._buffer = b""


_ONLY_PUT_BACK: Final = (
    "a slabnet reader's _buffer takes only bytes put back in front (_buffer[0:0] = data)"
    " and clear()"
)


class _FeedData:
    """``StreamReader.feed_data``: the method, and one that code may replace
    on a reader with effect.

    asyncio's protocol calls ``reader.feed_data(data)`` for every read, so
    code that assigns ``reader.feed_data = f`` sees every byte the
    connection brings (pproxy decrypts its shadowsocks ciphers and unframes
    websockets so, ``f`` calling the method it replaced). slabnet's
    transport hands chunks to ``_feed_chunk`` instead, one lookup fewer per
    read; the assignment therefore also puts a ``_feed_chunk`` on the reader
    that passes each chunk to ``f`` as ``bytes``, what asyncio's passes. A
    reader nobody changed pays nothing for this.
    """

    __slots__ = ("_method",)

    def __init__(self, method: Callable[[StreamReader, _BytesLike], None]) -> None:
        self._method = method

    def __get__(self, reader: StreamReader | None, owner: type | None = None) -> Any:
        if reader is None:
            return self._method
        replaced = reader.__dict__.get("feed_data")
        if replaced is not None:
            return replaced
        return self._method.__get__(reader, owner)

    def __set__(self, reader: StreamReader, feed: Callable[[bytes], object]) -> None:
        reader.__dict__["feed_data"] = feed
        reader.__dict__["_feed_chunk"] = lambda chunk: feed(chunk.tobytes())

    def __delete__(self, reader: StreamReader) -> None:
        reader.__dict__.pop("feed_data", None)
        reader.__dict__.pop("_feed_chunk", None)


class StreamReader:
    """A drop-in for ``asyncio.StreamReader`` with zero-copy chunk reads."""

    # What asyncio.StreamReaderProtocol reads of its reader, so that one can
    # feed a slabnet reader (loop.connect_read_pipe, subprocess pipes).
    _source_traceback = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "feed_data" in cls.__dict__ and "_feed_chunk" not in cls.__dict__:
            # A subclass's own feed_data hears every read, as on asyncio's.
            setattr(cls, "_feed_chunk", _feed_through_feed_data)

    def __init__(
        self, limit: int = _DEFAULT_LIMIT, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        if limit <= 0:
            raise ValueError("Limit cannot be <= 0")
        self._limit = limit
        self._loop = loop or asyncio.get_event_loop()
        # Made on first use: an empty deque costs 760 bytes, and most of a
        # server's connections are idle. Never None while it holds a chunk.
        self._chunks: collections.deque[memoryview] | None = None
        self._pos = 0  # bytes of _chunks[0] already consumed
        # Small chunks, coalesced, after all of _chunks: a _Sealed once one
        # comes, b"" while there is none (one object fewer per idle reader).
        self._tail: _Sealed | bytes = b""
        self._size = 0  # buffered bytes not yet consumed (_chunks and _tail)
        self._examined = 0  # bytes the separator search has looked at, ever
        self._eof = False
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._transport: asyncio.BaseTransport | None = None
        self._paused = False

    def __repr__(self) -> str:
        # asyncio's fields, in asyncio's order.
        info = ["StreamReader"]
        if self._size:
            info.append(f"{self._size} bytes")
        if self._eof:
            info.append("eof")
        if self._limit != _DEFAULT_LIMIT:
            info.append(f"limit={self._limit}")
        if self._waiter:
            info.append(f"waiter={self._waiter!r}")
        if self._exception:
            info.append(f"exception={self._exception!r}")
        if self._transport:
            info.append(f"transport={self._transport!r}")
        if self._paused:
            info.append("paused")
        return f"<{' '.join(info)}>"

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def _buffer(self) -> _BufferCopy:
        """A copy of the bytes buffered and not yet read; nothing is consumed.

        asyncio's reader keeps them in a ``bytearray`` of that name, and
        clients read it to ask whether a response is waiting without
        reading it (redis-py checks ``bool(reader._buffer)`` before reusing
        a pooled connection, and ``len(...)`` for pending invalidations;
        without the name every checkout failed with ``AttributeError``).
        A snapshot, not a live buffer: ``len``, truth, ``find`` and slices
        answer as asyncio's would. The one change it takes is asyncio's way
        of putting bytes back in front, ``_buffer[0:0] = data`` (pproxy
        reads a connection's first bytes to guess its protocol, then puts
        them back so), and ``_buffer.clear()``, which discards them all
        (aiosmtpd, after STARTTLS); any other raises ``TypeError``."""
        if not self._size:
            return _BufferCopy(b"", self)
        parts: list[_BytesLike] = list(self._chunks or ())
        if parts:
            parts[0] = parts[0][self._pos :]
        parts.append(self._tail)
        return _BufferCopy(b"".join(parts), self)

    @_buffer.setter
    def _buffer(self, data: _BytesLike) -> None:
        """Replace the unread bytes with a copy of ``data``: code written
        for asyncio's reader takes them so (pproxy, before it feeds them
        through the ``feed_data`` it put in place: ``reader._buffer, buf =
        bytearray(), reader._buffer``)."""
        data = bytes(memoryview(data))
        self._chunks = None
        self._pos = 0
        self._tail = b""
        self._size = 0
        self._put_back(data)
        self._maybe_resume()

    def _put_back(self, data: _BytesLike) -> None:
        """Put a copy of ``data`` in front of the unread bytes."""
        data = bytes(memoryview(data))
        if data:
            self._unread([memoryview(data)])
            self._wakeup_waiter()

    # ------------------------------------------------ feeding (protocol side)

    def exception(self) -> BaseException | None:
        return self._exception

    def set_exception(self, exc: BaseException) -> None:
        """Every read raises ``exc`` once the bytes buffered before it are
        read; bytes that come after it are left unread (``_refuse``)."""
        self._exception = exc
        self._wakeup_waiter()

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        if self._transport is not None:
            raise AssertionError("Transport already set")
        self._transport = transport

    def feed_eof(self) -> None:
        """The end of the data: bytes that come after it (an app may call
        this before its peer is done) are left unread (``_refuse``)."""
        self._eof = True
        self._wakeup_waiter()

    def at_eof(self) -> bool:
        """True if the buffer is empty and EOF was received."""
        return self._eof and not self._size

    def _feed_data(self, data: bytes | bytearray | memoryview) -> None:
        """asyncio-compatible: queue a copy of ``data``."""
        if self._eof:
            raise AssertionError("feed_data after feed_eof")
        if not data:
            return  # (None too, as asyncio's)
        # (memoryview() first: bytes(5) would be five zero bytes, where
        # asyncio's bytearray.extend raises TypeError.)
        try:
            view = memoryview(data)
        except TypeError:
            # Not bytes-like: asyncio's extend takes an iterable of ints
            # (and raises its own TypeError for anything else).
            buf = bytearray()
            buf.extend(data)
            view = memoryview(buf)
        self._put_chunk(memoryview(bytes(view)))

    feed_data = _FeedData(_feed_data)

    def _put_chunk(self, chunk: memoryview) -> None:
        # The hot path: the transport calls this for every chunk, as
        # _feed_chunk (unless feed_data was replaced: _FeedData).
        if self._eof or self._exception is not None:
            self._refuse()
            return
        size = self._size
        if not size:
            # The consumer keeps up (and the tail is empty): kept as it came.
            chunks = self._queue()
            if chunks is None:
                chunks = self._chunks = collections.deque()
            chunks.append(chunk)
            self._size = size = len(chunk)
        else:
            n = len(chunk)
            if n < _COALESCE_BELOW:
                tail = self._tail
                if isinstance(tail, _Sealed):
                    tail.extend(chunk)
                else:
                    self._tail = _Sealed(chunk)
            else:
                if self._tail:
                    self._seal_tail()
                self._queue().append(chunk)
            self._size = size = size + n
        if self._waiter is not None:
            self._wakeup_waiter()
        if size > 2 * self._limit and not self._paused:
            self._paused = self._pause_transport()

    _feed_chunk = _put_chunk

    def _refuse(self) -> None:
        """A chunk came after the app ended the reader (``feed_eof()``,
        ``set_exception()``; the connection's own end delivers none after):
        it is dropped, never handed out after that end, and the transport
        stops reading, so the peer's further bytes wait in the kernel.
        asyncio's reads never return such bytes either (its default loop
        fails the connection: "feed_data after feed_eof"). ``_paused`` is
        left alone: no read resumes a reader that takes nothing more."""
        self._pause_transport()

    def _pause_transport(self) -> bool:
        """Ask the transport to stop reading; False if there is none or it
        cannot (then it is not asked again)."""
        transport = self._transport
        if transport is None:
            return False
        try:
            transport.pause_reading()  # type: ignore[attr-defined]
        except NotImplementedError:
            self._transport = None
            return False
        return True

    def _seal_tail(self) -> None:
        """Move the coalesced small chunks into the chunk queue as one chunk.

        The view handed on is read-only and its ``bytearray`` is never
        written again: later small chunks start a fresh one."""
        self._queue().append(memoryview(self._tail).toreadonly())
        self._tail = b""

    def _queue(self) -> collections.deque[memoryview]:
        chunks = self._chunks
        if chunks is None:
            chunks = self._chunks = collections.deque()
        return chunks

    def _reach(self, n: int) -> None:
        """Make the first ``n`` buffered bytes (or all) lie in ``_chunks``:
        seal the tail if some of them are in it."""
        tail = self._tail
        if tail and n > self._size - len(tail):
            self._seal_tail()

    def _wakeup_waiter(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _maybe_resume(self) -> None:
        if self._paused and self._size <= self._limit:
            self._paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]

    def _new_waiter(self, func_name: str) -> asyncio.Future[None]:
        """The future the next chunk, EOF or error completes; the caller
        awaits it and then sets ``_waiter`` to None, whatever happened."""
        if self._waiter is not None:
            raise RuntimeError(
                f"{func_name}() called while another coroutine is "
                f"already waiting for incoming data"
            )
        assert not self._eof, "waiting for data after EOF"
        if self._paused:
            self._paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        waiter = self._waiter = self._loop.create_future()
        return waiter

    async def _wait_for_data(self, func_name: str) -> None:
        waiter = self._new_waiter(func_name)
        try:
            await waiter
        finally:
            self._waiter = None

    async def _wait_for_bytes(self, func_name: str) -> bool:
        """Wait until something is buffered (True) or EOF (False); the
        stored error is raised once nothing buffered is left before it.

        It waits on the future itself, not through ``_wait_for_data``: a
        reader waiting for its peer (most of a server's connections, most
        of the time) then holds one coroutine frame fewer."""
        while not self._size:
            if self._exception is not None:
                raise self._exception
            if self._eof:
                if self._paused:
                    self._maybe_resume()  # (an empty read resumes, as asyncio's)
                return False
            waiter = self._new_waiter(func_name)
            try:
                await waiter
            finally:
                self._waiter = None
        return True

    # ------------------------------------------------ buffer primitives

    def _take(self, n: int) -> bytes:
        """Remove ``n`` buffered bytes and return them, copied once."""
        self._reach(n)
        chunks = self._queue()
        pos = self._pos
        first = chunks[0]
        avail = len(first) - pos
        if n <= avail:
            data = first[pos : pos + n].tobytes()
            if n == avail:
                chunks.popleft()
                self._pos = 0
            else:
                self._pos = pos + n
            self._size -= n
            return data
        parts = [first[pos:]]
        chunks.popleft()
        need = n - avail
        while need:
            head = chunks[0]
            size = len(head)
            if size <= need:
                parts.append(head)
                chunks.popleft()
                need -= size
            else:
                parts.append(head[:need])
                self._pos = need
                break
        else:
            self._pos = 0
        self._size -= n
        return b"".join(parts)

    def _take_rest(self) -> bytes:
        """Remove and return every buffered byte (STARTTLS: they are the
        start of the peer's TLS handshake)."""
        if not self._size:
            return b""
        data = self._take(self._size)
        self._maybe_resume()
        return data

    def _take_chunk(self) -> memoryview:
        if not self._chunks:
            self._seal_tail()
        chunk = self._queue().popleft()
        if self._pos:
            chunk = chunk[self._pos :]
            self._pos = 0
        self._size -= len(chunk)
        if self._paused:
            self._maybe_resume()
        return chunk

    def _unread(self, parts: list[memoryview]) -> None:
        """Put chunks taken from the front back in front, in order."""
        chunks = self._queue()
        if self._pos:
            chunks[0] = chunks[0][self._pos :]
            self._pos = 0
        chunks.extendleft(reversed(parts))
        self._size += sum(map(len, parts))

    def _find(self, sep: bytes, start: int) -> int:
        """Index of ``sep`` in the buffer at or after ``start``, or -1.

        Only the bytes from ``start`` on are looked at, and the chunk that
        holds ``start`` is found by walking from the nearer end of the chunk
        queue: back from the newest chunk for a search that resumes where
        the last one stopped, forward from the oldest for a new search
        (``start`` 0), so neither costs what is buffered, and reading out
        N buffered chunks line by line is not N * N. Each chunk is searched
        in place; a match across a chunk boundary is looked for in a window
        of the ``len(sep) - 1`` bytes (from ``start`` on) before the
        boundary and as many after it.
        """
        size = self._size
        tail = self._tail
        tail_at = size - len(tail)  # buffer offset of the tail's byte 0
        self._examined += size - start
        if start >= tail_at:
            i = tail.find(sep, start - tail_at)
            return i if i < 0 else tail_at + i
        chunks = self._queue()
        if start < tail_at - start:
            k = 0
            base = -self._pos  # buffer offset of chunks[k]'s byte 0
            while base + len(chunks[k]) <= start:
                base += len(chunks[k])
                k += 1
        else:
            k = len(chunks)
            base = tail_at  # buffer offset of chunks[k]'s byte 0 (-_pos for k=0)
            while base > start:
                k -= 1
                base -= len(chunks[k])
        keep = len(sep) - 1
        pattern = _literal(sep)
        carry = b""  # the last `keep` bytes searched, from `start` on
        lo = start - base
        for k in range(k, len(chunks)):
            chunk = chunks[k]
            if carry:
                i = (carry + chunk[:keep].tobytes()).find(sep)
                if i != -1:
                    return base - len(carry) + i
            m = pattern.search(chunk, lo)
            if m is not None:
                return base + m.start()
            if keep:
                carry = (carry + chunk[max(lo, len(chunk) - keep) :].tobytes())[-keep:]
            base += len(chunk)
            lo = 0
        if carry:
            i = (carry + tail[:keep]).find(sep)
            if i != -1:
                return base - len(carry) + i
        i = tail.find(sep)
        return i if i < 0 else tail_at + i

    # ------------------------------------------------ zero-copy API

    async def read_chunk(self) -> memoryview:
        """The next chunk as a read-only ``memoryview``; empty at EOF.

        A chunk comes as the transport delivered it, except that small
        chunks which arrived while data was buffered come joined into one
        (see ``_COALESCE_BELOW``)."""
        if not self._size and not await self._wait_for_bytes("read_chunk"):
            return _EMPTY
        return self._take_chunk()

    def chunks(self) -> AsyncIterator[memoryview]:
        """``async for chunk in reader.chunks()``: chunks until EOF."""
        return _ChunkIterator(self)

    async def readinto(self, buf: Any) -> int:
        """Copy up to ``len(buf)`` bytes into ``buf``; 0 at EOF."""
        dest = memoryview(buf).cast("B")
        want = len(dest)
        if not want:
            return 0
        if not self._size and not await self._wait_for_bytes("readinto"):
            return 0
        self._reach(want)
        got = 0
        chunks = self._queue()
        while got < want and chunks:
            first = chunks[0]
            pos = self._pos
            n = min(len(first) - pos, want - got)
            dest[got : got + n] = first[pos : pos + n]
            got += n
            if pos + n == len(first):
                chunks.popleft()
                self._pos = 0
            else:
                self._pos = pos + n
        self._size -= got
        self._maybe_resume()
        return got

    # ------------------------------------------------ asyncio API

    def _raise_if_drained(self) -> None:
        """Raise the stored error once no byte is left before it (a read
        of 0 bytes too, as asyncio's)."""
        if self._exception is not None and not self._size:
            raise self._exception

    async def read(self, n: int = -1) -> bytes:
        if n == 0:
            self._raise_if_drained()
            return b""
        if n < 0:
            # Chunks are kept as they came, but runs of small ones are
            # copied into one buffer: a peer that sends a byte per segment
            # would otherwise make this hold a view and a bytes object, over
            # 200 bytes, for each byte.
            parts: list[memoryview] = []
            run: _Sealed | None = None
            try:
                while True:
                    # (read_chunk() inlined, so that a second reader's
                    # RuntimeError names read(), as asyncio's does.)
                    if not self._size and not await self._wait_for_bytes("read"):
                        break
                    chunk = self._take_chunk()
                    if len(chunk) < _COALESCE_BELOW:
                        if run is None:
                            run = _Sealed()
                        run += chunk
                        continue
                    if run is not None:
                        parts.append(memoryview(run).toreadonly())
                        run = None
                    parts.append(chunk)
            except BaseException as exc:
                if run is not None:
                    parts.append(memoryview(run).toreadonly())
                if parts:
                    # The error (a whole unit: see the module docstring),
                    # or cancelled or misused: every byte stays buffered.
                    self._unread(parts)
                raise
            if run is not None:
                parts.append(memoryview(run))
            return b"".join(parts)
        if not self._size and not await self._wait_for_bytes("read"):
            return b""
        data = self._take(min(n, self._size))
        self._maybe_resume()
        return data

    async def readexactly(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if n == 0:
            self._raise_if_drained()
            return b""
        while self._size < n:
            if self._exception is not None:
                raise self._exception  # (a whole unit: the bytes stay buffered)
            if self._eof:
                partial = self._take(self._size) if self._size else b""
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait_for_data("readexactly")
        data = self._take(n)
        self._maybe_resume()
        return data

    async def readline(self) -> bytes:
        sep = b"\n"
        try:
            line = await self.readuntil(sep)
        except asyncio.IncompleteReadError as e:
            return e.partial
        except asyncio.LimitOverrunError as e:
            if self._find(sep, e.consumed) == e.consumed:
                self._discard(e.consumed + len(sep))
            else:
                self._discard(self._size)
            self._maybe_resume()
            raise ValueError(e.args[0])
        return line

    def _discard(self, n: int) -> None:
        if n:
            self._take(n)

    async def readuntil(
        self, separator: _BytesLike | tuple[_BytesLike, ...] = b"\n"
    ) -> bytes:
        chunks = self._chunks
        if chunks and type(separator) is bytes and separator:
            # The hot case (a line of a protocol that reads line by line):
            # the separator ends inside the oldest chunk. No match is earlier
            # than the first one there, not even one across its end.
            # (_take inlined: a call to it and its checks made a line cost
            # 1.9x asyncio's where this costs 1.4x.)
            pos = self._pos
            first = chunks[0]
            m = _literal(separator).search(first, pos)
            if m is not None and m.start() - pos <= self._limit:
                end = m.end()
                self._examined += end - pos
                data = first[pos:end].tobytes()
                if end == len(first):
                    chunks.popleft()
                    self._pos = 0
                else:
                    self._pos = end
                self._size -= end - pos
                if self._paused:
                    self._maybe_resume()
                return data
        if isinstance(separator, tuple):
            if sys.version_info < (3, 13):
                if not separator:
                    # (asyncio's, which takes the tuple's length for a
                    # separator's before 3.13.)
                    raise ValueError("Separator should be at least one-byte string")
                raise TypeError("a tuple of separators needs Python 3.13 (as asyncio)")
            seps = sorted(map(_as_bytes, separator), key=len)
            if not seps:
                raise ValueError("Separator should contain at least one element")
        else:
            seps = [_as_bytes(separator)]
        if not seps[0]:
            raise ValueError("Separator should be at least one-byte string")
        min_len = len(seps[0])
        max_len = len(seps[-1])
        # Bytes before `offset` hold no separator: each pass searches only
        # what arrived since the last one, plus max_len - 1 bytes of overlap.
        offset = 0
        while True:
            if self._size - offset >= min_len:
                match_end = -1
                match_at = -1
                for sep in seps:
                    i = self._find(sep, offset)
                    if i != -1 and (match_end == -1 or i + len(sep) < match_end):
                        match_end = i + len(sep)
                        match_at = i
                if match_end != -1:
                    break
                offset = max(0, self._size + 1 - max_len)
                if offset > self._limit:
                    raise asyncio.LimitOverrunError(
                        "Separator is not found, and chunk exceed the limit", offset
                    )
            if self._exception is not None:
                raise self._exception  # (a whole unit: the bytes stay buffered)
            if self._eof:
                chunk = self._take(self._size) if self._size else b""
                raise asyncio.IncompleteReadError(chunk, None)
            await self._wait_for_data("readuntil")
        if match_at > self._limit:
            raise asyncio.LimitOverrunError(
                "Separator is found, but chunk is longer than limit", match_at
            )
        data = self._take(match_end)
        self._maybe_resume()
        return data

    def __aiter__(self) -> StreamReader:
        return self

    async def __anext__(self) -> bytes:
        val = await self.readline()
        if val == b"":
            raise StopAsyncIteration
        return val



def _feed_through_feed_data(reader: StreamReader, chunk: memoryview) -> None:
    """``_feed_chunk`` of a StreamReader subclass with its own ``feed_data``."""
    reader.feed_data(chunk.tobytes())


class _ChunkIterator:
    __slots__ = ("_reader",)

    def __init__(self, reader: StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _ChunkIterator:
        return self

    async def __anext__(self) -> memoryview:
        reader = self._reader
        # (read_chunk() inlined: one coroutine frame fewer per wait.)
        if not reader._size and not await reader._wait_for_bytes("read_chunk"):
            raise StopAsyncIteration
        return reader._take_chunk()


def _as_bytes(sep: Any) -> bytes:
    """A separator as ``bytes``: asyncio takes any bytes-like object."""
    if type(sep) is bytes:
        return sep
    try:
        return memoryview(sep).tobytes()
    except TypeError:
        raise TypeError(
            f"separator must be a bytes-like object, not {type(sep).__name__}"
        ) from None


_patterns: dict[bytes, re.Pattern[bytes]] = {}


def _literal(sep: bytes) -> re.Pattern[bytes]:
    pat = _patterns.get(sep)
    if pat is None:
        if len(_patterns) > 256:
            _patterns.clear()
        pat = _patterns[sep] = re.compile(re.escape(sep))
    return pat


# -------------------------------------------------------------------- protocol


class _StreamProtocol(ChunkProtocol):
    """Feeds a StreamReader; the asyncio StreamReaderProtocol's counterpart."""

    #: Over TLS, a read's chunks are all buffered even if reading pauses
    #: during them (TLSTransport.set_protocol): one read past the limit.
    takes_whole_reads: Final = True

    __slots__ = (
        "_loop", "_reader", "_client_connected_cb", "_transport", "_task", "_closed",
        "_paused", "_drain_waiters", "_connection_lost", "_lost_error", "_over_ssl", "_writer",
    )

    def __init__(
        self,
        reader: StreamReader,
        client_connected_cb: ClientConnectedCallback | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_event_loop()
        self._reader = reader
        self._client_connected_cb = client_connected_cb
        self._transport: _Transport | None = None
        self._task: asyncio.Task[None] | None = None
        # The close future and the list of drain waiters are made when first
        # wanted: few of a server's idle connections are ever awaited in
        # wait_closed() or drain(), and the two cost about 250 bytes each.
        self._closed: asyncio.Future[None] | None = None
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] | None = None
        self._connection_lost = False
        self._lost_error: BaseException | None = None  # what wait_closed() raises
        self._over_ssl = False
        # A server connection's writer, kept until the connection is lost
        # before Python 3.13, as asyncio's protocol keeps it there (see
        # StreamWriter.__del__).
        self._writer: StreamWriter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(_Transport, transport)
        reader = self._reader
        self._transport = transport
        reader.set_transport(transport)
        self._over_ssl = transport.get_extra_info("sslcontext") is not None
        if self._client_connected_cb is not None:
            writer = StreamWriter(transport, self, reader, self._loop)
            if _KEEP_SERVER_WRITER:
                self._writer = writer
            res = self._client_connected_cb(reader, writer)
            if asyncio.iscoroutine(res):
                self._task = self._loop.create_task(res)
                self._task.add_done_callback(self._on_cb_done)

    def _on_cb_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            if self._transport is not None:
                self._transport.close()
            return
        exc = task.exception()
        if exc is not None:
            self._loop.call_exception_handler({
                "message": "Unhandled exception in client_connected_cb",
                "exception": exc,
                "transport": self._transport,
            })
            if self._transport is not None:
                self._transport.close()

    def chunk_received(self, chunk: memoryview) -> None:
        self._reader._feed_chunk(chunk)

    def data_received(self, data: bytes) -> None:
        # From asyncio's SSLProtocol, in the STARTTLS recipe that predates
        # StreamWriter.start_tls(): ``loop.start_tls(writer.transport,
        # writer.transport.get_protocol(), ctx)``, then the writer is pointed
        # at the TLS transport it returns. (Its bytes are immutable: a view
        # needs no copy.) Bytes come this way only from a TLS layer, whose
        # EOF leaves nothing to keep open (eof_received).
        self._over_ssl = True
        if data:
            self._reader._feed_chunk(memoryview(data))

    def eof_received(self) -> bool:
        self._reader.feed_eof()
        return not self._over_ssl

    def connection_lost(self, exc: BaseException | None) -> None:
        reader = self._reader
        if exc is None:
            reader.feed_eof()
        else:
            reader.set_exception(exc)
        if not self._connection_lost:
            self._connection_lost = True
            if exc is not None and not isinstance(exc, LocalAbortError):
                # (wait_closed() after our own abort() is not a failure.)
                self._lost_error = exc
            if self._closed is not None:
                self._settle_closed(self._closed)
        for waiter in self._drain_waiters or ():
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        self._task = None
        self._writer = None

    def _settle_closed(self, closed: asyncio.Future[None]) -> None:
        if closed.done():
            return
        if self._lost_error is None:
            closed.set_result(None)
        else:
            closed.set_exception(self._lost_error)
            closed.exception()  # mark retrieved, as asyncio does

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for waiter in self._drain_waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    async def _drain_helper(self) -> None:
        if self._connection_lost:
            raise ConnectionResetError("Connection lost")
        if not self._paused:
            return
        waiter = self._loop.create_future()
        waiters = self._drain_waiters
        if waiters is None:
            waiters = self._drain_waiters = []
        waiters.append(waiter)
        try:
            await waiter
        finally:
            waiters.remove(waiter)

    def _get_close_waiter(self, stream: object = None) -> asyncio.Future[None]:
        # ``stream``: the writer, which asyncio's StreamWriter passes to
        # asyncio's protocol (unused here: one close future per connection).
        closed = self._closed
        if closed is None:
            closed = self._closed = self._loop.create_future()
            if self._connection_lost:
                self._settle_closed(closed)
        return closed

    def _upgraded(self, transport: TLSTransport) -> None:
        """STARTTLS has begun: the stream runs over the TLS layer from now on."""
        self._transport = transport
        self._over_ssl = True
        if self._reader is not None:
            self._reader._transport = transport


class StreamWriter:
    """A drop-in for ``asyncio.StreamWriter``.

    ``write`` and ``writelines`` return ``None`` when the bytes were accepted
    at once, or a ``slabnet.WriteRequest`` to await when they had to queue.
    """

    def __init__(
        self,
        transport: _Transport,
        protocol: _StreamProtocol,
        reader: StreamReader | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._reader = reader
        self._loop = loop

    def __del__(self, warnings: Any = warnings) -> None:
        # As asyncio's writer does (3.11.5 on): one dropped without close()
        # closes its connection, gracefully, and says so. A client's writer
        # is the caller's alone. A server connection's is kept by its
        # protocol until the connection is lost before 3.13, as asyncio's
        # protocol keeps it there: a handler may give the reader to a task
        # and return, and the task still gets every byte (asyncio 3.13
        # keeps neither, and so closes such a connection at once). From
        # 3.13 on, a handler that returns without close() ends its
        # connection, as asyncio's does.
        transport = getattr(self, "_transport", None)
        if transport is None or transport.is_closing():
            return  # (or __init__ failed)
        if self._loop.is_closed():
            warnings.warn(f"unclosed {self!r}: loop is closed", ResourceWarning)
            return
        message = f"unclosed {self!r}"
        self.close()
        warnings.warn(message, ResourceWarning, source=self)

    def __repr__(self) -> str:
        info = [self.__class__.__name__, f"transport={self._transport!r}"]
        if self._reader is not None:
            info.append(f"reader={self._reader!r}")
        return f"<{' '.join(info)}>"

    @property
    def transport(self) -> _Transport:
        return self._transport

    def write(self, data: bytes | bytearray | memoryview) -> WriteRequest | None:
        return self._transport.write(data)

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> WriteRequest | None:
        return self._transport.writelines(data)

    def write_eof(self) -> None:
        return self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def close(self) -> None:
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    async def wait_closed(self) -> None:
        # Shielded: the close future is the connection's, shared by every
        # waiter. asyncio's awaits it bare, so one cancelled wait_closed()
        # (a timeout around it) cancels it, and every later one raises
        # CancelledError at once, in a task nobody cancelled. The writer
        # passes itself, as asyncio's does: one built on asyncio's
        # StreamReaderProtocol (nats-py wraps loop.start_tls()'s transport
        # so) takes no call without it.
        await asyncio.shield(self._protocol._get_close_waiter(self))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    async def drain(self) -> None:
        reader = self._reader
        if reader is not None and reader._exception is not None:
            raise reader._exception
        protocol = self._protocol
        closing = self._transport.is_closing()
        if not (protocol._paused or protocol._connection_lost or closing):
            return  # the common case: nothing to wait for
        if closing:
            # Let connection_lost run first, as asyncio does.
            await asyncio.sleep(0)
        await self._protocol._drain_helper()

    async def start_tls(
        self,
        sslcontext: _ssl.SSLContext,
        *,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
        ssl_ragged_eof: bool = True,
        ssl_session: _ssl.SSLSession | None = None,
    ) -> None:
        """Upgrade the connection to TLS (STARTTLS), client or server side.

        ``ssl_ragged_eof`` and ``ssl_session`` as for ``open_connection``."""
        server_side = self._protocol._client_connected_cb is not None
        await self.drain()
        transport = self._transport
        reader = self._reader
        already_read = b"" if reader is None else reader._take_rest()
        try:
            tls, handshake = transport.upgrade_tls(
                sslcontext,
                already_read=already_read,
                server_side=server_side,
                server_hostname=server_hostname,
                ssl_handshake_timeout=ssl_handshake_timeout,
                ssl_shutdown_timeout=ssl_shutdown_timeout,
                ssl_ragged_eof=ssl_ragged_eof,
                ssl_session=ssl_session,
            )
        except BaseException:
            # Refused before anything changed (a bad argument, a closed
            # connection): the bytes are still the app's to read.
            if already_read and reader is not None:
                reader._unread([memoryview(already_read)])
            raise
        assert isinstance(tls, TLSTransport)
        # From now on every write goes through the TLS layer: one made while
        # the handshake runs is encrypted once it is done, never sent plain.
        self._transport = tls
        self._protocol._upgraded(tls)
        await awaiting_handshake(tls, handshake)


# -------------------------------------------------------------------- openers


def _ssl_args(
    ssl: _ssl.SSLContext | bool | None,
    server_side: bool,
    host: str | None,
    server_hostname: str | None,
    ssl_handshake_timeout: float | None,
    ssl_shutdown_timeout: float | None,
    ssl_ragged_eof: bool = True,
    ssl_session: _ssl.SSLSession | None = None,
) -> tuple[_ssl.SSLContext | None, str | None]:
    if server_side and isinstance(ssl, bool):
        # (asyncio's words; False too: a server's ssl is a context or None.)
        raise TypeError("ssl argument must be an SSLContext or None")
    if not ssl:
        if server_hostname is not None:
            raise ValueError("server_hostname is only meaningful with ssl")
        if ssl_handshake_timeout is not None:
            raise ValueError("ssl_handshake_timeout is only meaningful with ssl")
        if ssl_shutdown_timeout is not None:
            raise ValueError("ssl_shutdown_timeout is only meaningful with ssl")
        # (slabnet's own: refused too, or a caller who forgot ssl= would
        # get a plaintext connection for a session it meant to resume.)
        if ssl_session is not None:
            raise ValueError("ssl_session is only meaningful with ssl")
        if not ssl_ragged_eof:
            raise ValueError("ssl_ragged_eof is only meaningful with ssl")
        return None, None
    # Before connecting (asyncio checks in its SSL protocol, after).
    check_ssl_timeout("ssl_handshake_timeout", ssl_handshake_timeout, 0.0)
    check_ssl_timeout("ssl_shutdown_timeout", ssl_shutdown_timeout, 0.0)
    if isinstance(ssl, _ssl.SSLContext):
        ctx = ssl
    elif ssl is True:  # (a client's only: see above)
        ctx = _ssl.create_default_context()
    else:
        allowed = "an ssl.SSLContext or None" if server_side else "an ssl.SSLContext, True or None"
        raise TypeError(f"ssl must be {allowed}, not {type(ssl).__name__}")
    if server_side:
        return ctx, None
    if server_hostname is None:
        # As asyncio's create_connection()/create_unix_connection(), on both
        # loops, whatever the context's check_hostname: with no host to take
        # the name from (a Unix path, sock=) the caller must say which name
        # to send, or '' for none, so code that runs here runs on asyncio.
        if not host:
            raise ValueError("You must set server_hostname when using ssl without a host")
        server_hostname = host
    return ctx, server_hostname or None


async def _connect(
    create: Callable[..., Awaitable[tuple[asyncio.BaseTransport, Any]]],
    address: tuple[Any, ...],
    host: str | None,
    limit: int,
    ssl: _ssl.SSLContext | bool | None,
    server_hostname: str | None,
    ssl_handshake_timeout: float | None,
    ssl_shutdown_timeout: float | None,
    ssl_ragged_eof: bool,
    ssl_session: _ssl.SSLSession | None,
    kwds: dict[str, Any],
) -> tuple[StreamReader, StreamWriter]:
    loop = asyncio.get_running_loop()
    ctx, hostname = _ssl_args(
        ssl, False, host, server_hostname, ssl_handshake_timeout, ssl_shutdown_timeout,
        ssl_ragged_eof, ssl_session,
    )
    reader = StreamReader(limit=limit, loop=loop)
    protocol = _StreamProtocol(reader, loop=loop)
    waiter: asyncio.Future[None] = loop.create_future()
    slab = SlabProtocol(
        protocol, loop=loop, ssl=ctx, server_side=False, server_hostname=hostname,
        ssl_handshake_timeout=ssl_handshake_timeout,
        ssl_shutdown_timeout=ssl_shutdown_timeout,
        ssl_ragged_eof=ssl_ragged_eof, ssl_session=ssl_session,
        handshake_waiter=waiter,
    )
    if ctx is not None:
        # The TLS engine is made before connecting, so a server_hostname,
        # context or session it refuses raises here, with no connection
        # made, as asyncio's wrap_bio raises before its transport exists.
        # Made in connection_made, its failure aborted the transport the
        # loop had just made over a caller's sock=: closed (asyncio leaves
        # it to the caller) and, on uvloop, left holding its old descriptor
        # number, which the socket's finalizer closed later, whatever file
        # had taken that number by then.
        try:
            slab.upper.prepare()
        except BaseException:
            waiter.cancel()  # (see below)
            raise
    made: list[SlabProtocol] = []  # (the loops call the factory once)

    def factory() -> SlabProtocol:
        made.append(slab)
        return slab

    try:
        raw, _ = await create(factory, *address, **kwds)
    except BaseException:
        if made:  # cancelled, maybe after connection_made (uvloop)
            slab.abandon()
        # Nobody will await it. (uvloop makes the protocol before it
        # connects: a refused connect leaves the TLS layer waiting on it, in
        # a cycle through the waiter's done-callback, until it is done.)
        waiter.cancel()
        raise
    try:
        await waiter
    except BaseException:
        raw.abort()  # type: ignore[attr-defined]
        # The error is the waiter's too, and its traceback holds this frame:
        # without these names the frame refers to no waiter, and the failed
        # connection (over TLS its SSLObject) is no cycle for the collector.
        del waiter, made, _, slab
        raise
    transport = protocol._transport
    assert transport is not None
    return reader, StreamWriter(transport, protocol, reader, loop)


async def open_connection(
    host: str | None = None,
    port: int | str | None = None,
    *,
    limit: int = _DEFAULT_LIMIT,
    ssl: _ssl.SSLContext | bool | None = None,
    server_hostname: str | None = None,
    ssl_handshake_timeout: float | None = None,
    ssl_shutdown_timeout: float | None = None,
    ssl_ragged_eof: bool = True,
    ssl_session: _ssl.SSLSession | None = None,
    **kwds: Any,
) -> tuple[StreamReader, StreamWriter]:
    """Like ``asyncio.open_connection``; TLS runs through slabnet's engine.

    Extra keywords: ``ssl_ragged_eof`` (default True, as asyncio) accepts a
    TCP FIN without close_notify as EOF, after every byte before it; False
    raises ``TLSTruncatedError`` there instead (after every byte, and after
    what we queued was sent). ``ssl_session`` resumes a session
    (``ssl_object.session`` of an earlier connection). The rest go to
    ``loop.create_connection``.
    """
    loop = asyncio.get_running_loop()
    return await _connect(
        loop.create_connection, (host, port), host, limit, ssl, server_hostname,
        ssl_handshake_timeout, ssl_shutdown_timeout, ssl_ragged_eof, ssl_session, kwds,
    )


async def open_unix_connection(
    path: str | None = None,
    *,
    limit: int = _DEFAULT_LIMIT,
    ssl: _ssl.SSLContext | bool | None = None,
    server_hostname: str | None = None,
    ssl_handshake_timeout: float | None = None,
    ssl_shutdown_timeout: float | None = None,
    ssl_ragged_eof: bool = True,
    ssl_session: _ssl.SSLSession | None = None,
    **kwds: Any,
) -> tuple[StreamReader, StreamWriter]:
    """Like ``asyncio.open_unix_connection``."""
    loop = asyncio.get_running_loop()
    return await _connect(
        loop.create_unix_connection, (path,), None, limit, ssl, server_hostname,
        ssl_handshake_timeout, ssl_shutdown_timeout, ssl_ragged_eof, ssl_session, kwds,
    )


def _server_factory(
    client_connected_cb: ClientConnectedCallback,
    limit: int,
    ssl: _ssl.SSLContext | bool | None,
    ssl_handshake_timeout: float | None,
    ssl_shutdown_timeout: float | None,
    ssl_ragged_eof: bool,
) -> Callable[[], SlabProtocol]:
    loop = asyncio.get_running_loop()
    ctx, _ = _ssl_args(
        ssl, True, None, None, ssl_handshake_timeout, ssl_shutdown_timeout, ssl_ragged_eof
    )
    if limit <= 0:
        # Refused here, before the server listens: asyncio's StreamReader
        # refuses it in the factory, so its server accepts and then fails
        # every connection (on uvloop the client waits for good).
        raise ValueError("Limit cannot be <= 0")

    def factory() -> SlabProtocol:
        reader = StreamReader(limit=limit, loop=loop)
        protocol = _StreamProtocol(reader, client_connected_cb, loop=loop)
        return SlabProtocol(
            protocol, loop=loop, ssl=ctx, server_side=True,
            ssl_handshake_timeout=ssl_handshake_timeout,
            ssl_shutdown_timeout=ssl_shutdown_timeout,
            ssl_ragged_eof=ssl_ragged_eof,
        )

    return factory


async def start_server(
    client_connected_cb: ClientConnectedCallback,
    host: str | Iterable[str] | None = None,
    port: int | str | None = None,
    *,
    limit: int = _DEFAULT_LIMIT,
    ssl: _ssl.SSLContext | None = None,
    ssl_handshake_timeout: float | None = None,
    ssl_shutdown_timeout: float | None = None,
    ssl_ragged_eof: bool = True,
    **kwds: Any,
) -> asyncio.Server:
    """Like ``asyncio.start_server``; returns the loop's ``Server``.

    ``ssl_ragged_eof`` as for ``open_connection``.
    """
    loop = asyncio.get_running_loop()
    factory = _server_factory(
        client_connected_cb, limit, ssl, ssl_handshake_timeout, ssl_shutdown_timeout,
        ssl_ragged_eof,
    )
    server = await loop.create_server(factory, host, port, **kwds)  # type: ignore[arg-type]
    # Now, not at its first connection: an abort_clients() taken before
    # (a signal handler's) is ours too.
    _abort_ours_first(server)
    return server


async def start_unix_server(
    client_connected_cb: ClientConnectedCallback,
    path: str | None = None,
    *,
    limit: int = _DEFAULT_LIMIT,
    ssl: _ssl.SSLContext | None = None,
    ssl_handshake_timeout: float | None = None,
    ssl_shutdown_timeout: float | None = None,
    ssl_ragged_eof: bool = True,
    **kwds: Any,
) -> asyncio.Server:
    """Like ``asyncio.start_unix_server``."""
    loop = asyncio.get_running_loop()
    factory = _server_factory(
        client_connected_cb, limit, ssl, ssl_handshake_timeout, ssl_shutdown_timeout,
        ssl_ragged_eof,
    )
    server = await loop.create_unix_server(factory, path, **kwds)
    _abort_ours_first(server)  # (as start_server's)
    return server

