"""TLS record header scanner (sans-IO): follows the record headers of one
direction of a TLS stream and tells the engine which complete records wait
in its incoming BIO.

Theory of operation
===================

OpenSSL hides record boundaries: ``SSLObject.read`` decrypts at most one
record per call and gives no hint about what is still waiting in the incoming
``MemoryBIO``.  The TLS engine needs that hint for two decisions:

* may it keep reading into the same chunk?  Only if the next record is
  complete in the BIO, is application data, and is too long to be empty;
* may it skip the next ``SSLObject.read`` altogether?  Yes, when no complete
  record is left, because that read would only raise ``SSLWantReadError``,
  which costs a Python exception plus an OpenSSL error-queue lookup.

Every record starts with a plaintext 5-byte header (RFC 8446 §5.1, RFC 5246
§6.2.1)::

    ContentType type;              1 byte
    ProtocolVersion legacy_version 2 bytes, major always 3
    uint16 length;                 2 bytes, then `length` bytes of fragment

so the scanner only has to walk the ciphertext stream from header to header.
It sees every byte exactly once, as the engine hands it over, and keeps the
records whose headers it has parsed as *runs*: consecutive records of one
type and length, stored as (first header's stream offset, record size with
header, count, type).  A bulk transfer of equal records is one run however
many records it has, so neither parsing nor the queries below pay per record
for bookkeeping; a record unlike the one before starts a new run.

The engine tells it how far OpenSSL has read: ``consumed = fed -
incoming_bio.pending``.  With the stdlib's ``SSLObject`` OpenSSL reads a
record header and then exactly that record's body (read-ahead is off and
record pipelining is not enabled), so ``consumed`` either sits on a boundary
or inside the record whose header OpenSSL already pulled while the body was
still missing.  Either way the "next record" is the first one that ends
beyond ``consumed`` (in its run: index ``(consumed - start) // size``); it is
complete once it ends within the bytes in the BIO.  Runs that end at or
before ``consumed`` are dropped, so the bookkeeping never holds more than the
runs that are sitting in the BIO.

Runs of identical headers
-------------------------
Bulk senders repeat one record size (OpenSSL, nginx, Go and Node all fill
records to a fixed size while data is queued), so after parsing a header
``feed`` checks whether the headers that follow at the same stride carry the
same type, major version and length.  It compares each of those four byte
positions across all following headers as one strided slice, in C, and takes
the whole run at once; a run costs a few slice operations instead of a
Python loop turn per record (what that is worth end to end is in
``benchmarks/README.md``).  Pieces too small to hold a run, and pieces where
a probe found none, use the loop.

Validation
----------
A header is rejected with ``TLSRecordError`` when it cannot belong to a TLS
1.2 or 1.3 connection:

* content type outside 20..23.  Those are change_cipher_spec, alert,
  handshake and application_data (RFC 8446 §5.1).  24 (heartbeat) is refused
  too: we never negotiate the RFC 6520 extension, and §2 of that RFC forbids
  sending heartbeats without it.  An SSLv2-format ClientHello (first byte
  0x80) is refused for the same reason OpenSSL 3 refuses SSLv2: it is not
  TLS;
* a legacy version whose major byte is not 3 (every SSL 3.0 .. TLS 1.3 value
  is 0x03xx, RFC 8446 §5.1 and Appendix D);
* a length above the limit: 2^14 + 2048 for TLS 1.2 ciphertext (RFC 5246
  §6.2.3), 2^14 + 256 once TLS 1.3 has been negotiated (RFC 8446 §5.2).  The
  engine lowers the limit with :meth:`RecordScanner.set_max_length` when the
  handshake ends; until then the looser TLS 1.2 bound applies.

The error's ``reason`` is the one OpenSSL's record layer gives the same
header, as OpenSSL never sees it: ``WRONG_VERSION_NUMBER`` for a major byte
other than 3 (``HTTP_REQUEST`` or ``HTTPS_PROXY_REQUEST`` if the stream's
first bytes begin such a request), ``UNEXPECTED_MESSAGE`` for an unknown
content type (``BAD_RECORD_TYPE`` once TLS 1.3 has been negotiated), and
``PACKET_LENGTH_TOO_LONG`` for a length above the limit
(``ENCRYPTED_LENGTH_TOO_LONG`` up to 2^14 + 323, the longest record
OpenSSL's read buffer holds).  After a TLS 1.2 handshake OpenSSL
would check an unknown content type's MAC first, so what it says of one
depends on the record's bytes (``DECRYPTION_FAILED_OR_BAD_RECORD_MAC`` for
garbage); ``UNEXPECTED_MESSAGE`` here, as before the handshake.

* once the engine has told it the shortest record the connection's keys can
  produce (:meth:`RecordScanner.set_min_length`, when the handshake ends), a
  length below it: no encrypted record is shorter than its suite's empty
  record (TLS 1.3: the tag and the inner content type; TLS 1.2: 24 bytes
  with GCM and CCM, 16 with ChaCha20-Poly1305 and CCM_8, IV + MAC + 1 with
  CBC), so such a record can only fail to decrypt.
  ``DECRYPTION_FAILED_OR_BAD_RECORD_MAC``, what OpenSSL says of such a TLS
  1.3 record (of a short TLS 1.2 GCM one OpenSSL 3.0 says only "internal
  error").  In TLS 1.3 this applies to application_data records, the only
  ones that are encrypted.  In TLS 1.2 a renegotiation may agree on another
  suite: from its change_cipher_spec on, the bound is 16, the shortest of
  any suite, for the rest of the connection.  Junk of tiny records is
  refused as it is parsed instead of costing a run each until OpenSSL reads
  it.

Before that, a zero-length record is not rejected here: whether it is legal
depends on the content type, and OpenSSL checks it.

On an invalid header the scanner stops accepting bytes: :attr:`fed` stays at
the offset of the bad header, so the engine writes only the valid prefix into
the BIO and can still hand out every record before the bad one.  A header cut
by the end of a feed is kept (up to 4 bytes) and checked when the feed that
completes it comes; if it is bad, :attr:`fed` goes back to its offset, below
what the caller already passed on (the start of the header, which is
harmless: nobody can read a record from it), so the caller passes on nothing
of that feed.
"""

