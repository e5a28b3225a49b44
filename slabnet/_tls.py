"""Sans-IO TLS engine: one connection's TLS over ``ssl.SSLObject`` and two
``MemoryBIO`` objects, turning ciphertext into exact-size plaintext chunks
and plaintext into ciphertext pieces.

Theory of operation
===================

The engine never touches a socket.  The shell lends it ciphertext with
:meth:`TLSEngine.lend_data`: the engine moves it into the incoming
``MemoryBIO`` piece by piece as it reads, and :meth:`TLSEngine.release_lent`
copies what is left before the caller reuses its buffer (a view of the
shared read slab).  :meth:`TLSEngine.receive_data` copies ciphertext at once
instead.  The shell asks for plaintext with :meth:`TLSEngine.read_chunk`, and sends
whatever :meth:`TLSEngine.data_to_send` (one ``bytes``) or
:meth:`TLSEngine.data_to_send_many` (a list of pieces) returns.  Exact call
order::

    engine = TLSEngine(ctx, server_hostname=...)
    send(engine.data_to_send())              # ClientHello (clients)
    on every piece of ciphertext:
        engine.receive_data(piece)           # or lend_data(piece), and
                                             # release_lent() at the end
        if engine.state is HANDSHAKING:
            done = engine.do_handshake()     # raises on failure
            send(engine.data_to_send())
            if not done: continue
        while (chunk := engine.read_chunk()) is not None:
            if not chunk: EOF: the peer closed cleanly
            deliver(chunk)
        send(engine.data_to_send())          # renegotiation, KeyUpdate
    on TCP FIN: engine.receive_eof(), then the same read loop
    to write:   engine.write(data) / write_many(bufs); send(data_to_send())
    to close:   engine.start_shutdown(); send(data_to_send()); keep reading
                until read_chunk() returns the empty view (state CLOSED)

Neither BIO ever holds much: a ``MemoryBIO`` keeps the largest size it once
grew to for the life of the connection.  Incoming ciphertext given to
``lend_data`` goes in ``LEND_PIECE`` bytes at a time, during the handshake
too (the read that completes it may carry a burst of data behind the last
flight); outgoing plaintext goes to ``SSLObject.write`` ``WRITE_SLICE``
bytes at a time, with the ciphertext taken out in between, and what reads
produce themselves (a refused TLS 1.2 renegotiation: a 31-byte alert for
each 4-byte ClientHello header, up to 4096 of them in one record) is taken
out between the reads of one batch.

``SSLWantReadError`` only means "feed me more ciphertext"; with memory BIOs
``SSLWantWriteError`` cannot happen, because the outgoing BIO grows without
bound.  A TLS 1.2 renegotiation or a TLS 1.3 post-handshake message (session
ticket, KeyUpdate) is processed inside ``SSLObject.read`` and may queue
ciphertext of its own, so the shell sends ``data_to_send()`` after every read
batch.  During a TLS 1.2 renegotiation ``SSLObject.write`` can itself raise
``SSLWantReadError`` before it encrypts anything; the engine keeps such
writes (as private copies, so the retry passes the same bytes, which OpenSSL
requires) and retries them after the next read batch.  While the client waits
for the ServerHello the server may still send data, and the handshake step
that ``SSLObject.write`` runs first reads the next record: data there breaks
the connection (an "unexpected record" alert, or -- once a read has returned
such data -- a failure with no error at all, ``SSLEOFError``).  So after a
renegotiation may have begun (a TLS 1.2 record without data was read), data
in front of the next write is read first: a retry waits for the read side to
take it, a new write decrypts it into the chunks ``read_chunk`` returns next.

Record coalescing
-----------------
``SSL_read`` returns at most one record.  Peers that send small records
(nginx's 4 KiB ``ssl_buffer_size``, dynamic record sizing starting at ~1 KiB)
would make every record pay for a chunk and a trip through the shell.  A
:class:`~slabnet._records.RecordScanner` follows the record headers of the
incoming stream, so the engine knows what sits in the BIO: how far OpenSSL has
read is the stream offset written into the BIO minus ``incoming.pending``
(the scanner may have parsed lent data ahead of what the BIO was given, see
``_RUNS_AHEAD``, so that offset can trail ``scanner.fed``).  One
``read_chunk`` call is one batch:

* it starts with one ``SSLObject.read`` of whatever record comes next;
* it keeps reading into the same chunk, up to ``max_chunk`` bytes, only while
  the next record is complete, is application_data (type 23) and is longer
  than an empty record of the negotiated cipher (see
  :func:`empty_record_size`).  ``SSL_read`` skips an empty record and goes on
  with the next one, which could be a handshake record;
* it never waits for more input, but what was lent and is not in the BIO
  yet has arrived: when the plan ends where the BIO does, the next piece
  goes in and the batch goes on (a 256 KiB read of 1-byte records is one
  chunk of its 8-11 thousand bytes, not one per 32 KiB piece).

So in TLS 1.2 a handshake, alert or change_cipher_spec record ends the batch
and is processed by the *next* batch, after the data in front of it has been
returned.  In TLS 1.3 post-handshake messages travel in application_data
records and cannot be told apart from data by the header; they may be
processed in the middle of a batch.

When no complete record is left in the BIO and OpenSSL holds no decrypted
bytes (``SSLObject.pending() == 0``), ``read_chunk`` returns None without
calling ``SSLObject.read``: that read could only raise ``SSLWantReadError``,
which costs an exception and an OpenSSL error-queue walk (CPython's
gh-123954; what that costs is in benchmarks/README.md).  The engine never
writes EOF into the BIO; it decides between clean EOF and truncation itself,
from what the scanner has seen.

Chunk ownership
---------------
Every chunk is a read-only memoryview over a buffer of exactly its own size
(``len(chunk.obj) == len(chunk)``): an application may keep any chunk for a
long time without pinning anything else.  The engine holds no read buffer
between calls.  Each record of a batch is read with one ``read(n)`` into a
``bytes`` object, `n` being what is left of the batch's plaintext bound (the
sum over the batch of ``length - overhead``, :func:`record_overhead`), and
the parts are joined into the chunk.  Three shortcuts remain because each is
worth at least 5 % of a client's CPU end to end at some record size (the
measurement is in ``benchmarks/README.md``, "What each TLS read fast path is
worth"): a batch of one record is returned as it was read; a batch of
records that share one bound (what bulk senders send) is read by one
``map`` over that bound; and reads call the C method under a stock
``SSLObject`` directly.

Errors and EOF
--------------
The read side ends exactly once, with clean EOF (close_notify, or a TCP FIN
when ``ragged_eof=True``) or with an exception; it is reported after every
byte decrypted before it, and again on every later call.  ``ssl.SSLError``
subclasses raised by OpenSSL pass through unchanged.  A record header that
cannot be valid raises ``TLSRecordError`` once the records in front of it are
delivered, however the reads cut it: the scanner keeps the start of a header
until its end arrives, and OpenSSL never gets an invalid header whole (only
the start that came with an earlier piece is in the BIO; the engine counts
what went into the BIO itself, since the scanner's ``fed`` then goes back).
A FIN without close_notify raises ``TLSTruncatedError`` (unless
``ragged_eof``); a FIN inside a record always does, because bytes were lost.
Nothing after close_notify is returned.

Lifecycle
---------
:class:`TLSState` is the one lifecycle enum, changed only by
:meth:`TLSEngine._set_state`, which allows only the transitions listed in
``_TRANSITIONS``.  All calls into the ``SSLObject`` that move data or change
its state go through one choke point, :meth:`TLSEngine._ssl_io`.
"""

