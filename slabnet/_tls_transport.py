"""The TLS layer: ``TLSTransport``, between a plain connection and the app.

Theory of operation
-------------------
A ``TLSTransport`` has two faces, and only public calls cross either::

    app (ChunkProtocol)    calls write(), close(), pause_reading(), ...
      ^ chunk_received(plaintext), connection_made(self), ...
    TLSTransport           drives one TLSEngine (sans-IO, ``_tls.py``)
      v write()/writelines(ciphertext), pause_reading(), close(), abort(exc)
      ^ chunk_received(ciphertext), eof_received(), connection_lost(), ...
    SlabTransport          the plain connection (``_transport.py``)

To the plain connection below it is the protocol (a ``ChunkProtocol`` with
``borrows_chunks = True``); to the application above it is the transport.
It is the one object that knows about TLS: the plain connection carries
ciphertext as it would carry any bytes.

Reads. Ciphertext arrives lent: it is a view of the loop's lending buffer,
valid only during ``chunk_received``. The engine takes it into its BIO by
pieces while it decrypts and copies the rest before the call returns
(``lend_data``/``release_lent``), so ciphertext never pins a slab. The
decrypted chunks -- coalesced records, each in a buffer of its own exact
size -- go to the app. An app that pauses reading gets nothing more until
it resumes, as from asyncio's transports (the rest of the read waits in the
engine); slabnet's streams, which buffer what comes, and a TLS layer inside
this one take a whole read even if they pause during it
(``takes_whole_reads``). Pausing pauses the plain connection, whose next
read takes in at most 1 KiB, holds it and pauses the socket, so the
engine's BIO never grows while the app is paused.

Writes. A connection's first write of a loop iteration, or its first after
a read, is encrypted and sent at once (one record). The plaintext written
after it during the iteration is gathered and encrypted in one
``write_many`` at the end of it (or once ``CORK_LIMIT`` bytes wait), so
records are as full as possible; the ciphertext goes to the plain
connection in one ``writelines``, as pieces (joined there only when they
average under ``JOIN_BELOW``: a large write is never copied). A write that
cannot be sent at once (the plain connection has a queue, or the handshake
is not done) gets a ``WriteRequest``, which completes once its ciphertext
has been sent (``SlabTransport.track``).

Closing. ``close()`` encrypts what is gathered, sends close_notify (unless
the peer's FIN came: asyncio sends none then either) and keeps
reading until the peer's close_notify (or its FIN) ends the read side; then
it closes the plain connection, which sends what it still queues first. The
shutdown timeout bounds the wait. After ``close()`` the app's pause no
longer stops the reads, and the plaintext read is dropped, not delivered
(neither loop's SSL transport gives the app data after its close(): uvloop
drops it, the asyncio loop fails the connection with
APPLICATION_DATA_AFTER_CLOSE_NOTIFY), so that the peer's close_notify,
however much data comes before it, ends the wait.

Failure. ``_fail`` is the one path for every error that ends the
connection: the handshake's, the engine's and the app's callbacks'. The
waiter of ``open_connection``/``start_tls`` or the app's
``connection_lost`` gets the error, after every byte decrypted before it.

Lifecycle: one enum, ``_Stage`` (HANDSHAKE, READY, SHUTDOWN, DONE), one
gate (``_set_stage``). The engine's ``TLSState`` is the TLS session's own
state; the stage is the connection's, as the app sees it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import threading
from collections.abc import Iterable
from typing import Any, Final

from ._errors import (
    HandshakeTimeoutError,
    LocalAbortError,
    ShutdownTimeoutError,
    TLSTruncatedError,
    untraced,
)
from ._tls import MAX_FRAGMENT, TLSEngine
from ._transport import (
    _AFTER_READ, _NOT_YET, CORK_LIMIT, CORK_PIECES, EXITS, SlabTransport, WriteGate,
    _as_bytes_view, _keep, _views_of, _SELECTOR_LOOP, FEED, FEED_PAUSED, FEED_STOPPED,
    FEED_SWITCHED, _loop_resources, callback_name, chunk_deliverer, flow_limits, schedule_flush,
)
from ._write import WriteRequest

__all__ = ["TLSTransport"]

log = logging.getLogger("slabnet")

#: The read-buffer high-water mark both loops' TLS transports start with
#: (asyncio's FLOW_CONTROL_HIGH_WATER_SSL_READ, 256 KiB); low is a quarter.
DEFAULT_READ_HIGH_WATER: Final = 256 * 1024

#: asyncio's defaults (asyncio.constants): 60 s handshake, 30 s shutdown.
SSL_HANDSHAKE_TIMEOUT: Final = 60.0
SSL_SHUTDOWN_TIMEOUT: Final = 30.0

#: Answers the engine sends by itself while the plain connection's queue is
#: paused -- a KeyUpdate of ours for each the peer requests (RFC 8446
#: 4.6.3: every record may carry one), the refusal of a renegotiation -- at
#: most this many bytes of them before reading stops until the peer takes
#: some. A peer that asks without ever reading would otherwise grow our
#: queue at its own sending rate, 27 bytes per request (asyncio's and
#: uvloop's SSL transports let it). 16 KiB is some 600 requests with no
#: progress at all on our side: no peer that reads does that.
ANSWERS_MAX: Final = 16 * 1024

#: What a record adds to its plaintext, at most, with the ciphers OpenSSL
#: negotiates: 5 bytes of header, then an explicit IV, a MAC or tag and
#: padding (AES-CBC with HMAC-SHA384: 16 + 48 + up to 16; AEAD: 8 + 16 or
#: 1 + 16 in TLS 1.3). 128 bounds them all: when plaintext a renegotiation
#: held is sent, this much per record is not counted as answers.
RECORD_OVERHEAD_MAX: Final = 128

#: What ``prepare`` makes the engine from: the context, server_side, the
#: server hostname, ragged EOF, the session.
_EngineArgs = tuple[ssl.SSLContext, bool, "str | None", bool, "ssl.SSLSession | None"]

#: The names get_extra_info answers from the engine, not from the socket.
_TLS_EXTRA: Final = frozenset(
    {"ssl_object", "peercert", "cipher", "compression", "sslcontext", "peercert_bin",
     # TLSEngine.get_extra_info's own names, beyond asyncio's
     "server_hostname", "tls_version", "alpn_protocol", "session", "session_reused"}
)


def check_ssl_timeout(name: str, value: float | None, default: float) -> float:
    """``value``, or ``default`` for None; asyncio's ValueError (its words,
    sslproto.py) for a timeout that is not positive: 0 would fail every
    handshake at once, and a shutdown timeout of 0 would drop what close()
    still has to send."""
    if value is None:
        return default
    # (NaN too, which compares false: the asyncio loop's timer for it never
    # fires, and uvloop's raises ValueError for every connection.)
    if not value > 0:
        raise ValueError(f"{name} should be a positive number, got {value}")
    return value


class _Stage(enum.Enum):
    HANDSHAKE = "handshake"  # the app has no transport yet (or STARTTLS waits)
    READY = "ready"  # reading and writing
    SHUTDOWN = "shutdown"  # close()/abort() called: close_notify exchange, flush
    DONE = "done"  # connection_lost delivered


_STAGES: Final = {
    _Stage.HANDSHAKE: {_Stage.READY, _Stage.SHUTDOWN, _Stage.DONE},
    _Stage.READY: {_Stage.SHUTDOWN, _Stage.DONE},
    _Stage.SHUTDOWN: {_Stage.DONE},
    _Stage.DONE: set(),
}


async def _await(future: asyncio.Future[None]) -> None:
    await future


class TLSTransport(WriteGate):
    """The transport of a TLS connection, and the protocol of the plain
    connection under it. Made by ``SlabProtocol(app, ssl=...)`` and by
    ``SlabTransport.start_tls``."""

    # An idle TLS server holds one per connection. CPython shares one key
    # table among the instance dicts of a class while they hold at most 30
    # keys; one more made each dict 1.3 KiB larger. The attributes added
    # last are slots instead.
    __slots__ = (
        "_iterations", "_sent_in", "_held_plain", "_whole_reads", "_accepted", "_thread",
        "_resume_after_pump", "__dict__", "__weakref__",
    )

    #: To the plain connection: ciphertext is copied into the engine before
    #: chunk_received returns.
    borrows_chunks: Final = True

    def __init__(
        self,
        app: asyncio.BaseProtocol,
        loop: asyncio.AbstractEventLoop,
        sslcontext: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
        ssl_ragged_eof: bool = True,
        ssl_session: Any = None,
        waiter: asyncio.Future[None] | None = None,
        upgrade: bool = False,
        app_paused: bool = False,
    ) -> None:
        super().__init__(loop=loop)  # (sets _loop)
        self._thread = threading.get_ident()  # the loop's (see _wrong_thread)
        self._init_gate()  # (before set_protocol, which the gate watches)
        self._app: Any
        self._deliver: Any
        self.set_protocol(app)
        # An empty name is no name (no SNI, nothing to check), as asyncio's
        # and uvloop's SSL protocols read it; SSLContext.wrap_bio refuses "".
        server_hostname = server_hostname or None
        self._engine_args: _EngineArgs | None = (
            sslcontext, server_side, server_hostname, ssl_ragged_eof, ssl_session)
        self._handshake_timeout = check_ssl_timeout(
            "ssl_handshake_timeout", ssl_handshake_timeout, SSL_HANDSHAKE_TIMEOUT
        )
        self._shutdown_timeout = check_ssl_timeout(
            "ssl_shutdown_timeout", ssl_shutdown_timeout, SSL_SHUTDOWN_TIMEOUT
        )
        self._waiter = waiter
        if waiter is not None:
            waiter.add_done_callback(self._waiter_done)
        self._upgrade = upgrade  # STARTTLS: the app has its (plain) transport
        self._app_made = upgrade  # the app's connection_made was called
        self._engine: TLSEngine | None = None
        # The connection under us: the plain one, or for TLS inside TLS
        # (start_tls on a TLS connection) the outer TLS layer.
        self._lower: SlabTransport | TLSTransport | None = None
        self._stage = _Stage.HANDSHAKE
        self._closing = False  # SHUTDOWN or DONE: a hot check
        self._timer: asyncio.TimerHandle | None = None  # handshake or shutdown
        self._read_over = False  # read side ended: close_notify, EOF or failure
        self._peer_eof = False  # the peer's TCP FIN arrived
        self._error: BaseException | None = None  # what connection_lost reports
        self._reading_paused = False  # by the app
        self._read_high, self._read_low = flow_limits(None, None, DEFAULT_READ_HIGH_WATER)
        # The engine's own answers (ANSWERS_MAX): bytes sent while the plain
        # connection's queue is paused, and whether reading waits for it.
        self._lower_paused = False
        self._answers = 0
        self._answers_wait = False
        # The app resumed with records or plaintext held: the plain
        # connection resumes once the pump has delivered them (_pump).
        self._resume_after_pump = False
        self._released = 0  # the engine's released_plaintext, as last sent
        self._plain: list[memoryview] = []  # plaintext for the next flush
        self._plain_bytes = 0
        self._flush_scheduled = False
        # The iteration of the last write encrypted at once, or _AFTER_READ
        # or _REPLIED (see write and _gather; as SlabTransport.write).
        self._iterations = _loop_resources(loop).iterations
        self._sent_in = _NOT_YET
        # Plaintext a paused BufferedProtocol app's buffers did not take
        # (hold_rest): delivered before anything newer once it resumes.
        self._held_plain: memoryview | None = None
        self._reqs: list[WriteRequest] = []  # waiting for encryption
        # Requests whose plaintext the engine holds until a renegotiation
        # ends (TLSEngine.held_plaintext): tracked once it is encrypted.
        self._held: list[WriteRequest] = []
        # A server's incoming connection on the asyncio loop, until its
        # handshake ends: what the task that waits for it awaits (see
        # _wait_as_accepted).
        self._accepted: asyncio.Future[None] | None = None
        if app_paused:
            # STARTTLS on a plain connection whose writing is paused: the app
            # has had pause_writing and waits for its resume, which is ours
            # to give now, once the plain connection resumes.
            self._protocol_paused = True

    # ------------------------------------------------ lifecycle gate

    def _set_stage(self, new: _Stage) -> None:
        if new not in _STAGES[self._stage]:
            raise RuntimeError(f"slabnet TLS transport: {self._stage.value} -> {new.value}")
        self._stage = new
        self._closing = new is _Stage.SHUTDOWN or new is _Stage.DONE

    def is_closing(self) -> bool:
        # Also once the plain connection below is closing (a send failed: a
        # reset; the loop read one): no write reaches the peer any more,
        # and a writer's drain() must let connection_lost run, not return
        # at once to a loop of write() and drain() that never yields.
        lower = self._lower
        return self._closing or (lower is not None and lower.is_closing())

    def _writes_closed(self) -> bool:
        lower = self._lower
        return self._closing or lower is None or lower.is_closing()

    def prepare(self) -> None:
        """Make the engine. It raises for a bad ``server_hostname``
        (UnicodeError, ValueError) or a client context on the server side
        (ssl.SSLError): STARTTLS calls this before the connection changes
        hands, so the plain connection and its unread bytes stay the app's."""
        assert self._engine_args is not None, "the engine is made once"
        ctx, server_side, hostname, ragged, session = self._engine_args
        engine = TLSEngine(
            ctx, server_side=server_side, server_hostname=hostname,
            session=session, ragged_eof=ragged,
        )
        engine.answers_limit = ANSWERS_MAX  # (see _pump)
        self._engine = engine
        self._engine_args = None  # (the engine holds what it needs)

    # ================================================ the plain connection's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, (SlabTransport, TLSTransport))
        self._lower = lower = transport
        if self._upgrade:
            low, high = lower.get_write_buffer_limits()
            self.set_write_buffer_limits(high, low)
        else:
            self._forward_limits()
        if self._engine is None:  # (STARTTLS made it before the switch)
            try:
                self.prepare()
            except Exception as exc:
                # Nothing may be read as plaintext on a connection meant for TLS.
                self._fail(exc, "slabnet: could not set up the connection")
                return
        self._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)
        assert self._engine is not None
        incoming = self._waiter is None and not self._upgrade and self._engine.ssl_object.server_side
        if incoming and isinstance(self._loop, _SELECTOR_LOOP):
            self._wait_as_accepted()
        self._handshake()

    def _wait_as_accepted(self) -> None:
        """Give a server's incoming connection the task the asyncio loop
        gives its own: that loop accepts each in a task that awaits the
        handshake and closes the connection if it is cancelled, as
        ``asyncio.run()`` cancels every task when it returns. So a client
        that never finishes its handshake does not leave the socket open
        past the run, for the collector to warn of. (uvloop has no such
        task: its ``close()`` warns of the connection, as of its own.) The
        task ends with the handshake; the future it awaits keeps it."""
        self._accepted = accepted = self._loop.create_future()
        accepted.add_done_callback(self._accept_cancelled)
        self._loop.create_task(_await(accepted))

    def _accept_cancelled(self, accepted: asyncio.Future[None]) -> None:
        # (Cancelling the task cancels the future it awaits.) Not reported:
        # nothing failed, the app has not seen the connection.
        if accepted.cancelled() and self._stage is _Stage.HANDSHAKE and self._lower is not None:
            self._read_over = True
            self._abort(LocalAbortError("the TLS handshake was cancelled"))

    def _handshake_over(self) -> None:
        accepted = self._accepted
        if accepted is not None:
            self._accepted = None
            if not accepted.done():
                accepted.set_result(None)

    def chunk_received(self, data: memoryview) -> None:
        """Ciphertext from the plain connection, lent until we return."""
        engine = self._engine
        if engine is None:
            return  # set-up failed: the connection is being aborted
        if self._stage is not _Stage.HANDSHAKE:
            self._sent_in = _AFTER_READ
            # A whole read, to an app that takes one even if it pauses
            # during it (see set_protocol).
            self._pump(self._whole_reads and not self._reading_paused, False, data)
            return
        # The read that completes the handshake may carry a burst of data
        # behind it: it goes into the BIO by pieces like every other read,
        # and what the handshake leaves of it is delivered (whole, to an app
        # that takes whole reads; else until the app pauses). Whatever
        # is left, not only what is still ciphertext: the engine may hold
        # the end of it already (the peer's close_notify, taken in with
        # the record before it), which no later read would bring. (The
        # handshake delivers it: see the end of _handshake.)
        engine.lend_data(data)
        try:
            self._handshake()
        finally:
            engine.release_lent()

    def eof_received(self) -> bool:
        engine = self._engine
        if engine is None or self._stage is _Stage.HANDSHAKE:
            self._peer_eof = True
            if engine is not None:
                engine.receive_eof()
                self._handshake()
            return True
        # Records that came before the EOF are read before it: all of them
        # now for a stream (it takes whole reads, paused or not) and inside
        # another TLS layer, which closes once this returns; for a protocol
        # until it pauses, and the rest, then the end, once it resumes
        # (_resume_lower): a protocol gets nothing while paused, and over
        # TCP the FIN leaves the connection open for our answer.
        whole = self._whole_reads or isinstance(self._lower, TLSTransport)
        if engine.input_pending and not self._read_over:
            # (Inside another TLS layer, which delivers its whole read even
            # to a paused app, our records can wait in the engine while that
            # layer reads on to its close_notify. The peer's close_notify
            # among them is answered with ours, as it would be without the
            # pause: asyncio's streams answer it too.)
            self._pump(whole)
        self._peer_eof = True
        # The peer's FIN ends its direction only: ours stays open until our
        # close. Encrypt what the app wrote this iteration now, while the
        # engine still takes plaintext (a FIN without close_notify breaks
        # it when strict), so all of it is sent before the socket closes.
        if self._plain and self._stage is _Stage.READY:
            self._flush()
        engine.receive_eof()
        self._pump(whole)
        return True  # we close the plain connection ourselves

    def connection_lost(self, exc: BaseException | None) -> None:
        stage = self._stage
        if stage is _Stage.DONE:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._error is None:
            self._error = exc  # (an error of the final delivery comes second)
            if (
                exc is not None and stage is _Stage.HANDSHAKE and self._waiter is None
                and self._loop.get_debug()
            ):
                # A server's incoming connection, lost in its handshake (a
                # reset): reported in debug mode, as _fail reports one that
                # failed there, and as asyncio's loop reports it.
                self._report_setup_failed(exc)
        try:
            if self._engine is not None and stage is not _Stage.HANDSHAKE and (
                not self._read_over or self._held_plain is not None
            ):
                # Deliver every byte that was decrypted before the connection
                # went; if reading is paused, to whom WriteGate._final_receiver
                # says, if anyone.
                receiver = self._app if not self._reading_paused else self._final_receiver(self._app)
                if receiver is not None:
                    if receiver is not self._app:
                        self._deliver, _ = chunk_deliverer(receiver, self)
                    self._pump(force=True, final=True)
        finally:
            # Even if the app's chunk_received raised KeyboardInterrupt or
            # SystemExit there: the app still hears the connection go.
            self._end(stage)

    def _end(self, stage: _Stage) -> None:
        """The rest of connection_lost, once what was decrypted is delivered."""
        if self._timer is not None:
            # That delivery may have started a shutdown (the app's close()
            # from a chunk): nothing is left to time.
            self._timer.cancel()
            self._timer = None
        self._handshake_over()
        err = self._error
        self._fail_writes(err or ConnectionResetError("connection lost with data unsent"))
        self._stage = _Stage.DONE  # always allowed: the connection is gone
        self._closing = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(err or ConnectionResetError(
                "connection lost during the TLS handshake"
                if stage is _Stage.HANDSHAKE else "connection lost"
            ))
        try:
            if self._app_made:
                self._app.connection_lost(err)
        finally:
            # Then let the app go, as the plain connection lets us go: it
            # holds us (a stream's transport), and the cycle would keep the
            # connection and its SSLObject for the cyclic garbage collector.
            self._app = self._deliver = None

    def pause_writing(self) -> None:
        self._lower_paused = True
        self._check_pause()  # the plain connection's queue is part of ours

    def resume_writing(self) -> None:
        self._lower_paused = False
        self._answers = 0  # the peer takes what we send
        if self._answers_wait:
            self._answers_wait = False
            self._resume_lower()
        self._check_pause(True)  # (told by the plain connection, from the loop)

    # ================================================ the app's side

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        engine = self._engine
        if engine is not None and name in _TLS_EXTRA:
            return engine.get_extra_info(name, default)
        lower = self._lower
        return default if lower is None else lower.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        app: asyncio.BaseProtocol = self._app
        return app

    # A BufferedProtocol app: the owner of its _BufferFiller.

    def feed_state(self, protocol: Any) -> int:
        if self._closing or self._stage is _Stage.DONE or isinstance(self._error, LocalAbortError):
            return FEED_STOPPED
        if self._reading_paused:
            return FEED_PAUSED  # (after a switch too: the new one gets it on resume)
        return FEED_SWITCHED if self._app is not protocol else FEED

    def hold_rest(self, rest: memoryview) -> None:
        held = self._held_plain
        self._held_plain = rest if held is None else memoryview(held.tobytes() + rest.tobytes())

    def deliver_now(self, chunk: memoryview) -> None:
        self._deliver(chunk)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        # Any protocol, as the loop's transports take (loop.sendfile()'s
        # fallback sets its own asyncio Protocol for the time of the send).
        deliver, _ = chunk_deliverer(protocol, self)
        self._app = protocol
        self._deliver = deliver
        # Whether the app takes every chunk of a read even once it has
        # paused reading meanwhile (slabnet's streams buffer them). Any
        # other gets none after its pause: the rest waits for its resume,
        # as asyncio's transports call no data_received() while paused
        # (the app may hand the connection over with set_protocol()).
        self._whole_reads = bool(getattr(protocol, "takes_whole_reads", False))
        if self._sendfile_swap(protocol):
            self.resume_reading()

    # STARTTLS inside this session: WriteGate.upgrade_tls (TLS inside TLS,
    # as a client reaches a TLS destination through a TLS proxy).

    def _check_upgradable(self) -> None:
        if self._closing or self._stage is not _Stage.READY:
            raise ConnectionResetError(
                "cannot start TLS on a connection that is closed or still in its handshake"
            )

    def _carry(self, tls: TLSTransport) -> None:
        self._app = tls  # (the app is the inner layer's from now on)
        self._deliver = tls.chunk_received
        self._whole_reads = True  # (ciphertext, into the inner engine)

    def track(self, req: WriteRequest) -> None:
        """Complete ``req`` once every byte written so far has been sent
        (``SlabTransport.track``; for a TLS layer inside this one)."""
        if self._stage is _Stage.DONE or self._lower is None:
            req._finish(self._error or ConnectionResetError("connection lost with data unsent"))
        elif self._plain or self._stage is _Stage.HANDSHAKE:
            self._reqs.append(req)  # tracked once that plaintext is encrypted
        else:
            self._track([req])

    # ------------------------------------------------ reading

    # The socket's state is the plain connection's; ours is only whether
    # the app wants chunks. So a STARTTLS upgrade started while the plain
    # transport was paused is resumed by either transport's resume_reading.

    def is_reading(self) -> bool:
        # From close() on the app gets nothing more: False, as uvloop's TLS
        # transport and both loops' plain ones say (our shutdown still reads,
        # to the peer's close_notify, and drops what it reads).
        lower = self._lower
        return (
            not self._reading_paused and not self._closing
            and lower is not None and (lower.is_reading() or self._resume_after_pump)
        )

    def pause_reading(self) -> None:
        self._note_pause(not self._reading_paused)
        if self._reading_paused or self._closing:
            # (After close(), reading goes on to the peer's close_notify,
            # as asyncio's shutdown reads, and drops what it reads.)
            return
        self._reading_paused = True
        assert self._lower is not None
        self._lower.pause_reading()

    def resume_reading(self) -> None:
        if self._stage is _Stage.DONE or not self._note_resume():
            return  # (gone, or sending a file: WriteGate._note_resume)
        was_paused = self._reading_paused
        self._reading_paused = False
        self._resume_lower(was_paused)

    def _resume_lower(self, held: bool = True) -> None:
        """Resume the plain connection's reads, unless the app's pause or
        the engine's unread answers still hold them; ``held``: records may
        have arrived meanwhile."""
        if self._answers_wait or self._reading_paused:
            return
        assert self._lower is not None
        engine = self._engine
        backlog = engine is not None and (
            engine.buffered_ciphertext or engine.plaintext_waiting
            or self._held_plain is not None
        )
        if backlog:
            # Records that arrived before the pause are delivered first, and
            # only then does the plain connection read again: resumed now,
            # its next read (256 KiB) could come before the pump, be kept
            # behind them (a copy of all that is held), and the app, which
            # pauses again after a chunk or two, would make every turn of
            # the loop read more than it delivers: the whole stream held,
            # and copied once a read. (So after any resume, a second one
            # too, made before that pump: it finds them still held.)
            self._resume_after_pump = True
        else:
            self._resume_after_pump = False
            self._lower.resume_reading()
        if backlog or held and engine is not None and not self._read_over and (
            engine.read_ended or self._peer_eof
        ):
            # So is an end the engine read with them: no input may come to
            # bring it (a peer waits for our close_notify after its own).
            self._loop.call_soon(self._pump)

    # The read-buffer limits of the loops' TLS transports: their SSL
    # protocol buffers incoming ciphertext up to the high mark before it
    # pauses the socket. Ours holds no more than one read's: it decrypts
    # each read as it comes, and reading pauses with the app. So the limits
    # are kept and reported, as set, and change nothing; the size is the
    # ciphertext that has come and is not decrypted yet, as theirs is.

    def set_read_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._read_high, self._read_low = flow_limits(high, low, DEFAULT_READ_HIGH_WATER)

    def get_read_buffer_limits(self) -> tuple[int, int]:
        return (self._read_low, self._read_high)

    def get_read_buffer_size(self) -> int:
        engine = self._engine
        return 0 if engine is None else engine.buffered_ciphertext

    def has_pending_input(self) -> bool:
        """True if ciphertext has arrived that was not delivered as plaintext
        yet (``TLSEngine.input_pending``): the start of a record waiting for
        the rest, or records left while reading is paused. The peer of an
        idle connection that holds any has sent something."""
        engine = self._engine
        return engine is not None and engine.input_pending

    # ------------------------------------------------ writing

    def write(self, data: Any) -> WriteRequest | None:  # type: ignore[override]
        """Encrypt and send ``data``; None if nothing is waiting for the
        socket, else a WriteRequest that completes once it is sent."""
        if threading.get_ident() != self._thread:
            self._wrong_thread()
        view = data if type(data) is bytes else _as_bytes_view(data)
        n = len(view)
        if not n:
            return None
        if self._closing or self._eof_requested:
            if not self._check_writable():
                return None
        if (
            self._sent_in != self._iterations.now and not self._plain
            and n <= MAX_FRAGMENT and self._stage is _Stage.READY
        ):
            lower, engine = self._lower, self._engine
            assert lower is not None and engine is not None
            if not lower.get_write_buffer_size():
                # The first write of an iteration, nothing gathered or
                # queued: one record, sent at once (what _gather and
                # _encrypt would do, without their lists).
                try:
                    cipher = engine.write_alone(view)
                except Exception as exc:  # (as in _flush)
                    self._abort(untraced(exc))
                    return None
                if cipher is not None:
                    self._sent_in = self._iterations.stamp(self._sent_in, self._loop)
                    if cipher:
                        lower.write(cipher)
                    if engine.held_plaintext or lower.get_write_buffer_size():
                        self._check_pause()
                    return None
        return self._gather(memoryview(view), n)

    def writelines(self, list_of_data: Iterable[Any]) -> WriteRequest | None:  # type: ignore[override]
        if threading.get_ident() != self._thread:
            self._wrong_thread()
        views, total = _views_of(list_of_data)
        if not views:
            return None
        if len(views) == 1:
            return self.write(views[0])  # (a timer's one frame: one record at once)
        if self._closing or self._eof_requested:
            if not self._check_writable():
                return None
        # All of them are gathered before anything is sent or the app is
        # told to pause: its pause_writing() may write or close, and that
        # comes after the whole call, as with the loops' transports.
        plain = self._plain
        for v in views:
            plain.append(_keep(v))
        self._plain_bytes += total
        return self._gathered(total)

    def _wrong_thread(self) -> None:
        """A write from another thread than the one the connection was made
        in: refused unless that thread runs the loop now (a loop may be run
        by another thread later). The loop's thread may be in OpenSSL with
        this connection's SSL object at the same moment (CPython lets go of
        the GIL there), and two threads in one SSL object crash the process;
        asyncio's transports are not thread-safe either."""
        if asyncio._get_running_loop() is self._loop:
            self._thread = threading.get_ident()
            return
        raise RuntimeError(
            "a TLS transport written to from a thread other than its event loop's: "
            "use loop.call_soon_threadsafe()"
        )

    def _gather(self, view: memoryview, n: int) -> WriteRequest | None:
        # Encrypted at the end of the iteration: the caller may reuse its
        # buffer before that.
        self._plain.append(_keep(view))
        self._plain_bytes += n
        return self._gathered(n)

    def _gathered(self, n: int) -> WriteRequest | None:
        """``n`` bytes of plaintext were just gathered (one write's): send
        them now, or at the end of the iteration; their request, if they
        must wait for the plain connection."""
        req = None
        stage = self._stage
        lower = self._lower
        queued = 0 if lower is None else lower.get_write_buffer_size()
        if queued or stage is _Stage.HANDSHAKE:
            # Its ciphertext position is known once it is encrypted.
            req = WriteRequest(n, -1, None, self._loop)
            self._reqs.append(req)
        if stage is _Stage.READY:
            if self._sent_in != self._iterations.now:
                # The first write of an iteration, or the first after a
                # read, is encrypted and sent at once: a frame sent on a
                # timer or a reply waits for no callback. What follows it in
                # the same iteration is gathered into one record.
                self._sent_in = self._iterations.stamp(self._sent_in, self._loop)
                self._flush()  # (checks the pause itself)
                return req
            if self._plain_bytes >= CORK_LIMIT or len(self._plain) >= CORK_PIECES:
                # (Pieces: each is a view of the app's buffer, some 200
                # bytes of objects; 65,536 one-byte writes held 20 MiB.)
                self._flush()
                return req
            if not self._flush_scheduled:
                self._flush_scheduled = schedule_flush(self._loop, self._flush_soon)
        if queued + self._plain_bytes > self._high:
            self._check_pause()
        return req

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("write_eof() is not supported on TLS connections")

    def get_write_buffer_size(self) -> int:
        # Plaintext gathered, plaintext the engine holds during a TLS 1.2
        # renegotiation (a peer that never finishes one must not make a
        # writer buffer without bound), and the plain connection's queue.
        lower, engine = self._lower, self._engine
        return (
            self._plain_bytes
            + (0 if engine is None else engine.held_plaintext)
            + (0 if lower is None else lower.get_write_buffer_size())
        )

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        super().set_write_buffer_limits(high, low)
        self._forward_limits()

    def _forward_limits(self) -> None:
        # The plain connection's pause/resume calls tell us when to look
        # again, so it pauses above our low-water mark and resumes at it: we
        # may be paused by plaintext while its queue stays under our high
        # mark, and then its drain to our low mark must still reach us.
        if self._lower is not None:
            self._lower.set_write_buffer_limits(self._low, self._low)

    # ------------------------------------------------ closing

    def close(self) -> None:
        stage = self._stage
        if stage is _Stage.SHUTDOWN or stage is _Stage.DONE:
            return
        if stage is _Stage.HANDSHAKE:
            # Nothing was exchanged with the application yet.
            self._abort(LocalAbortError("closed during the TLS handshake"))
            return
        self._set_stage(_Stage.SHUTDOWN)
        engine, lower = self._engine, self._lower
        assert engine is not None and lower is not None
        try:
            self._encrypt()
            if not self._peer_eof:
                # A peer whose FIN came has left TLS: no close_notify goes
                # to it (asyncio's _do_shutdown skips unwrap() then too).
                engine.start_shutdown()
        except Exception as exc:
            # The engine broke on an earlier write (ssl.SSLError): no
            # close_notify can follow. close() never raises (asyncio's
            # does not): the connection ends with that error instead.
            self._abort(untraced(exc))
            return
        self._send_output()
        self._timer = self._loop.call_later(self._shutdown_timeout, self._shutdown_timed_out)
        if self._read_over:
            self._close_lower()  # the peer's close_notify came first
            return
        if self._reading_paused:
            self._reading_paused = False
            self._resume_lower(held=False)  # (the pump below reads what is held)
        # What arrived while reading was paused (it may hold the peer's
        # close_notify), and plaintext the shutdown took out of OpenSSL,
        # is read now: nothing new may ever arrive to start the pump.
        self._loop.call_soon(self._pump)

    def abort(self, exc: BaseException | None = None) -> None:
        """Close at once, dropping queued data (see ``SlabTransport.abort``).

        Plaintext gathered for the end-of-iteration flush is encrypted and
        handed to the plain connection first: asyncio's ``write()`` encrypts
        and sends at once, so that much had gone out there too.
        """
        if self._plain and self._stage is _Stage.READY:
            try:
                self._encrypt()
            except Exception:  # (the engine refuses: the abort ends it anyway)
                pass
        self._abort(exc or LocalAbortError("connection aborted locally (transport.abort())"))

    def _abort(self, exc: BaseException) -> None:
        if self._stage is _Stage.DONE:
            return
        if self._error is None:
            self._error = exc
        self._fail_writes(exc)
        if self._stage is not _Stage.SHUTDOWN:
            self._set_stage(_Stage.SHUTDOWN)
        assert self._lower is not None
        self._lower.abort(exc)

    def _close_after(self, exc: BaseException) -> None:
        """The peer's FIN came without close_notify and the engine refuses
        that (strict). The read side is over, ours is not: the plain
        connection sends what it queues (the app wrote it before the FIN
        arrived), then closes, and the app gets ``exc`` in connection_lost.
        Bounded by the shutdown timeout, like a graceful close."""
        if self._error is None:
            self._error = exc
        self._set_stage(_Stage.SHUTDOWN)
        self._timer = self._loop.call_later(self._shutdown_timeout, self._shutdown_timed_out)
        assert self._lower is not None
        self._lower.close()

    def _shutdown_timed_out(self) -> None:
        self._timer = None
        # asyncio's own words first (sslproto.py, uvloop's too), so that
        # code matching its message keeps working.
        self._abort(ShutdownTimeoutError(
            f"SSL shutdown timed out (not done within {self._shutdown_timeout} s)"
        ))

    # ------------------------------------------------ writing: internals

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        if self._stage is not _Stage.DONE:
            self._flush(True)

    def _flush(self, from_loop: bool = False) -> None:
        if self._plain and self._stage is not _Stage.HANDSHAKE:
            try:
                self._encrypt()
            except Exception as exc:
                # The engine refused to encrypt (ssl.SSLError): nothing more
                # can be sent in order. The connection ends with that error,
                # which every waiter gets, instead of escaping to the loop.
                self._abort(untraced(exc))
                return
        self._check_pause(from_loop)

    def _encrypt(self) -> None:
        """Encrypt the plaintext gathered this iteration and send it."""
        plain = self._plain
        if not plain:
            return
        engine, lower = self._engine, self._lower
        assert engine is not None and lower is not None
        self._plain = []
        self._plain_bytes = 0
        engine.write_many(plain)
        # A large write comes out in several pieces (TLSEngine.WRITE_SLICE);
        # each is queued as it is (writelines joins only small ones).
        pieces = engine.data_to_send_many()
        if pieces:
            lower.writelines(pieces)
        reqs = self._reqs
        if reqs:
            self._reqs = []
            self._track(reqs)
        if engine.plaintext_waiting and not self._reading_paused:
            # During a renegotiation the write decrypted the data in front
            # of it first (TLSEngine._read_ahead): no new input may come to
            # deliver it.
            self._loop.call_soon(self._pump)

    def _track(self, reqs: list[WriteRequest]) -> None:
        """Make ``reqs`` complete once the ciphertext queued so far is sent,
        unless the engine still holds plaintext (a TLS 1.2 renegotiation is
        in progress): then theirs is among it, or behind it, and they wait
        for ``_send_output`` after the read that ends the renegotiation."""
        engine, lower = self._engine, self._lower
        assert engine is not None and lower is not None
        if engine.held_plaintext:
            self._held.extend(reqs)
            return
        if self._held:
            reqs = self._held + reqs
            self._held = []
        for req in reqs:
            lower.track(req)

    def _send_output(self) -> None:
        """Send what the engine produced by itself (handshake, alerts,
        renegotiation, close_notify)."""
        engine, lower = self._engine, self._lower
        assert engine is not None and lower is not None
        pieces = engine.data_to_send_many()
        released = engine.released_plaintext - self._released
        self._released = engine.released_plaintext
        if pieces and not lower.is_closing():
            lower.writelines(pieces)
            if self._lower_paused and self._stage is not _Stage.HANDSHAKE:
                sent = sum(map(len, pieces))
                if released:
                    # The app's writes a renegotiation held, now encrypted:
                    # not answers. Counted as such they stopped the reads
                    # (a peer that reads only once it has written, as
                    # openssl s_server does, then waited for us for good).
                    records = released // MAX_FRAGMENT + 1
                    sent = max(0, sent - released - records * RECORD_OVERHEAD_MAX)
                self._answers += sent
                if self._answers > ANSWERS_MAX and not self._answers_wait:
                    # The peer asks for answers and reads none of them.
                    self._answers_wait = True
                    lower.pause_reading()
        if self._held and not engine.held_plaintext:
            self._track([])
        if self._protocol_paused:
            self._check_pause()  # held plaintext may have been encrypted

    def _fail_writes(self, exc: BaseException) -> None:
        for req in self._held + self._reqs:
            req._finish(exc)
        self._reqs = []
        self._held = []
        self._plain = []
        self._plain_bytes = 0

    # ------------------------------------------------ handshake

    def _handshake(self) -> None:
        engine = self._engine
        assert engine is not None
        try:
            done = engine.do_handshake()
        except Exception as exc:
            # (Kept by the engine and by us: see _errors.untraced.)
            exc = untraced(exc)
            self._send_output()
            if isinstance(exc, TLSTruncatedError) and self._peer_eof:
                # The peer's FIN cut the handshake: asyncio's (and uvloop's)
                # ConnectionResetError, which code written for them catches.
                reset = self._handshake_reset()
                reset.__cause__ = exc
                exc = reset
            self._fail(exc)
            return
        self._send_output()
        if not done:
            if self._peer_eof:
                self._fail(self._handshake_reset())
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._handshake_over()
        self._set_stage(_Stage.READY)
        if not self._upgrade:
            self._app_made = True
            try:
                self._app.connection_made(self)
            except EXITS:
                raise
            except BaseException as exc:  # (CancelledError too: see EXITS)
                self._app_failed(exc, "connection_made")
                return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._plain:
            self._flush()
        # What the engine holds of the read that completed the handshake:
        # whole to an app that takes whole reads, unless it paused in
        # connection_made (a stream's handler that runs there: a plain
        # function, or an eager task), before this delivery began.
        self._pump(self._whole_reads and not self._reading_paused)

    def _waiter_done(self, waiter: asyncio.Future[None]) -> None:
        # The caller gave up on the handshake (a timeout, a cancelled task):
        # what was exchanged is neither plaintext nor TLS, so the connection
        # ends, as asyncio's start_tls closes its transport then.
        if waiter.cancelled() and self._stage is _Stage.HANDSHAKE and self._lower is not None:
            self._fail(LocalAbortError("the TLS handshake was cancelled"))

    @staticmethod
    def _handshake_reset() -> ConnectionResetError:
        return ConnectionResetError("peer closed the connection during the TLS handshake")

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self._stage is _Stage.HANDSHAKE:
            # asyncio's own words (sslproto.py), so that code matching its
            # message keeps working.
            self._fail(HandshakeTimeoutError(
                f"SSL handshake is taking longer than {self._handshake_timeout}"
                " seconds: aborting the connection"
            ))

    # ------------------------------------------------ reading: internals

    def _pump(
        self, force: bool = False, final: bool = False, data: memoryview | None = None
    ) -> None:
        """Deliver decrypted chunks until the engine needs more input.

        ``data`` is new ciphertext, lent: the engine may keep a reference to
        it while it decrypts and must have copied it all before we return.
        ``force``: deliver even if the app pauses reading meanwhile.
        ``final``: from ``connection_lost``; deliver what is left, report
        nothing but through ``_error``.

        Errors from the engine and from the app are kept apart: the engine's
        end the read side (after every byte before them), the app's are its
        bugs, reported to the loop's exception handler whatever the stage.
        """
        engine = self._engine
        if engine is None:
            return
        if self._stage is _Stage.DONE or isinstance(self._error, LocalAbortError) or (
            self._read_over and self._held_plain is None
        ):
            if data is not None:
                engine.receive_data(data)  # an engine that is done ignores it
            self._lower_resumes()  # (nothing to deliver before it)
            return
        if data is not None:
            if self._read_over:  # (back for held plaintext only)
                engine.receive_data(data)
                data = None
            else:
                engine.lend_data(data)
        app_error: BaseException | None = None
        failed_in = "chunk_received"
        try:
            while force or not self._reading_paused:
                chunk = self._held_plain
                if chunk is not None and not self._reading_paused:
                    self._held_plain = None  # (the older bytes first)
                elif self._read_over:
                    break  # (back for the held plaintext only: the rest was read)
                else:
                    chunk = engine.read_chunk()
                if chunk is None:
                    if not engine.answers_stopped:
                        break
                    # The reads made ANSWERS_MAX of output by themselves
                    # (refused renegotiations, KeyUpdates): sent before the
                    # rest of the read is answered, so that reading stops
                    # there if nobody reads them; one read of 4-byte
                    # requests would otherwise queue 7.75 times its size.
                    if not final:
                        self._send_output()
                        if self._answers_wait:
                            break
                    continue
                if not chunk:
                    self._read_over = True
                    break
                if self._closing:
                    # close() was called: the app is done, and only the
                    # peer's close_notify ends the shutdown. What the peer
                    # sent before it is dropped: a reader nobody reads must
                    # neither grow nor, by its pause, stall the exchange,
                    # and an app that closed (an idle HTTP/2 connection)
                    # must not get a request that crossed its close_notify.
                    continue
                try:
                    # (The app's now: set_protocol() may have been called
                    # from the last chunk's callback.)
                    deliver = self._deliver
                    deliver(chunk)
                except EXITS:
                    # KeyboardInterrupt, SystemExit: out of run_forever, as
                    # the loops let them out. What this read decrypted
                    # beyond the chunk would wait in the engine for the
                    # peer's next bytes, which may never come: delivered
                    # (and answered) once the loop runs again.
                    if not final:
                        self._loop.call_soon(self._pump)
                    raise
                except BaseException as exc:  # (CancelledError too: see EXITS)
                    app_error, failed_in = exc, callback_name(deliver)
                    break
                if isinstance(self._error, LocalAbortError):
                    return  # abort() from chunk_received: that was the last
        except Exception as exc:
            self._read_failed(untraced(exc), final)
            return
        finally:
            if data is not None:
                engine.release_lent()
        if app_error is not None:
            self._app_failed(app_error, failed_in, final)
            return
        if final:
            return
        self._send_output()
        self._lower_resumes()
        if self._read_over and self._held_plain is None:
            # (With plaintext held for a paused app, the EOF comes after
            # it: from the pump of its resume.)
            self._read_eof()

    def _lower_resumes(self) -> None:
        """What was held at the app's resume is delivered (``_resume_lower``):
        the plain connection reads again, unless the app paused meanwhile
        or the engine's answers hold it."""
        if (
            self._resume_after_pump and not self._reading_paused and not self._answers_wait
            and self._lower is not None
        ):
            self._resume_after_pump = False
            self._lower.resume_reading()

    def _read_failed(self, exc: Exception, final: bool) -> None:
        """The engine ended the read side with ``exc``, after every byte."""
        self._read_over = True
        if final:
            self._error = self._error or exc
        elif self._stage is _Stage.SHUTDOWN:
            # We asked to close; the peer went without its close_notify.
            self._close_lower()
        elif isinstance(exc, TLSTruncatedError) and self._peer_eof:
            # Strict: the peer's FIN came without close_notify. Only its
            # direction is over: what we queued still goes out, then the
            # app learns of the truncation in connection_lost.
            self._close_after(exc)
        else:
            self._send_output()
            self._fail(exc)

    def _read_eof(self) -> None:
        closing = self._stage is _Stage.SHUTDOWN
        if closing and self._error is not None:
            self._close_lower()  # aborted: the app hears nothing more
            return
        # The peer's side ended cleanly. After our close() too: asyncio and
        # uvloop call eof_received() there as well, before connection_lost.
        try:
            keep_open = self._app.eof_received()
        except EXITS:
            raise
        except BaseException as exc:
            self._app_failed(exc, "eof_received")
            return
        if closing:
            self._close_lower()
            return
        if keep_open:
            log.debug("%r: eof_received() returned True, ignored over TLS", self._app)
        self.close()

    def _close_lower(self) -> None:
        """Both close_notify alerts went (or the peer is gone): the plain
        connection sends what it still queues, then closes."""
        assert self._lower is not None
        self._lower.close()

    # ------------------------------------------------ failure

    def _fail(self, exc: BaseException, setup: str | None = None) -> None:
        """The one failure path: end the connection with ``exc``.

        ``exc`` goes to whoever waits for this connection: the waiter of
        ``open_connection``/``start_tls`` if it still waits, and the app's
        ``connection_lost`` if the app has seen ``connection_made``. A local
        failure to set the connection up (``setup``: the message) that
        neither would see -- a server's incoming connection -- goes to the
        loop's exception handler; so does the handshake of a server's
        incoming connection that the peer fails, in debug mode only, as
        asyncio's loop reports it (with its message). Then
        the plain connection is aborted: the socket closes at once and
        nothing more is read, so nothing is buffered or delivered after
        the failure.
        """
        self._read_over = True
        waiter = self._waiter
        told = self._app_made
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            told = True
        # (No waiter: a server's incoming connection; asyncio's loop reports
        # its failed handshake in debug mode.)
        if not told and (setup is not None or (waiter is None and self._loop.get_debug())):
            self._report_setup_failed(exc, setup)
        self._abort(exc)

    def _report_setup_failed(self, exc: BaseException, setup: str | None = None) -> None:
        """Tell the loop's exception handler that the connection could not
        be set up (``setup``: the message), in asyncio's loop's words for an
        incoming connection whose handshake failed."""
        self._loop.call_exception_handler({
            "message": setup or "Error on transport creation for incoming connection",
            "exception": exc, "protocol": self._app, "transport": self,
        })

    def _app_failed(self, exc: BaseException, name: str, final: bool = False) -> None:
        """The app's callback ``name`` raised: an application bug. Report it
        to the loop's exception handler (as the loops do for a protocol's
        ``data_received``) and end the connection with it."""
        self._loop.call_exception_handler({
            "message": f"slabnet: protocol.{name}() failed",
            "exception": exc, "protocol": self._app, "transport": self,
        })
        if final:  # connection_lost is running: it reports _error
            self._read_over = True
            self._error = self._error or exc
            return
        self._fail(exc)

    def __repr__(self) -> str:
        return f"<TLSTransport {self._stage.value} over={self._lower!r}>"