from __future__ import annotations

import struct
from typing import Final

from slabnet._errors import TLSRecordError

__all__ = [
    "CHANGE_CIPHER_SPEC",
    "ALERT",
    "HANDSHAKE",
    "APPLICATION_DATA",
    "HEADER_SIZE",
    "MAX_LENGTH_TLS12",
    "MAX_LENGTH_TLS13",
    "RecordScanner",
]

# ContentType values, RFC 8446 §5.1 (the same numbers as RFC 5246 §6.2.1).
CHANGE_CIPHER_SPEC: Final = 20
ALERT: Final = 21
HANDSHAKE: Final = 22
APPLICATION_DATA: Final = 23

_TYPE_NAMES: Final = {
    CHANGE_CIPHER_SPEC: "change_cipher_spec",
    ALERT: "alert",
    HANDSHAKE: "handshake",
    APPLICATION_DATA: "application_data",
}

#: type (1) + legacy_record_version (2) + length (2), RFC 8446 §5.1.
HEADER_SIZE: Final = 5

#: TLSCiphertext.length limit in TLS 1.2 (and before), as OpenSSL keeps it:
#: 2^14 + 320 (``SSL3_RT_MAX_ENCRYPTED_LENGTH``). RFC 5246 §6.2.3 allows
#: 2^14 + 2048, but OpenSSL, the engine under the ``ssl`` module, refuses a
#: longer header as soon as it reads it; a scanner that waited for such a
#: record's body left a peer that stalls after the header unanswered.
MAX_LENGTH_TLS12: Final = 2**14 + 320

#: TLSCiphertext.length limit in TLS 1.3: 2^14 + 256 (RFC 8446 §5.2).
MAX_LENGTH_TLS13: Final = 2**14 + 256

# The longest record OpenSSL 3.0's read buffer holds: 2^14 bytes of
# plaintext, 320 of encryption overhead and 3 that align the payload (the
# buffer less a header). It refuses a longer header with
# PACKET_LENGTH_TOO_LONG before any other check, in any version; a record
# between the version's limit and this gets ENCRYPTED_LENGTH_TOO_LONG.
_OPENSSL_LONGEST: Final = 2**14 + 320 + 3

# Drop consumed runs from the front of the run list once this many pile up
# (``del list[:n]``); any small number works.
_COMPACT_AT: Final = 32

# The weight of a record that must not be batched.  Any value above every
# possible budget works; plaintext budgets are at most a chunk size.
_BARRIER: Final = 1 << 62

# Fields of a run (a small list, mutated in place while the run grows).
_START, _SIZE, _COUNT, _TYPE = 0, 1, 2, 3

_HEADER: Final = struct.Struct(">BHH")