from __future__ import annotations

import enum
import functools
import ssl
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Final, Union

from slabnet._errors import TLSRecordError, TLSTruncatedError
from slabnet._records import MAX_LENGTH_TLS12, MAX_LENGTH_TLS13, RecordScanner

__all__ = ["TLSEngine", "TLSState", "empty_record_size", "record_overhead"]

Buffer = Union[bytes, bytearray, memoryview]

#: Largest TLSPlaintext fragment: 2^14 bytes (RFC 8446 §5.1, RFC 5246
#: §6.2.1).  It is the default chunk size (a larger one gains little, see
#: benchmarks/README.md, and lets a paused stream overshoot its high-water
#: mark by more) and the size ``write_many`` joins small buffers to, so that
#: each joined piece fills whole records.
MAX_FRAGMENT: Final = 2**14

_EMPTY: Final = memoryview(b"")

#: lend_data() moves lent ciphertext into the BIO this many bytes at a time,
#: whenever the BIO holds less than _LEND_LOW: enough for a full batch of
#: MAX_FRAGMENT plaintext plus the overhead of its records.
LEND_PIECE: Final = 32768
_LEND_LOW: Final = MAX_FRAGMENT + 4096

#: The record headers of lent data are parsed ahead of the BIO -- a whole
#: read at once, one scanner call, what a bulk stream of one record size
#: costs -- only until this many new runs (records of a size unlike the one
#: before, some 130 bytes of bookkeeping each) have come; beyond that, a
#: piece's headers are parsed as it goes into the BIO.  Parsed all at once,
#: a read of alternating 5- and 6-byte junk records held 6 MB per 256 KiB
#: while the app paused, and cost 25 ms of CPU before OpenSSL refused the
#: first of them; parsed piece by piece, bulk streams paid 5-9 % more engine
#: CPU at 1 KiB records (eight scanner calls per read instead of one).
_RUNS_AHEAD: Final = 16

#: What goes into the BIO is parsed first, however many runs its headers
#: start; but a piece goes in only as far as its headers leave at most this
#: many runs listed (at least one more record goes in, so reads go on).
#: Junk of alternating 0- and 1-byte records held 9,000 runs (1.2 MB) per
#: LEND_PIECE and a half in the BIO of a paused reader; now 512 (70 KB),
#: the rest waits as the engine's copy of the read, a byte a byte.  Valid
#: records of changing sizes reach the bound only below 64 bytes each on
#: average, and then cost one more top-up per 512 records.
_RUNS_IN_BIO: Final = 512

#: The write side's bound, the mirror of LEND_PIECE: the outgoing
#: ``MemoryBIO`` also keeps the largest size it ever grew to (10 MiB after
#: one 8 MiB write), so plaintext goes to ``SSLObject.write`` at most
#: WRITE_SLICE bytes (four full records) at a time, and the ciphertext is
#: taken out of the BIO whenever it holds _DRAIN_AT bytes or more.  The BIO
#: then never holds more than _DRAIN_AT plus one slice's ciphertext (under
#: 130 KiB; OpenSSL rounds its allocation up by a third).  The pieces are
#: handed out as they are, never joined (see data_to_send_many).
WRITE_SLICE: Final = 4 * MAX_FRAGMENT
_DRAIN_AT: Final = 65536

# What reads produce themselves is taken out of the outgoing BIO between
# the reads of a batch once it holds _DRAIN_AT too. One ``SSL_read``
# processes every complete record in the incoming BIO (less than LEND_PIECE
# plus _LEND_LOW), and a TLS 1.2 record of 4-byte ClientHello headers makes
# a 31-byte refusal alert of each (7.75 times its size): the BIO stays under
# _DRAIN_AT plus the answers to one SSL_read (measured: 313 KiB allocated
# after a 240 KiB read of such records, 165 KiB with one request per
# record), where the answers to the whole read (1.8 MiB) used to stay
# allocated for the life of the connection.


# ---------------------------------------------------------------------------
# Record expansion of a cipher suite
# ---------------------------------------------------------------------------

# The shortest record any TLS 1.2 (or 1.0, 1.1) suite OpenSSL offers makes
# once encryption is on: ChaCha20-Poly1305's tag, or CCM_8's explicit nonce
# and tag; GCM makes 24, CBC and the MAC-only suites at least a 16-byte MAC.
# The bound once a renegotiation may have changed the suite.
_TLS12_SHORTEST: Final = 16

# AEAD tag sizes: 16 bytes for GCM (NIST SP 800-38D as used by RFC 5288),
# ChaCha20-Poly1305 (RFC 8439) and CCM (RFC 6655); 8 bytes for CCM_8.
_TAG: Final = 16
_TAG_CCM8: Final = 8
# TLS 1.2 GCM and CCM send an 8-byte explicit nonce per record (RFC 5288 §3,
# RFC 6655 §3); ChaCha20-Poly1305 derives it from the sequence number
# (RFC 7905 §2).
_EXPLICIT_NONCE: Final = 8
# HMAC output sizes by the suite's MAC name (RFC 5246 §6.2.3.1).
_MAC_SIZES: Final = {"MD5": 16, "SHA": 20, "SHA256": 32, "SHA384": 48}
# CBC padding: 1 length byte plus up to 255 padding bytes (RFC 5246
# §6.2.3.2), so an empty CBC record can carry up to 256 bytes of padding.
_MAX_CBC_PADDING: Final = 256


