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
# surviving pointers) rare and the lists short.  A 64 KiB read of 1 KiB
# records adds about 64 entries.
_COMPACT_AT: Final = 64

_HEADER: Final = struct.Struct(">BBBH")


class RecordScanner:
    """Follows the record headers in one direction of a TLS byte stream.

    Call order: ``feed(data)`` for every piece of ciphertext, in stream order,
    as it is written into the incoming BIO; in between, ask
    :meth:`next_record`, :meth:`has_complete_record` or :meth:`data_run` with
    the number of bytes OpenSSL has consumed so far (never decreasing).
    """

    __slots__ = (
        "_ends",
        "_types",
        "_head",
        "_base",
        "_dropped",
        "_fed",
        "_next_header",
        "_partial",
        "_max_length",
        "_error",
    )

    def __init__(self, max_length: int = MAX_LENGTH_TLS12) -> None:
        # Parallel lists, one entry per parsed header: the stream offset just
        # past the record, and its content type.  Entries before `_head` are
        # consumed and wait for compaction.  A record starts where the one
        # before it ends; the first stored one starts at `_base`.
        self._ends: list[int] = []
        self._types: list[int] = []
        self._head = 0
        self._base = 0
        self._dropped = 0  # entries removed by compaction
        self._fed = 0  # stream bytes accepted so far
        self._next_header = 0  # stream offset of the next header to parse
        self._partial = b""  # the start of a header cut short by a feed (< 5)
        self._max_length = max_length
        self._error: TLSRecordError | None = None

    # -- input ---------------------------------------------------------------

    @property
    def fed(self) -> int:
        """Stream bytes accepted so far (stops in front of an invalid header)."""
        return self._fed

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
                self._fed += n
                return
            offset = self._next_header
            ctype, major, _minor, length = _HEADER.unpack(
                self._partial + bytes(data[:need])
            )
            self._partial = b""
            if ctype not in _TYPE_NAMES or major != 3 or length > self._max_length:
                self._fail(ctype, major, length, offset)
            self._next_header = offset + HEADER_SIZE + length
            self._ends.append(self._next_header)
            self._types.append(ctype)
        base = self._fed
        stop = base + n
        pos = self._next_header
        unpack_from = _HEADER.unpack_from
        ends = self._ends
        types = self._types
        limit = self._max_length
        valid = _TYPE_NAMES
        # The hot loop: one unpack and three tests per record.
        while pos + HEADER_SIZE <= stop:
            ctype, major, _minor, length = unpack_from(data, pos - base)
            if major != 3 or length > limit or ctype not in valid:
                self._fail(ctype, major, length, pos)
            pos += HEADER_SIZE + length
            ends.append(pos)
            types.append(ctype)
        self._next_header = pos
        self._fed = stop
        if pos < stop:
            # A header starts in this piece but does not end in it.
            self._partial = bytes(data[pos - base :])

    def _fail(self, ctype: int, major: int, length: int, offset: int) -> None:
        if ctype not in _TYPE_NAMES:
            problem = f"unknown content type {ctype}"
        elif major != 3:
            problem = f"legacy_record_version major byte {major} (must be 3)"
        else:
            problem = (
                f"{_TYPE_NAMES[ctype]} record length {length} is above the"
                f" limit of {self._max_length} bytes"
                f" ({_limit_reason(self._max_length)})"
            )
        # Stop for good: the bytes from here on are not a TLS stream.
        self._fed = offset
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
                ctype = self._types[i]
                del ends[i:]
                del self._types[i:]
                self._fail(ctype, 3, length, start)

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
        head = self._head
        count = len(ends)
        while head < count and ends[head] <= consumed:
            head += 1
        if head >= _COMPACT_AT:
            self._base = ends[head - 1]
            del ends[:head]
            del self._types[:head]
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
            if end <= self._fed:
                length = end - self._start_of(head) - HEADER_SIZE
                return self._types[head], length
        return None

    def has_complete_record(self, consumed: int) -> bool:
        """True if a complete record follows the first `consumed` bytes."""
        head = self._advance(consumed)
        return head < len(self._ends) and self._ends[head] <= self._fed

    def data_run(
        self, consumed: int, empty_size: int, overhead: int, budget: int
    ) -> tuple[int, int, int]:
        """Measure the run of records that may be read into one chunk.

        Starting with the next record after `consumed`, take records while
        each is complete, is application_data, is longer than `empty_size`
        (so it cannot be empty) and its plaintext bound ``length - overhead``
        still fits into `budget` together with the ones before it.

        Returns ``(end, bound, count)``: the stream offset just past the last
        record taken (``consumed`` if none), the sum of their plaintext bounds
        and how many records were taken.
        """
        head = self._advance(consumed)
        ends = self._ends
        types = self._types
        fed = self._fed
        count = len(ends)
        start = self._start_of(head)
        end = consumed
        bound = 0
        taken = head
        # Compare whole records (header included) to skip a subtraction.
        smallest = empty_size + HEADER_SIZE
        cost = overhead + HEADER_SIZE
        while head < count:
            stop = ends[head]
            size = stop - start
            if (
                size <= smallest
                or stop > fed
                or types[head] != APPLICATION_DATA
                or bound + size - cost > budget
            ):
                break
            bound += size - cost
            end = start = stop
            head += 1
        return end, bound, head - taken


def _limit_reason(limit: int) -> str:
    if limit == MAX_LENGTH_TLS13:
        return "2^14 + 256, RFC 8446 section 5.2"
    if limit == MAX_LENGTH_TLS12:
        return "2^14 + 2048, RFC 5246 section 6.2.3"
    return "configured"
