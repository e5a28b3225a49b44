"""Tests for the TLS record header scanner (slabnet._records)."""

from __future__ import annotations

import ssl
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import client_ctx, openssl_like, server_ctx
from slabnet._errors import TLSRecordError
from slabnet._records import (
    ALERT,
    APPLICATION_DATA,
    CHANGE_CIPHER_SPEC,
    HANDSHAKE,
    HEADER_SIZE,
    MAX_LENGTH_TLS12,
    MAX_LENGTH_TLS13,
    RecordScanner,
)


def record(ctype: int, length: int, version: int = 0x0303, fill: int = 0xAB) -> bytes:
    return struct.pack(">BHH", ctype, version, length) + bytes([fill]) * length


RECORDS = [
    (HANDSHAKE, 40),
    (APPLICATION_DATA, 100),
    (APPLICATION_DATA, 0),
    (ALERT, 2),
    (APPLICATION_DATA, 300),
]
STREAM = b"".join(record(t, n) for t, n in RECORDS)


#: What the public queries can tell about a record: whether it may start a
#: data run (application_data with a fragment) or ends one (anything else).
DATA, OTHER = "data", "other"


def kind(ctype: int, length: int) -> tuple[str, int]:
    return (DATA if ctype == APPLICATION_DATA and length else OTHER), length


KINDS = [kind(t, n) for t, n in RECORDS]


def feed_all(sc: RecordScanner, data: bytes, split: bool) -> None:
    """Feed ``data`` whole, or a byte at a time if ``split``."""
    for i in range(len(data)) if split else [0]:
        sc.feed(data[i : i + 1] if split else data)


def walk(
    scanner: RecordScanner, stream_len: int, start: int = 0
) -> list[tuple[str, int]]:
    """Pretend OpenSSL consumes record by record from `start` (consumed
    never goes back); collect each complete record as the public queries
    see it: its kind (data_run with no overhead) and its length (the
    smallest `avail` for which has_complete_record says complete)."""
    scanner.set_expansion(0, 0)
    seen = []
    consumed = start
    while scanner.has_complete_record(consumed):
        lo, hi = consumed + 1, scanner.fed
        while lo < hi:
            mid = (lo + hi) // 2
            if scanner.has_complete_record(consumed, mid):
                hi = mid
            else:
                lo = mid + 1
        count = scanner.data_run(consumed, 2**62)[2]
        seen.append((DATA if count > 0 else OTHER, lo - consumed - HEADER_SIZE))
        consumed = lo
    assert consumed <= stream_len
    return seen


def test_whole_feed() -> None:
    sc = RecordScanner()
    sc.feed(STREAM)
    assert sc.fed == len(STREAM)
    assert sc.has_complete_record(0)
    assert sc.records_consumed == 0
    assert walk(sc, len(STREAM)) == KINDS
    assert sc.records_consumed == len(RECORDS)
    assert sc.buffered_records == 0


def test_byte_by_byte() -> None:
    sc = RecordScanner()
    for i in range(len(STREAM)):
        sc.feed(STREAM[i : i + 1])
        assert sc.fed == i + 1
    assert walk(sc, len(STREAM)) == KINDS


@pytest.mark.parametrize("new_runs", range(len(RECORDS) + 1))
def test_a_run_budget_stops_at_a_header_and_the_rest_parses_on(new_runs: int) -> None:
    # (The engine parses lent data ahead of its BIO with a budget of runs:
    # slabnet._tls._RUNS_AHEAD.) Every record of STREAM starts a run.
    sc = RecordScanner()
    sc.feed(STREAM, new_runs)
    ends = [0]
    for _, n in RECORDS:
        ends.append(ends[-1] + HEADER_SIZE + n)
    assert sc.fed == ends[min(new_runs, len(RECORDS))]
    assert sc.buffered_records == min(new_runs, len(RECORDS))
    sc.feed(memoryview(STREAM)[sc.fed :])
    assert sc.fed == len(STREAM)
    assert walk(sc, len(STREAM)) == KINDS


