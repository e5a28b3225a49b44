"""The asyncio shell: SlabProtocol (loop-facing) and SlabTransport (app-facing).

Theory of operation
-------------------
slabnet runs over the event loop's plain TCP (or Unix) transport, on the
default asyncio loop and on uvloop alike, and adds three things the loops do
not do:

Reads. ``SlabProtocol`` is an ``asyncio.BufferedProtocol``: the loop reads
straight into a reservation of the loop's ``ReadSlab`` and the protocol hands
the resulting read-only view to the application's ``ChunkProtocol``. With
TLS, the view is copied into the ``TLSEngine``'s incoming BIO at once (so
ciphertext never pins a slab) and the engine's coalesced plaintext chunks,
each in an exact-size buffer, go to the application instead.

Writes. The loop's transports copy or join data they cannot send at once and
cannot tell which write has reached the kernel. slabnet sends itself, on its
own duplicate of the socket's file descriptor (the loops refuse
``add_writer`` on a descriptor their transport owns, and a duplicate is the
public way to wait for writability without touching their internals). The
loop's transport never writes; it still reads, and performs ``write_eof`` and
the final close, after slabnet's queue is empty. If the loop closes its
transport first (``Server.close_clients()``), the duplicate still holds the
connection: the queue goes out on it, then it is closed (``_outlive_raw``).

* A write with nothing queued before it goes straight to ``send``; if the
  kernel takes it all, no object is made and ``write`` returns ``None``.
* A small write (below ``BufferPool.small_limit``) is copied into the loop's
  pool and sent, with every other small write of the same loop iteration, by
  one ``sendmsg`` from a ``call_soon`` callback -- or at once when 64 KiB
  have gathered.
* What the kernel does not take waits in an ``OutQueue`` (memoryview slices,
  no joins), and the caller gets a ``WriteRequest``.
* TLS: plaintext written during an iteration is encrypted in one
  ``write_many`` at the end of it, so records are as full as possible and the
  ciphertext goes out in one send.

Lifecycle is one enum with one gate (``_set_state``); see ``_TRANSITIONS``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import ssl
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, cast

from ._errors import (
    HandshakeTimeoutError,
    LocalAbortError,
    ShutdownTimeoutError,
    TLSTruncatedError,
)
from ._pool import BufferPool
from ._slab import ReadSizer, ReadSlab, _Sealed, _Slab
from ._write import OutQueue, WriteRequest

if TYPE_CHECKING:
    from ._tls import TLSEngine

__all__ = [
    "ChunkProtocol",
    "SlabProtocol",
    "SlabTransport",
    "get_pool",
    "get_slab",
]

log = logging.getLogger("slabnet")

#: asyncio's FlowControlMixin default high-water mark; low is a quarter.
DEFAULT_HIGH_WATER: Final = 64 * 1024

#: Flush gathered small writes before the end of the iteration once this
#: much is waiting (issue 4: "or earlier when the pooled bytes reach 64 KiB").
CORK_LIMIT: Final = 64 * 1024

#: asyncio's defaults (asyncio.constants): 60 s handshake, 30 s shutdown.
SSL_HANDSHAKE_TIMEOUT: Final = 60.0
SSL_SHUTDOWN_TIMEOUT: Final = 30.0

#: TLS: the most one read takes in once the app has paused reading (see
#: SlabProtocol.get_buffer); that read also pauses the socket.
_PAUSED_READ: Final = 1024

_SEND_RETRY: Final = (BlockingIOError, InterruptedError)

#: asyncio's LOG_THRESHOLD_FOR_CONNLOST_WRITES: writes on a closed connection
#: are dropped silently, then each one from the fifth on logs a warning.
_DROPPED_WRITES_LOG: Final = 5

#: Buffers nobody can change while their view waits in the queue: ``bytes``,
#: and the read slab (a region is never rewritten while a view of it lives),
#: so a chunk read from one connection can be queued on another uncopied.
#: A read-only view of anything else (a ``bytearray`` behind ``toreadonly()``)
#: may still change through a writable view or the object: it is copied.
_IMMUTABLE: Final = frozenset({bytes, _Slab, _Sealed})


# ---------------------------------------------------------------- per loop


class _LoopResources:
    __slots__ = ("slab", "pool", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.slab = ReadSlab(loop=loop)
        self.pool = BufferPool()


_resources: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopResources] = (
    weakref.WeakKeyDictionary()
)


def _loop_resources(loop: asyncio.AbstractEventLoop) -> _LoopResources:
    res = _resources.get(loop)
    if res is None:
        res = _resources[loop] = _LoopResources(loop)
    return res


def get_slab(loop: asyncio.AbstractEventLoop | None = None) -> ReadSlab:
    """The read slab shared by every slabnet connection on ``loop``."""
    return _loop_resources(loop or asyncio.get_running_loop()).slab


def get_pool(loop: asyncio.AbstractEventLoop | None = None) -> BufferPool:
    """The small-write pool shared by every slabnet connection on ``loop``."""
    return _loop_resources(loop or asyncio.get_running_loop()).pool


# ---------------------------------------------------------------- interface



class ChunkProtocol(asyncio.BaseProtocol):
    """What slabnet calls on the application.

    Call order: ``connection_made(transport)`` (after the TLS handshake, if
    any), then ``chunk_received(chunk)`` any number of times, then
    ``eof_received()`` at most once, then ``connection_lost(exc)``.
    ``pause_writing``/``resume_writing`` bracket periods where the write
    buffer is above its high-water mark.

    ``chunk`` is a read-only, non-empty ``memoryview``. A plain TCP chunk may
    be a view of the loop's read slab: keeping it keeps that slab alive (see
    ``slabnet.memory_stats()``); copy it (``bytes(chunk)``) to keep a few
    bytes for long. A TLS chunk owns its exact-size buffer.
    """

    __slots__ = ()

    def chunk_received(self, chunk: memoryview) -> None:
        """Called with each chunk of bytes, in order."""

    def eof_received(self) -> bool | None:
        """The peer will send nothing more. Return True to keep writing."""
        return None


# ---------------------------------------------------------------- lifecycle


class _State(enum.Enum):
    HANDSHAKING = "handshaking"  # TCP up, TLS handshake in progress
    OPEN = "open"
    CLOSING = "closing"  # close() called: flushing, TLS shutdown
    CLOSED = "closed"  # connection_lost delivered


# The state the per-read path checks, as a module global (one lookup).
_HANDSHAKING: Final = _State.HANDSHAKING

_TRANSITIONS: Final = {
    _State.HANDSHAKING: {_State.OPEN, _State.CLOSING, _State.CLOSED},
    _State.OPEN: {_State.HANDSHAKING, _State.CLOSING, _State.CLOSED},  # STARTTLS
    _State.CLOSING: {_State.CLOSED},
    _State.CLOSED: set(),
}


class SlabTransport(asyncio.Transport):
    """The transport an application protocol sees. Made by ``SlabProtocol``."""

    def __init__(self, proto: SlabProtocol, raw: asyncio.Transport) -> None:
        super().__init__()
        self._proto = proto
        self._raw = raw
        self._loop = proto._loop
        self._state = _State.HANDSHAKING if proto._tls is not None else _State.OPEN
        self._closing = False  # derived from _state by _set_state: a hot check
        self._pool = proto._pool
        self._out = OutQueue()
        # Our own duplicate of the descriptor, for send and for waiting.
        raw_sock = raw.get_extra_info("socket")
        self._sock: socket.socket | None = socket.socket(fileno=_dup(raw_sock))
        self._sock.setblocking(False)
        self._wfd = self._sock.fileno()
        self._waiting_writable = False
        self._flush_scheduled = False
        self._corked = 0  # pooled bytes waiting for the end-of-iteration flush
        self._tls_plain: list[memoryview] = []  # plaintext for the next flush
        self._tls_plain_bytes = 0
        self._tls_reqs: list[WriteRequest] = []  # waiting for encryption
        # Requests whose plaintext the engine holds until a renegotiation
        # ends (TLSEngine.held_plaintext): tracked once it is encrypted.
        self._tls_held: list[WriteRequest] = []
        self._eof_requested = False
        self._eof_sent = False
        self._error: BaseException | None = None
        self._dropped_writes = 0  # writes after close()/abort()/the connection went
        self._raw_gone = False  # the loop closed its transport with bytes queued
        self._high = DEFAULT_HIGH_WATER
        self._low = DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._reading_paused = False
        self._raw_paused = False  # TLS: pause_reading() pauses the socket lazily
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------ lifecycle gate

    def _set_state(self, new: _State) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"slabnet transport: {self._state.value} -> {new.value}")
        self._state = new
        self._closing = new is _State.CLOSING or new is _State.CLOSED

    def is_closing(self) -> bool:
        return self._closing

    # ------------------------------------------------ info

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        tls = self._proto._tls
        if tls is not None and name in _TLS_EXTRA:
            return tls.get_extra_info(name, default)
        return self._raw.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        app: asyncio.BaseProtocol = self._proto._app
        return app

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._proto._set_app(protocol)

    # ------------------------------------------------ reading

    def is_reading(self) -> bool:
        return not self._reading_paused and self._state is not _State.CLOSED

    def pause_reading(self) -> None:
        if self._reading_paused or self._state is _State.CLOSED:
            return
        self._reading_paused = True
        if self._proto._tls is None:
            self._pause_raw()
        # TLS: the socket is paused by the next read (buffer_updated), so a
        # stream drained before the next read costs no epoll_ctl calls.

    def _pause_raw(self) -> None:
        self._raw_paused = True
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        if not self._reading_paused or self._state is _State.CLOSED:
            return
        self._reading_paused = False
        proto = self._proto
        tls = proto._tls
        if self._raw_paused:  # (paused as plain TCP, even if STARTTLS came since)
            self._raw_paused = False
            if not proto._raw_eof:
                self._raw.resume_reading()
            if tls is not None:
                self._loop.call_soon(proto._tls_pump)
        elif tls is not None and tls.buffered_ciphertext:
            # Records that arrived before the pause are delivered first.
            self._loop.call_soon(proto._tls_pump)

    # ------------------------------------------------ writing: public

    def write(self, data: Any) -> WriteRequest | None:  # type: ignore[override]
        """Send ``data``; None if accepted at once, else a WriteRequest."""
        # The hot path: plain bytes on an open connection, few lookups.
        view = data if type(data) is bytes else _as_bytes_view(data)
        n = len(view)
        if not n:
            return None
        if self._state is not _State.OPEN or self._eof_requested or self._sock is None:
            if not self._check_writable():
                return None
        if self._proto._tls is not None:
            return self._tls_write(memoryview(view), n)
        out = self._out
        if n < self._pool.small_limit:
            # Gather: copy into the pool; one sendmsg at the end of the
            # iteration carries every small write of this iteration.
            region = self._pool.alloc(n)
            region[:] = view
            blocked = self._waiting_writable
            out.append(region)
            self._corked += n
            if blocked:
                req = out.request(n)
                self._check_pause()
                return req
            if self._corked >= CORK_LIMIT:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush_soon)
            if out.queued > self._high:
                self._check_pause()
            return None
        # A large write is never copied on its way to the kernel; only what
        # has to wait is, and only when the caller could change it meanwhile.
        view = memoryview(view)
        if not out:
            # Nothing before it: try the kernel directly (seed 002).
            sock = self._sock
            assert sock is not None
            try:
                sent = sock.send(view)
            except _SEND_RETRY:
                sent = 0
            except OSError as exc:
                self._write_failed(exc)
                return None
            out.passed(sent)
            if sent == n:
                return None
            out.append(_keep(view[sent:]))
            req = out.request(n - sent)
            self._wait_writable()
            self._check_pause()
            return req
        # Pooled small writes (or a blocked queue) are ahead of it.
        out.append(_keep(view))  # the caller may reuse its buffer meanwhile
        if not self._waiting_writable:
            self._flush()  # one sendmsg for the pooled writes and this one
            if not out:
                return None
        req = out.request(n)
        self._check_pause()
        return req

    def writelines(self, list_of_data: Iterable[Any]) -> WriteRequest | None:  # type: ignore[override]
        """Write several buffers; they go out with one ``sendmsg``."""
        views = [v for v in map(_as_bytes_view, list_of_data) if v.nbytes]
        if not views:
            return None
        if not self._check_writable():
            return None
        total = sum(v.nbytes for v in views)
        if self._proto._tls is not None:
            req = None
            for v in views:
                req = self._tls_write(v, v.nbytes) or req
            return req
        out = self._out
        for v in views:
            out.append(_keep(v))
        if not self._waiting_writable:
            self._flush()
            if not out:
                return None
        req = out.request(total)
        self._check_pause()
        return req

    def can_write_eof(self) -> bool:
        return self._proto._tls is None and self._raw.can_write_eof()

    def write_eof(self) -> None:
        if self._proto._tls is not None:
            raise NotImplementedError("write_eof() is not supported on TLS connections")
        if self._eof_requested or self._state is _State.CLOSED:
            return
        self._eof_requested = True
        if not self._out and not self._waiting_writable:
            self._send_eof()
        else:
            self._flush()

    def get_write_buffer_size(self) -> int:
        return self._out.queued + self._tls_plain_bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._check_pause()

    # ------------------------------------------------ closing

    def close(self) -> None:
        if self._state in (_State.CLOSING, _State.CLOSED):
            return
        if self._state is _State.HANDSHAKING:
            # Nothing was exchanged with the application yet.
            self._abort(LocalAbortError("closed during the TLS handshake"))
            return
        self._set_state(_State.CLOSING)
        proto = self._proto
        tls = proto._tls
        if tls is not None:
            try:
                self._tls_flush_plain()
                tls.start_shutdown()
            except Exception as exc:
                # The engine broke on an earlier write (ssl.SSLError): no
                # close_notify can follow. close() never raises (asyncio's
                # does not): the connection ends with that error instead.
                self._abort(exc)
                return
            self._send_tls_output()
            timeout = proto._shutdown_timeout
            self._timer = self._loop.call_later(timeout, self._shutdown_timed_out)
            if self._reading_paused:
                self._reading_paused = False
                if self._raw_paused:
                    self._raw_paused = False
                    self._raw.resume_reading()
            # What arrived while reading was paused (it may hold the peer's
            # close_notify), and plaintext the shutdown took out of OpenSSL,
            # is read now: nothing new may ever arrive to start the pump.
            self._loop.call_soon(proto._tls_pump)
            return
        if not self._raw_paused and not proto._raw_eof:
            self._pause_raw()
        self._maybe_close_raw()

    def abort(self) -> None:
        """Close at once, dropping queued data.

        Unlike asyncio (where the reader then sees EOF), every waiter -- a
        pending read, ``drain()``, a ``WriteRequest`` -- raises
        ``ConnectionAbortedError``: data was dropped, so EOF would be a lie.
        Bytes that had already arrived are still read first.
        """
        self._abort(LocalAbortError("connection aborted locally (transport.abort())"))

    def _abort(self, exc: BaseException) -> None:
        if self._state is _State.CLOSED:
            return
        if self._error is None:
            self._error = exc
        self._fail_writes(exc)
        self._close_sock()
        if self._state is not _State.CLOSING:
            self._set_state(_State.CLOSING)
        if self._raw_gone:
            # The loop's transport is closed already: it will not call back.
            self._loop.call_soon(self._proto.connection_lost, None)
            return
        self._raw.abort()

    def _close_after(self, exc: BaseException) -> None:
        """TLS: the peer's FIN came without close_notify and the engine
        refuses that (strict). The read side is over, ours is not: send what
        is queued (the app wrote it before the FIN arrived), then close, and
        report ``exc`` in connection_lost. Bounded by the shutdown timeout,
        like a graceful close."""
        if self._error is None:
            self._error = exc
        self._set_state(_State.CLOSING)
        self._timer = self._loop.call_later(
            self._proto._shutdown_timeout, self._shutdown_timed_out
        )
        self._maybe_close_raw()

    def _shutdown_timed_out(self) -> None:
        self._timer = None
        self._abort(ShutdownTimeoutError(
            f"TLS shutdown did not complete within {self._proto._shutdown_timeout} s"
        ))

    def _maybe_close_raw(self) -> None:
        # CLOSING and nothing left to send: hand the close to the loop.
        if self._out or self._tls_plain:
            return
        if self._raw_gone:
            self._close_sock()  # the last descriptor: the kernel closes now
            self._loop.call_soon(self._proto.connection_lost, None)
            return
        if self._proto._tls is not None and self._state is _State.CLOSING:
            if not self._proto._tls_closed:
                return  # waiting for the peer's close_notify
        self._close_sock()
        self._raw.close()

    def _close_sock(self) -> None:
        sock = self._sock
        if sock is None:
            return
        if self._waiting_writable:
            self._waiting_writable = False
            self._loop.remove_writer(self._wfd)
        self._sock = None
        sock.close()

    # ------------------------------------------------ writing: internals

    def _check_writable(self) -> bool:
        """False if a write must be dropped; raises after ``write_eof()``.

        As asyncio's transports do, a write after ``close()``, ``abort()`` or
        the loss of the connection is dropped without an error (``drain()``
        raises the connection's error instead), and each one from the fifth
        on logs a warning. (uvloop raises RuntimeError once its handle is
        closed; slabnet follows the default loop on both loops.)
        """
        if self._eof_requested:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._closing or self._sock is None:
            self._dropped_writes += 1
            if self._dropped_writes >= _DROPPED_WRITES_LOG:
                log.warning("%r: write() on a closed connection: data dropped", self)
            return False
        return True

    def _tls_write(self, view: memoryview, n: int) -> WriteRequest | None:
        # Encrypted at the end of the iteration: the caller may reuse its
        # buffer before that.
        self._tls_plain.append(_keep(view))
        self._tls_plain_bytes += n
        req = None
        if self._waiting_writable or self._state is _State.HANDSHAKING:
            # Its ciphertext position is known once it is encrypted.
            req = WriteRequest(n, -1)
            self._tls_reqs.append(req)
        if self._state is _State.OPEN:
            if self._tls_plain_bytes >= CORK_LIMIT:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush_soon)
        self._check_pause()
        return req

    def _tls_flush_plain(self) -> None:
        """Encrypt the plaintext gathered this iteration and queue it."""
        plain = self._tls_plain
        if not plain:
            return
        tls = self._proto._tls
        assert tls is not None
        self._tls_plain = []
        self._tls_plain_bytes = 0
        tls.write_many(plain)
        out = self._out
        # A large write comes out in several pieces (TLSEngine.WRITE_SLICE);
        # each is queued as it is, never joined.
        for piece in tls.data_to_send_many():
            out.append(memoryview(piece))
        reqs = self._tls_reqs
        if reqs:
            self._tls_reqs = []
            self._track_encrypted(reqs)

    def _track_encrypted(self, reqs: list[WriteRequest]) -> None:
        """Make ``reqs`` complete once the ciphertext queued so far is sent,
        unless the engine still holds plaintext (a TLS 1.2 renegotiation is
        in progress): then theirs is among it, or behind it, and they wait
        for ``_send_tls_output`` after the read that ends the renegotiation."""
        tls = self._proto._tls
        assert tls is not None
        if tls.held_plaintext:
            self._tls_held.extend(reqs)
            return
        if self._tls_held:
            reqs = self._tls_held + reqs
            self._tls_held = []
        for req in reqs:
            self._out.track(req)

    def _send_tls_output(self) -> None:
        tls = self._proto._tls
        assert tls is not None
        pieces = tls.data_to_send_many()
        out = self._out
        for piece in pieces:
            out.append(memoryview(piece))
        if self._tls_held and not tls.held_plaintext:
            self._track_encrypted([])
        if pieces and not self._waiting_writable:
            self._flush()

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        if self._state is _State.CLOSED:
            return
        self._flush()

    def _flush(self) -> None:
        """Send what is queued; wait for writability if the kernel is full."""
        if self._tls_plain and self._state is not _State.HANDSHAKING:
            try:
                self._tls_flush_plain()
            except Exception as exc:
                # The engine refused to encrypt (ssl.SSLError): nothing more
                # can be sent in order. The connection ends with that error,
                # which every waiter gets, instead of escaping to the loop.
                self._abort(exc)
                return
        self._corked = 0
        out = self._out
        sock = self._sock
        if sock is None:
            return
        while out:
            bufs = out.buffers()
            try:
                if len(bufs) == 1:
                    sent = sock.send(bufs[0])
                else:
                    sent = sock.sendmsg(bufs)
            except _SEND_RETRY:
                break
            except OSError as exc:
                self._write_failed(exc)
                return
            if out.sent(sent) or sent < sum(b.nbytes for b in bufs):
                break
        if out:
            self._wait_writable()
        elif self._waiting_writable:
            self._waiting_writable = False
            self._loop.remove_writer(self._wfd)
        self._check_pause()
        if not out:
            if self._eof_requested and not self._eof_sent:
                self._send_eof()
            if self._state is _State.CLOSING:
                self._maybe_close_raw()

    def _on_writable(self) -> None:
        self._flush()

    def _wait_writable(self) -> None:
        if not self._waiting_writable:
            self._waiting_writable = True
            self._loop.add_writer(self._wfd, self._on_writable)

    def _check_pause(self) -> None:
        size = self._out.queued + self._tls_plain_bytes
        if not self._writing_paused:
            if size > self._high:
                self._writing_paused = True
                self._notify_app("pause_writing")
        elif size <= self._low:
            self._writing_paused = False
            self._notify_app("resume_writing")

    def _notify_app(self, name: str) -> None:
        app = self._proto._app
        try:
            getattr(app, name)()
        except Exception as exc:  # an application bug: report, carry on
            self._loop.call_exception_handler({
                "message": f"protocol.{name}() failed",
                "exception": exc, "transport": self, "protocol": app,
            })

    def _send_eof(self) -> None:
        self._eof_sent = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self._write_failed(exc)

    def _fail_writes(self, exc: BaseException) -> None:
        self._out.fail(exc)
        for req in self._tls_held + self._tls_reqs:
            req._finish(exc)
        self._tls_reqs = []
        self._tls_held = []
        self._tls_plain = []
        self._tls_plain_bytes = 0

    def _write_failed(self, exc: OSError) -> None:
        self._abort(exc)

    # ------------------------------------------------ from SlabProtocol

    def _outlive_raw(self) -> bool:
        """The loop closed its transport with our bytes still queued: send them.

        ``Server.close_clients()`` (3.13), or anything else that calls
        ``close()`` on the loop's transport, ends it at once: that transport
        never wrote, so it has nothing to flush. Our duplicate descriptor
        keeps the connection itself open, so what slabnet queued still goes
        out on it, as asyncio's own transport flushes before it closes; then
        the duplicate is closed (``_maybe_close_raw``) and the connection is
        lost for good. True if the loss is deferred until then. Only a
        graceful close gets here; an abort or a reset drops the queue.
        """
        if self._sock is None or self._state is _State.HANDSHAKING:
            return False
        self._flush()  # (TLS: encrypts this iteration's plaintext first)
        if not self._out or self._sock is None:
            return False
        self._raw_gone = True
        if self._state is _State.OPEN:
            self._set_state(_State.CLOSING)  # later writes are dropped
        return True

    def _connection_lost(self, exc: BaseException | None) -> BaseException | None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        err = self._error or exc
        self._fail_writes(err or ConnectionResetError("connection lost with data unsent"))
        self._close_sock()
        self._state = _State.CLOSED  # always allowed: the loop says so
        self._closing = True
        return err

    def __repr__(self) -> str:
        return f"<SlabTransport {self._state.value} raw={self._raw!r}>"


_TLS_EXTRA: Final = frozenset(
    {"ssl_object", "peercert", "cipher", "compression", "sslcontext", "peercert_bin",
     # TLSEngine.get_extra_info's own names, beyond asyncio's
     "server_hostname", "tls_version", "alpn_protocol", "session", "session_reused"}
)


def _dup(raw_sock: Any) -> int:
    try:
        return os.dup(raw_sock.fileno())
    except OSError as exc:
        # EMFILE with one descriptor left: asyncio would have managed.
        raise OSError(
            exc.errno, f"{exc.strerror} (slabnet sends on a duplicate of the"
            " socket's descriptor: each connection needs two)"
        ) from exc


def _keep(view: memoryview) -> memoryview:
    """``view`` if its bytes cannot change while it waits to be sent, else a copy.

    Read-only is not enough: ``memoryview(buf).toreadonly()`` still shows
    every later change to ``buf``. Only the buffer behind the view tells.
    """
    if view.readonly and type(view.obj) in _IMMUTABLE:
        return view
    return memoryview(view.tobytes())


def _as_bytes_view(data: Any) -> memoryview:
    view = memoryview(data)
    if view.itemsize != 1 or view.ndim != 1:
        view = view.cast("B")
    return view


# ---------------------------------------------------------------- protocol


class SlabProtocol(asyncio.BufferedProtocol):
    """A ``BufferedProtocol`` that reads through the loop's slab.

    Pass it to ``loop.create_connection``/``create_server`` (as a factory
    returning new instances). It hands read-only chunks to ``app`` (a
    ``ChunkProtocol``) and gives ``app`` a ``SlabTransport``. With ``ssl``, it
    runs slabnet's own TLS over the plain transport; a TCP FIN without
    close_notify is EOF, as in asyncio, unless ``ssl_ragged_eof=False``
    (then ``TLSTruncatedError``, after every byte).
    """

    def __init__(
        self,
        app: asyncio.BaseProtocol,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        ssl: ssl.SSLContext | None = None,
        server_side: bool = False,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
        ssl_ragged_eof: bool = True,
        ssl_session: Any = None,
        handshake_waiter: asyncio.Future[None] | None = None,
        slab: ReadSlab | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        res = _loop_resources(self._loop)
        self._slab = slab or res.slab
        self._pool = res.pool
        self._sizer = ReadSizer()  # this connection's plain TCP read size
        self._app: Any
        self._deliver: Callable[[memoryview], None]
        self._set_app(app)
        self._tls: TLSEngine | None = None
        self._ssl_args: tuple[Any, ...] | None = None
        if ssl is not None:
            self._ssl_args = (ssl, server_side, server_hostname, ssl_ragged_eof, ssl_session)
        self._handshake_timeout = (
            SSL_HANDSHAKE_TIMEOUT if ssl_handshake_timeout is None else ssl_handshake_timeout
        )
        self._shutdown_timeout = (
            SSL_SHUTDOWN_TIMEOUT if ssl_shutdown_timeout is None else ssl_shutdown_timeout
        )
        self._waiter = handshake_waiter
        self._raw: asyncio.Transport | None = None  # the loop's transport
        self._transport: SlabTransport | None = None
        self._raw_eof = False
        self._tls_closed = False  # the read side is over (close_notify, EOF, failure)
        self._lost = False
        self._upgrading = False
        self._app_made = False  # the app's connection_made was called

    def _set_app(self, app: asyncio.BaseProtocol) -> None:
        deliver = getattr(app, "chunk_received", None)
        if deliver is None:
            raise TypeError(f"{app!r} has no chunk_received(): not a ChunkProtocol")
        self._app = app
        self._deliver = deliver

    # ------------------------------------------------ loop callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        transport = cast(asyncio.Transport, transport)
        self._raw = transport
        try:
            if self._ssl_args is not None:
                from ._tls import TLSEngine

                ctx, server_side, hostname, ragged, session = self._ssl_args
                # Raises for a bad server_hostname (UnicodeError, ValueError)
                # or a client context on the server side (ssl.SSLError).
                self._tls = TLSEngine(
                    ctx, server_side=server_side, server_hostname=hostname,
                    session=session, ragged_eof=ragged,
                )
            self._transport = tr = SlabTransport(self, transport)
        except Exception as exc:
            # Nothing may be read as plaintext on a connection meant for TLS.
            self._tls = None
            self._fail(exc, "slabnet: could not set up the connection")
            return
        if self._tls is None:
            if self._tell_app_made(tr) and self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            return
        tr._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)
        self._tls_handshake()

    def _tell_app_made(self, tr: SlabTransport) -> bool:
        """Call the app's connection_made; False (connection failed) if it raised."""
        self._app_made = True
        try:
            self._app.connection_made(tr)
        except Exception as exc:
            self._app_failed(exc, "connection_made")
            return False
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._tls is not None:
            tr = self._transport
            if tr is not None and tr._reading_paused:
                # The app paused reading: take in only a little (the socket
                # is paused after this read, in buffer_updated; uvloop must
                # not be paused from get_buffer).
                return self._slab.reserve_lent()[:_PAUSED_READ]
            return self._slab.reserve_lent()
        return self._slab.reserve_for(self._sizer)

    def buffer_updated(self, nbytes: int) -> None:
        tls = self._tls
        if tls is None:
            self._deliver(self._slab.commit(nbytes))
            return
        # Ciphertext is only lent: the engine copies it into its BIO before
        # this callback returns, so no chunk is made and no slab is pinned.
        data = self._slab.consume(nbytes)
        tr = self._transport
        if tr is not None and tr._state is _HANDSHAKING:
            # Lent too: the read that completes the handshake may carry a
            # burst of data behind it, which must go into the BIO by pieces
            # like every other read.  What the handshake leaves of the read
            # is delivered whole, as below, before the rest is released.
            tls.lend_data(data)
            try:
                self._tls_handshake()
                state: _State = tr._state  # (changed by the handshake)
                if state is _State.OPEN and tls.buffered_ciphertext:
                    self._tls_pump(True)
            finally:
                tls.release_lent()
        else:
            # A whole read is delivered even if the app pauses during it (as
            # asyncio does).  A read made while paused is not delivered, and
            # pauses the socket (pause_reading() leaves that to the next read).
            paused = False
            if tr is not None and tr._reading_paused:
                paused = True
                if not tr._raw_paused:
                    tr._pause_raw()
            self._tls_pump(not paused, False, data)

    def eof_received(self) -> bool | None:
        self._raw_eof = True
        tls = self._tls
        tr = self._transport
        if tr is None:
            return None  # the connection is already gone
        if tls is None:
            keep_open = self._app.eof_received()
            if not keep_open:
                tr.close()
            return True
        if tr._state is _State.HANDSHAKING:
            tls.receive_eof()
            self._tls_handshake()
            return True
        # The peer's FIN ends its direction only: ours stays open until our
        # close. Encrypt what the app wrote this iteration now, while the
        # engine still takes plaintext (a FIN without close_notify breaks
        # it when strict), so all of it is sent before the socket closes.
        if tr._tls_plain and tr._state is _State.OPEN:
            tr._flush()
        tls.receive_eof()
        self._tls_pump(force=True)
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        tr = self._transport
        if exc is None and tr is not None and tr._outlive_raw():
            return  # called again once the queue is sent (or dropped)
        self._lost = True
        if tr is None:
            waiter = self._waiter  # (set up failed: it has the error already)
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc or ConnectionResetError("connection lost"))
            return
        if self._tls is not None and tr._state is not _State.HANDSHAKING and not self._tls_closed:
            # Deliver every byte that was decrypted before the connection went.
            self._tls_pump(force=True, final=True)
        handshaking = tr._state is _State.HANDSHAKING
        err = tr._connection_lost(exc)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(err or ConnectionResetError(
                "connection lost during the TLS handshake" if handshaking else "connection lost"
            ))
        self._transport = None
        if self._app_made:  # (a STARTTLS handshake too: the app has its transport)
            self._app.connection_lost(err)

    def pause_writing(self) -> None:  # the loop transport never writes
        pass

    def resume_writing(self) -> None:
        pass

    # ------------------------------------------------ TLS

    async def start_tls(
        self,
        sslcontext: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
        ssl_ragged_eof: bool = True,
        ssl_session: Any = None,
    ) -> None:
        """Upgrade this plain connection to TLS (STARTTLS) and wait for it.

        Bytes written before the call go out in plaintext first; every byte
        read after it is ciphertext.
        """
        from ._tls import TLSEngine

        tr = self._transport
        if self._tls is not None:
            raise RuntimeError("the connection already uses TLS")
        if tr is None or tr.is_closing():
            raise ConnectionResetError("cannot start TLS on a closed connection")
        if not server_side and not server_hostname and sslcontext.check_hostname:
            raise ValueError("start_tls() on a client needs server_hostname")
        self._tls = TLSEngine(
            sslcontext, server_side=server_side, server_hostname=server_hostname,
            session=ssl_session, ragged_eof=ssl_ragged_eof,
        )
        if ssl_handshake_timeout is not None:
            self._handshake_timeout = ssl_handshake_timeout
        if ssl_shutdown_timeout is not None:
            self._shutdown_timeout = ssl_shutdown_timeout
        self._waiter = waiter = self._loop.create_future()
        self._upgrading = True
        tr._set_state(_State.HANDSHAKING)
        tr._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)
        self._tls_handshake()
        await waiter

    def _tls_handshake(self) -> None:
        tls = self._tls
        tr = self._transport
        assert tls is not None and tr is not None
        try:
            done = tls.do_handshake()
        except Exception as exc:
            tr._send_tls_output()
            self._fail(exc)
            return
        tr._send_tls_output()
        if not done:
            if self._raw_eof:
                self._fail(ConnectionResetError("peer closed the connection during the TLS handshake"))
            return
        if tr._timer is not None:
            tr._timer.cancel()
            tr._timer = None
        tr._set_state(_State.OPEN)
        if self._upgrading:
            self._upgrading = False  # STARTTLS: the app has its transport
        elif not self._tell_app_made(tr):
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if tr._tls_plain:
            tr._flush()
        self._tls_pump()

    def _handshake_timed_out(self) -> None:
        tr = self._transport
        if tr is None:
            return
        tr._timer = None
        if tr._state is _State.HANDSHAKING:
            # asyncio's own words (sslproto.py), so that code matching its
            # message keeps working.
            self._fail(HandshakeTimeoutError(
                f"SSL handshake is taking longer than {self._handshake_timeout}"
                " seconds: aborting the connection"
            ))

    def _tls_pump(
        self, force: bool = False, final: bool = False, data: memoryview | None = None
    ) -> None:
        """Deliver decrypted chunks until the engine needs more input.

        ``data`` is new ciphertext, lent: the engine may keep a reference to
        it while it decrypts and must have copied it all before we return.
        ``final``: from ``connection_lost``; deliver what is left, report
        nothing but through ``tr._error``.

        Errors from the engine and from the app are kept apart: the engine's
        end the read side (after every byte before them), the app's are its
        bugs, reported to the loop's exception handler whatever the state.
        """
        tls = self._tls
        tr = self._transport
        if tls is None:
            return
        if tr is None or self._tls_closed or isinstance(tr._error, LocalAbortError):
            if data is not None:
                tls.receive_data(data)  # an engine that is done ignores it
            return
        deliver = self._deliver
        if data is not None:
            tls.lend_data(data)
        app_error: Exception | None = None
        try:
            while force or not tr._reading_paused:
                chunk = tls.read_chunk()
                if chunk is None:
                    break
                if not chunk:
                    self._tls_closed = True
                    break
                try:
                    deliver(chunk)
                except Exception as exc:
                    app_error = exc
                    break
                if isinstance(tr._error, LocalAbortError):
                    return  # abort() from chunk_received: that was the last
        except Exception as exc:
            if final:
                tr._error = tr._error or exc
            elif tr._state is _State.CLOSING:
                # We asked to close; the peer went without its close_notify.
                self._tls_closed = True
                tr._maybe_close_raw()
            elif isinstance(exc, TLSTruncatedError) and self._raw_eof:
                # Strict: the peer's FIN came without close_notify. Only its
                # direction is over: what we queued still goes out, then the
                # app learns of the truncation in connection_lost.
                self._tls_closed = True
                tr._close_after(exc)
            else:
                tr._send_tls_output()
                self._fail(exc)
            return
        finally:
            if data is not None:
                tls.release_lent()
        if app_error is not None:
            self._app_failed(app_error, "chunk_received", final)
            return
        if final:
            return
        tr._send_tls_output()
        if self._tls_closed:
            self._tls_eof()

    def _tls_eof(self) -> None:
        tr = self._transport
        assert tr is not None
        if tr._state is _State.CLOSING:
            tr._maybe_close_raw()
            return
        try:
            keep_open = self._app.eof_received()
        except Exception as exc:
            self._app_failed(exc, "eof_received")
            return
        if keep_open:
            log.debug("%r: eof_received() returned True, ignored over TLS", self._app)
        tr.close()

    # ------------------------------------------------ failure

    def _fail(self, exc: BaseException, setup: str | None = None) -> None:
        """The one failure path: end the connection with ``exc``.

        ``exc`` goes to whoever waits for this connection: the waiter of
        ``open_connection``/``start_tls`` if it still waits, and the app's
        ``connection_lost`` if the app has seen ``connection_made``. A local
        failure to set the connection up (``setup``: the message) that
        neither would see -- a server's incoming connection -- goes to the
        loop's exception handler. (A handshake the peer fails is not
        reported there: asyncio reports those only in debug mode.) Then
        the loop's transport is aborted: the socket closes at once and
        nothing more is read, so nothing is buffered or delivered after
        the failure.
        """
        self._tls_closed = True
        waiter = self._waiter
        told = self._app_made
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            told = True
        if setup is not None and not told:
            self._loop.call_exception_handler({
                "message": setup, "exception": exc, "protocol": self, "transport": self._raw,
            })
        tr = self._transport
        if tr is not None:
            tr._abort(exc)
        elif self._raw is not None and not self._lost:
            self._raw.abort()

    def _app_failed(self, exc: Exception, name: str, final: bool = False) -> None:
        """The app's callback ``name`` raised: an application bug. Report it
        to the loop's exception handler (as the loops do for a protocol's
        ``data_received``) and end the connection with it."""
        self._loop.call_exception_handler({
            "message": f"slabnet: protocol.{name}() failed",
            "exception": exc, "protocol": self._app, "transport": self._transport,
        })
        if final:  # connection_lost is running: it reports tr._error
            self._tls_closed = True
            tr = self._transport
            if tr is not None:
                tr._error = tr._error or exc
            return
        self._fail(exc)