# feed() looks for runs of identical headers (see _repeats) only in pieces of
# at least this many bytes, and only where at least this many whole headers
# follow: below that the per-record loop is as cheap as a probe.
_PROBE_MIN_BYTES: Final = 4096
_PROBE_MIN_RUN: Final = 6


class RecordScanner:
    """Follows the record headers in one direction of a TLS byte stream.

    Call order: ``feed(data)`` for every piece of ciphertext, in stream order;
    in between, ask :meth:`has_complete_record` or :meth:`data_run` with the number of bytes OpenSSL has consumed so far
    (never decreasing).

    For :meth:`data_run` a record weighs its plaintext bound (``length -
    overhead``) if it is an application_data record longer than an empty
    one, else a barrier weight larger than any budget.  Within a run every
    record weighs the same, so a run is measured with arithmetic, not a loop
    over records.  :meth:`set_expansion` supplies overhead and empty size
    once the cipher is known; until then every record is a barrier.
    """

    __slots__ = (
        "fed",
        "_runs",
        "_head",
        "_dropped",
        "_consumed",
        "_parsed",
        "_next_header",
        "_partial",
        "_max_length",
        "_min_length",
        "_min_after_ccs",
        "_overhead",
        "_empty",
        "_error",
    )

    #: Stream bytes accepted so far (stops in front of an invalid header).
    #: Read-only for callers.
    fed: int

    def __init__(self, max_length: int = MAX_LENGTH_TLS12) -> None:
        # Runs of parsed records, oldest first: [start, size, count, type].
        # Runs before `_head` are consumed and wait for compaction.
        self._runs: list[list[int]] = []
        self._head = 0
        self._dropped = 0  # records in runs removed by compaction
        self._consumed = 0  # records consumed, as of the last query
        self._parsed = 0  # records parsed, in runs still listed or dropped
        self.fed = 0
        self._next_header = 0  # stream offset of the next header to parse
        self._partial = b""  # the start of a header cut short by a feed (< 5)
        self._max_length = max_length
        self._min_length = 0  # no bound until set_min_length()
        self._min_after_ccs = -1  # the bound after a change_cipher_spec (-1: the same)
        self._overhead = 0
        self._empty = _BARRIER  # nothing is batched until set_expansion()
        self._error: TLSRecordError | None = None

    # -- input ---------------------------------------------------------------

    @property
    def error(self) -> TLSRecordError | None:
        """The error that stopped the scanner, if any."""
        return self._error

    def feed(self, data: bytes | bytearray | memoryview, new_runs: int = -1) -> None:
        """Parse the headers that complete within the next `data` bytes.

        Raises ``TLSRecordError`` at the first invalid header; :attr:`fed` then
        counts only the bytes in front of it, and later calls raise it again.

        `new_runs` >= 0 bounds the bookkeeping: parsing stops in front of the
        header that would start run number `new_runs` + 1 of this call, and
        :attr:`fed` then ends at that header (the caller feeds the rest,
        from there, later).  A bulk stream, one record size, parses whole.
        """
        if self._error is not None:
            raise self._error
        n = len(data)
        if self._partial:
            # Finish a header that an earlier feed cut short.
            need = HEADER_SIZE - len(self._partial)
            if n < need:
                self._partial += bytes(data[:n])
                self.fed += n
                return
            ctype, version, length = _HEADER.unpack(self._partial + bytes(data[:need]))
            self._partial = b""
            self._add(ctype, version, length, self._next_header)
        base = self.fed
        stop = base + n
        pos = self._next_header
        unpack_from = _HEADER.unpack_from
        runs = self._runs
        limit = self._max_length
        shortest = self._min_length
        # The run that the next record may extend, and its record size (-1:
        # none; only application_data runs are extended here).
        last: list[int] = runs[-1] if runs else []
        last_size = last[_SIZE] if last and last[_TYPE] == APPLICATION_DATA else -1
        parsed = 0
        probe = n >= _PROBE_MIN_BYTES
        cap = len(runs) + new_runs if new_runs >= 0 else -1  # (-1: no bound)
        stopped = False
        # The hot loop: one unpack, three tests and one increment a record.
        while pos + HEADER_SIZE <= stop:
            ctype, version, length = unpack_from(data, pos - base)
            if ctype == APPLICATION_DATA and version >> 8 == 3 and length <= limit:
                size = HEADER_SIZE + length
                if size == last_size:
                    last[_COUNT] += 1
                else:
                    if len(runs) == cap:
                        stopped = True
                        break
                    if length < shortest:
                        # (Checked once a run: its records share the length.)
                        self._parsed += parsed
                        self._add(ctype, version, length, pos)  # (raises)
                    last = [pos, size, 1, APPLICATION_DATA]
                    runs.append(last)
                    last_size = size
                pos += size
                parsed += 1
                if probe:
                    # Bulk senders repeat one record size: take the whole
                    # run of identical headers that follows in one go.
                    more = (stop - pos - HEADER_SIZE) // size
                    if more >= _PROBE_MIN_RUN:
                        run = _repeats(data, pos - size - base, size, more)
                        last[_COUNT] += run
                        pos += run * size
                        parsed += run
                        # A stream whose sizes vary gets no more probes from
                        # this piece: a probe that finds no run costs more
                        # than the records it looked at.
                        probe = run >= _PROBE_MIN_RUN
            else:
                if len(runs) == cap:
                    stopped = True
                    break
                self._parsed += parsed
                parsed = 0
                self._add(ctype, version, length, pos)
                pos = self._next_header
                last = runs[-1]
                last_size = -1
                shortest = self._min_length  # (a change_cipher_spec may lower it)
        self._parsed += parsed
        self._next_header = pos
        if stopped:
            self.fed = pos  # (a header boundary: nothing partial is kept)
            return
        self.fed = stop
        if pos < stop:
            # A header starts in this piece but does not end in it.
            self._partial = bytes(data[pos - base :])

    def _add(self, ctype: int, version: int, length: int, offset: int) -> None:
        """Check and append one header (the slow path of :meth:`feed`)."""
        if version >> 8 != 3 or ctype not in _TYPE_NAMES:
            header = _HEADER.pack(ctype, version, length)
            # (The version first, as OpenSSL's record layer checks it.)
            if version >> 8 != 3:
                reason = "WRONG_VERSION_NUMBER"
                if offset == 0:
                    reason = _not_tls(header)
            elif self._max_length == MAX_LENGTH_TLS13:
                reason = "BAD_RECORD_TYPE"
            else:
                reason = "UNEXPECTED_MESSAGE"
            if ctype not in _TYPE_NAMES:
                problem = f"unknown content type {ctype}"
            else:
                problem = (
                    f"legacy_record_version 0x{version:04x}: major byte"
                    f" {version >> 8} is not 3"
                )
            if reason in _NOT_TLS:
                problem += (
                    f" (its bytes {header!r} begin"
                    f" {_NOT_TLS[reason]}: the peer does not speak TLS)"
                )
        elif length > self._max_length:
            reason = _too_long(self._max_length, length)
            problem = (
                f"{_TYPE_NAMES[ctype]} record length {length} is above the"
                f" limit of {self._max_length} bytes"
                f" ({_limit_reason(self._max_length)})"
            )
        elif length < self._min_length and (
            ctype == APPLICATION_DATA or self._max_length != MAX_LENGTH_TLS13
        ):
            reason = "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
            problem = (
                f"{_TYPE_NAMES[ctype]} record length {length} is below"
                f" {self._min_length}, the shortest an encrypted record of"
                " this connection can be: it cannot be decrypted"
            )
        else:
            size = HEADER_SIZE + length
            runs = self._runs
            last = runs[-1] if runs else None
            if last is not None and last[_SIZE] == size and last[_TYPE] == ctype:
                last[_COUNT] += 1
            else:
                runs.append([offset, size, 1, ctype])
            self._parsed += 1
            self._next_header = offset + size
            if ctype == CHANGE_CIPHER_SPEC and self._min_after_ccs >= 0:
                # A TLS 1.2 renegotiation: the records after this one may
                # be sealed with another suite, and so may every later one.
                self._min_length = min(self._min_length, self._min_after_ccs)
                self._min_after_ccs = -1
            return
        self._fail(offset, problem, reason)

    def _fail(self, offset: int, problem: str, reason: str) -> None:
        # Stop for good: the bytes from here on are not a TLS stream.
        self.fed = offset
        self._next_header = offset
        self._partial = b""
        self._error = TLSRecordError(
            f"invalid TLS record header at stream offset {offset}: {problem}", reason
        )
        raise self._error

    def set_max_length(self, max_length: int) -> None:
        """Change the record length limit (the engine lowers it for TLS 1.3).

        Records already parsed but not yet consumed are checked again, so a
        record that arrived with the handshake's last flight is not let
        through by the looser bound.  Raises ``TLSRecordError`` like
        :meth:`feed`; the records in front of the bad one stay readable.
        """
        self._max_length = max_length
        runs = self._runs
        for j in range(self._head, len(runs)):
            start, size, count, ctype = runs[j]
            length = size - HEADER_SIZE
            if length > max_length:
                # Unconsumed records of this run are bad from the first on;
                # keep what OpenSSL has already consumed of it.
                first = self._consumed - self._records_before(j) if j == self._head else 0
                self._parsed -= count - first + sum(r[_COUNT] for r in runs[j + 1 :])
                del runs[j + 1 :]
                if first:
                    runs[j][_COUNT] = first
                else:
                    del runs[j]
                self._fail(
                    start + first * size,
                    f"{_TYPE_NAMES[ctype]} record length {length} is above the"
                    f" limit of {max_length} bytes ({_limit_reason(max_length)})",
                    _too_long(max_length, length),
                )

    def set_min_length(self, min_length: int, after_ccs: int = -1) -> None:
        """Refuse records shorter than `min_length` from here on (TLS 1.3:
        application_data records only).  Records already parsed are not
        checked again (OpenSSL refuses them when it reads them).

        With `after_ccs` >= 0, the bound becomes at most `after_ccs` from
        the first change_cipher_spec record parsed after this call on, for
        good: in TLS 1.2 only a renegotiation sends one once the handshake
        is done, and the suite it agrees on seals the records after it."""
        self._min_length = min_length
        self._min_after_ccs = after_ccs

    def set_expansion(self, overhead: int, empty_size: int) -> None:
        """Tell the scanner the negotiated record expansion.

        `overhead` is the smallest number of bytes a record adds to its
        plaintext, `empty_size` the length of the longest record that may
        carry no plaintext (see ``slabnet._tls.record_overhead`` and
        ``empty_record_size``).  Weights are computed when asked for, so
        records already parsed get the new ones too.
        """
        if not 0 <= overhead <= empty_size:
            raise ValueError(
                f"need 0 <= overhead <= empty_size, got {overhead} and {empty_size}"
            )
        self._overhead = overhead
        self._empty = empty_size

    # -- queries -------------------------------------------------------------

    @property
    def records_consumed(self) -> int:
        """Records OpenSSL has read completely, as of the last query."""
        return self._consumed

    @property
    def buffered_records(self) -> int:
        """Parsed records not yet known to be consumed (bookkeeping size)."""
        return self._parsed - self._consumed

    def _records_before(self, index: int) -> int:
        """Records in the runs in front of ``self._runs[index]`` (``_dropped``
        counts the consumed runs, listed or compacted away, before ``_head``)."""
        return self._dropped + sum(r[_COUNT] for r in self._runs[self._head : index])

    def _locate(self, consumed: int) -> tuple[list[int] | None, int]:
        """The run holding the next record after `consumed`, and that
        record's index in the run; drops the runs OpenSSL is done with."""
        runs = self._runs
        head = self._head
        n = len(runs)
        while head < n:
            run = runs[head]
            i = (consumed - run[_START]) // run[_SIZE]
            if i < run[_COUNT]:
                break
            self._dropped += run[_COUNT]
            head += 1
        else:
            self._consumed = self._dropped
            if head:
                del runs[:head]
                self._head = 0
            return None, 0
        if head >= _COMPACT_AT:
            del runs[:head]
            head = 0
        self._head = head
        if i < 0:
            i = 0  # (not reached: consumed never goes back past a run)
        self._consumed = self._dropped + i
        return run, i

    def runs_after(self, consumed: int) -> int:
        """How many runs hold records after the first `consumed` bytes (the
        bookkeeping still listed, parsed ahead of the BIO or not)."""
        run, _ = self._locate(consumed)
        return 0 if run is None else len(self._runs) - self._head

    def has_complete_record(self, consumed: int, avail: int | None = None) -> bool:
        """True if a complete record follows the first `consumed` bytes
        (complete within the first `avail` bytes, all that were fed if None)."""
        run, i = self._locate(consumed)
        if avail is None:
            avail = self.fed
        return run is not None and run[_START] + (i + 1) * run[_SIZE] <= avail

    def data_next(self, consumed: int) -> bool:
        """True if the record that holds stream offset `consumed` -- the
        next one after the first `consumed` bytes, complete or not -- is
        application_data."""
        run, _ = self._locate(consumed)
        return run is not None and run[_TYPE] == APPLICATION_DATA

    def data_run(
        self, consumed: int, budget: int, avail: int | None = None
    ) -> tuple[int, int, int, int]:
        """Measure the run of records that may be read into one chunk.

        Starting with the next record after `consumed`, take records while
        each is complete, is application_data, is longer than an empty record
        (see :meth:`set_expansion`) and its plaintext bound still fits into
        `budget` together with the ones before it.

        Returns ``(end, bound, count, weight)``: the stream offset just past
        the last record taken (``consumed`` if none), the sum of their
        plaintext bounds, how many records were taken, and the one plaintext
        bound they all share (0 if they differ).  `count` is 0 when the next
        record is complete but cannot start a run, and -1 when no complete
        record follows `consumed` at all.  "Complete" means within the first
        `avail` stream bytes (default: all that were fed): the engine parses
        a read's headers at once but puts its bytes into the BIO piece by
        piece.
        """
        run, i = self._locate(consumed)
        if run is None:
            return consumed, 0, -1, 0
        if avail is None:
            avail = self.fed
        start, size, count, ctype = run
        start += i * size  # the next record's header
        if start + size > avail:
            return consumed, 0, -1, 0
        length = size - HEADER_SIZE
        if ctype != APPLICATION_DATA or length <= self._empty:
            return consumed, 0, 0, 0
        weight = length - self._overhead
        take = min(count - i, (avail - start) // size, budget // weight)
        if take < count - i:
            # The usual case: the batch ends inside the first run.
            if take <= 0:
                return consumed, 0, 0, 0
            return start + take * size, take * weight, take, weight
        end = consumed
        bound = taken = shared = 0
        count -= i
        runs = self._runs
        for j in range(self._head, len(runs)):
            if j > self._head:
                start, size, count, ctype = runs[j]
            length = size - HEADER_SIZE
            if ctype != APPLICATION_DATA or length <= self._empty:
                break
            weight = length - self._overhead
            take = min(count, (avail - start) // size, (budget - bound) // weight)
            if take <= 0:
                break
            shared = weight if not taken or shared == weight else 0
            end = start + take * size
            bound += take * weight
            taken += take
            if take < count:
                break
        return end, bound, taken, shared

    @property
    def mid_record(self) -> bool:
        """True if the bytes fed so far end inside a record."""
        return self._next_header != self.fed


def _repeats(data: bytes | bytearray | memoryview, first: int, step: int, count: int) -> int:
    """How many of the `count` headers at ``first + step``, ``first +
    2 * step``, ... equal the one at `first` in type, major version and
    length (each byte position is compared as one strided slice, in C)."""
    lanes = memoryview(data)[first : first + count * step + HEADER_SIZE]
    run = count
    for j in (0, 1, 3, 4):  # type, major version, length (the minor may vary)
        lane = lanes[j + step :: step].tobytes()
        run = min(run, count - len(lane.lstrip(lanes[j : j + 1])))
        if not run:
            break
    return run


#: OpenSSL's reasons for a first record that is another protocol's request,
#: and what it is.
_NOT_TLS: Final = {
    "HTTP_REQUEST": "an HTTP request",
    "HTTPS_PROXY_REQUEST": "an HTTP proxy's CONNECT request",
}


def _not_tls(header: bytes) -> str:
    """OpenSSL's reason for a stream whose first five bytes are not a TLS
    record header: it names the two requests a misdirected client sends
    most (plain HTTP to a TLS port, an HTTP proxy's CONNECT)."""
    if header.startswith((b"GET ", b"POST ", b"HEAD ", b"PUT ")):
        return "HTTP_REQUEST"
    if header.startswith(b"CONNE"):
        return "HTTPS_PROXY_REQUEST"
    return "WRONG_VERSION_NUMBER"


def _too_long(limit: int, length: int) -> str:
    """OpenSSL's reason for a record of ``length`` bytes, above ``limit``."""
    if limit in (MAX_LENGTH_TLS12, MAX_LENGTH_TLS13) and length <= _OPENSSL_LONGEST:
        return "ENCRYPTED_LENGTH_TOO_LONG"
    return "PACKET_LENGTH_TOO_LONG"


def _limit_reason(limit: int) -> str:
    if limit == MAX_LENGTH_TLS13:
        return "2^14 + 256, RFC 8446 section 5.2"
    if limit == MAX_LENGTH_TLS12:
        return "2^14 + 320: OpenSSL's, below RFC 5246 section 6.2.3's 2^14 + 2048"
    return "configured"