def test_a_run_budget_takes_a_bulk_stream_whole() -> None:
    bulk = record(APPLICATION_DATA, 1000) * 200 + record(APPLICATION_DATA, 10)
    sc = RecordScanner()
    sc.feed(bulk[:7])  # a header cut short, finished by the next feed
    sc.feed(memoryview(bulk)[7:], 0)  # (the run that header starts is the last feed's)
    last = len(bulk) - len(record(APPLICATION_DATA, 10))
    assert sc.fed == last and sc.buffered_records == 200
    sc.feed(memoryview(bulk)[last:], 0)  # no new run allowed: nothing parsed
    assert sc.fed == last
    sc.feed(memoryview(bulk)[last:], 1)
    assert sc.fed == len(bulk) and sc.buffered_records == 201


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_split_at_every_offset(cut: int) -> None:
    sc = RecordScanner()
    sc.feed(memoryview(STREAM)[:cut])
    # Records that end within the first piece are complete already.
    complete = []
    off = 0
    for t, n in RECORDS:
        if off + HEADER_SIZE + n <= cut:
            complete.append(kind(t, n))
        off += HEADER_SIZE + n
    assert walk(sc, cut) == complete
    sc.feed(bytearray(STREAM[cut:]))
    start = sum(HEADER_SIZE + n for _, n in complete)
    assert complete + walk(sc, len(STREAM), start) == KINDS


def test_trailing_partial_header_and_body() -> None:
    sc = RecordScanner()
    tail = record(APPLICATION_DATA, 50)
    for extra in (tail[:3], tail[:HEADER_SIZE], tail[:20]):
        sc = RecordScanner()
        sc.feed(STREAM + extra)
        assert walk(sc, len(STREAM)) == KINDS
        # The trailing record is not complete: not reported.
        assert not sc.has_complete_record(len(STREAM))
        assert sc.data_run(len(STREAM), 16384)[2] == -1
        sc.feed(tail[len(extra) :])
        assert walk(sc, len(STREAM) + len(tail), len(STREAM)) == [(DATA, 50)]


def test_consumed_inside_a_record() -> None:
    # OpenSSL pulled the header but the body was missing: consumed sits
    # inside the record, which is still "the next record".
    sc = RecordScanner()
    rec = record(APPLICATION_DATA, 64)
    sc.set_expansion(0, 0)
    sc.feed(rec[:10])
    assert not sc.has_complete_record(HEADER_SIZE)
    sc.feed(rec[10:])
    assert sc.has_complete_record(HEADER_SIZE)
    assert sc.data_run(HEADER_SIZE, 16384) == (len(rec), 64, 1, 64)
    assert not sc.has_complete_record(len(rec))


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (struct.pack(">BHH", 0x80, 0x0303, 10), ["unknown content type 128"]),
        (struct.pack(">BHH", 24, 0x0303, 10), ["unknown content type 24"]),
        (struct.pack(">BHH", 19, 0x0303, 10), ["unknown content type 19"]),
        (struct.pack(">BHH", 23, 0x0203, 10), ["legacy_record_version", "0x0203"]),
        (struct.pack(">BHH", 22, 0x0403, 10), ["major byte 4"]),
        (
            struct.pack(">BHH", 23, 0x0303, MAX_LENGTH_TLS12 + 1),
            [f"length {MAX_LENGTH_TLS12 + 1}", "OpenSSL", "RFC 5246"],
        ),
    ],
)
@pytest.mark.parametrize("split", [False, True])
def test_invalid_header(header: bytes, words: list[str], split: bool) -> None:
    good = record(HANDSHAKE, 30) + record(APPLICATION_DATA, 20)
    sc = RecordScanner()
    data = good + header + b"\x00" * 12
    with pytest.raises(TLSRecordError) as info:
        if split:
            # The bad header arrives cut in two.
            sc.feed(data[: len(good) + 2])
            sc.feed(data[len(good) + 2 :])
        else:
            sc.feed(data)
    message = str(info.value)
    assert f"offset {len(good)}" in message
    for word in words:
        assert word in message
    assert sc.fed == len(good)  # only the valid prefix was accepted
    assert sc.error is info.value
    # The records in front of the bad header stay readable.
    assert walk(sc, len(good)) == [(OTHER, 30), (DATA, 20)]
    with pytest.raises(TLSRecordError):
        sc.feed(b"more")


