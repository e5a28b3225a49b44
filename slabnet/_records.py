"""TLS record header scanner (sans-IO).

Theory of operation
===================

OpenSSL hides record boundaries: ``SSLObject.read`` decrypts at most one
record per call and gives no hint about what is still waiting in the incoming
``MemoryBIO``.  The TLS engine needs that hint for two decisions (seed 001 and
cpython issue 123954):

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
It sees every byte exactly once, as the engine copies it into the BIO, and
keeps a list of the records whose headers it has parsed, as absolute stream
offsets (``end`` = offset one past the record's last byte).

The engine tells it how far OpenSSL has read: ``consumed = fed -
incoming_bio.pending``.  With the stdlib's ``SSLObject`` OpenSSL reads a
record header and then exactly that record's body (read-ahead is off and
record pipelining is not enabled), so ``consumed`` either sits on a boundary
or inside the record whose header OpenSSL already pulled while the body was
still missing.  Either way the "next record" is the first one whose ``end``
lies beyond ``consumed``; it is complete once ``end <= fed``.  Records that
end at or before ``consumed`` are dropped, so the bookkeeping never holds
more than the records that are sitting in the BIO.

Runs of identical headers
-------------------------
Bulk senders repeat one record size (OpenSSL, nginx, Go and Node all fill
records to a fixed size while data is queued), so after parsing a header
``feed`` checks whether the headers that follow at the same stride carry the
same type, major version and length.  It compares each of those four byte
positions across all following headers as one strided slice, in C, and takes
the whole run at once; a run costs a few slice operations instead of a
Python loop turn per record (at 1 KiB records this halved the scanner's
cost).  Pieces too small to hold a run, and pieces where a probe found none,
use the loop.

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

A zero-length record is not rejected here: whether it is legal depends on the
content type and on keys the scanner does not know, and OpenSSL checks it.

On an invalid header the scanner stops accepting bytes: :attr:`fed` stays at
the offset of the bad header, so the engine writes only the valid prefix into
the BIO and can still hand out every record before the bad one.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
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

#: TLSCiphertext.length limit in TLS 1.2: 2^14 + 2048 (RFC 5246 §6.2.3).
MAX_LENGTH_TLS12: Final = 2**14 + 2048

#: TLSCiphertext.length limit in TLS 1.3: 2^14 + 256 (RFC 8446 §5.2).
MAX_LENGTH_TLS13: Final = 2**14 + 256

# Compact the record lists once this many consumed entries pile up in front
# of them.  Any small number works; 64 keeps `del list[:n]` (a memmove of the
# surviving pointers) rare and the lists short: a 64 KiB socket read of
# 1 KiB records adds about 64 entries.
_COMPACT_AT: Final = 64

# The weight of a record that must not be batched.  Any value above every
# possible budget works; plaintext budgets are at most a chunk size.
_BARRIER: Final = 1 << 62

_HEADER: Final = struct.Struct(">BHH")

# feed() looks for runs of identical headers (see _repeats) only in pieces of
# at least this many bytes, and only where at least this many whole headers
# follow: below that the per-record loop is as cheap as a probe.
_PROBE_MIN_BYTES: Final = 4096
_PROBE_MIN_RUN: Final = 6


class RecordScanner:
    """Follows the record headers in one direction of a TLS byte stream.

    Call order: ``feed(data)`` for every piece of ciphertext, in stream order,
    as it is written into the incoming BIO; in between, ask
    :meth:`next_record`, :meth:`has_complete_record` or :meth:`data_run` with
    the number of bytes OpenSSL has consumed so far (never decreasing).

    For :meth:`data_run` the scanner gives every record a weight when it
    parses the header: its plaintext bound (``length - overhead``) if it is
    an application_data record longer than an empty one, else a barrier
    weight larger than any budget.  A run is then found with two binary
    searches over running sums instead of a Python loop over records.
    :meth:`set_expansion` supplies overhead and empty size once the cipher
    is known; until then every record is a barrier.
    """

    __slots__ = (
        "fed",
        "_ends",
        "_cum",
        "_odd",
        "_head",
        "_base",
        "_cum_base",
        "_total",
        "_dropped",
        "_next_header",
        "_partial",
        "_max_length",
        "_overhead",
        "_empty",
        "_error",
    )

    #: Stream bytes accepted so far (stops in front of an invalid header).
    #: Read-only for callers.
    fed: int

    def __init__(self, max_length: int = MAX_LENGTH_TLS12) -> None:
        # One entry per parsed header in `_ends` (stream offset just past the
        # record) and `_cum` (running sum of weights, this record included).
        # A record starts where the one before it ends; the first stored one
        # starts at `_base`, and `_cum_base` is the sum in front of it.
        # Entries before `_head` are consumed and wait for compaction.
        self._ends: list[int] = []
        self._cum: list[int] = []
        # Content types other than application_data, by record end offset:
        # they are rare, so data records pay for no third list.
        self._odd: dict[int, int] = {}
        self._head = 0
        self._base = 0
        self._cum_base = 0
        self._total = 0  # == _cum[-1], or _cum_base when empty
        self._dropped = 0  # entries removed by compaction
        self.fed = 0
        self._next_header = 0  # stream offset of the next header to parse
        self._partial = b""  # the start of a header cut short by a feed (< 5)
        self._max_length = max_length
        self._overhead = 0
        self._empty = _BARRIER  # nothing is batched until set_expansion()
        self._error: TLSRecordError | None = None

    # -- input ---------------------------------------------------------------

    @property
    def error(self) -> TLSRecordError | None:
        """The error that stopped the scanner, if any."""
        return self._error

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Parse the headers that complete within the next `data` bytes.

        Raises ``TLSRecordError`` at the first invalid header; :attr:`fed` then
        counts only the bytes in front of it, and later calls raise it again.
        """
        if self._error is not None:
            raise self._error
        n = len(data)
        if self._partial:
            # Finish a header that an earlier feed cut short.
            need = HEADER_SIZE - len(self._partial)
            if n < need:
                self._partial += bytes(data)
                self.fed += n
                return
            ctype, version, length = _HEADER.unpack(self._partial + bytes(data[:need]))
            self._partial = b""
            self._add(ctype, version, length, self._next_header)
        base = self.fed
        stop = base + n
        pos = self._next_header
        unpack_from = _HEADER.unpack_from
        ends = self._ends
        cum = self._cum
        ends_append = ends.append
        cum_append = cum.append
        total = self._total
        limit = self._max_length
        empty = self._empty
        overhead = self._overhead
        probe = n >= _PROBE_MIN_BYTES
        # The hot loop: one unpack, two or three tests, two appends a record.
        while pos + HEADER_SIZE <= stop:
            ctype, version, length = unpack_from(data, pos - base)
            if ctype == APPLICATION_DATA and version >> 8 == 3 and length <= limit:
                step = HEADER_SIZE + length
                pos += step
                ends_append(pos)
                weight = length - overhead if length > empty else _BARRIER
                total += weight
                cum_append(total)
                if probe:
                    # Bulk senders repeat one record size: take the whole
                    # run of identical headers that follows in one go.
                    more = (stop - pos - HEADER_SIZE) // step
                    if more >= _PROBE_MIN_RUN:
                        run = _repeats(data, pos - step - base, step, more)
                        if run:
                            ends.extend(range(pos + step, pos + run * step + 1, step))
                            cum.extend(range(total + weight, total + run * weight + 1, weight))
                            pos += run * step
                            total += run * weight
                        # A stream whose sizes vary gets no more probes from
                        # this piece: each costs about as much as 5 records.
                        probe = run >= _PROBE_MIN_RUN
            else:
                self._total = total
                self._add(ctype, version, length, pos)
                pos = self._next_header
                total = self._total
        self._total = total
        self._next_header = pos
        self.fed = stop
        if pos < stop:
            # A header starts in this piece but does not end in it.
            self._partial = bytes(data[pos - base :])

    def _add(self, ctype: int, version: int, length: int, offset: int) -> None:
        """Check and append one header (the slow path of :meth:`feed`)."""
        if ctype not in _TYPE_NAMES:
            problem = f"unknown content type {ctype}"
        elif version >> 8 != 3:
            problem = (
                f"legacy_record_version 0x{version:04x}: major byte"
                f" {version >> 8} is not 3"
            )
        elif length > self._max_length:
            problem = (
                f"{_TYPE_NAMES[ctype]} record length {length} is above the"
                f" limit of {self._max_length} bytes"
                f" ({_limit_reason(self._max_length)})"
            )
        else:
            end = offset + HEADER_SIZE + length
            self._ends.append(end)
            self._total += self._weight(ctype, length)
            self._cum.append(self._total)
            if ctype != APPLICATION_DATA:
                self._odd[end] = ctype
            self._next_header = end
            return
        self._fail(offset, problem)

    def _weight(self, ctype: int, length: int) -> int:
        if ctype == APPLICATION_DATA and length > self._empty:
            return length - self._overhead
        return _BARRIER

    def _fail(self, offset: int, problem: str) -> None:
        # Stop for good: the bytes from here on are not a TLS stream.
        self.fed = offset
        self._next_header = offset
        self._partial = b""
        self._error = TLSRecordError(
            f"invalid TLS record header at stream offset {offset}: {problem}"
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
        ends = self._ends
        for i in range(self._head, len(ends)):
            start = self._start_of(i)
            length = ends[i] - start - HEADER_SIZE
            if length > max_length:
                ctype = self._odd.get(ends[i], APPLICATION_DATA)
                del ends[i:]
                del self._cum[i:]
                self._total = self._cum[-1] if self._cum else self._cum_base
                self._fail(
                    start,
                    f"{_TYPE_NAMES[ctype]} record length {length} is above the"
                    f" limit of {max_length} bytes ({_limit_reason(max_length)})",
                )

    def set_expansion(self, overhead: int, empty_size: int) -> None:
        """Tell the scanner the negotiated record expansion.

        `overhead` is the smallest number of bytes a record adds to its
        plaintext, `empty_size` the length of the longest record that may
        carry no plaintext (see ``slabnet._tls.record_overhead`` and
        ``empty_record_size``).  Weights of unconsumed records are redone.
        """
        if overhead == self._overhead and empty_size == self._empty:
            return
        self._overhead = overhead
        self._empty = empty_size
        ends = self._ends
        cum = self._cum
        head = self._head
        total = cum[head - 1] if head else self._cum_base
        odd = self._odd
        for i in range(head, len(ends)):
            length = ends[i] - self._start_of(i) - HEADER_SIZE
            total += self._weight(odd.get(ends[i], APPLICATION_DATA), length)
            cum[i] = total
        self._total = total

    # -- queries -------------------------------------------------------------

    @property
    def records_consumed(self) -> int:
        """Records OpenSSL has read completely, as of the last query."""
        return self._dropped + self._head

    @property
    def buffered_records(self) -> int:
        """Parsed records not yet known to be consumed (bookkeeping size)."""
        return len(self._ends) - self._head

    def _advance(self, consumed: int) -> int:
        """Drop records that end at or before `consumed`; return the index
        of the next record (``len(self._ends)`` if no header is parsed)."""
        ends = self._ends
        head = bisect_right(ends, consumed, self._head)
        if head >= _COMPACT_AT:
            self._base = ends[head - 1]
            self._cum_base = self._cum[head - 1]
            del ends[:head]
            del self._cum[:head]
            if self._odd:
                base = self._base
                for end in [end for end in self._odd if end <= base]:
                    del self._odd[end]
            self._dropped += head
            head = 0
        self._head = head
        return head

    def _start_of(self, index: int) -> int:
        return self._ends[index - 1] if index else self._base

    def next_record(self, consumed: int) -> tuple[int, int] | None:
        """The next record after `consumed` bytes, if it is complete.

        Returns ``(content_type, length)``, length being the fragment length
        from the header, or None when the next record has not fully arrived
        (or no record is left).
        """
        head = self._advance(consumed)
        if head < len(self._ends):
            end = self._ends[head]
            if end <= self.fed:
                length = end - self._start_of(head) - HEADER_SIZE
                return self._odd.get(end, APPLICATION_DATA), length
        return None

    def has_complete_record(self, consumed: int, avail: int | None = None) -> bool:
        """True if a complete record follows the first `consumed` bytes
        (complete within the first `avail` bytes, all that were fed if None)."""
        head = self._advance(consumed)
        if avail is None:
            avail = self.fed
        return head < len(self._ends) and self._ends[head] <= avail

    def data_run(
        self, consumed: int, budget: int, avail: int | None = None
    ) -> tuple[int, int, int]:
        """Measure the run of records that may be read into one chunk.

        Starting with the next record after `consumed`, take records while
        each is complete, is application_data, is longer than an empty record
        (see :meth:`set_expansion`) and its plaintext bound still fits into
        `budget` together with the ones before it.

        Returns ``(end, bound, count)``: the stream offset just past the last
        record taken (``consumed`` if none), the sum of their plaintext bounds
        and how many records were taken.  `count` is 0 when the next record
        is complete but cannot start a run, and -1 when no complete record
        follows `consumed` at all (so the caller needs no second query).
        "Complete" means within the first `avail` stream bytes (default: all
        that were fed): the engine parses a read's headers at once but puts
        its bytes into the BIO piece by piece.
        """
        ends = self._ends
        head = bisect_right(ends, consumed, self._head)
        if head >= _COMPACT_AT:
            head = self._advance(consumed)
        else:
            self._head = head
        if avail is None:
            avail = self.fed
        n = len(ends)
        if head == n or ends[head] > avail:
            return consumed, 0, -1
        cum = self._cum
        before = cum[head - 1] if head else self._cum_base
        limit = before + budget
        if cum[head] > limit:
            return consumed, 0, 0
        nxt = head + 1
        if nxt == n or ends[nxt] > avail or cum[nxt] > limit:
            # One record (large records fill a batch alone): no search.
            return ends[head], cum[head] - before, 1
        complete = bisect_right(ends, avail, nxt)
        stop = bisect_right(cum, limit, nxt, complete)
        return ends[stop - 1], cum[stop - 1] - before, stop - head


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


def _limit_reason(limit: int) -> str:
    if limit == MAX_LENGTH_TLS13:
        return "2^14 + 256, RFC 8446 section 5.2"
    if limit == MAX_LENGTH_TLS12:
        return "2^14 + 2048, RFC 5246 section 6.2.3"
    return "configured"