@functools.lru_cache(maxsize=64)
def _expansion(version: str, cipher_name: str) -> tuple[int, int]:
    """(smallest per-record overhead, longest empty record) for a suite."""
    name = cipher_name.upper()
    if version == "TLSv1.3":
        # TLSInnerPlaintext = content || type (1 byte) || zero padding,
        # sealed with the AEAD tag (RFC 8446 §5.2).  Padding is optional
        # and unbounded, so this is the size of an unpadded empty record.
        tag = _TAG_CCM8 if "CCM_8" in name else _TAG
        return tag + 1, tag + 1
    if "GCM" in name or "CCM" in name:
        tag = _TAG_CCM8 if "CCM8" in name or "CCM_8" in name else _TAG
        return _EXPLICIT_NONCE + tag, _EXPLICIT_NONCE + tag
    if "CHACHA20" in name:
        return _TAG, _TAG
    mac = _MAC_SIZES.get(name.rsplit("-", 1)[-1])
    if mac is None:
        # Unknown suite: claim no overhead (buffers are then sized
        # generously and trimmed) and treat every record as possibly empty,
        # which turns coalescing off.  Correct, only slower.
        return 0, MAX_LENGTH_TLS12
    if "NULL" in name.split("-") or "RC4" in name:
        # No encryption or a stream cipher: the MAC is all there is.
        return mac, mac
    block = 8 if ("DES" in name or "IDEA" in name or "RC2" in name) else 16
    # TLS 1.1+ sends an explicit IV per record (RFC 4346 §6.2.3.2); TLS 1.0
    # chains the IV from the previous record.
    iv = 0 if version in ("TLSv1", "SSLv3") else block
    # At least one padding-length byte; at most 256 bytes of padding, with
    # MAC-then-encrypt or encrypt-then-MAC (RFC 7366) alike.
    return iv + mac + 1, iv + mac + _MAX_CBC_PADDING


def record_overhead(version: str, cipher_name: str) -> int:
    """Smallest number of bytes a record of this suite adds to its plaintext.

    ``length - record_overhead(...)`` bounds the plaintext of a record whose
    header says ``length``; it is exact for AEAD suites (TLS 1.3 records may
    be shorter only if the peer pads them).  ``version`` and ``cipher_name``
    are what ``SSLObject.version()`` and ``SSLObject.cipher()[0]`` return.
    """
    return _expansion(version, cipher_name)[0]


def empty_record_size(version: str, cipher_name: str) -> int:
    """Length of the longest application_data record that may be empty.

    TLS 1.3 AEAD: tag + inner content type (17; 9 for CCM_8).  TLS 1.2 GCM
    and CCM: explicit nonce + tag (24; 16 for CCM_8).  TLS 1.2
    ChaCha20-Poly1305: the tag (16).  CBC suites: IV + MAC + the largest
    padding (256), because a peer may pad an empty record that much.  An
    unknown suite gets 2^14 + 2048, which disables coalescing.
    """
    return _expansion(version, cipher_name)[1]


# ---------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------


class TLSState(enum.Enum):
    """Lifecycle of one TLS connection."""

    HANDSHAKING = "handshaking"
    #: Handshake done; reading and writing.  The read side may already have
    #: ended (peer's close_notify, accepted ragged EOF) while we still write.
    OPEN = "open"
    #: We sent close_notify and wait for the peer's.
    CLOSING = "closing"
    #: Both close_notify alerts exchanged (or the read side ended cleanly).
    CLOSED = "closed"
    #: A TLS error or truncation ended the connection.
    BROKEN = "broken"


_HANDSHAKING: Final = TLSState.HANDSHAKING
_OPEN: Final = TLSState.OPEN
_CLOSING: Final = TLSState.CLOSING
_CLOSED: Final = TLSState.CLOSED
_BROKEN: Final = TLSState.BROKEN

_TRANSITIONS: Final[dict[TLSState, frozenset[TLSState]]] = {
    _HANDSHAKING: frozenset({_OPEN, _BROKEN}),
    _OPEN: frozenset({_CLOSING, _CLOSED, _BROKEN}),
    _CLOSING: frozenset({_CLOSED, _BROKEN}),
    _CLOSED: frozenset(),
    _BROKEN: frozenset(),
}


class _Op(enum.Enum):
    HANDSHAKE = "do_handshake"
    WRITE = "write"
    SHUTDOWN = "unwrap"


_EOF: Final = object()  # the read side ended cleanly
_AGAIN: Final = object()  # a read made progress but produced no data
_IN_INIT: Final = object()  # SSL_shutdown refused: a renegotiation is running


def _c_read(sslobj: ssl.SSLObject) -> Any:
    """``sslobj.read``: the C method underneath a stock SSLObject (one
    Python frame less per record, worth it at small records, see
    benchmarks/README.md), a subclass's override otherwise."""
    inner = getattr(sslobj, "_sslobj", None)
    if inner is not None and type(sslobj).read is ssl.SSLObject.read:
        return inner.read
    return sslobj.read