def test_length_limits() -> None:
    sc = RecordScanner()
    sc.feed(record(APPLICATION_DATA, MAX_LENGTH_TLS12))  # exactly the limit is fine
    assert walk(sc, HEADER_SIZE + MAX_LENGTH_TLS12) == [(DATA, MAX_LENGTH_TLS12)]
    sc = RecordScanner(MAX_LENGTH_TLS13)
    sc.feed(record(APPLICATION_DATA, MAX_LENGTH_TLS13))
    with pytest.raises(TLSRecordError, match="RFC 8446"):
        sc.feed(record(APPLICATION_DATA, MAX_LENGTH_TLS13 + 1))


#: A stream's first bytes that are not TLS, and OpenSSL's reason for them.
NOT_TLS = {
    "GET": b"GET / HTTP/1.1\r\n\r\n",
    "POST": b"POST /x HTTP/1.1\r\n",
    "HEAD": b"HEAD / HTTP/1.1\r\n",
    "PUT": b"PUT /x HTTP/1.1\r\n",
    "CONNECT": b"CONNECT a:443 HTTP/1.1\r\n",
    "DELETE": b"DELETE /x HTTP/1.1\r\n",
    "response": b"HTTP/1.1 400 Bad Request\r\n\r\n",
    "version_0503": record(HANDSHAKE, 5, version=0x0503),
    "type_72": record(72, 5),
    "heartbeat": record(24, 5),
    "too_long": record(HANDSHAKE, 0xFFFF)[:40],
}


@pytest.mark.parametrize("kind", sorted(NOT_TLS))
def test_a_first_header_is_refused_with_openssls_reason(server_cert: Any, kind: str) -> None:
    # OpenSSL never sees a header the scanner refuses: the error names the
    # reason OpenSSL's record layer gives the same bytes (here as a server's
    # first read), which code branches on (HTTP_REQUEST: plain HTTP sent to
    # a TLS port; WRONG_VERSION_NUMBER: not TLS at all).
    data = NOT_TLS[kind]
    with pytest.raises(TLSRecordError) as info:
        RecordScanner().feed(data)
    ours = info.value
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    sslobj = server_ctx(server_cert).wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(data)
    with pytest.raises(ssl.SSLError) as info:
        sslobj.do_handshake()
    assert openssl_like(ours) == openssl_like(info.value)
    assert str(ours).startswith(f"[SSL: {ours.reason}] invalid TLS record header at stream offset 0: ")
    if ours.reason in ("HTTP_REQUEST", "HTTPS_PROXY_REQUEST"):
        assert f"its bytes {data[:5]!r} begin an HTTP" in str(ours)


