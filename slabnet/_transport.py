"""The plain connection: ``SlabProtocol`` below, ``SlabTransport`` above.

Theory of operation
-------------------
slabnet runs over the event loop's own TCP (or Unix) transport, on the
default asyncio loop and on uvloop alike. This module is the plain layer;
TLS is a layer of its own on top of it (``_tls_transport.py``)::

    app (ChunkProtocol)               app (ChunkProtocol)
      |  SlabTransport                  |  TLSTransport  (TLS layer)
      |                                 |  SlabTransport
    SlabProtocol                      SlabProtocol
    loop's transport                  loop's transport

``SlabProtocol`` is what the loop calls: an ``asyncio.BufferedProtocol``
that reads straight into a reservation of the loop's ``ReadSlab`` and hands
each read to the layer above (the *upper* protocol) as one read-only
``memoryview``. ``SlabTransport`` is what the upper protocol calls. The two
are the two faces of one plain connection: they are made together, the
protocol owns the transport, and they talk through the few methods marked
"the protocol's side" below, never through each other's state.

Reads. A read goes to the upper protocol as a chunk of the slab (see
``_slab.py`` for when that is a zero-copy view and when a copy). An upper
protocol that copies every chunk before ``chunk_received`` returns -- the
TLS layer, which puts ciphertext into its engine's BIO -- says so with
``borrows_chunks = True``: its reads then go into the slab's lending buffer
and are never committed, so they never pin or advance a slab.

Writes. The loop's transports copy or join data they cannot send at once and
cannot tell which write has reached the kernel. slabnet sends itself, with
``os.write``/``os.writev`` on the socket's descriptor, while the loop's
transport is open (the loop closes that descriptor only after its transport
says ``is_closing()``, and nothing runs between that check and the send).
Only bytes the kernel refuses need more: the loops refuse ``add_writer`` on
a descriptor their transport owns, so a connection whose queue waits for
writability takes a duplicate of the descriptor (``os.dup``) to wait on, and
closes it once the queue is empty. An idle or keeping-up connection holds
one descriptor, as asyncio's. With no descriptor to spare (``EMFILE``), or
with the duplicate in the upper half of the process's descriptor limit
(a server with many slow readers, or a burst of connections, whose queues
all wait: their duplicates must not leave ``accept()`` none), a blocked
queue lends its bytes to the loop's transport instead (``_lend``), which
waits on its own descriptor, and takes the queue back once it has sent
them all (its protocol's ``resume_writing``, with write buffer limits of
0); so does then every queue that waits on a duplicate. Nothing polls,
nothing is lost and nothing fails; what is written meanwhile waits behind
the lent bytes. So does, once the process holds half its limit, a queue
whose peer has taken nothing for a second or two (a per-loop sweep,
``_LoopResources``): a crowded server's stalled readers hold one descriptor
each. Otherwise the loop's transport never writes; it reads, shuts the
write side down (``write_eof``) and performs the final close, after
slabnet's queue is empty. If the loop
closes its transport first (``Server.close_clients()``), the duplicate
holds the connection: the queue goes out on it, then it is closed
(``_outlive_raw``); meanwhile a 3.13 ``Server`` counts it among its clients
(``_OutlivingClient``), so ``wait_closed()`` waits for it and
``abort_clients()`` drops it. Once the loop's transport is closing, its descriptor is
used only while it is still this socket (``fstat`` inode): uvloop closes it
at once, and its number may already be another connection's.

* A write with nothing queued before it goes straight to ``send``; if the
  kernel takes it all, no object is made and ``write`` returns ``None``.
* A connection's first small write (below ``BufferPool.small_limit``) of a
  loop iteration, or its first after a read, goes straight to ``send`` as a
  large one does: a reply, or a frame sent on a timer. The small writes after
  it in the same iteration are copied into the loop's pool, each right after
  the one before while no other connection's copy came between (one buffer,
  ``OutQueue.gather``), and sent together from a ``call_soon`` callback
  (``FlushSoon``, which a loop closed before its turn sends from as it
  drops it) -- or at once when 64 KiB, or 1024 writes (``IOV_MAX``), have
  gathered, or when no loop runs.
  (``_Iterations`` tells the iterations apart with one callback per loop,
  not per connection, and none for a reply: the write after a reply goes
  at once too, since nothing tells its iteration from the reply's.)
* What the kernel does not take waits in an ``OutQueue`` (memoryview slices,
  no joins), and the caller gets a ``WriteRequest``.

Lifecycle: one enum, ``_State`` (OPEN, CLOSING, CLOSED), one gate
(``_set_state``); see ``_TRANSITIONS``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
import resource
import ssl
import weakref
from asyncio import base_events as asyncio_base_events
from asyncio import constants as asyncio_constants
from asyncio import transports as asyncio_transports
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, cast

from ._errors import LocalAbortError, untraced
from ._pool import BufferPool
from ._slab import ReadSizer, ReadSlab, _Sealed, _Slab
from ._write import IOV_MAX, OutQueue, WriteRequest

if TYPE_CHECKING:
    from ._tls_transport import TLSTransport

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
# The low-water marks of the default high ones (this, and the TLS layer's
# 256 KiB read limit): one int object that every connection shares, where
# an int above 256 computed anew is an object of its own per connection.
_QUARTERS: Final = {high: high // 4 for high in (DEFAULT_HIGH_WATER, 256 * 1024)}

#: Small writes gathered in the pool go out at the end of the loop iteration,
#: or earlier once this much is waiting: one ``sendmsg`` per 64 KiB at most.
CORK_LIMIT: Final = 64 * 1024

#: ... or once this many writes are waiting: one ``sendmsg`` takes no more
#: (``IOV_MAX``), so gathering further saves no call, and a loop of tiny
#: ``write(); await drain()`` that never yields would otherwise run 65,536
#: times before its bytes reach the kernel, or a reset they meet reaches it.
CORK_PIECES: Final = IOV_MAX

#: The most a read made while the upper protocol is paused takes in (and
#: holds until it resumes); that read also pauses the socket.
_PAUSED_READ: Final = 1024

_SEND_RETRY: Final = (BlockingIOError, InterruptedError)

#: A send error that means the connection is over: the peer can send no
#: more, so what the kernel holds of what it sent is all there will be.
_SEND_ENDED: Final = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)

#: The most ``take_unread`` reads from the kernel at a connection's end
#: (more than a receive buffer holds: Linux's largest default is 6 MiB),
#: and the size of each of its reads.
_UNREAD_MOST: Final = 32 * 1024 * 1024
_UNREAD_READ: Final = 256 * 1024

#: What an app's callback raises that is not its failure: these leave
#: run_forever, as out of the loops' own callbacks. The loops' transports
#: re-raise exactly these and take any other exception, CancelledError
#: too, for the app's failure (reported, and the connection ends with it
#: where it came from a data callback).
EXITS: Final = (SystemExit, KeyboardInterrupt)

#: A queue that waits on a duplicate and sends nothing for between one and
#: two of these (seconds) has a peer that stopped reading: once the process
#: holds half its descriptor limit, it gives the duplicate back and lends
#: its bytes to the loop's transport (SlabTransport._lend).
_STALLED_AFTER: Final = 1.0


def _descriptors_crowded() -> bool:
    """Whether the process holds at least half its soft descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return False
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc, or EMFILE
        try:  # (the lowest free number: a lower bound)
            held = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            return True
        os.close(held)
    return held >= soft // 2