class TLSEngine:
    """TLS for one connection, without I/O.  See the module docstring."""

    __slots__ = (
        "ssl_object",
        "_context",
        "_incoming",
        "_outgoing",
        "_scanner",
        "_read",
        "_state",
        "_ragged_eof",
        "_max_chunk",
        "_tls12",
        "_input_closed",
        "_read_final",
        "_error",
        "_leftover",
        "_held",
        "_blocked",
        "_renegotiating",
        "_avail",
        "_lent",
        "_lent_pos",
        "_lent_owned",
        "_lent_parsed",
        "_shutdown_after_writes",
        "_sealed",
        "answers_limit",
        "answers_stopped",
        "released_plaintext",
        "read_calls",
        "chunks_returned",
        "want_read_errors",
        "write_calls",
    )

    ssl_object: ssl.SSLObject

    def __init__(
        self,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
        ragged_eof: bool = False,
        max_chunk: int = MAX_FRAGMENT,
    ) -> None:
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be positive, got {max_chunk}")
        self._context = context
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
            session=session,
        )
        self._scanner = RecordScanner()
        self._read = _c_read(self.ssl_object)
        self._state = _HANDSHAKING
        self._ragged_eof = ragged_eof
        self._max_chunk = max_chunk
        self._tls12 = False
        self._input_closed = False
        # _EOF or the exception that ends the read side, once reached.
        self._read_final: object = None
        self._error: BaseException | None = None  # why we are BROKEN
        self._leftover = False  # OpenSSL may hold decrypted bytes
        # Both rarely hold anything: lists (an empty deque costs 760 bytes
        # per connection, an empty list 56).
        self._held: list[memoryview] = []  # decrypted before its turn
        self._blocked: list[bytes] = []  # writes waiting for a handshake
        # TLS 1.2: a record without data was read since the last write went
        # through, so SSLObject.write may run a handshake step (see the
        # module docstring).
        self._renegotiating = False
        # Stream offset up to which ciphertext is in the incoming BIO,
        # counted from what went in (the scanner may have parsed further, see
        # lend_data, or, after an invalid header, accepted less: the start
        # of a header cut by a read went in before its end showed it bad),
        # and the lent ciphertext not copied into the BIO yet.
        self._avail = 0
        self._lent: memoryview | None = None
        self._lent_pos = 0
        self._lent_owned = False  # _lent is our copy (release_lent), not the caller's
        self._lent_parsed = 0  # how much of _lent the scanner has parsed
        self._shutdown_after_writes = False
        # Ciphertext already taken out of the outgoing BIO (see WRITE_SLICE).
        self._sealed: list[bytes] = []
        # read_chunk() returns None early, answers_stopped True, once reads
        # made this much output of their own (0: never): the shell sends it,
        # and may stop reading, before the rest of a read is answered.
        self.answers_limit = 0
        self.answers_stopped = False
        # Plaintext held by a renegotiation and encrypted since (a running
        # total): its ciphertext comes out with the engine's own output, and
        # is the app's data, not answers the peer asked for.
        self.released_plaintext = 0
        # Counters for tests and benchmarks.
        self.read_calls = 0  # SSLObject.read calls
        self.chunks_returned = 0  # non-empty chunks from read_chunk()
        self.want_read_errors = 0  # SSLWantReadError raised by read
        self.write_calls = 0  # SSLObject.write calls

    # -- properties ----------------------------------------------------------

    @property
    def state(self) -> TLSState:
        return self._state

    @property
    def records_read(self) -> int:
        """Records OpenSSL has consumed from the incoming BIO (handshake
        records included), as of the last read_chunk()."""
        return self._scanner.records_consumed

    @property
    def buffered_ciphertext(self) -> int:
        """Incoming ciphertext bytes that OpenSSL has not consumed yet."""
        lent = self._lent
        if lent is None:
            return self._incoming.pending
        return self._incoming.pending + len(lent) - self._lent_pos

    @property
    def input_pending(self) -> bool:
        """True if ciphertext was fed that has given no plaintext yet: bytes
        OpenSSL has not consumed, or the start of a record that it has
        consumed (an over-read) and cannot decrypt before the rest comes."""
        return bool(self.buffered_ciphertext) or self._scanner.mid_record

    @property
    def eof_received(self) -> bool:
        """True once read_chunk() has returned (or will return) clean EOF."""
        return self._read_final is _EOF

    @property
    def read_ended(self) -> bool:
        """True once read_chunk() has returned (or will return) its end:
        clean EOF, or the error it raises. A read can decrypt the last
        records and find the end behind them: the end then waits here for
        the next read_chunk() with no input left to buffer."""
        return self._read_final is not None

    def _set_state(self, new: TLSState) -> None:
        old = self._state
        if new is old:
            return
        if new not in _TRANSITIONS[old]:
            raise RuntimeError(f"TLSEngine: illegal transition {old.name} -> {new.name}")
        self._state = new

    def _break(self, exc: BaseException) -> BaseException:
        """Record `exc` as the end of the connection (state BROKEN)."""
        if self._error is None:
            self._error = exc
        if self._state is not _BROKEN and self._state is not _CLOSED:
            self._set_state(_BROKEN)
        return exc

    # -- incoming ciphertext -------------------------------------------------

    def receive_data(self, data: Buffer) -> None:
        """Take ciphertext from the peer; `data` is copied before returning."""
        view = self._accept(data)
        if view is None:
            return
        if self._lent is not None:
            self._keep_behind_lent(view)  # stream order
            return
        view = view[: self._parse(view)]
        self._incoming.write(view)
        self._avail += len(view)

    def lend_data(self, data: memoryview) -> None:
        """Take ciphertext like :meth:`receive_data`, but borrow `data`: it
        goes into the incoming BIO ``LEND_PIECE`` bytes at a time, as
        :meth:`read_chunk` needs it.  The caller must not change `data`
        before calling :meth:`release_lent`, which copies what is left.

        Why: a ``MemoryBIO`` never gives back memory it once grew to, so
        writing a whole 256 KiB read would leave every connection that once
        received one holding 256 KiB.  Fed by pieces it stays near
        ``LEND_PIECE`` plus one batch.  The record headers are parsed
        ahead of the BIO only while they cost little (see ``_RUNS_AHEAD``).
        """
        view = self._accept(data)
        if view is None:
            return
        if self._lent is not None:
            self._keep_behind_lent(view)  # stream order
            return
        self._lent = view
        self._lent_pos = 0
        self._lent_parsed = 0
        self._lent_owned = False
        self._top_up()

    def _accept(self, data: Buffer) -> memoryview | None:
        """``data`` as a byte view, or None if nothing more is read (the
        read side is over, or an invalid header came)."""
        if self._read_final is not None or self._state is _CLOSED:
            return None  # nothing after close_notify or an error is read
        if self._scanner.error is not None:
            return None
        view = memoryview(data)
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")  # count and cut bytes, not items
        return view

    def _parse(self, view: memoryview, new_runs: int = -1) -> int:
        """Parse the record headers in `view`, the ciphertext after what
        was parsed so far (within `new_runs`, as ``RecordScanner.feed``);
        return how many of its bytes were parsed.  After an invalid header
        (``scanner.error`` set) that is the valid prefix, which alone may go
        into the BIO, the bytes in front of the error read first; if the
        header's start came with earlier bytes, none of these."""
        scanner = self._scanner
        before = scanner.fed
        try:
            scanner.feed(view, new_runs)
        except TLSRecordError:
            pass  # (kept by the scanner, raised once the prefix is read)
        return max(scanner.fed - before, 0)

    def _keep_behind_lent(self, view: memoryview) -> None:
        """Ciphertext that arrived while an earlier read is not all in the
        BIO yet (the app paused reading): kept, copied, behind it."""
        lent = self._lent
        assert lent is not None
        self._lent = memoryview(b"".join((lent[self._lent_pos :], view)))
        self._lent_parsed -= self._lent_pos
        self._lent_pos = 0
        self._lent_owned = True

    def release_lent(self) -> None:
        """Copy the rest of the data lent by :meth:`lend_data`: the engine
        keeps it, outside the BIO, until reads need it (its headers parsed
        as far as ``_RUNS_AHEAD`` took them, the rest when it goes in)."""
        lent = self._lent
        if lent is not None and not self._lent_owned:
            self._lent = memoryview(lent[self._lent_pos :].tobytes())
            self._lent_parsed -= self._lent_pos
            self._lent_pos = 0
            self._lent_owned = True

    def _top_up(self) -> None:
        """Move the next piece of lent data into the incoming BIO, its
        record headers parsed first."""
        lent = self._lent
        assert lent is not None
        pos = self._lent_pos
        end = min(pos + LEND_PIECE, len(lent))
        if self._lent_parsed < end:
            lent = self._parse_lent(end)
            # (Short of `end` if _RUNS_IN_BIO stopped the parse, or an
            # invalid header cut the lent data.)
            end = min(end, self._lent_parsed)
        if end >= len(lent):
            self._lent = None
            piece = lent[pos:]
        else:
            self._lent_pos = end
            piece = lent[pos:end]
        self._incoming.write(piece)
        self._avail += len(piece)

    def _parse_lent(self, end: int) -> memoryview:
        """Parse the headers of the lent data through offset `end`, unless
        ``_RUNS_IN_BIO`` stops it sooner, and on as far as ``_RUNS_AHEAD``
        allows; return the lent data, cut in front of an invalid header if
        one came (nothing after it goes into the BIO, and the bytes in front
        of it are read first)."""
        lent = self._lent
        assert lent is not None
        start = self._lent_parsed
        scanner = self._scanner
        # A bulk stream's whole read in one call: one record size, one run.
        done = start + self._parse(lent[start:], _RUNS_AHEAD)
        error = scanner.error
        if done < end and error is None:
            # Records of many sizes: the next piece's, as far as the runs
            # listed for the BIO allow (and one record at least).
            listed = scanner.runs_after(self._avail - self._incoming.pending)
            done += self._parse(lent[done:end], max(_RUNS_IN_BIO - listed, 1))
            error = scanner.error
        if error is not None:
            self._lent = lent = lent[:done]  # (nothing after the bad header goes in)
        self._lent_parsed = done
        return lent

    def receive_eof(self) -> None:
        """The peer closed its side of TCP.  Call read_chunk() next."""
        self._input_closed = True

    # -- handshake -----------------------------------------------------------

    def do_handshake(self) -> bool:
        """Advance the handshake; True once it is complete.

        Raises the ``ssl.SSLError`` OpenSSL raised (certificate errors are
        ``ssl.SSLCertVerificationError``), ``TLSRecordError`` for garbage,
        or ``TLSTruncatedError`` if the peer closed TCP mid-handshake.
        """
        state = self._state
        if state is not _HANDSHAKING:
            if state is _BROKEN and self._error is not None:
                raise self._error
            return True
        while self._ssl_io(_Op.HANDSHAKE) is _AGAIN:
            if self._lent is not None:
                # Lent input goes into the BIO by pieces here too: the read
                # that completes the handshake may carry a burst of data.
                self._top_up()
                continue
            # OpenSSL wants more; has everything that arrived been used up?
            scanner = self._scanner
            if not scanner.has_complete_record(
                self._avail - self._incoming.pending, self._avail
            ):
                if scanner.error is not None:
                    raise self._break(scanner.error)
                if self._input_closed:
                    raise self._break(
                        TLSTruncatedError(
                            "the peer closed the connection during the TLS handshake"
                        )
                    )
            return False
        self._on_handshake_done()
        return True

    def _on_handshake_done(self) -> None:
        sslobj = self.ssl_object
        version = sslobj.version() or ""
        self._refresh_expansion()
        self._tls12 = version != "TLSv1.3"
        self._set_state(_OPEN)
        # Records shorter than the cipher makes can only fail to decrypt:
        # the scanner refuses them at once (see RecordScanner).
        # The suite's empty record is its shortest (TLS 1.2 GCM: 24 bytes;
        # OpenSSL 3.0 says only "internal error" of a shorter one); after a
        # TLS 1.2 renegotiation's change_cipher_spec, any suite's.
        cipher = sslobj.cipher()
        if cipher is not None:
            shortest = _expansion(version, cipher[0])[0]
            after_ccs = _TLS12_SHORTEST if self._tls12 else -1
            self._scanner.set_min_length(shortest, after_ccs)
        if version == "TLSv1.3":
            try:
                self._scanner.set_max_length(MAX_LENGTH_TLS13)
            except TLSRecordError:
                pass  # surfaces from read_chunk() after the data before it

    def _refresh_expansion(self) -> None:
        sslobj = self.ssl_object
        cipher = sslobj.cipher()
        if cipher is not None:
            overhead, empty = _expansion(sslobj.version() or "", cipher[0])
            self._scanner.set_expansion(overhead, empty)

    # -- reading -------------------------------------------------------------

    def read_chunk(self) -> memoryview | None:
        """Decrypt the next batch of buffered records.

        Returns a non-empty read-only memoryview of at most ``max_chunk``
        bytes (``len(chunk.obj) == len(chunk)``); None when nothing more can
        be decrypted from what has arrived (or the handshake is not done);
        the empty memoryview at clean EOF, again on every later call.  A
        pending error is raised once every byte in front of it was returned,
        and again on every later call.  With ``answers_limit`` set, None
        also comes (``answers_stopped`` True) once reads made that much
        output of their own: send ``data_to_send_many()``, then call again.
        """
        self.answers_stopped = False
        if self._held:
            return self._held.pop(0)  # (bytes in front of the end, if any)
        final = self._read_final
        if final is not None:
            if final is _EOF:
                return _EMPTY
            raise final  # type: ignore[misc]
        if self._state is _HANDSHAKING:
            return None
        # One batch, as described in the module docstring; again after a
        # record without data (_AGAIN) or when lent input remains.
        incoming = self._incoming
        sslobj = self.ssl_object
        result: Any
        while True:
            pending = self._fill()
            fed = self._avail
            if self._leftover:
                result = self._read_batch(fed, pending, fed - pending, 0, 0, 0)
            else:
                end, bound, count, weight = self._scanner.data_run(
                    fed - pending, self._max_chunk, fed
                )
                if count == 1:
                    # One record (what large records give): read into a
                    # bytes object of its bound and returned as it is.
                    self.read_calls += 1
                    try:
                        first = self._read(bound)
                    except ssl.SSLError as exc:
                        result = self._read_failed(exc, pending)
                    else:
                        if not first:
                            self._on_close_notify()
                            result = _EOF
                        else:
                            if incoming.pending < fed - end:
                                self._leftover = True  # see the over-read note
                            self.chunks_returned += 1
                            chunk = memoryview(first)
                            if not self._blocked and not self._shutdown_after_writes:
                                return chunk
                            result = chunk
                elif count < 0 and not sslobj.pending():
                    # Nothing complete is buffered: a read could only raise
                    # SSLWantReadError.
                    result = None
                else:
                    result = self._read_batch(fed, pending, end, bound, count, weight)
            if result is _AGAIN or (result is None and self._lent is not None):
                # Records without data may have made answers of their own
                # (renegotiation refusals, KeyUpdates): take them out before
                # the next records go in, as the write side does, or one
                # read of a peer that asks for them in every record would
                # grow the BIO, for good, to several times the read.
                self._seal_if_full()
                limit = self.answers_limit
                if limit and (self._sealed or self._outgoing.pending >= limit):
                    self.answers_stopped = True
                    return None
                if result is None:
                    self._top_up()
                continue
            break
        if self._blocked or self._shutdown_after_writes:
            self._retry_blocked_writes()
        if result is None:
            if self._input_closed or self._scanner.error is not None:
                return self._on_input_used_up()
            return None
        if result is _EOF:
            return _EMPTY
        return result  # type: ignore[no-any-return]

    def _on_input_used_up(self) -> memoryview | None:
        """No complete record is left in the BIO and OpenSSL holds no
        plaintext: nothing more can be decrypted until more input comes."""
        scanner = self._scanner
        final: BaseException | None
        if scanner.error is not None:
            final = scanner.error
        elif self._input_closed:
            partial = self._incoming.pending
            # OpenSSL may already have pulled the start of a cut record out
            # of the BIO into its own buffer (an over-read, TLS 1.3), so the
            # BIO can be empty; the scanner still sees that the stream did
            # not end on a record boundary.
            if partial or scanner.mid_record:
                final = TLSTruncatedError(
                    "the peer closed the connection in the middle of a TLS"
                    " record"
                    + (f" ({partial} bytes of it were not read)" if partial else "")
                )
            elif self._ragged_eof:
                self._read_final = _EOF
                if self._state is _CLOSING:
                    self._set_state(_CLOSED)
                return _EMPTY
            else:
                # Name the streams' and transports' keyword too: that is
                # what most apps passed (the engine's own is ragged_eof).
                final = TLSTruncatedError(
                    "the peer closed the connection without a TLS close_notify"
                    " alert (pass ssl_ragged_eof=True, or ragged_eof=True to"
                    " a TLSEngine, to accept this)"
                )
        else:
            return None
        self._read_final = final
        raise self._break(final)

    def _on_close_notify(self) -> None:
        self._read_final = _EOF
        if self._state is _CLOSING:
            self._set_state(_CLOSED)

    # -- writing -------------------------------------------------------------

    def write(self, data: Buffer) -> None:
        """Encrypt `data` (any size; more than ``WRITE_SLICE`` bytes are
        encrypted a slice at a time, see the constant)."""
        self._check_writable()
        self._write_one(data)

    def write_many(self, buffers: Sequence[Buffer]) -> None:
        """Encrypt several buffers with as few ``SSLObject.write`` calls as
        possible: runs of small buffers are joined into pieces of at most
        ``MAX_FRAGMENT`` bytes; a buffer of that size or more is written on
        its own, without a copy (sliced like :meth:`write`)."""
        self._check_writable()
        run: list[Buffer] = []
        run_size = 0
        write = self._write_one
        for buf in buffers:
            size = memoryview(buf).nbytes if isinstance(buf, memoryview) else len(buf)
            if not size:
                continue
            if size >= MAX_FRAGMENT:
                if run:
                    write(run[0] if len(run) == 1 else b"".join(run))
                    run = []
                    run_size = 0
                write(buf)
                continue
            if run_size + size > MAX_FRAGMENT:
                write(run[0] if len(run) == 1 else b"".join(run))
                run = []
                run_size = 0
            run.append(buf)
            run_size += size
        if run:
            write(run[0] if len(run) == 1 else b"".join(run))

    def write_alone(self, data: Buffer) -> bytes | None:
        """Encrypt ``data``, at most ``MAX_FRAGMENT`` bytes, and return its
        ciphertext (one record), when nothing else waits to be encrypted or
        taken out; else None, having done nothing (``write_many`` then)."""
        if (
            self._state is not _OPEN or self._blocked or self._renegotiating
            or self._shutdown_after_writes or self._sealed or self._outgoing.pending
        ):
            return None
        self._ssl_io(_Op.WRITE, data)  # (held, if a renegotiation began)
        return self._outgoing.read()

    def _write_one(self, data: Buffer) -> None:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size <= WRITE_SLICE:
            self._write_piece(data)
            return
        # A large buffer goes WRITE_SLICE bytes at a time (slices of a
        # memoryview: no copy, except for slices that wait for a handshake).
        view = memoryview(data)
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")
        for start in range(0, len(view), WRITE_SLICE):
            self._write_piece(view[start : start + WRITE_SLICE])

    def _write_piece(self, piece: Buffer) -> None:
        """Encrypt at most ``WRITE_SLICE`` bytes, or keep them (as a private
        copy) behind writes that wait for a handshake."""
        if self._blocked:
            self._blocked.append(bytes(piece))
        else:
            self._ssl_io(_Op.WRITE, piece)
        self._seal_if_full()

    def _seal_if_full(self) -> None:
        """Take the ciphertext out of the outgoing BIO once it holds
        ``_DRAIN_AT`` bytes (see WRITE_SLICE)."""
        outgoing = self._outgoing
        if outgoing.pending >= _DRAIN_AT:
            self._sealed.append(outgoing.read())

    @property
    def held_plaintext(self) -> int:
        """Bytes of plaintext written but not encrypted yet: during a TLS 1.2
        renegotiation OpenSSL encrypts no application data, and the engine
        keeps it until the new handshake is done (0 the rest of the time)."""
        return sum(map(len, self._blocked)) if self._blocked else 0

    def _check_writable(self) -> None:
        state = self._state
        if state is _OPEN and not self._shutdown_after_writes:
            return
        if state is _BROKEN and self._error is not None:
            raise self._error
        raise RuntimeError(f"TLSEngine: cannot write in state {state.name}")

    def _retry_blocked_writes(self) -> None:
        blocked = self._blocked
        while blocked and self._state is not _BROKEN:
            if self._data_ahead():
                return  # read first (see _read_ahead); retried after that read
            if self._ssl_io(_Op.WRITE, blocked[0]) is _AGAIN:
                return
            self.released_plaintext += len(blocked[0])
            del blocked[0]
            self._seal_if_full()
        if self._shutdown_after_writes and not blocked and self._state is _OPEN:
            self._shutdown_after_writes = False
            self._send_close_notify()

    def data_to_send(self) -> bytes:
        """Ciphertext waiting to be sent (empty bytes if none), as one
        ``bytes``: after a large write that joins the pieces, a copy that
        :meth:`data_to_send_many` avoids."""
        return b"".join(self.data_to_send_many())  # (one piece: no copy)

    def data_to_send_many(self) -> list[bytes]:
        """Ciphertext waiting to be sent, in order, as the non-empty pieces
        it was taken out of the BIO in (an empty list if none).  Each piece
        holds at most ``_DRAIN_AT`` bytes plus one slice's ciphertext; the
        shell queues them without joining them."""
        tail = self._outgoing.read()
        sealed = self._sealed
        if sealed:
            self._sealed = []
            if tail:
                sealed.append(tail)
            return sealed
        return [tail] if tail else []

    # -- shutdown ------------------------------------------------------------

    def start_shutdown(self) -> None:
        """Queue our close_notify.  OPEN -> CLOSING, or -> CLOSED if the
        peer's close_notify (or an accepted ragged EOF) already arrived.
        Idempotent in CLOSING and CLOSED."""
        state = self._state
        if state is _CLOSING or state is _CLOSED:
            return
        if state is not _OPEN:
            if state is _BROKEN and self._error is not None:
                raise self._error
            raise RuntimeError(f"TLSEngine: cannot shut down in state {state.name}")
        if self._blocked:
            # close_notify must follow the data that waits for a handshake.
            self._shutdown_after_writes = True
            return
        self._send_close_notify()

    def _send_close_notify(self) -> None:
        # unwrap() calls SSL_shutdown twice; the second call reads from the
        # incoming BIO and throws application data away once our
        # close_notify is sent.  Keep what has not been read: decrypted
        # bytes go to `_held`, ciphertext is taken out of the BIO and put
        # back afterwards (the BIO is a FIFO, so the order is kept).
        sslobj = self.ssl_object
        if self._read_final is None and self._leftover_pending():
            self._held.append(memoryview(sslobj.read(sslobj.pending())))
        saved = self._incoming.read() if self._incoming.pending else b""
        try:
            result = self._ssl_io(_Op.SHUTDOWN)
        finally:
            if saved:
                self._incoming.write(saved)
        if self._state is _BROKEN:
            return
        if result is _IN_INIT:
            # A TLS 1.2 renegotiation is running: OpenSSL sends no alert
            # before it ends. Retried after each read, as a held write is.
            self._shutdown_after_writes = True
            return
        if result is _AGAIN and self._read_final is None:
            self._set_state(_CLOSING)
        else:
            # Both alerts are exchanged, or nothing more can arrive.
            self._set_state(_CLOSED)

    def _leftover_pending(self) -> bool:
        return self.ssl_object.pending() > 0

    def _data_ahead(self) -> bool:
        """True if OpenSSL holds decrypted bytes, or the next record in the
        incoming BIO (complete or not) is application data."""
        if self.ssl_object.pending():
            return True
        pending = self._incoming.pending
        return bool(pending) and self._scanner.data_next(self._avail - pending)

    def _fill(self) -> int:
        """Keep a full batch in the BIO: move lent input in while less than
        _LEND_LOW bytes wait there.  Returns what waits there."""
        pending = self._incoming.pending
        if pending < _LEND_LOW and self._lent is not None:
            self._top_up()
            pending = self._incoming.pending
        return pending

    def _read_ahead(self) -> None:
        """Before a write while a TLS 1.2 renegotiation may run: decrypt the
        data in front of the next record without data into ``_held``, which
        read_chunk returns first.  ``SSLObject.write`` would otherwise run a
        handshake step that reads it, and the connection would break (see
        the module docstring).  An error on the way is kept for the read
        side (after these bytes), as every read's is."""
        sslobj = self.ssl_object
        while self._read_final is None and self._state is not _BROKEN:
            pending = self._fill()
            fed = self._avail
            if sslobj.pending():
                # Plaintext OpenSSL holds comes first: the leftover plan.
                end, bound, count, weight = fed - pending, 0, 0, 0
            else:
                if not pending or not self._scanner.data_next(fed - pending):
                    return  # nothing, or a record without data, is next
                end, bound, count, weight = self._scanner.data_run(
                    fed - pending, self._max_chunk, fed
                )
                if count < 0:
                    return  # a record not complete yet: the write only reads its start
                if self._leftover:
                    end, bound, count, weight = fed - pending, 0, 0, 0
            try:
                result = self._read_batch(fed, pending, end, bound, count, weight)
            except ssl.SSLError:
                return  # (kept: _read_failed)
            if not isinstance(result, memoryview):
                return
            self._held.append(result)

    @property
    def plaintext_waiting(self) -> bool:
        """True if decrypted bytes wait for read_chunk without any new input:
        a write decrypted them first (see ``_read_ahead``), or OpenSSL holds
        the rest of a record a batch read into (a read that stopped when
        the app paused)."""
        return bool(self._held) or self.ssl_object.pending() > 0

    # -- the SSLObject choke point ------------------------------------------

    def _ssl_io(self, op: _Op, data: Buffer | None = None) -> Any:
        """The one place that handshakes, writes and shuts down (reads are
        in :meth:`read_chunk`).

        Returns ``_AGAIN`` where OpenSSL raised ``SSLWantReadError``, else
        None.  Errors are recorded (state BROKEN) and raised.
        """
        sslobj = self.ssl_object
        try:
            if op is _Op.WRITE:
                if self._renegotiating:
                    self._read_ahead()
                self.write_calls += 1
                sslobj.write(data)  # type: ignore[arg-type]
                self._renegotiating = False  # (a handshake step would have raised)
            elif op is _Op.HANDSHAKE:
                sslobj.do_handshake()
            else:
                sslobj.unwrap()
        except ssl.SSLWantReadError:
            if op is _Op.WRITE:
                if not self._blocked or self._blocked[0] is not data:
                    self._blocked.append(bytes(data))  # type: ignore[arg-type]
            return _AGAIN
        except ssl.SSLError as exc:
            if op is _Op.SHUTDOWN and exc.reason == "SHUTDOWN_WHILE_IN_INIT":
                return _IN_INIT  # (nothing changed: OpenSSL refused at once)
            raise self._break(exc)
        return None

    def _read_failed(self, exc: ssl.SSLError, pending: int, progress: bool = False) -> Any:
        """Account for a read that raised; return what the batch returns
        if it produced no byte (`progress` False), else None.

        Without progress an error is raised; after progress the bytes go
        first and the error is kept for the next call, as is close_notify.
        """
        if isinstance(exc, ssl.SSLWantReadError):
            self.want_read_errors += 1
            if progress:
                return None
            # A record without data (a handshake message) was consumed; more
            # may follow.  Without progress there is nothing left.
            if self._incoming.pending < pending or self._leftover:
                self._leftover = False
                return _AGAIN
            return None
        if isinstance(exc, ssl.SSLZeroReturnError):
            self._on_close_notify()  # close_notify after we sent ours
            return _EOF
        self._read_final = exc
        self._break(exc)
        if progress:
            return None
        raise exc

    def _read_batch(
        self, fed: int, pending: int, end: int, bound: int, count: int, weight: int
    ) -> Any:
        """Read one batch: `count` records planned from their headers (the
        plaintext `bound` in all, `weight` each if they share it, the stream
        offset `end` after them), or with `count` 0 whatever record comes
        next (leftover plaintext, or a record that cannot start a plan:
        handshake, alert, too short), planning the rest after it.  Returns
        a chunk, or None, _AGAIN or _EOF; the one place that reads from the
        SSLObject.
        """
        sslobj = self.ssl_object
        read = self._read
        parts: list[bytes] = []
        calls = 0
        mapped = -1  # len(parts) before the map, once it started
        try:
            if count <= 0:
                if self._tls12:
                    # A record that is not data (a HelloRequest, a client's
                    # ClientHello) may be next, or was: see _read_ahead.
                    self._renegotiating = True
                calls = 1
                first = read(self._max_chunk)
                if not first:
                    self._on_close_notify()
                    return _EOF
                parts.append(first)
                if sslobj.pending():
                    self._leftover = True
                    return self._chunk(parts)
                self._leftover = False
                if self._tls12:
                    self._refresh_expansion()  # a renegotiation may have ended
                pending = self._incoming.pending
                end, bound, count, weight = self._scanner.data_run(
                    fed - pending, self._max_chunk - len(first), fed
                )
                if count <= 0:
                    return self._chunk(parts)
            got = len(parts[0]) if parts else 0
            while True:
                start = len(parts)
                if weight:
                    # Records that share one bound (what bulk senders send),
                    # each read into a ``bytes`` of exactly that size by one
                    # ``map``, a loop in C.  When a read raises, list.extend
                    # keeps the parts it already appended.
                    mapped = start
                    parts.extend(map(read, repeat(weight, count)))
                    mapped = -1
                    calls += count
                    if not parts[-1]:
                        # close_notify: that read returned b"", and so did
                        # every later one, without touching the BIO.
                        self._on_close_notify()
                        while parts and not parts[-1]:
                            parts.pop()
                        break
                else:
                    left = bound
                    while count > 0 and left > 0:
                        count -= 1
                        calls += 1
                        part = read(left)
                        if not part:
                            self._on_close_notify()
                            break
                        parts.append(part)
                        left -= len(part)
                    if self._read_final is _EOF:
                        break
                if self._incoming.pending < fed - end:
                    # Over-read: a planned record carried no data (a TLS 1.3
                    # session ticket or KeyUpdate), so SSL_read went on into
                    # a record outside the plan, which may not have fit: ask
                    # pending() before the next batch.
                    self._leftover = True
                    break
                # The plan may end where the BIO does while lent records
                # that arrived with the same read wait behind it: move the
                # next piece in and plan on (small records would otherwise
                # make chunks of one LEND_PIECE's worth, 1 KiB at 1-byte
                # records, where the batch may take max_chunk).
                got += sum(map(len, parts[start:]))
                room = self._max_chunk - got
                if self._lent is None or room <= 0 or self._incoming.pending >= _LEND_LOW:
                    break
                # One bytes for this plan's parts: the batch then holds at
                # most one piece's worth of small objects at a time.
                parts[start:] = [b"".join(parts[start:])]
                self._seal_if_full()  # answers made by these reads, if any
                limit = self.answers_limit
                if limit and (self._sealed or self._outgoing.pending >= limit):
                    break
                self._top_up()
                fed = self._avail
                end, bound, count, weight = self._scanner.data_run(
                    fed - self._incoming.pending, room, fed
                )
                if count <= 0:
                    break
        except ssl.SSLError as exc:
            # Bytes that came first are returned; what ended the batch is
            # seen again (or kept, for an error) by the next call.
            if mapped >= 0:
                calls += len(parts) - mapped + 1
            result = self._read_failed(exc, pending, bool(parts))
            if not parts:
                return result
        finally:
            self.read_calls += calls
        if not parts:
            return _EOF if self._read_final is _EOF else None
        return self._chunk(parts)

    def _chunk(self, parts: list[bytes]) -> memoryview:
        self.chunks_returned += 1
        return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))

    # -- extra info ----------------------------------------------------------

    def get_extra_info(self, name: str, default: object = None) -> object:
        """Connection details under asyncio's SSL transport names:
        ``peercert``, ``peercert_bin``, ``cipher``, ``compression``,
        ``ssl_object``, ``sslcontext``, ``server_hostname``, ``tls_version``,
        ``alpn_protocol``, ``session``, ``session_reused``."""
        sslobj = self.ssl_object
        if name == "ssl_object":
            return sslobj
        if name == "sslcontext":
            return self._context
        if name == "server_hostname":
            return sslobj.server_hostname
        if self._state is _HANDSHAKING:
            return default
        if name == "peercert":
            return sslobj.getpeercert()
        if name == "peercert_bin":
            return sslobj.getpeercert(binary_form=True)
        if name == "cipher":
            return sslobj.cipher()
        if name == "compression":
            return sslobj.compression()
        if name == "tls_version":
            return sslobj.version()
        if name == "alpn_protocol":
            return sslobj.selected_alpn_protocol()
        if name == "session":
            return sslobj.session
        if name == "session_reused":
            return sslobj.session_reused
        return default