def test_reasons_after_the_first_header_and_in_tls13() -> None:
    first = record(HANDSHAKE, 40)
    cases = [
        (MAX_LENGTH_TLS12, first + b"GET / HTTP/1.1\r\n", "WRONG_VERSION_NUMBER"),  # (not first)
        (MAX_LENGTH_TLS12, first + record(99, 5), "UNEXPECTED_MESSAGE"),
        (MAX_LENGTH_TLS13, first + record(99, 5), "BAD_RECORD_TYPE"),
        (MAX_LENGTH_TLS13, record(APPLICATION_DATA, MAX_LENGTH_TLS13 + 1), "ENCRYPTED_LENGTH_TOO_LONG"),
        (MAX_LENGTH_TLS12, record(APPLICATION_DATA, MAX_LENGTH_TLS12 + 1), "ENCRYPTED_LENGTH_TOO_LONG"),
        (MAX_LENGTH_TLS12, record(APPLICATION_DATA, 2**14 + 324), "PACKET_LENGTH_TOO_LONG"),
    ]
    for limit, data, reason in cases:
        with pytest.raises(TLSRecordError) as info:
            RecordScanner(limit).feed(data)
        assert (info.value.reason, info.value.library, info.value.errno) == (reason, "SSL", 1)
    sc = RecordScanner()
    sc.feed(record(APPLICATION_DATA, MAX_LENGTH_TLS13 + 1))
    with pytest.raises(TLSRecordError) as info:
        sc.set_max_length(MAX_LENGTH_TLS13)  # (the handshake ended as TLS 1.3)
    assert info.value.reason == "ENCRYPTED_LENGTH_TOO_LONG"