def _spare_descriptor(fd: int) -> bool:
    """Whether a duplicate that got number ``fd`` may be kept: it lies in
    the lower half of the soft descriptor limit. The kernel hands out the
    lowest free number, so a higher one means the table is half full, and
    the rest is left to what the application opens (accept(), files)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft == resource.RLIM_INFINITY or fd < soft // 2

#: Loops that read once per readiness event (see SlabProtocol: lazy pause).
_SELECTOR_LOOP: Final = asyncio.selector_events.BaseSelectorEventLoop

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


#: ``SlabTransport._sent_in`` (and ``TLSTransport``'s) once a read came: the
#: next small write goes at once, and needs no ``_Iterations.mark`` -- the
#: next read will say so again. Before any write or read, ``_NOT_YET``.
_AFTER_READ: Final = -1
_NOT_YET: Final = -2
#: After that reply: no callback tells its iteration from the next, so the
#: next small write goes at once too (the second piece of a reply, or the
#: first write on a timer's turn), and marks.
_REPLIED: Final = -3


class _Iterations:
    """Tells a loop's iterations apart, for the write path.

    ``now`` is the same number throughout an iteration and a new one in the
    next, once a connection asked by ``mark``: one callback per loop and
    iteration in which slabnet sent a write on a timer's turn or gathered
    some, however many connections did; none for replies to reads. (The
    callback runs among the next iteration's; a write made there before it
    counts as the earlier iteration's, and is merely gathered.)"""

    __slots__ = ("now", "_armed")

    def __init__(self) -> None:
        self.now = 0
        self._armed = False

    def mark(self, loop: asyncio.AbstractEventLoop) -> int:
        """``now``, which changes after this iteration."""
        if not self._armed:
            self._armed = True
            loop.call_soon(self._advance)
        return self.now

    def stamp(self, sent_in: int, loop: asyncio.AbstractEventLoop) -> int:
        """The ``_sent_in`` of a connection whose write goes at once, whose
        last was ``sent_in``: ``now``, which changes after this iteration.
        A reply (``sent_in`` is ``_AFTER_READ``) arms no callback, which
        would cost one per round trip: ``_REPLIED``."""
        if sent_in == _AFTER_READ:
            return _REPLIED
        return self.mark(loop)

    def _advance(self) -> None:
        self.now += 1
        self._armed = False


class FlushSoon:
    """A connection's end-of-iteration flush (``_flush_soon``), as the loop
    callback that sends the small writes it gathered.

    A loop closed before the callback's turn drops it unrun: one stopped in
    the iteration that gathered them (a signal handler's last word to each
    peer, then ``loop.stop()``), then closed. asyncio's ``write()`` hands
    the kernel a small write within the call, so a loop closed early loses
    none of them; here the drop sends them (``__del__``, as the loop clears
    its queue) as far as the kernel takes them, with no loop left to wait
    for the rest. (A write made while no loop runs is sent at once:
    ``schedule_flush``.)"""

    __slots__ = ("_flush",)

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush: Callable[[], None] | None = flush

    def __call__(self) -> None:
        flush, self._flush = self._flush, None
        if flush is not None:
            flush()

    def __repr__(self) -> str:
        return f"<FlushSoon {self._flush!r}>"

    def __del__(self) -> None:
        flush, self._flush = self._flush, None
        if flush is not None:  # dropped unrun
            try:
                flush()
            except Exception:  # (the loop is closed: nothing can wait)
                pass


def schedule_flush(loop: asyncio.AbstractEventLoop, flush: Callable[[], None]) -> bool:
    """Run ``flush`` at the end of this iteration: True. With no loop
    running (writes from code between two runs), no iteration ends: it runs
    now, as asyncio's write() sends within the call, and False."""
    if loop.is_running():
        loop.call_soon(FlushSoon(flush))
        return True
    flush()
    return False


class _LoopResources:
    __slots__ = ("slab", "pool", "iterations", "blocked", "_sweeping", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.slab = ReadSlab(loop=loop)
        self.pool = BufferPool()
        self.iterations = _Iterations()
        # The connections whose queue waits on a duplicate descriptor, with
        # the bytes each had sent at the last sweep (see _sweep_blocked).
        # (Weak: a connection left blocked when its loop ends must not keep
        # the loop, the key these resources are kept under, alive.)
        self.blocked: weakref.WeakKeyDictionary[SlabTransport, int] = weakref.WeakKeyDictionary()
        # A sweep is scheduled. (Not its handle: it holds the loop.)
        self._sweeping = False
        _LoopEnd.watch(self, loop)

    def loop_closed(self) -> None:
        """The loop has closed (``_LoopEnd``): give back what only it could
        have used -- the read slabs, which its trim timer would have
        released, and the duplicate descriptors of the queues that waited
        on it, which would hold their connections open after the loop closed
        its own descriptors (uvloop closes them all)."""
        self.slab.release()
        for tr in list(self.blocked):
            tr._loop_closed()
        self.blocked.clear()

    def watch(self, tr: SlabTransport, loop: asyncio.AbstractEventLoop) -> None:
        self.blocked[tr] = tr._out.sent_total
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(_STALLED_AFTER, self._sweep_blocked, loop)

    def give_back_all(self) -> None:
        """The descriptor table is half full: every queue that waits on a
        duplicate gives it back and lends its bytes to the loop's transport
        (a burst of connections whose queues all block must not take the
        descriptors accept() needs)."""
        for tr in list(self.blocked):
            tr._give_back_stalled()

    def _sweep_blocked(self, loop: asyncio.AbstractEventLoop) -> None:
        """A queue that sent nothing for a whole period has a peer that
        does not read. Once the process holds half its descriptor limit,
        such a queue's duplicate goes back (its bytes are lent to the loop's
        transport), so that a server's stalled readers hold one descriptor
        each, as asyncio's; below that it keeps it (lent bytes are copied
        on the asyncio loop of 3.11, and what is written meanwhile waits
        until they are all sent; a duplicate costs neither)."""
        self._sweeping = False
        blocked = self.blocked
        stalled = []
        for tr, seen in list(blocked.items()):
            sent = tr._out.sent_total
            if sent == seen:
                stalled.append(tr)
            else:
                blocked[tr] = sent
        if stalled and _descriptors_crowded():
            for tr in stalled:
                tr._give_back_stalled()
        if blocked and not loop.is_closed():
            self._sweeping = True
            loop.call_later(_STALLED_AFTER, self._sweep_blocked, loop)


class _LoopEnd:
    """Tells a loop's resources that it closed.

    A closed loop can live on for as long as anything refers to it (a
    future, a task, a lock bound to it, a traceback's frame), and its
    resources with it, kept under it: tens of MB of read slabs that only its
    trim timer releases, which closed with it. asyncio has no close hook,
    but both loops drop their pending timers as they close: this is a timer
    far in the future, which does its work when it is dropped unrun
    (``__del__``) and, should it ever come due, waits again."""

    __slots__ = ("_res", "_loop")

    #: Seconds between two watches of a loop that runs long.
    PERIOD: Final = 86400.0

    def __init__(self, res: _LoopResources, loop: asyncio.AbstractEventLoop) -> None:
        # (Weak: the loop's timer must not keep either alive.)
        self._res: weakref.ref[_LoopResources] | None = weakref.ref(res)
        self._loop = weakref.ref(loop)

    @classmethod
    def watch(cls, res: _LoopResources, loop: asyncio.AbstractEventLoop) -> None:
        # Only from the loop's own thread, or while no thread runs it
        # (get_slab(loop) may be called from anywhere): a loop's timers are
        # not thread-safe. A closed loop has nothing left to give back.
        if loop.is_closed() or (
            loop.is_running() and asyncio._get_running_loop() is not loop
        ):
            return
        loop.call_later(cls.PERIOD, cls(res, loop))

    def _take(self) -> _LoopResources | None:
        """The resources, once: whichever of the run and the drop comes
        first has them."""
        ref, self._res = self._res, None
        return None if ref is None else ref()

    def __call__(self) -> None:
        res = self._take()
        loop = self._loop()
        if res is not None and loop is not None:
            self.watch(res, loop)

    def __del__(self) -> None:
        res = self._take()
        if res is not None:  # dropped unrun: the loop closed
            try:
                res.loop_closed()
            except Exception:  # (a __del__ has no one to raise to)
                pass


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

    Data before errors: bytes that arrived before the connection failed are
    delivered first, so ``chunk_received`` can come while reading is paused,
    just before ``connection_lost(exc)`` -- with the little a paused plain
    connection read (at most 1 KiB), or the TLS chunks already decrypted.
    (A plain ``asyncio.Protocol`` under ``SlabProtocol`` gets no data while
    paused: those bytes are dropped for it, as asyncio's transports do.)

    ``chunk`` is a read-only, non-empty ``memoryview``. A plain TCP chunk may
    be a view of the loop's read slab: keeping it keeps that slab alive (see
    ``slabnet.memory_stats()``); copy it (``bytes(chunk)``) to keep a few
    bytes for long. A TLS chunk owns its exact-size buffer.
    """

    __slots__ = ()

    #: True for a protocol that is done with each chunk when
    #: ``chunk_received`` returns (it copies what it keeps): its chunks may
    #: then be views of a buffer that the next read reuses.
    borrows_chunks: bool = False

    def chunk_received(self, chunk: memoryview) -> None:
        """Called with each chunk of bytes, in order."""

    def eof_received(self) -> bool | None:
        """The peer will send nothing more. Return True to keep writing."""
        return None


# ---------------------------------------------------------------- transport


def flow_limits(high: int | None, low: int | None, default_high: int) -> tuple[int, int]:
    """``(high, low)`` as asyncio's transports fill in the ones not given:
    ``default_high`` with neither, four times ``low`` with only it, and
    ``low`` a quarter of ``high``."""
    if high is None:
        high = default_high if low is None else 4 * low
    if low is None:
        low = _QUARTERS.get(high)  # (a shared int for the defaults)
        if low is None:
            low = high // 4
    if not high >= low >= 0:
        raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
    return high, low


class _State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # close() or abort() called, or the send side failed
    CLOSED = "closed"  # connection_lost delivered


_TRANSITIONS: Final = {
    _State.OPEN: {_State.CLOSING, _State.CLOSED},
    _State.CLOSING: {_State.CLOSED},
    _State.CLOSED: set(),
}


_SENDFILE_FALLBACK: Final = getattr(
    getattr(asyncio_constants, "_SendfileMode", None), "FALLBACK", None
)


class _FlowControlStandIn(asyncio.Transport):
    """What WriteGate takes of asyncio's ``_FlowControlMixin`` (private, the
    base of its own transports, which loop.sendfile()'s fallback requires;
    CPython 3.8 to 3.13 have it), should a Python lack it: then there is no
    sendfile (RuntimeError, as before)."""

    __slots__ = ("_loop", "_protocol_paused")

    def __init__(self, extra: Any = None, loop: Any = None) -> None:
        super().__init__(extra)
        self._loop = loop


if TYPE_CHECKING:
    _FlowControlBase = asyncio_transports._FlowControlMixin
elif _SENDFILE_FALLBACK is not None and hasattr(asyncio_transports, "_FlowControlMixin"):
    _FlowControlBase = asyncio_transports._FlowControlMixin
else:
    _FlowControlBase = _FlowControlStandIn

#: loop.sendfile() takes a transport of ours (by asyncio's fallback).
_SENDFILE: Final = not issubclass(_FlowControlStandIn, _FlowControlBase)

#: The protocol the fallback sets for the time of the send (private, as the
#: mixin: CPython 3.8 to 3.13 have it), recognised by WriteGate.set_protocol
#: (see _sendfile_swap); None where there is no sendfile.
_SENDFILE_PROTOCOL: Final = (
    getattr(asyncio_base_events, "_SendfileFallbackProtocol", None) if _SENDFILE else None
)


class WriteGate(_FlowControlBase):
    """What every slabnet transport does the same way around its writes:
    the write-buffer limits and the pause/resume calls they cause, the rule
    for writes on a closed connection, and the STARTTLS upgrade. A subclass
    provides ``get_write_buffer_size()``, ``_writes_closed()``,
    ``get_protocol()`` (who hears ``pause_writing``/``resume_writing``, and
    the app of a TLS layer started on it), ``_check_upgradable()`` and
    ``_carry()``.

    ``loop.sendfile()`` on the asyncio loop sends the file by its
    read-and-write fallback (``_sendfile_compatible``), as it does on its
    own TLS transports. That fallback takes only a ``_FlowControlMixin``
    (an ``isinstance`` check) and reads its ``_protocol_paused``: so this
    class is one, and ``_protocol_paused`` is our "the app was told
    pause_writing" flag. Every method of the mixin is overridden here; its
    other slots (``_high_water``, ``_low_water``) go unused. The fallback
    swaps the protocol for its own (``set_protocol``) with reading paused,
    and restores it, then resumes reading: what arrived meanwhile is held
    (``SlabProtocol._hold``) and delivered to the app after. The app may
    read its stream meanwhile, and reading stays paused until its protocol
    is back (``_sendfile_swap``). uvloop's ``sendfile`` is asyncio's
    abstract one: NotImplementedError for every transport, its own too.
    """

    __slots__ = (
        "_high", "_low", "_resume_scheduled", "_eof_requested", "_dropped_writes",
        "_sending_file", "_reading_before", "_resume_after",
    )

    if _SENDFILE:
        _sendfile_compatible = _SENDFILE_FALLBACK

    # The asyncio loop's start_tls() takes every slabnet transport, as it
    # takes its own TLS transports (TLS inside TLS): its SSLProtocol becomes
    # the upper protocol through set_protocol(). uvloop's takes only its own.
    _start_tls_compatible = True

    _loop: asyncio.AbstractEventLoop

    def _init_gate(self) -> None:
        self._high = DEFAULT_HIGH_WATER
        self._low = DEFAULT_HIGH_WATER // 4
        self._protocol_paused = False
        self._resume_scheduled = False  # a resume found in an app's call (_check_pause)
        self._eof_requested = False
        self._dropped_writes = 0  # writes after close()/abort()/the connection went
        self._sending_file = False  # loop.sendfile()'s fallback protocol is set
        self._reading_before = True  # the app read before the last pause_reading()
        self._resume_after = False  # reading resumes once the app's protocol is back

    def get_write_buffer_size(self) -> int:
        raise NotImplementedError

    def _writes_closed(self) -> bool:
        raise NotImplementedError

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def abort(self, exc: BaseException | None = None) -> None:
        raise NotImplementedError

    def _force_close(self, exc: BaseException | None) -> None:
        """What asyncio's ``SSLProtocol`` calls on a fatal error or when its
        shutdown times out (``loop.start_tls()`` over this transport), as
        the loop's transports have it: an abort whose error its
        ``connection_lost`` reports, which wakes the ``start_tls()`` that
        waits for the handshake."""
        self.abort(exc)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high, self._low = flow_limits(high, low, DEFAULT_HIGH_WATER)
        # New limits may pause the app at once; a resume waits for the next
        # drain, as with both loops' transports (from inside pause_writing()
        # the app would otherwise hear resume_writing() before its pause
        # returned).
        if not self._protocol_paused:
            self._check_pause()

    def _check_writable(self) -> bool:
        """False if a write must be dropped; raises after ``write_eof()``.

        As asyncio's default loop does once its connection is lost, a write
        after ``close()``, ``abort()`` or the loss of the connection is
        dropped without an error (``drain()`` raises the connection's error
        instead), and each one from the fifth on logs a warning. (That loop
        still sends a write made after ``close()`` while its buffer drains;
        uvloop raises RuntimeError once its handle is closed. slabnet drops
        it on both loops: after ``close()`` the peer gets what was written
        before it.)
        """
        self._check_not_eof()
        if self._writes_closed():
            self._dropped_writes += 1
            if self._dropped_writes >= _DROPPED_WRITES_LOG:
                log.warning("%r: write() on a closed connection: data dropped", self)
            return False
        return True

    def _check_not_eof(self) -> None:
        """Raise if ``write_eof()`` was called: any write after it is an
        error, an empty one too (the loops' write() checks this first)."""
        if self._eof_requested:
            raise RuntimeError("Cannot call write() after write_eof()")

    def _check_pause(self, from_loop: bool = False) -> None:
        """Tell the app to pause above the high-water mark, or to resume at
        the low one. A resume is told from the loop's callbacks only
        (``from_loop``: a writable socket, the end-of-iteration flush), as
        the loops' transports tell it from their write callbacks: found in
        one of the app's own calls -- a ``write()`` whose gathered bytes it
        sent, made in ``pause_writing()`` or in a producer's loop -- it comes
        from the loop a moment later, never nested in the app's call (whose
        producer would run again inside itself)."""
        size = self.get_write_buffer_size()
        if not self._protocol_paused:
            if size > self._high:
                self._protocol_paused = True
                self._notify_app("pause_writing")
        elif size <= self._low:
            if from_loop:
                self._protocol_paused = False
                self._notify_app("resume_writing")
            elif not self._resume_scheduled:
                self._resume_scheduled = True
                self._loop.call_soon(self._resume_soon)

    def _resume_soon(self) -> None:
        self._resume_scheduled = False
        if self._protocol_paused:
            self._check_pause(True)

    def get_protocol(self) -> asyncio.BaseProtocol:
        raise NotImplementedError

    def _notify_app(self, name: str) -> None:
        app = self.get_protocol()
        if app is None:  # (the connection is gone)
            return
        try:
            getattr(app, name)()
        except EXITS:
            raise
        except BaseException as exc:  # an application bug: report, carry on
            # (CancelledError too, as the loops' transports do: out of
            # write() it would reach a caller that cancelled nothing, and
            # out of _flush() it would skip the close that waited for it.)
            self._loop.call_exception_handler({
                "message": f"protocol.{name}() failed",
                "exception": exc, "transport": self, "protocol": app,
            })

    # ------------------------------------------------ reading during loop.sendfile()
    #
    # The fallback pauses reading, sets its own protocol, whose
    # data_received() raises, and at the end sets the app's back and
    # resumes reading if is_reading() said True at the start. Meanwhile the
    # app may read its stream: a stream that paused reading at its limit
    # resumes it once it is read below the limit, or waits for more, and
    # the bytes would go to the fallback's protocol. So while that protocol
    # is set, resume_reading() and pause_reading() only note what the app
    # wants: the socket stays paused (what arrives waits in the kernel,
    # bounded), and reading resumes when the app's protocol is back if the
    # app read before the send (its own state: a TLS transport whose reads
    # wait for the peer says False, and the fallback would leave it paused
    # for good) or resumed during it. The fallback's protocol is recognised
    # by its class: nothing else tells its set_protocol() from
    # loop.start_tls()'s, which also comes with reading paused, and whose
    # protocol must get the bytes.

    def _note_pause(self, reading: bool) -> None:
        """``pause_reading()`` was called, with the app reading before it if
        ``reading`` (before the fallback's pause: the app's state at the
        start of the send, which is_reading() does not tell for TLS, where
        the plain connection may be paused by itself)."""
        if self._sending_file:
            self._resume_after = False
        self._reading_before = reading

    def _note_resume(self) -> bool:
        """``resume_reading()`` was called: False if it must wait for the
        end of a sendfile."""
        if self._sending_file:
            self._resume_after = True
            return False
        return True

    def _final_receiver(self, protocol: Any) -> Any | None:
        """Who gets what a read held back, reading paused, when the
        connection ends with ``protocol`` set: a protocol that takes chunks;
        during a sendfile the app's own, which hears the loss through the
        fallback's protocol, if it takes chunks or read before the send (the
        bytes were the app's; the fallback would have handed them over once
        done); otherwise nobody (an asyncio protocol that paused is never
        handed data by the loops, and the fallback's protocol raises)."""
        if self._sending_file:
            protocol = protocol._proto
            if self._resume_after:
                return protocol
        return protocol if hasattr(protocol, "chunk_received") else None

    def _sendfile_swap(self, protocol: asyncio.BaseProtocol) -> bool:
        """``set_protocol(protocol)``: True if reading must resume now
        (the app's protocol is back after a send, and the app reads)."""
        was = self._sending_file
        self._sending_file = protocol.__class__ is _SENDFILE_PROTOCOL
        if self._sending_file and not was:
            self._resume_after = self._reading_before  # (before the fallback's pause)
        return was and not self._sending_file and self._resume_after

    # ------------------------------------------------ STARTTLS

    async def start_tls(self, sslcontext: ssl.SSLContext, **kwargs: Any) -> asyncio.Transport:
        """Upgrade this connection to TLS (STARTTLS; on a TLS connection, a
        second session inside it); return the TLS transport once the
        handshake is done. Keywords as for ``upgrade_tls``."""
        tls, handshake = self.upgrade_tls(sslcontext, **kwargs)
        await awaiting_handshake(tls, handshake)
        return tls

    def upgrade_tls(
        self,
        sslcontext: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
        ssl_ragged_eof: bool = True,
        ssl_session: Any = None,
        already_read: bytes = b"",
    ) -> tuple[asyncio.Transport, asyncio.Future[None]]:
        """Start the TLS handshake on this connection (STARTTLS).

        Returns the TLS transport at once, with a future that completes with
        the handshake (or raises its error). The TLS layer becomes this
        transport's protocol; the caller should write through the TLS
        transport from now on: what it writes during the handshake is
        encrypted once the handshake is done, whereas bytes written here
        would go out in plaintext, in the middle of it. Bytes written before
        the call go out in plaintext first; every byte read after it is
        ciphertext. ``already_read``: bytes the app had received but not
        consumed when it asked for TLS (a peer that sent its handshake right
        behind the STARTTLS command, without waiting for the answer): they
        are ciphertext too, and go to the TLS layer first.
        """
        from ._tls_transport import TLSTransport

        if not isinstance(sslcontext, ssl.SSLContext):  # (asyncio's words)
            raise TypeError(
                f"sslcontext is expected to be an instance of ssl.SSLContext, got {sslcontext!r}"
            )
        self._check_upgradable()
        if not server_side and not server_hostname and sslcontext.check_hostname:
            raise ValueError("start_tls() on a client needs server_hostname")
        waiter: asyncio.Future[None] = self._loop.create_future()
        tls = TLSTransport(
            self.get_protocol(), self._loop, sslcontext, server_side=server_side,
            server_hostname=server_hostname, ssl_handshake_timeout=ssl_handshake_timeout,
            ssl_shutdown_timeout=ssl_shutdown_timeout, ssl_ragged_eof=ssl_ragged_eof,
            ssl_session=ssl_session, waiter=waiter, upgrade=True, app_paused=self._protocol_paused,
        )
        tls.prepare()  # (what the engine refuses is raised before the switch)
        self._carry(tls)
        tls.connection_made(self)
        if already_read and not tls.is_closing():
            tls.chunk_received(memoryview(already_read))
        return tls, waiter

    def _check_upgradable(self) -> None:
        """Raise if this connection cannot carry a TLS session now."""
        raise NotImplementedError

    def _carry(self, tls: TLSTransport) -> None:
        """Make ``tls`` this connection's protocol: it gets every chunk."""
        raise NotImplementedError


class _OutlivingClient:
    """A ``SlabTransport`` that outlives the loop's transport (see
    ``_outlive_raw``), as its ``Server`` (3.13) counts it among its clients
    meanwhile: in their place, a loop's transport still flushing its buffer
    stays there until it is lost. So ``wait_closed()`` waits for the queue
    to go out, ``close_clients()`` lets it, and ``abort_clients()`` drops it
    (the loop detached its own transport already, and the Server saw no
    client left: ``wait_closed()`` returned while slabnet still sent, and
    ``abort_clients()`` reached nothing, so a client that never read kept
    the connection, its queue and a descriptor)."""

    __slots__ = ("_transport", "_server", "__weakref__")

    def __init__(self, transport: SlabTransport, server: Any) -> None:
        self._transport = transport
        self._server = server
        server._clients.add(self)  # (the Server holds it weakly; the transport holds it)

    def close(self) -> None:
        pass  # (it is closing: the queue goes out, then the connection ends)

    def abort(self) -> None:
        self._transport.abort()

    def detach(self) -> None:
        self._server._detach(self)


def _abort_ours_first(server: Any) -> None:
    """Make ``server.abort_clients()`` (3.13) abort slabnet's transports
    first; once per ``Server``: ``start_server`` does it at once, and the
    first connection a ``Server`` makes for a ``SlabProtocol`` does it for
    one of a factory of the app's own (an ``abort_clients`` taken from
    that one before its first connection is the loop's alone).

    The loop's ``abort_clients()`` aborts the loop's transports, which looks
    to ``SlabProtocol`` like ``close_clients()``: ``connection_lost(None)``
    either way. After a close slabnet still sends its queue on the
    duplicate descriptor (``SlabTransport._outlive_raw``), as asyncio's
    transport flushes its buffer; after an abort it must drop it, as
    asyncio's does, or a client that never reads keeps its connection."""
    abort_clients = getattr(server, "abort_clients", None)
    clients = getattr(server, "_clients", None)
    if abort_clients is None or clients is None:
        return  # (before 3.13, and uvloop's Server: no abort_clients)
    if getattr(server, "_slabnet_aborts_first", False):
        return
    server._slabnet_aborts_first = True
    # The replacement lives in the server's __dict__, so it must not refer
    # to the server: a bound method of it would make a cycle, and a closed
    # Server (its protocol factory, the app's handler and all it refers to)
    # would wait for the cyclic collector instead of going with its last
    # reference, as asyncio's does.
    server_ref = weakref.ref(server)
    if getattr(abort_clients, "__self__", None) is server:
        loops_abort = abort_clients.__func__
        set_on_instance = None
    else:  # (an abort_clients the app set on the instance: kept as it is)
        loops_abort, set_on_instance = None, abort_clients

    def abort_slabnet_clients() -> None:
        for raw in list(clients):
            if not isinstance(raw, asyncio.BaseTransport):
                continue  # (ours, outliving the loop's: abort_clients() aborts it)
            proto = raw.get_protocol()
            tr = proto._transport if isinstance(proto, SlabProtocol) else None
            if tr is not None:
                tr.abort()
        if set_on_instance is not None:
            set_on_instance()
        else:
            loops_abort(server_ref())  # (alive: this is called through it)

    server.abort_clients = abort_slabnet_clients


class _Duplicate:
    """A descriptor of slabnet's own for a connection's socket (``os.dup``):
    closed by ``close()`` or, for a connection its loop left behind, when it
    is collected -- silently, unlike a ``socket.socket``: the user never
    made it, and the loop's transport warns of the connection itself."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class SlabTransport(WriteGate):
    """The transport of a plain connection. Made by ``SlabProtocol``."""

    # (Slots: an idle server holds one of these per connection. ``_loop``
    # is a slot of asyncio's _FlowControlMixin, under WriteGate.)
    __slots__ = (
        "_proto", "_raw", "_pool", "_iterations", "_state", "_closing", "_out", "_fd",
        "_ino", "_dup", "_send_open", "_waiting_writable", "_lending",
        "_flush_scheduled", "_corked", "_corked_pieces", "_eof_sent", "_error", "_raw_gone",
        "_sent_in", "_outliving", "_send_deferred", "_res",
        "__weakref__",  # (as the loops' transports)
    )

    def __init__(self, proto: SlabProtocol, raw: asyncio.Transport, res: _LoopResources) -> None:
        if raw.get_extra_info("sslcontext") is not None:
            # The loop's TLS (ssl= given to the loop, not to SlabProtocol):
            # its socket is the TCP connection under the TLS, and what we
            # sent on it would go out in plaintext.
            raise TypeError(
                "SlabProtocol over the loop's TLS transport: "
                "pass ssl= to SlabProtocol, not to the loop"
            )
        super().__init__(loop=proto.loop)  # (sets _loop)
        self._proto = proto
        self._raw = raw
        self._pool = res.pool
        self._iterations = res.iterations
        self._res = res
        self._state = _State.OPEN
        self._closing = False  # derived from _state by _set_state: a hot check
        self._out = OutQueue()
        # The loop's descriptor, sent on while its transport is open, and
        # what it is (its inode), to tell once that transport is closing.
        self._fd: int = raw.get_extra_info("socket").fileno()
        self._ino = os.fstat(self._fd).st_ino
        # Ours, only while the queue waits (or outlives raw): an object that
        # closes it when collected, so that a connection left waiting when
        # its loop ends (the loop closed, the transport collected) still
        # closes its descriptor.
        self._dup: _Duplicate | None = None
        self._send_open = True  # False once the send side is closed for good
        self._waiting_writable = False
        # No descriptor to wait on: the loop's transport holds the queue's
        # bytes (_lend) until it has sent them all (_lent_drained); the next
        # wait after that may take a duplicate again.
        self._lending = False
        self._flush_scheduled = False
        # The iteration of the last small write sent at once, or
        # _AFTER_READ or _REPLIED: the next one goes at once too (see write).
        self._sent_in = _NOT_YET
        self._corked = 0  # pooled bytes waiting for the end-of-iteration flush
        self._corked_pieces = 0  # and the writes they came in
        self._eof_sent = False
        self._error: BaseException | None = None
        self._raw_gone = False  # the loop closed its transport with bytes queued
        self._send_deferred = False  # _error is a send's, made while raw closed (_send_failed)
        self._outliving: _OutlivingClient | None = None  # in its Server's clients meanwhile
        self._init_gate()

    # ------------------------------------------------ lifecycle gate

    def _set_state(self, new: _State) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"slabnet transport: {self._state.value} -> {new.value}")
        self._state = new
        self._closing = new is not _State.OPEN

    def is_closing(self) -> bool:
        # (Also once the loop's transport closes of its own accord: it read
        # a reset, say, and its connection_lost is on its way; a drain()
        # then waits for it and raises, as over the loop's transport.)
        return self._closing or self._raw.is_closing()

    def _writes_closed(self) -> bool:
        return self._closing or not self._send_open

    # ------------------------------------------------ info

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._raw.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        upper: asyncio.BaseProtocol = self._proto.upper
        return upper

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._proto.set_upper(protocol)
        if self._sendfile_swap(protocol):
            self.resume_reading()

    # ------------------------------------------------ reading

    # The reading state is the protocol's, which makes the reads.

    def is_reading(self) -> bool:
        # (From close() or abort() on nothing more is read, as on both loops.)
        return not self._closing and self._proto.is_reading()

    def pause_reading(self) -> None:
        if self._state is not _State.CLOSED:
            self._note_pause(self._proto.is_reading())
            self._proto.pause_reading()

    def resume_reading(self) -> None:
        # (A closed connection reads no more, as asyncio's; nor one that
        # sends a file: WriteGate._note_resume.)
        if not self._closing and self._note_resume():
            self._proto.resume_reading()

    # ------------------------------------------------ writing: public

    def write(self, data: Any) -> WriteRequest | None:  # type: ignore[override]
        """Send ``data``; None if accepted at once, else a WriteRequest."""
        # The hot path: plain bytes on an open connection, few lookups.
        view = data if type(data) is bytes else _as_bytes_view(data)
        n = len(view)
        if not n:
            self._check_not_eof()  # the loops check that before the length
            return None
        if self._closing or self._eof_requested or not self._send_open:
            if not self._check_writable():
                return None
        out = self._out
        if n < self._pool.small_limit:
            sent_in = self._sent_in
            if not out.queued and sent_in != self._iterations.now:
                # The first small write of an iteration, or the first after a
                # read, goes straight to the kernel: a frame sent on a timer
                # or a reply waits for nothing (waiting for the end of the
                # iteration would cost a copy, a callback and, for a reply,
                # one more loop iteration on both loops). Those after it in
                # the same iteration are gathered into one sendmsg.
                self._sent_in = self._iterations.stamp(sent_in, self._loop)
                return self._send_now([memoryview(view)], n)
            if self._waiting_writable:
                # The kernel is full: the bytes wait in the queue's own
                # buffer, with the other small writes made meanwhile, not in
                # the shared pool, where one region pins the whole pool for
                # as long as the peer takes to read.
                out.append_small(view)
                req = out.request(n, self._loop)
                self._check_pause()
                return req
            # Gather: copy into the pool, right after this connection's last
            # copy; one send at the end of the iteration carries every small
            # write of this iteration. (The write that went at once marked
            # the iteration: the next one's first goes at once again.)
            out.gather(self._pool, view, n)
            self._corked += n
            self._corked_pieces += 1
            if self._corked >= CORK_LIMIT or self._corked_pieces >= CORK_PIECES:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = schedule_flush(self._loop, self._flush_soon)
            if out.queued > self._high:
                self._check_pause()
            return None
        # A large write is never copied on its way to the kernel; only what
        # has to wait is, and only when the caller could change it meanwhile.
        view = memoryview(view)
        if not out.queued:
            # Nothing before it: try the kernel directly. A write it takes
            # whole completes synchronously and makes no object at all.
            return self._send_now([view], n)
        return self._queue_behind([view], n)

    def writelines(self, list_of_data: Iterable[Any]) -> WriteRequest | None:  # type: ignore[override]
        """Write several buffers; they go out with one ``sendmsg``."""
        views, total = _views_of(list_of_data)
        if not views:
            self._check_not_eof()
            return None
        if not self._check_writable():
            return None
        if not self._out and len(views) <= IOV_MAX:
            return self._send_now(views, total)
        return self._queue_behind(views, total)

    def _send_now(self, views: list[memoryview], total: int) -> WriteRequest | None:
        """Nothing is queued: hand ``views`` (``total`` bytes) to the kernel
        at once; queue only what it does not take (kept or copied)."""
        fd = self._send_fd()
        if fd < 0:
            return None
        try:
            sent = os.writev(fd, views) if len(views) > 1 else os.write(fd, views[0])
        except _SEND_RETRY:
            sent = 0
        except OSError as exc:
            self._send_failed(untraced(exc))  # (its frame holds `views`: the caller's data)
            return None
        out = self._out
        out.passed(sent)
        if sent == total:
            return None
        left = total - sent
        for v in views:
            if sent >= v.nbytes:
                sent -= v.nbytes
                continue
            out.append(_keep(v[sent:]))
            sent = 0
        req = out.request(left, self._loop)
        self._wait_writable()
        self._check_pause()
        return req

    def _queue_behind(self, views: list[memoryview], total: int) -> WriteRequest | None:
        """Pooled small writes (or a blocked queue) are ahead of ``views``:
        queue them (the caller may reuse its buffers meanwhile) and send
        everything with one ``sendmsg`` unless the kernel is full."""
        out = self._out
        small = self._pool.small_limit if self._waiting_writable else 0
        for v in views:
            if v.nbytes < small:
                out.append_small(v)  # (as write() does while the kernel is full)
            else:
                out.append(_keep(v))
        if not self._waiting_writable:
            self._flush()
            if not out:
                return None
        req = out.request(total, self._loop)
        self._check_pause()
        return req

    def track(self, req: WriteRequest) -> None:
        """Complete ``req`` once every byte written so far has been sent
        (for a layer above that made ``req`` for bytes of its own), or fail
        it with the error that dropped them."""
        out = self._out
        if not self._send_open and out.sent_total < out.end and not self._send_deferred:
            req._finish(self._error or ConnectionResetError("connection lost with data unsent"))
            return
        out.track(req)  # (after a deferred send error: failed with the loop's)

    def can_write_eof(self) -> bool:
        return self._raw.can_write_eof()

    def write_eof(self) -> None:
        if self._eof_requested or self._state is _State.CLOSED:
            return
        if self._out and not self._waiting_writable:
            self._flush()  # gathered writes first: asyncio's write() sent them
        self._eof_requested = True
        if self._out or self._waiting_writable:
            return  # the flush that empties the queue sends it (or fails)
        # Now, as the loop's own transport does it, and with its error: on
        # the asyncio loop a shutdown() that fails (ENOTCONN once the peer's
        # reset has come) raises here and leaves the connection open for
        # close(), as asyncio's write_eof() does; uvloop reports it later,
        # as the connection's loss.
        self._send_eof()

    def get_write_buffer_size(self) -> int:
        return self._out.queued

    # ------------------------------------------------ STARTTLS (WriteGate.upgrade_tls)

    def _check_upgradable(self) -> None:
        if self._closing:
            raise ConnectionResetError("cannot start TLS on a closed connection")

    def _carry(self, tls: TLSTransport) -> None:
        self._proto.set_upper(tls)
        # A FIN the app's protocol got goes to the TLS layer too, from the
        # loop: after its connection_made and the bytes read before.
        self._proto.tell_eof_again()

    # ------------------------------------------------ closing

    def close(self) -> None:
        if self._state is not _State.OPEN:
            return
        self._set_state(_State.CLOSING)
        self._proto.pause_reading()
        self._proto.stop_reading()
        if self._out and self._send_open and not self._waiting_writable:
            # Small writes gathered for the end-of-iteration flush: nothing
            # can join them now, and asyncio's write() would have handed
            # them to the kernel already. Sending them here, not a turn
            # later, lets the close follow at once (_flush ends in
            # _maybe_close_raw once the queue is empty).
            self._flush()
        else:
            self._maybe_close_raw()

    def abort(self, exc: BaseException | None = None) -> None:
        """Close at once, dropping queued data.

        Unlike asyncio (where the reader then sees EOF), every waiter -- a
        pending read, ``drain()``, a ``WriteRequest`` -- raises
        ``ConnectionAbortedError``: data was dropped, so EOF would be a lie.
        Bytes that had already arrived are still read first. A layer above
        may pass the error that ends the connection instead (``exc``): the
        protocol's ``connection_lost`` then gets it.

        What is dropped is what waits for the kernel to take it, as with
        asyncio. Small writes gathered for the end-of-iteration flush have
        not been tried yet (asyncio's ``write()`` would have handed them to
        the kernel at once): they go out first, as far as the kernel takes
        them now, so ``write(); await drain(); abort()`` sends the write.
        """
        self._proto.stop_reading()
        if self._out and not self._waiting_writable and self._send_open:
            self._send_queued()
        self._abort(exc or LocalAbortError("connection aborted locally (transport.abort())"))

    def _abort(self, exc: BaseException) -> None:
        if self._state is _State.CLOSED:
            return
        if self._error is None:
            self._error = exc
        self._out.fail(exc)
        self._close_sock()
        if self._state is _State.OPEN:
            self._set_state(_State.CLOSING)
        if self._raw_gone:
            # The loop's transport is closed already: it will not call back.
            self._loop.call_soon(self._proto.connection_lost, None)
            return
        self._raw.abort()

    def _send_failed(self, exc: BaseException) -> None:
        """A send raised ``exc``. While the loop's transport is closing of
        its own accord, it has read how the connection ended -- a reset,
        most often, after which the kernel refuses sends with EPIPE -- and
        its ``connection_lost``, on its way, says so: the send side closes
        and that error, not the send's, ends the writes and the reads, as
        it does asyncio's (the send's is kept for a close of the loop's
        that brings none). (On uvloop a reset read first left every waiter
        with ``BrokenPipeError``.) Otherwise the send's error ends the
        connection. When that error is the connection's end (a reset the
        send met first), what the peer sent before it and the kernel still
        holds is read first (``take_unread``): the loss delivers it before
        the error, as a read that met the reset would have."""
        if self._raw.is_closing() and not self._raw_gone:
            if self._error is None:
                # (Ours only if the loop's close turns out to be a graceful
                # one, which brings no error: _connection_lost.)
                self._error = exc
                self._send_deferred = True
            self._close_sock()
            return
        if isinstance(exc, _SEND_ENDED) and not self._raw_gone:
            self._proto.take_unread(self._fd)
        self._abort(exc)

    def _maybe_close_raw(self) -> None:
        # CLOSING and nothing left to send: hand the close to the loop.
        if self._out:
            return
        self._close_sock()
        if self._raw_gone:
            # The loop's transport is closed already: it will not call back.
            self._loop.call_soon(self._proto.connection_lost, None)
            return
        self._raw.close()

    def _close_sock(self) -> None:
        if self._send_open:
            self._send_open = False
            self._stop_waiting()

    # ------------------------------------------------ writing: internals

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        if self._state is _State.CLOSED:
            return
        self._flush(True)

    def _flush(self, from_loop: bool = False) -> None:
        """Send what is queued; wait for writability if the kernel is full.
        (``from_loop``: called by the loop, which may tell the app to resume.)"""
        self._corked = 0
        self._corked_pieces = 0
        out = self._out
        if self._lending:
            return  # (nothing may go out before the lent bytes: _lent_drained)
        if not self._send_open or (out and not self._send_queued()):
            return
        if out:
            self._wait_writable()
        else:
            self._stop_waiting()
        self._check_pause(from_loop)
        if not out:
            if self._eof_requested and not self._eof_sent:
                try:
                    self._send_eof()
                except OSError as exc:  # (no caller to raise it to)
                    self._send_failed(untraced(exc))
            if self._state is _State.CLOSING:
                self._maybe_close_raw()

    def _send_queued(self) -> bool:
        """Hand the kernel what is queued, as much as it takes now; False
        if the connection failed (aborted) meanwhile."""
        out = self._out
        fd = self._send_fd()
        if fd < 0:
            return False
        while out:
            bufs = out.buffers()
            try:
                sent = os.write(fd, bufs[0]) if len(bufs) == 1 else os.writev(fd, bufs)
            except _SEND_RETRY:
                break
            except Exception as exc:
                # (Any failure: a buffer the kernel refuses would otherwise
                # stay at the head of the queue, and the connection hang.)
                self._send_failed(untraced(exc))  # (its frame holds `bufs`: the queue)
                return False
            if out.sent(sent) or sent < sum(b.nbytes for b in bufs):
                break
        return True

    def _send_fd(self) -> int:
        """The descriptor to send on now: our duplicate while we hold one,
        else the loop's. Once the loop's transport is closing, its
        descriptor may be closed already (uvloop) and its number another
        socket's: it is used only while its inode is still this socket's,
        else the connection is lost (-1)."""
        if self._dup is not None:
            return self._dup.fileno()
        if self._raw.is_closing() and not self._fd_is_ours():
            self._abort(ConnectionResetError("the loop closed the connection's descriptor"))
            return -1
        return self._fd

    def _fd_is_ours(self) -> bool:
        try:
            return os.fstat(self._fd).st_ino == self._ino
        except OSError:
            return False

    def _wait_writable(self, outlive: bool = False) -> None:
        """The kernel is full: call ``_flush`` again once it can take more.
        (``outlive``: the duplicate is to hold the connection after the
        loop's transport closes, so it is kept in a crowded table too; so it
        is once that transport is closing, which may end before it could
        send bytes lent to it.)"""
        if self._waiting_writable:
            return
        self._waiting_writable = True
        outlive = outlive or self._raw.is_closing()
        # What waits may be gathered writes: regions of the loop's shared
        # pool, which the other connections' writes fill meanwhile.
        self._out.own_pooled()
        if (
            self._dup is None
            and (not self._raw.is_closing() or self._fd_is_ours())
        ):
            try:
                fd = os.dup(self._fd)
            except OSError:  # EMFILE, ENFILE: no descriptor to wait on
                pass
            else:
                if outlive or _spare_descriptor(fd):
                    self._dup = _Duplicate(fd)
                else:
                    os.close(fd)
                    self._res.give_back_all()
        if self._dup is not None:
            self._loop.add_writer(self._dup.fileno(), self._flush, True)
            self._res.watch(self, self._loop)
            return
        self._lend()

    def _lend(self) -> None:
        """No descriptor to wait on: hand every queued byte to the loop's
        transport, which waits on its own descriptor, and take the queue
        back once it has sent them all (``SlabProtocol.resume_writing``).
        Writes made meanwhile queue behind them here, and requests complete
        then: nothing polls, and the connection keeps one descriptor. (The
        queue is taken back from a callback of its own, never from inside
        the loop's transport's: a close() made there would end that
        transport twice on the asyncio loop.)"""
        raw = self._raw
        self._lending = True  # (so an abort below stops waiting cleanly)
        if raw.is_closing():
            # (It may drop writes now, the asyncio loop's silently, and it
            # will not carry the queue past its close: nor can we, with no
            # descriptor of our own.)
            self._abort(ConnectionResetError(
                "no descriptor to carry the queue while the loop closes the connection"))
            return
        # (Limits of 0: it tells its protocol of the first byte it holds,
        # pause_writing, and of its buffer becoming empty, resume_writing.)
        raw.set_write_buffer_limits(0, 0)
        try:
            for view in self._out.lend():
                # (Not writelines(): the asyncio loop's, from 3.12 on, never
                # tells its protocol to pause, so it would never resume.)
                raw.write(view)
        except Exception as exc:  # (closed meanwhile: uvloop refuses)
            self._abort(ConnectionResetError(f"the loop's transport refused the queue: {exc}"))
            return
        if not raw.get_write_buffer_size():
            self._loop.call_soon(self._lent_drained)  # it took them all at once

    def _lent_drained(self) -> None:
        """The loop's transport has sent every byte lent to it (a peer that
        reads): what was queued since goes now, and the next wait may take a
        duplicate again."""
        if not self._lending or self._raw.get_write_buffer_size():
            return  # (aborted meanwhile, the queue dropped; or lent again)
        self._lending = False
        self._waiting_writable = False
        self._out.repaid()
        self._flush(True)  # (and an EOF or a close that waited for the queue)

    def _give_back_stalled(self) -> None:
        """The sweep saw this queue send nothing for a whole period, in a
        crowded descriptor table: close the duplicate and lend the queue to
        the loop's transport until it has sent it all. (Not once the loop's
        transport is closing: the duplicate may be what holds the
        connection then.)"""
        self._res.blocked.pop(self, None)
        dup = self._dup
        if (
            dup is None or not self._waiting_writable or self._lending
            or self._raw_gone or self._raw.is_closing()
        ):
            return
        self._loop.remove_writer(dup.fileno())
        dup.close()
        self._dup = None
        self._lend()

    def _loop_closed(self) -> None:
        """The loop closed while this queue waited on a duplicate descriptor:
        close it. The queue stays unsent, as a loop's transport keeps its
        buffer when its loop closes under it; the connection ends as the
        loop left it (uvloop closes its descriptor, the asyncio loop keeps
        its socket open until the transport is collected or closed)."""
        dup = self._dup
        if dup is not None:
            dup.close()  # (its number stays -1: the loop forgot it)

    def _stop_waiting(self) -> None:
        """The queue is empty, or the send side closed: stop waiting and
        give back the duplicate, unless it still has a queue to carry after
        the loop closed its transport. (Bytes lent to the loop's transport
        stay there: it sends them, or an abort drops them.)"""
        if self._waiting_writable:
            self._waiting_writable = False
            if self._lending:
                self._lending = False
            else:
                # (Before the close: epoll forgets a descriptor only while
                # it is open, and this one shares its socket with the loop's.)
                assert self._dup is not None
                self._loop.remove_writer(self._dup.fileno())
        if self._dup is not None:
            self._res.blocked.pop(self, None)  # (watched while it waits on one)
            if not self._out or not self._send_open:
                self._dup.close()
                self._dup = None

    def _send_eof(self) -> None:
        """Shut our direction down; raises what the shutdown raises. The
        loop's transport holds nothing to write by now (what was lent to it
        was sent before the queue emptied), so it shuts down at once
        (uvloop: once libuv's empty write queue is done)."""
        self._eof_sent = True
        if not self._raw.is_closing():
            self._raw.write_eof()

    # ------------------------------------------------ the protocol's side

    def _outlive_raw(self) -> bool:
        """The loop closed its transport with our bytes still queued: send them.

        ``Server.close_clients()`` (3.13), or anything else that calls
        ``close()`` on the loop's transport, ends it once it has flushed what
        it holds, which is at most the bytes lent to it (``_lend``): the
        rest of slabnet's queue is not its. The duplicate descriptor that a
        waiting queue holds (taken now if it had none) keeps the connection
        itself open, so what slabnet queued still goes
        out on it, as asyncio's own transport flushes before it closes; then
        the duplicate is closed (``_maybe_close_raw``) and the connection is
        lost for good. True if the loss is deferred until then. Only a
        graceful close gets here; an abort or a reset drops the queue. (The
        loop's abort of its transport looks the same from here: so the
        ``Server`` of slabnet's ``start_server`` aborts ours first, in
        ``abort_clients()``.)
        """
        if not self._send_open:
            return False
        if self._lending:
            if self._raw.get_write_buffer_size():
                return False  # (lent bytes it did not send are lost with it)
            self._lent_drained()  # (before the callback that would: now)
        self._flush()
        if not self._out or not self._send_open:
            return False
        if self._dup is None:
            # No descriptor was free for a duplicate. Try again now (the
            # loop's is still open until this returns); if there is still
            # none, the queue cannot outlive it and is lost with it.
            self._stop_waiting()
            self._wait_writable(outlive=True)
            if self._dup is None:
                return False
        self._raw_gone = True
        if self._state is _State.OPEN:
            self._set_state(_State.CLOSING)  # later writes are dropped
        server = getattr(self._raw, "_server", None)  # (still set: the loop detaches after this)
        if isinstance(getattr(server, "_clients", None), weakref.WeakSet):
            self._outliving = _OutlivingClient(self, server)
        return True

    def _connection_lost(self, exc: BaseException | None) -> BaseException | None:
        """The loop's transport is gone: end every write; return the error
        the connection ended with (ours, from an abort, before the loop's).

        The loop's own error (a reset it read) is kept untraced: on the
        asyncio loop its traceback holds the frame of the read that failed,
        and with it the buffer that read was given, a slab of ours, which
        stays pinned as long as the app keeps the error. (Any other error
        is the protocol's own, raised from a callback of ours: it keeps its
        traceback.)"""
        if isinstance(exc, OSError):
            exc = untraced(exc)
        if self._outliving is not None:
            self._outliving.detach()
            self._outliving = None
        err = exc if self._send_deferred and exc is not None else self._error or exc
        self._out.fail(err or ConnectionResetError("connection lost with data unsent"))
        self._close_sock()
        self._state = _State.CLOSED  # always allowed: the loop says so
        self._closing = True
        return err

    def __repr__(self) -> str:
        return f"<SlabTransport {self._state.value} raw={self._raw!r}>"


async def awaiting_handshake(tls: asyncio.Transport, handshake: asyncio.Future[None]) -> None:
    """Await a STARTTLS handshake; a caller that gives up on it ends the
    connection, whatever the handshake's state.

    A cancellation during the handshake aborts it (the TLS layer sees its
    waiter cancelled). One that comes after the handshake completed but
    before the caller resumed cannot be seen there: the caller gets
    CancelledError all the same and takes the upgrade for abandoned, so the
    connection ends then too, as asyncio's ``start_tls`` closes its
    transport whenever its await of the handshake raises."""
    try:
        await handshake
    except BaseException:
        if not tls.is_closing():
            tls.abort()
        raise


def _keep(view: memoryview) -> memoryview:
    """``view`` if its bytes cannot change while it waits to be sent, else a copy.

    Read-only is not enough: ``memoryview(buf).toreadonly()`` still shows
    every later change to ``buf``. Only the buffer behind the view tells.
    """
    if view.readonly and type(view.obj) in _IMMUTABLE:
        return view
    return memoryview(view.tobytes())


#: ``writelines`` joins its buffers into one when they average fewer bytes
#: than this: a copy of a few KiB costs less than the buffer's own
#: bookkeeping on the way to ``sendmsg`` (a view, an iovec, a queue entry:
#: about half a microsecond each, where ``b"".join`` copies 4 KiB in about as
#: long), so frames written as many small pieces (a length prefix and a
#: body, a line per item) cost what one write of them costs. Larger buffers
#: are never copied, only gathered.
JOIN_BELOW: Final = 4096


def _views_of(list_of_data: Iterable[Any]) -> tuple[list[memoryview], int]:
    """The non-empty buffers of a ``writelines`` call and their size in
    bytes, joined into one when they are many and small (``JOIN_BELOW``)."""
    items: list[Any] | tuple[Any, ...] = (
        list_of_data if isinstance(list_of_data, (list, tuple)) else list(list_of_data)
    )
    if len(items) > 1:
        # Many small buffers are joined with no Python-level step per buffer.
        # len() is the size in bytes of bytes, bytearrays and byte views;
        # of other buffers it is at most that, and an item that is no
        # buffer, or a view that join() cannot read, is left to the loop
        # below, which names what is wrong with it.
        try:
            small = sum(map(len, items)) < len(items) * JOIN_BELOW
        except TypeError:
            small = False
        if small:
            try:
                joined = b"".join(items)
            except (TypeError, ValueError, BufferError):
                pass
            else:
                return ([memoryview(joined)] if joined else []), len(joined)
    views = [v for v in map(_as_bytes_view, items) if v.nbytes]
    total = 0
    for v in views:
        total += v.nbytes
    if len(views) > 1 and total < len(views) * JOIN_BELOW:
        views = [memoryview(b"".join(views))]
    return views, total


def _as_bytes_view(data: Any) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        # (The default loop's words; memoryview's name the wrong function.)
        raise TypeError(
            f"data argument must be a bytes-like object, not {type(data).__name__!r}"
        ) from None
    if view.format != "B" or view.ndim != 1 or not view.c_contiguous:
        # What is sent and copied is one run of unsigned bytes: the pool's
        # copy refuses another format even of 1-byte items ("c", "b",
        # ctypes' "<c"), and the kernel and OpenSSL take only contiguous
        # memory, so a strided view is copied (as bytes() reads it).
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


# ---------------------------------------------------------------- protocol


def chunk_deliverer(protocol: Any, owner: Any) -> tuple[Any, bool]:
    """What hands ``protocol`` a chunk, and whether it borrows chunks.

    A ``ChunkProtocol`` gets each chunk as it is; an asyncio protocol is
    taken too, as the loop's transports take one: a ``BufferedProtocol``
    has each chunk copied into its buffers (``_BufferFiller``: ``owner``,
    the layer that delivers, says whether it still reads for it), a
    ``Protocol`` gets it as ``bytes`` (both copy it before they return, so
    they borrow)."""
    deliver = getattr(protocol, "chunk_received", None)
    if deliver is not None:
        return deliver, bool(getattr(protocol, "borrows_chunks", False))
    if isinstance(protocol, asyncio.BufferedProtocol):
        return _BufferFiller(protocol, owner), True
    if callable(getattr(protocol, "data_received", None)):
        return functools.partial(_data_received, protocol), True
    raise TypeError(
        f"{protocol!r} has no chunk_received(), data_received() or "
        f"get_buffer(): not a protocol"
    )


# What the layer that delivers chunks (SlabProtocol, TLSTransport: the
# owner of a _BufferFiller) says of the protocol it fills, in feed_state().
FEED: Final = 0  # go on
FEED_PAUSED: Final = 1  # reading is paused: the rest waits for the resume
FEED_SWITCHED: Final = 2  # set_protocol(): the rest goes to the new protocol
FEED_STOPPED: Final = 3  # closed or aborted: nothing more is delivered


class _BufferFiller:
    """Hands chunks to an asyncio ``BufferedProtocol`` as the loops hand it
    reads: copied into the buffers its ``get_buffer()`` returns, one
    buffer at a time. A chunk can be larger than the protocol's buffer
    (a whole 256 KiB read, a 16 KiB TLS chunk), where the loops read no more
    than the buffer takes, so the owner is asked before each buffer whether
    it still reads for this protocol. Paused (its buffer is full), the rest
    is held by the owner, copied, and comes first after the resume; after
    ``set_protocol()`` it goes to the new protocol; after ``close()`` or
    ``abort()`` nothing more is delivered."""

    __slots__ = ("protocol", "owner", "calling")

    def __init__(self, protocol: asyncio.BufferedProtocol, owner: Any) -> None:
        # owner: feed_state(protocol) -> FEED..., hold_rest(rest) keeps the
        # rest for after the resume, deliver_now(chunk) hands it to the
        # protocol set now.
        self.protocol = protocol
        self.owner = owner
        self.calling = "get_buffer"  # the protocol's method called last (callback_name)

    def __call__(self, chunk: memoryview) -> None:
        protocol, owner = self.protocol, self.owner
        while chunk:
            state = owner.feed_state(protocol)
            if state:
                if state == FEED_PAUSED:
                    owner.hold_rest(memoryview(chunk.tobytes()))  # (chunks may be lent)
                elif state == FEED_SWITCHED:
                    owner.deliver_now(memoryview(chunk.tobytes()))
                return
            n = 0
            try:
                self.calling = "get_buffer"
                buf = memoryview(protocol.get_buffer(len(chunk))).cast("B")
                n = min(len(buf), len(chunk))
                if not n:
                    raise RuntimeError("get_buffer() returned an empty buffer")
                buf[:n] = chunk[:n]
                self.calling = "buffer_updated"
                protocol.buffer_updated(n)
            except BaseException as exc:
                # Any other exception ends the connection (the owner
                # reports it). KeyboardInterrupt, SystemExit (EXITS) leave
                # run_forever, as from the loops' own callbacks, and the
                # connection lives on: the rest of the chunk waits in the
                # owner, first once the loop runs again (the loops would not
                # have read it yet).
                rest = chunk[n:] if self.calling == "buffer_updated" else chunk
                if isinstance(exc, EXITS) and rest and owner.feed_state(protocol) != FEED_STOPPED:
                    owner.hold_rest(memoryview(rest.tobytes()))  # (chunks may be lent)
                raise
            chunk = chunk[n:]


def callback_name(deliver: Callable[[memoryview], object]) -> str:
    """The upper protocol's method that ``deliver`` (made by
    ``chunk_deliverer``) called last: what an error it raised is reported
    as, so that an app hears of the method it wrote."""
    if isinstance(deliver, _BufferFiller):
        return deliver.calling
    if isinstance(deliver, functools.partial):
        return "data_received"
    return "chunk_received"


def _data_received(protocol: asyncio.Protocol, chunk: memoryview) -> None:
    protocol.data_received(chunk.tobytes())


class SlabProtocol(asyncio.BufferedProtocol):
    """A ``BufferedProtocol`` that reads through the loop's slab.

    Pass it to ``loop.create_connection``/``create_server`` (as a factory
    returning new instances). It hands read-only chunks to ``app`` (a
    ``ChunkProtocol``) and gives ``app`` a ``SlabTransport``. With ``ssl``,
    slabnet's TLS layer (``TLSTransport``) sits between the two: it is this
    protocol's upper protocol, and ``app`` gets it as its transport. (The
    loop's own TLS, ``ssl=`` given to the loop, is refused: its socket is
    the TCP connection under that TLS. ``loop.create_connection()`` raises
    ``TypeError``; the loop reports a server's incoming connection so.) A TCP FIN without close_notify is EOF, as in asyncio, unless
    ``ssl_ragged_eof=False`` (then ``TLSTruncatedError``, after every byte).
    ``handshake_waiter`` gets the result once ``app`` has its transport (or
    the exception that prevented it).
    """

    __slots__ = (
        "loop", "upper", "_slab", "_res", "_sizer", "_waiter", "_ready_when_made",
        "_deliver", "_borrows", "_raw", "_transport", "_upper_made", "_lost",
        "_lazy_pause", "_paused", "_socket_paused", "_eof", "_pause_buf", "_held",
        "_release_scheduled", "_stopped", "_eof_held", "_eof_to",
    )

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
        self.loop = loop or asyncio.get_running_loop()
        res = _loop_resources(self.loop)
        self._slab = slab or res.slab
        self._res = res
        self._sizer = ReadSizer()  # this connection's plain read size
        self._waiter = handshake_waiter
        # Plain: the app is ready when it has its transport. With TLS the
        # layer above tells the waiter, after the handshake.
        self._ready_when_made = ssl is None
        upper: Any = app
        if ssl is not None:
            from ._tls_transport import TLSTransport

            upper = TLSTransport(
                app, self.loop, ssl, server_side=server_side,
                server_hostname=server_hostname,
                ssl_handshake_timeout=ssl_handshake_timeout,
                ssl_shutdown_timeout=ssl_shutdown_timeout,
                ssl_ragged_eof=ssl_ragged_eof, ssl_session=ssl_session,
                waiter=handshake_waiter,
            )
        self.upper: Any
        self._deliver: Any
        self._borrows = False
        self.set_upper(upper)
        self._raw: asyncio.Transport | None = None  # the loop's transport
        self._transport: SlabTransport | None = None
        self._upper_made = False  # the upper protocol's connection_made was called
        self._lost = False
        # Reading. On a selector loop, pause_reading() only sets _paused; the
        # socket itself is paused by the next read made while paused, which
        # takes in at most _PAUSED_READ bytes and holds them (_held) for
        # after resume. The selector loop reads once per readiness and runs
        # the callbacks the read scheduled before it polls again, so an upper
        # protocol that is drained meanwhile -- a stream whose consumer keeps
        # up -- costs no system call and no Handle at all. libuv (uvloop)
        # reads again at once, in the same callback, so there the next read
        # would always come while paused: the socket pauses at once instead.
        self._lazy_pause = isinstance(self.loop, _SELECTOR_LOOP)
        self._paused = False
        self._socket_paused = False
        self._eof = False  # the loop's transport read EOF: never resume it
        self._pause_buf: bytearray | None = None
        self._held: memoryview | None = None
        self._release_scheduled = False
        self._stopped = False  # closed or aborted by the layer above: no more chunks
        self._eof_held = False  # a read made while paused found the peer's FIN
        self._eof_to: Any = None  # the upper protocol that was told of the FIN

    def set_upper(self, upper: Any) -> None:
        """Make ``upper`` the protocol that gets this connection's chunks.

        An asyncio protocol is taken too, as the loop's transports take
        one (``loop.start_tls()`` hands the connection to asyncio's
        ``SSLProtocol`` so): a ``BufferedProtocol`` has each chunk copied
        into its buffers, a ``Protocol`` gets it as ``bytes``."""
        deliver, borrows = chunk_deliverer(upper, self)
        self.upper = upper
        self._deliver = deliver
        self._borrows = borrows

    # ------------------------------------------------ loop callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        transport = cast(asyncio.Transport, transport)
        self._raw = transport
        try:
            self._transport = tr = SlabTransport(self, transport, self._res)
        except Exception as exc:  # (no socket behind the transport, or the loop's TLS)
            if transport.get_extra_info("sslcontext") is not None:
                # The loop's TLS: raised, the loop's SSL protocol ends the
                # connection, and loop.create_connection() (or
                # connect_accepted_socket()) raises it, as for any protocol
                # whose connection_made raises there; the loop reports it
                # once (for a server's incoming connection, that is all).
                # Reported and aborted here instead, the caller got a
                # closed transport and no error.
                waiter = self._waiter
                if waiter is not None and not waiter.done():
                    waiter.set_exception(exc)
                raise
            self._setup_failed(exc)
            return
        server = getattr(transport, "_server", None)  # (the asyncio loop's, server side)
        if server is not None:
            _abort_ours_first(server)
        self._upper_made = True
        try:
            self.upper.connection_made(tr)
        except Exception as exc:
            self._app_failed(exc, "connection_made")
            return
        waiter = self._waiter
        if self._ready_when_made and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._paused:
            buf = self._pause_buf = bytearray(_PAUSED_READ)
            return memoryview(buf)
        if self._borrows:
            return self._slab.reserve_lent()
        return self._slab.reserve_for(self._sizer)

    def buffer_updated(self, nbytes: int) -> None:
        # (Nothing runs between get_buffer and buffer_updated: _paused is
        # what it was there.)
        tr = self._transport
        if tr is not None:
            tr._sent_in = _AFTER_READ  # (see SlabTransport.write)
        if self._paused:
            self._hold(nbytes)
            return
        # An exception from the app ends the connection here, at once: the
        # loop's transport would end it only an iteration later (its fatal
        # error path), while ours still took writes.
        deliver = self._deliver
        try:
            if self._borrows:
                # Only lent: the upper protocol copies it before returning,
                # so no chunk is made and no slab is pinned.
                deliver(self._slab.consume(nbytes))
            else:
                deliver(self._slab.commit(nbytes))
        except EXITS:
            # KeyboardInterrupt, SystemExit from an asyncio BufferedProtocol
            # part of the way through the read: its filler holds the rest.
            self._release_soon()
            raise
        except BaseException as exc:  # (CancelledError too: see EXITS)
            self._app_failed(exc, callback_name(deliver))

    def eof_received(self) -> bool | None:
        tr = self._transport
        if tr is None:
            return None  # the connection is already gone
        self._eof = True
        if self._paused:
            # Found by a read made while paused (lazy pause): the loops tell
            # a paused protocol of the FIN only after resume_reading(), so
            # it is held, as the bytes of such a read are.
            self._eof_held = True
        else:
            try:
                self._deliver_eof(tr)
            except EXITS:
                raise
            except BaseException as exc:  # (as in buffer_updated)
                self._app_failed(exc, "eof_received")
        return True  # the loop's transport stays: our close() ends it

    def _deliver_eof(self, tr: SlabTransport) -> None:
        self._eof_to = upper = self.upper
        keep_open = upper.eof_received()
        if not keep_open:
            tr.close()

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
        err = tr._connection_lost(exc)
        waiter = self._waiter
        if self._ready_when_made and waiter is not None and not waiter.done():
            waiter.set_exception(err or ConnectionResetError("connection lost"))
        self._transport = None
        if not self._upper_made:
            return
        upper, held, deliver = self.upper, self._held, self._deliver
        if held is not None and self._paused:
            receiver = tr._final_receiver(upper)
            if receiver is None:
                held = self._held = None  # (it gets the loss only, as there)
            elif receiver is not upper:
                deliver, _ = chunk_deliverer(receiver, self)
        try:
            if held is not None:  # what arrived before the end is delivered first
                self._held = None
                try:
                    deliver(held)
                finally:
                    # (To the protocol set now: the delivery's callback may
                    # have switched to another, as an upgrade does.)
                    self.upper.connection_lost(err)
            else:
                upper.connection_lost(err)
        finally:
            # Then the upper protocol is let go (the transport's
            # get_protocol() is None from now on, as asyncio's): it holds
            # this connection's transport, which holds us, and without the
            # cut every closed connection -- over TLS its SSLObject too --
            # would wait for the cyclic garbage collector instead of being
            # freed with its last reference.
            self.upper = self._deliver = self._eof_to = None

    # ------------------------------------------------ a BufferedProtocol upper
    # (the owner of its _BufferFiller)

    def feed_state(self, protocol: Any) -> int:
        if self._stopped or self._transport is None:
            return FEED_STOPPED
        if self._paused:
            return FEED_PAUSED  # (after a switch too: the new one gets it on resume)
        return FEED_SWITCHED if self.upper is not protocol else FEED

    def hold_rest(self, rest: memoryview) -> None:
        """What a paused upper protocol's buffers did not take of a chunk:
        first after the resume, as the bytes of a read made while paused."""
        held = self._held
        self._held = rest if held is None else memoryview(rest.tobytes() + held.tobytes())
        if not self._socket_paused and self._raw is not None:
            # (As _hold: no newer read may come before the held bytes.)
            self._socket_paused = True
            self._raw.pause_reading()

    def deliver_now(self, chunk: memoryview) -> None:
        self._deliver(chunk)

    def pause_writing(self) -> None:
        # The loop's transport holds bytes lent to it (SlabTransport._lend);
        # resume_writing tells when it has sent them all.
        pass

    def resume_writing(self) -> None:
        tr = self._transport
        if tr is not None and tr._lending:
            self.loop.call_soon(tr._lent_drained)

    # ------------------------------------------------ reading control
    # (SlabTransport's pause_reading/resume_reading/is_reading)

    def is_reading(self) -> bool:
        return not self._paused

    def stop_reading(self) -> None:
        """The transport is closed or aborted: deliver nothing more. Bytes
        a read made while paused holds are dropped, and so is what a later
        read brings (close() pauses, abort() ends reading): the loops would
        not have read them (asyncio: after close() "no more data will be
        received"), and on uvloop the socket is paused before they come."""
        self._stopped = True
        self._held = None
        self._eof_held = False

    def pause_reading(self) -> None:
        self._paused = True
        if not self._lazy_pause and not self._socket_paused and self._raw is not None:
            self._socket_paused = True
            self._raw.pause_reading()

    def tell_eof_again(self) -> None:
        """The peer's FIN went to an earlier upper protocol (the app's, which
        kept the connection open, before its STARTTLS): tell the one there
        is now too, from the loop, once it is made. The loops' transports
        tell it when reading resumes after the switch, as they read the FIN
        again (``loop.start_tls()`` pauses, switches and resumes); without
        it a TLS handshake would wait for its timeout."""
        if self._eof and not self._eof_held and not self._stopped and self._eof_to is not self.upper:
            self._eof_held = True
            if not self._paused:
                self._release_soon()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        self.tell_eof_again()
        if self._held is not None or self._eof_held:
            # Delivered from the loop, not from inside the caller (a stream
            # resumes in the middle of a read), and before any newer read:
            # the socket resumes only once the held bytes are delivered.
            self._release_soon()
        elif self._socket_paused:
            self._resume_socket()

    def _hold(self, nbytes: int) -> None:
        """A read made while paused: keep its bytes, pause the socket."""
        buf = self._pause_buf
        assert buf is not None
        self._pause_buf = None
        if not self._stopped:
            data = bytes(memoryview(buf)[:nbytes])
            held = self._held
            self._held = memoryview(data if held is None else held.tobytes() + data)
        # Even if it was paused already: uvloop ignores a pause made before
        # it starts reading (from connection_made), and reads on.
        self._socket_paused = True
        assert self._raw is not None
        self._raw.pause_reading()

    def take_unread(self, fd: int) -> None:
        """A send met the connection's end, which aborts it: read now what
        the kernel still holds of the peer's bytes (descriptor ``fd``), or
        it would go with the connection, and hold it after anything held
        already. ``connection_lost`` delivers it before the error, paused
        or not, as it delivers the bytes of a read made while paused. (A
        read that met the reset instead would have returned them first; a
        paused connection, or one whose bytes arrived in this iteration,
        had not read them yet.) Nothing is read after a FIN (the kernel
        holds nothing more) or once the app closed or aborted."""
        if self._stopped or self._eof or self._transport is None:
            return
        parts = [] if self._held is None else [self._held.tobytes()]
        total = 0
        while total < _UNREAD_MOST:
            try:
                data = os.read(fd, _UNREAD_READ)
            except InterruptedError:
                continue
            except OSError:  # nothing more now (EAGAIN), or the reset itself
                break
            if not data:
                break
            parts.append(data)
            total += len(data)
        if total:
            self._held = memoryview(b"".join(parts))

    def _release_soon(self) -> None:
        """Deliver what is held (and resume the socket) from the loop."""
        if not self._release_scheduled:
            self._release_scheduled = True
            self.loop.call_soon(self._release_held)

    def _release_held(self) -> None:
        self._release_scheduled = False
        held = self._held
        if self._paused or self._transport is None:
            return  # paused again meanwhile, or gone (connection_lost delivers)
        # An exception from the app is handled as the loops handle one from
        # a callback they make (buffer_updated, eof_received); escaping
        # from this callback, it would leave the socket paused for good.
        if held is not None:
            self._held = None
            deliver = self._deliver
            try:
                deliver(held)
            except EXITS:
                # KeyboardInterrupt, SystemExit: out of run_forever, as the
                # loops let them out of their own callbacks. The rest (what
                # a BufferedProtocol's filler held again, the held EOF, the
                # socket's resume) is done once the loop runs again, or the
                # socket would stay paused for good.
                self._release_soon()
                raise
            except BaseException as exc:  # (as in buffer_updated)
                self._app_failed(exc, callback_name(deliver))
                return
        if self._eof_held and not self._paused:
            self._eof_held = False
            try:
                self._deliver_eof(self._transport)
            except EXITS:
                raise
            except BaseException as exc:
                self._app_failed(exc, "eof_received")
            return
        if not self._paused and self._socket_paused:
            self._resume_socket()

    def _resume_socket(self) -> None:
        self._socket_paused = False
        if not self._eof and self._raw is not None:
            self._raw.resume_reading()

    # ------------------------------------------------ failure

    def abandon(self) -> None:
        """The opener gave up: ``loop.create_connection()`` raised (it was
        cancelled) after it may have called ``connection_made``. End the
        connection now. uvloop closes the transport of a connect cancelled
        in the iteration that made it without ever calling
        ``connection_lost``, which would leave the connection's state (a
        TLS handshake and its timer) behind; asyncio calls it later, and
        then it is a no-op. Nothing to do
        for a connection never made or already lost."""
        if self._raw is None or self._lost:
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()  # its awaiter is gone
        self._raw.abort()
        self.connection_lost(LocalAbortError("the connect was abandoned"))

    def _setup_failed(self, exc: BaseException) -> None:
        """The plain connection could not be set up: tell whoever waits for
        it, or the loop's exception handler (a server's incoming
        connection), and abort the loop's transport."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        else:
            self.loop.call_exception_handler({
                "message": "slabnet: could not set up the connection",
                "exception": exc, "protocol": self, "transport": self._raw,
            })
        assert self._raw is not None
        self._raw.abort()

    def _app_failed(self, exc: BaseException, name: str) -> None:
        """The upper protocol's ``name`` callback, called by us, raised: an
        application bug, reported once; the connection ends with it."""
        self.loop.call_exception_handler({
            "message": f"slabnet: protocol.{name}() failed",
            "exception": exc, "protocol": self.upper, "transport": self._transport,
        })
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        tr = self._transport
        if tr is not None:
            tr.abort(exc)