def established(server_cert: Any, tls_ca: Any, version: ssl.TLSVersion) -> tuple[ssl.SSLObject, ssl.MemoryBIO]:
    """A client SSLObject after a completed handshake, and its incoming BIO."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx(server_cert, version).wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx(tls_ca, version).wrap_bio(c_in, c_out, server_hostname="localhost")
    for _ in range(10):
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    server.write(b"x")  # (TLS 1.3: the session tickets come before it)
    c_in.write(s_out.read())
    assert client.read(10) == b"x"
    return client, c_in


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["tls13", "tls12"])
def test_length_reasons_after_the_handshake_are_openssls(
    server_cert: Any, tls_ca: Any, version: ssl.TLSVersion
) -> None:
    """A record header too long for the negotiated version gets the reason
    OpenSSL gives the same header once the handshake is done: in TLS 1.3,
    ENCRYPTED_LENGTH_TOO_LONG only up to the longest record its read buffer
    holds, PACKET_LENGTH_TOO_LONG above (slabnet said ENCRYPTED_... for
    every length, 17000 and 18433 included)."""
    limit = MAX_LENGTH_TLS13 if version is ssl.TLSVersion.TLSv1_3 else MAX_LENGTH_TLS12
    for length in (limit + 1, 2**14 + 323, 2**14 + 324, 17000, 18433, 30000, 65535):
        if length <= limit:
            continue
        client, incoming = established(server_cert, tls_ca, version)
        incoming.write(record(APPLICATION_DATA, length)[: HEADER_SIZE + 64])
        with pytest.raises(ssl.SSLError) as theirs:
            client.read(100)
        with pytest.raises(TLSRecordError) as ours:
            RecordScanner(limit).feed(record(APPLICATION_DATA, length))
        assert (length, openssl_like(ours.value)) == (length, openssl_like(theirs.value))


@pytest.mark.parametrize("split", [False, True], ids=["whole", "byte_by_byte"])
def test_records_shorter_than_the_minimum_are_refused(split: bool) -> None:
    # Once the engine sets the shortest record its keys make, a header
    # below it is refused where it starts (a run of data in front of it
    # stays readable), whether it comes in the middle of a bulk piece or
    # byte by byte. In TLS 1.3 only application_data records are encrypted:
    # a short alert or change_cipher_spec record is left to OpenSSL.
    bulk = record(APPLICATION_DATA, 1024) * 8
    for limit, ok, bad in [
        (MAX_LENGTH_TLS13, [record(APPLICATION_DATA, 17), record(ALERT, 2)], [(APPLICATION_DATA, 16)]),
        (MAX_LENGTH_TLS12, [record(APPLICATION_DATA, 16)], [(APPLICATION_DATA, 0), (ALERT, 2), (HANDSHAKE, 15)]),
    ]:
        minimum = 17 if limit == MAX_LENGTH_TLS13 else 16
        sc = RecordScanner(limit)
        sc.set_min_length(minimum)
        feed_all(sc, bulk + b"".join(ok), split)
        for ctype, length in bad:
            sc = RecordScanner(limit)
            sc.set_min_length(minimum)
            with pytest.raises(TLSRecordError) as info:
                feed_all(sc, bulk + record(ctype, length) + bulk, split)
            assert info.value.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
            assert f"offset {len(bulk)}: " in str(info.value)
            assert f"length {length} is below {minimum}" in str(info.value)
            assert sc.fed == len(bulk) and sc.buffered_records == 8


@pytest.mark.parametrize("split", [False, True], ids=["whole", "bytewise"])
def test_a_renegotiations_change_cipher_spec_lowers_the_minimum_for_good(split: bool) -> None:
    # TLS 1.2 GCM: no record is shorter than 24 bytes, until a
    # renegotiation's change_cipher_spec (the only one after the handshake)
    # switches to a suite whose empty records may be 16 bytes (ChaCha20,
    # CCM_8). The records behind it, in the same feed too, get 16; so does
    # everything after, whatever comes.
    bulk = record(APPLICATION_DATA, 1024) * 8
    sc = RecordScanner(MAX_LENGTH_TLS12)
    sc.set_min_length(24, after_ccs=16)
    with pytest.raises(TLSRecordError, match="length 16 is below 24"):
        feed_all(sc, bulk + record(APPLICATION_DATA, 16), split)
    sc = RecordScanner(MAX_LENGTH_TLS12)
    sc.set_min_length(24, after_ccs=16)
    after = record(APPLICATION_DATA, 16) + bulk + record(HANDSHAKE, 16)
    feed_all(sc, bulk + record(HANDSHAKE, 40) + record(CHANGE_CIPHER_SPEC, 25) + after, split)
    feed_all(sc, record(CHANGE_CIPHER_SPEC, 16) + record(APPLICATION_DATA, 16), split)
    assert sc.buffered_records == 8 + 2 + 1 + 8 + 1 + 2
    with pytest.raises(TLSRecordError, match="length 15 is below 16"):
        feed_all(sc, record(APPLICATION_DATA, 15), split)
    # Without after_ccs (TLS 1.3, whose change_cipher_spec records are
    # compatibility padding), the bound stays.
    sc = RecordScanner(MAX_LENGTH_TLS13)
    sc.set_min_length(17)
    with pytest.raises(TLSRecordError, match="length 16 is below 17"):
        feed_all(sc, record(CHANGE_CIPHER_SPEC, 1) + record(APPLICATION_DATA, 16), split)


def test_set_max_length_rechecks_buffered_records() -> None:
    sc = RecordScanner()
    first = record(APPLICATION_DATA, 100)
    sc.feed(first + record(APPLICATION_DATA, MAX_LENGTH_TLS13 + 10))
    with pytest.raises(TLSRecordError, match=f"offset {len(first)}"):
        sc.set_max_length(MAX_LENGTH_TLS13)
    assert sc.fed == len(first)
    assert walk(sc, len(first)) == [(DATA, 100)]


def test_set_max_length_inside_a_partly_consumed_run() -> None:
    sc = RecordScanner()
    big = record(APPLICATION_DATA, MAX_LENGTH_TLS13 + 10)
    sc.feed(record(HANDSHAKE, 30) + big * 3)
    first = HEADER_SIZE + 30
    assert sc.has_complete_record(0, first) and not sc.has_complete_record(0, first - 1)
    assert sc.has_complete_record(first + len(big))  # OpenSSL read two records
    assert sc.records_consumed == 2
    with pytest.raises(TLSRecordError, match=f"offset {first + len(big)}:.*above the limit"):
        sc.set_max_length(MAX_LENGTH_TLS13)
    # What OpenSSL already read stays counted; nothing after the bad header.
    assert sc.fed == first + len(big)
    assert sc.records_consumed == 2
    assert sc.buffered_records == 0
    assert not sc.has_complete_record(first + len(big))


def test_data_run() -> None:
    sc = RecordScanner()
    stream = (
        record(APPLICATION_DATA, 1040)
        + record(APPLICATION_DATA, 1040)
        + record(APPLICATION_DATA, 17)  # may be empty (TLS 1.3 overhead)
        + record(APPLICATION_DATA, 1040)
        + record(HANDSHAKE, 100)
        + record(APPLICATION_DATA, 1040)
        + record(APPLICATION_DATA, 500)
    )
    sc.feed(stream)
    # Before set_expansion nothing is batchable.
    assert sc.data_run(0, 16384)[2] == 0
    sc.set_expansion(17, 17)
    rec = HEADER_SIZE + 1040
    assert sc.data_run(0, 16384) == (2 * rec, 2 * (1040 - 17), 2, 1040 - 17)
    # The budget limits the run.
    assert sc.data_run(0, 1040 - 17) == (rec, 1040 - 17, 1, 1040 - 17)
    assert sc.data_run(0, 1000)[2] == 0
    # The short record stops it; past it, the handshake record does.
    after_short = 2 * rec + HEADER_SIZE + 17
    assert sc.data_run(after_short, 16384) == (after_short + rec, 1023, 1, 1023)
    hs_start = after_short + rec
    assert sc.data_run(hs_start, 16384)[2] == 0
    last = hs_start + HEADER_SIZE + 100
    # Records of different sizes share no plaintext bound (weight 0).
    assert sc.data_run(last, 16384) == (len(stream), 1023 + 483, 2, 0)
    assert sc.data_run(last, 1500) == (last + rec, 1023, 1, 1023)
    # Nothing complete left.
    assert sc.data_run(len(stream), 16384)[2] == -1
    sc.feed(record(APPLICATION_DATA, 1040)[:100])
    assert sc.data_run(len(stream), 16384)[2] == -1


def test_bookkeeping_stays_bounded() -> None:
    sc = RecordScanner()
    sc.set_expansion(17, 17)
    rec = record(APPLICATION_DATA, 1000)
    consumed = 0
    for i in range(5000):
        sc.feed(rec if i % 7 else rec + record(HANDSHAKE, 10))
        consumed += sum(HEADER_SIZE + n for _, n in walk(sc, sc.fed, consumed))
        assert sc.buffered_records <= 2
        assert len(sc._runs) <= 40  # consumed runs are dropped
    assert sc.records_consumed == 5000 + (5000 // 7 + 1)


def test_set_expansion_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="overhead <= empty_size"):
        RecordScanner().set_expansion(24, 17)


def test_equal_records_are_one_run() -> None:
    sc = RecordScanner()
    sc.set_expansion(17, 17)
    rec = record(APPLICATION_DATA, 1040)
    stream = rec * 300 + record(HANDSHAKE, 40) + rec * 5
    # Fed in pieces that cut records and headers anywhere, probed or not.
    for a in range(0, len(stream), 3001):
        sc.feed(stream[a : a + 3001])
    assert [(r[1], r[2], r[3]) for r in sc._runs] == [
        (1045, 300, APPLICATION_DATA), (45, 1, HANDSHAKE), (1045, 5, APPLICATION_DATA)
    ]
    assert sc.buffered_records == 306
    # 16 records of 1023 plaintext bytes fit in 16 KiB.
    assert sc.data_run(0, 16384) == (16 * 1045, 16 * 1023, 16, 1023)
    assert sc.data_run(290 * 1045, 16384) == (300 * 1045, 10 * 1023, 10, 1023)
    assert sc.data_run(300 * 1045, 16384)[2] == 0  # the handshake record
    assert sc.records_consumed == 300


def reference_parse(stream: bytes) -> tuple[list[tuple[int, int]], int | None]:
    """Straightforward parser: complete records and the offset of the first
    invalid header (None if none)."""
    out = []
    pos = 0
    while pos + HEADER_SIZE <= len(stream):
        ctype, version, length = struct.unpack_from(">BHH", stream, pos)
        if ctype not in (20, 21, 22, 23) or version >> 8 != 3 or length > MAX_LENGTH_TLS12:
            return out, pos
        if pos + HEADER_SIZE + length > len(stream):
            break
        out.append((ctype, length))
        pos += HEADER_SIZE + length
    return out, None


record_st = st.tuples(st.sampled_from([20, 21, 22, 23]), st.integers(0, 300)).map(
    lambda tl: record(*tl)
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.one_of(record_st, st.binary(max_size=12)), max_size=12),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
)
def test_property_arbitrary_bytes(parts: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(parts)
    expected, bad = reference_parse(stream)
    sc = RecordScanner()
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    error = None
    for a, b in zip(points, points[1:]):
        try:
            sc.feed(stream[a:b])
        except TLSRecordError as exc:  # the only error it may raise
            error = exc
            break
    if bad is None:
        assert error is None
    else:
        assert error is not None and f"offset {bad}" in str(error)
        assert sc.fed == bad
    got = walk(sc, len(stream))
    assert got == [kind(t, n) for t, n in expected[: len(got)]]
    # Every complete record before the bad header is reported.
    assert len(got) == len(expected)


def reference_data_run(
    records: list[tuple[int, int]], consumed: int, fed: int, budget: int,
    overhead: int, empty: int,
) -> tuple[int, int, int, int]:
    """data_run() spelled out record by record over a known record list."""
    pos = 0
    i = 0
    while i < len(records) and pos + HEADER_SIZE + records[i][1] <= consumed:
        pos += HEADER_SIZE + records[i][1]
        i += 1
    if i == len(records) or pos + HEADER_SIZE + records[i][1] > fed:
        return consumed, 0, -1, 0
    end, bound, count = consumed, 0, 0
    weights = set()
    while i < len(records):
        ctype, length = records[i]
        stop = pos + HEADER_SIZE + length
        if stop > fed or ctype != APPLICATION_DATA or length <= empty:
            break
        if bound + length - overhead > budget:
            break
        end, bound, count = stop, bound + length - overhead, count + 1
        weights.add(length - overhead)
        pos = stop
        i += 1
    return end, bound, count, weights.pop() if len(weights) == 1 else 0


# Runs of identical records (what bulk senders produce), sometimes broken by
# a different size, type or minor version: the shapes feed() probes for.
run_st = st.tuples(
    st.sampled_from([APPLICATION_DATA] * 4 + [HANDSHAKE, ALERT]),
    st.sampled_from([0, 17, 18, 40, 1040, 1041, 4113]),
    st.integers(1, 40),
    st.sampled_from([0x0303, 0x0303, 0x0301]),
)


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(run_st, min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 200_000), max_size=6),
    budget=st.sampled_from([1000, 1023, 5000, 16384]),
)
def test_property_repeated_headers(
    runs: list[tuple[int, int, int, int]], cuts: list[int], budget: int
) -> None:
    records = [(t, n) for t, n, count, _ in runs for _ in range(count)]
    stream = b"".join(record(t, n, v) * count for t, n, count, v in runs)
    sc = RecordScanner()
    sc.set_expansion(17, 17)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    ends = []
    pos = 0
    for _, n in records:
        pos += HEADER_SIZE + n
        ends.append(pos)
    asked = 0  # consumed never goes back
    for a, b in zip(points, points[1:]):
        sc.feed(stream[a:b])
        # Ask at every record boundary already fed, as OpenSSL would consume.
        for consumed in [0] + ends:
            if consumed > b:
                break
            if consumed < asked:
                continue
            asked = consumed
            assert sc.data_run(consumed, budget) == reference_data_run(
                records, consumed, b, budget, 17, 17
            )
    assert sc.records_consumed == len(records)
    assert sc.buffered_records == 0
    fresh = RecordScanner()
    for a, b in zip(points, points[1:]):
        fresh.feed(stream[a:b])
    assert walk(fresh, len(stream)) == [kind(t, n) for t, n in records]
