"""Tests for the sans-IO TLS engine (slabnet._tls).

No event loop: two engines joined in memory, and the engine driven over a
plain blocking socket against real ``openssl s_server`` / ``s_client``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import trustme
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import block_until_records, openssl_like, unread
from slabnet._errors import TLSRecordError, TLSTruncatedError
from slabnet._tls import (
    _LEND_LOW,
    LEND_PIECE,
    MAX_FRAGMENT,
    TLSEngine,
    TLSState,
    empty_record_size,
    record_overhead,
)

VERSIONS = [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3]
VERSION_IDS = ["tls12", "tls13"]
HOST = "example.test"


# ---------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server_cert(ca: trustme.CA) -> trustme.LeafCert:
    return ca.issue_cert(HOST, "localhost", "127.0.0.1")


def contexts(
    ca: trustme.CA, cert: trustme.LeafCert, version: ssl.TLSVersion
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(sctx)
    cctx = ssl.create_default_context()
    ca.configure_trust(cctx)
    for ctx in (sctx, cctx):
        ctx.minimum_version = version
        ctx.maximum_version = version
    return cctx, sctx


@pytest.fixture(params=VERSIONS, ids=VERSION_IDS)
def ctxs(
    request: pytest.FixtureRequest, ca: trustme.CA, server_cert: trustme.LeafCert
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    return contexts(ca, server_cert, request.param)


def handshake(c: TLSEngine, s: TLSEngine) -> None:
    cdone = sdone = False
    for _ in range(10):
        cdone = c.do_handshake() or cdone
        s.receive_data(c.data_to_send())
        sdone = s.do_handshake() or sdone
        c.receive_data(s.data_to_send())
        if cdone and sdone:
            break
    assert cdone and sdone
    assert c.state is TLSState.OPEN and s.state is TLSState.OPEN


def make_pair(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext], **kw: object
) -> tuple[TLSEngine, TLSEngine]:
    cctx, sctx = ctxs
    c = TLSEngine(cctx, server_hostname=HOST, **kw)  # type: ignore[arg-type]
    s = TLSEngine(sctx, server_side=True)
    handshake(c, s)
    # Let the client process session tickets (TLS 1.3) right away.
    assert c.read_chunk() is None
    return c, s


def drain(e: TLSEngine) -> list[memoryview]:
    chunks = []
    while (chunk := e.read_chunk()) is not None:
        if not chunk:
            break
        check_chunk(chunk, e)
        chunks.append(chunk)
    return chunks


def check_chunk(chunk: memoryview, e: TLSEngine) -> None:
    assert chunk.readonly
    assert len(chunk.obj) == len(chunk) == chunk.nbytes  # type: ignore[arg-type]
    assert 0 < len(chunk) <= e._max_chunk


def split_records(ciphertext: bytes) -> list[bytes]:
    out = []
    pos = 0
    while pos < len(ciphertext):
        (length,) = struct.unpack_from(">H", ciphertext, pos + 3)
        out.append(ciphertext[pos : pos + 5 + length])
        pos += 5 + length
    return out


# ---------------------------------------------------------------------------
# record expansion helper
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "cipher", "empty", "overhead"),
    [
        ("TLSv1.3", "TLS_AES_128_GCM_SHA256", 17, 17),
        ("TLSv1.3", "TLS_AES_256_GCM_SHA384", 17, 17),
        ("TLSv1.3", "TLS_CHACHA20_POLY1305_SHA256", 17, 17),
        ("TLSv1.3", "TLS_AES_128_CCM_8_SHA256", 9, 9),
        ("TLSv1.2", "ECDHE-RSA-AES128-GCM-SHA256", 24, 24),
        ("TLSv1.2", "ECDHE-ECDSA-AES256-GCM-SHA384", 24, 24),
        ("TLSv1.2", "ECDHE-RSA-CHACHA20-POLY1305", 16, 16),
        ("TLSv1.2", "ECDHE-ECDSA-AES128-CCM8", 16, 16),
        ("TLSv1.2", "ECDHE-ECDSA-AES128-CCM", 24, 24),
        # CBC: IV 16 + MAC 20 + up to 256 bytes of padding; at least 1.
        ("TLSv1.2", "ECDHE-RSA-AES128-SHA", 16 + 20 + 256, 16 + 20 + 1),
        ("TLSv1.2", "ECDHE-RSA-AES256-SHA384", 16 + 48 + 256, 16 + 48 + 1),
        ("TLSv1.2", "AES128-SHA256", 16 + 32 + 256, 16 + 32 + 1),
        ("TLSv1.2", "DES-CBC3-SHA", 8 + 20 + 256, 8 + 20 + 1),
        ("TLSv1", "ECDHE-RSA-AES128-SHA", 20 + 256, 20 + 1),  # implicit IV
        ("TLSv1.2", "NULL-SHA256", 32, 32),
        ("TLSv1.2", "MYSTERY-CIPHER", 2**14 + 320, 0),  # (every record a barrier)
    ],
)
def test_empty_record_size(version: str, cipher: str, empty: int, overhead: int) -> None:
    assert empty_record_size(version, cipher) == empty
    assert record_overhead(version, cipher) == overhead


@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_empty_record_size_matches_openssl(
    version: ssl.TLSVersion, ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    # An AEAD record carrying n bytes is exactly n + overhead long on the
    # wire, which is what the engine sizes its buffers from.
    c, s = make_pair(contexts(ca, server_cert, version))
    name = c.ssl_object.cipher()[0]  # type: ignore[index]
    ver = c.ssl_object.version()
    assert ver is not None
    for n in (1, 100, 1000):
        s.write(b"x" * n)
        (rec,) = split_records(s.data_to_send())
        assert len(rec) - 5 - n == record_overhead(ver, name)
        assert empty_record_size(ver, name) == record_overhead(ver, name)


# ---------------------------------------------------------------------------
# handshake
# ---------------------------------------------------------------------------


def test_handshake_and_extra_info(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    cctx, sctx = ctxs
    cctx.set_alpn_protocols(["h2", "http/1.1"])
    sctx.set_alpn_protocols(["http/1.1"])
    seen_sni: list[str | None] = []

    def sni(obj: object, name: str | None, ctx: ssl.SSLContext) -> None:
        seen_sni.append(name)

    sctx.sni_callback = sni  # type: ignore[assignment]
    c = TLSEngine(cctx, server_hostname=HOST)
    s = TLSEngine(sctx, server_side=True)
    assert c.state is TLSState.HANDSHAKING
    assert c.read_chunk() is None  # nothing to read during the handshake
    assert c.get_extra_info("cipher") is None
    handshake(c, s)
    assert seen_sni == [HOST]
    assert c.get_extra_info("alpn_protocol") == "http/1.1"
    assert c.get_extra_info("ssl_object") is c.ssl_object
    assert c.get_extra_info("sslcontext") is cctx
    peercert = c.get_extra_info("peercert")
    assert isinstance(peercert, dict)
    assert ("DNS", HOST) in peercert["subjectAltName"]
    assert isinstance(c.get_extra_info("peercert_bin"), bytes)
    cipher = c.get_extra_info("cipher")
    assert isinstance(cipher, tuple) and cipher[1] == c.ssl_object.version()
    assert c.get_extra_info("compression") is None
    assert c.get_extra_info("nonexistent", "dflt") == "dflt"
    assert c.do_handshake() is True  # idempotent


def test_handshake_cert_error_passes_through(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    cctx, sctx = ctxs
    c = TLSEngine(cctx, server_hostname="wrong.test")
    s = TLSEngine(sctx, server_side=True)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(c, s)
    assert c.state is TLSState.BROKEN
    with pytest.raises(ssl.SSLCertVerificationError):
        c.do_handshake()  # the same error again
    with pytest.raises(ssl.SSLCertVerificationError):
        c.write(b"x")


def test_handshake_eof_and_garbage(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    cctx, _ = ctxs
    c = TLSEngine(cctx, server_hostname=HOST)
    assert c.do_handshake() is False
    c.receive_eof()
    with pytest.raises(TLSTruncatedError, match="during the TLS handshake"):
        c.do_handshake()
    assert c.state is TLSState.BROKEN

    c = TLSEngine(cctx, server_hostname=HOST)
    assert c.do_handshake() is False
    c.receive_data(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(TLSRecordError, match="offset 0: unknown content type 72"):
        c.do_handshake()
    assert c.state is TLSState.BROKEN


def test_session_resumption(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    cctx, sctx = ctxs
    c1, s1 = make_pair(ctxs)
    s1.write(b"hello")
    c1.receive_data(s1.data_to_send())
    assert bytes(drain(c1)[0]) == b"hello"
    session = c1.ssl_object.session
    assert session is not None
    c2 = TLSEngine(cctx, server_hostname=HOST, session=session)
    s2 = TLSEngine(sctx, server_side=True)
    handshake(c2, s2)
    assert c2.get_extra_info("session_reused") is True
    assert s2.ssl_object.session_reused


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def test_round_trip_byte_exact(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    payload = os.urandom(300_000)
    for a, b in ((c, s), (s, c)):
        a.write(payload[:10])
        a.write(memoryview(payload)[10:100_000])
        a.write_many([payload[100_000:100_001], bytearray(payload[100_001:250_000])])
        a.write_many([memoryview(payload)[i : i + 500] for i in range(250_000, 300_000, 500)])
        wire = a.data_to_send()
        got = bytearray()
        for i in range(0, len(wire), 7000):
            b.receive_data(memoryview(wire)[i : i + 7000])
            for chunk in drain(b):
                got += chunk
        assert got == payload


def test_write_many_joins_small_buffers(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    small = [bytes([i]) * 100 for i in range(200)]  # 20 000 bytes
    s.write_many(small)
    assert s.write_calls == 2  # 16 384 bytes hold 163 buffers, then the rest
    big = b"B" * 40_000
    s.write_many([b"a", big, b"b", b"c"])
    assert s.write_calls == 2 + 3  # "a", big alone (not joined), "bc"
    c.receive_data(s.data_to_send())
    assert b"".join(bytes(x) for x in drain(c)) == b"".join(small) + b"a" + big + b"bc"


def test_write_alone_is_one_record_or_nothing(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    # The transport's first write of an iteration: one record back, or None
    # and nothing done where anything else waits, so order always holds.
    c, s = make_pair(ctxs)
    s.data_to_send()  # (what the handshake left: session tickets)
    record = s.write_alone(b"frame 0")
    assert record is not None and len(split_records(record)) == 1
    assert s.data_to_send() == b""  # all of it was handed back
    s.write(b"queued")  # ciphertext waits in the engine: behind it, not alone
    assert s.write_alone(b"frame 1") is None
    pending = s.data_to_send()
    record2 = s.write_alone(b"frame 1")
    assert record2 is not None
    c.receive_data(record + pending + record2)
    assert b"".join(bytes(x) for x in drain(c)) == b"frame 0queuedframe 1"
    calls = s.write_calls
    s.start_shutdown()
    assert s.write_alone(b"late") is None and s.write_calls == calls
    fresh = TLSEngine(ctxs[0], server_hostname=HOST)  # before its handshake
    assert fresh.write_alone(b"early") is None and fresh.write_calls == 0


def test_coalescing(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    msgs = [os.urandom(700 + i) for i in range(100)]
    for m in msgs:
        s.write(m)
    wire = s.data_to_send()
    assert len(split_records(wire)) == 100
    before = (c.chunks_returned, c.read_calls, c.records_read)
    c.receive_data(wire)
    chunks = drain(c)
    assert b"".join(chunks) == b"".join(msgs)
    assert len(chunks) == c.chunks_returned - before[0]
    # ~75 KB in at most 16 KiB chunks: 5 or 6 chunks, not 100.
    assert len(chunks) <= 7
    assert all(len(ch) <= MAX_FRAGMENT for ch in chunks)
    assert c.read_calls - before[1] == 100  # one SSL_read per record
    assert c.records_read - before[2] == 100
    # Chunks are exact-size, read-only and independent of each other.
    assert all(isinstance(ch.obj, (bytes, bytearray)) for ch in chunks)
    assert c.want_read_errors == 0 or c.ssl_object.version() == "TLSv1.3"


def test_coalescing_respects_max_chunk(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs, max_chunk=3000)
    payload = os.urandom(50_000)
    for i in range(0, len(payload), 1000):
        s.write(payload[i : i + 1000])
    s.write(payload[:20_000])  # 16 KiB records: bigger than max_chunk
    c.receive_data(s.data_to_send())
    chunks = drain(c)
    assert all(len(ch) <= 3000 for ch in chunks)
    assert b"".join(chunks) == payload + payload[:20_000]
    assert len(chunks) < 50 + 20


@pytest.mark.parametrize("record", [700, 4000, 16384])
def test_lent_data_is_fed_in_pieces(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext], record: int
) -> None:
    c, s = make_pair(ctxs)
    payload = os.urandom(300_000)
    for i in range(0, len(payload), record):
        s.write(payload[i : i + record])
    wire = bytearray(s.data_to_send())
    largest = max(len(r) for r in split_records(bytes(wire)))
    got = []
    highest = 0
    for off in range(0, len(wire), 131072):
        lent = memoryview(wire)[off : off + 131072]
        c.lend_data(lent)
        assert c.buffered_ciphertext >= len(lent) - largest
        while (chunk := c.read_chunk()) is not None:
            check_chunk(chunk, c)
            got.append(bytes(chunk))
            highest = max(highest, c._incoming.pending)
        c.release_lent()
        lent[:] = b"\0" * len(lent)  # the lender reuses its buffer
    assert b"".join(got) == payload
    # The BIO never held a whole 128 KiB read, only a piece on top of what
    # was left when it ran low; full-size batches were still made.
    assert highest <= LEND_PIECE + _LEND_LOW + largest
    assert sum(len(g) for g in got) / len(got) > MAX_FRAGMENT * 0.9


def test_release_lent_copies_the_rest(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    payload = os.urandom(100_000)
    for i in range(0, len(payload), 1000):
        s.write(payload[i : i + 1000])
    wire = bytearray(s.data_to_send())
    c.lend_data(memoryview(wire))
    first = c.read_chunk()  # reading pauses after one chunk
    assert first is not None
    waiting = c.buffered_ciphertext
    c.release_lent()
    wire[:] = b"\0" * len(wire)
    # The rest is the engine's own copy now (in the BIO, or behind it until
    # reads need it: see lend_data), none of it the lender's buffer.
    assert c.buffered_ciphertext == waiting
    assert c._lent is None or c._lent.obj is not wire
    rest = b"".join(bytes(x) for x in drain(c))
    assert bytes(first) + rest == payload


def test_invalid_header_in_lent_data(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    for i in range(60):
        s.write(bytes([48 + i % 10]) * 1500)
    wire = bytearray(s.data_to_send() + b"\x17\x09\x09\x00\x10" + b"\x00" * 16)
    c.lend_data(memoryview(wire))
    got = b"".join(bytes(x) for x in drain_until_error(c))
    c.release_lent()
    assert got == b"".join(bytes([48 + i % 10]) * 1500 for i in range(60))
    with pytest.raises(TLSRecordError, match="major byte 9"):
        c.read_chunk()


class CountingSSLObject(ssl.SSLObject):
    """An SSLObject subclass that overrides read() and pending()."""

    reads = 0
    pendings = 0

    def read(self, len: int = 1024, buffer: bytearray | None = None) -> bytes:  # type: ignore[override]
        CountingSSLObject.reads += 1
        return super().read(len, buffer)  # type: ignore[arg-type]

    def pending(self) -> int:
        CountingSSLObject.pendings += 1
        return super().pending()


def test_sslobject_subclass_overrides_are_used(
    ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    # The engine reads through the C methods of the stock SSLObject only.
    cctx, sctx = contexts(ca, server_cert, ssl.TLSVersion.TLSv1_3)
    cctx.sslobject_class = CountingSSLObject
    c, s = make_pair((cctx, sctx))
    before = CountingSSLObject.reads, CountingSSLObject.pendings
    for i in range(30):
        s.write(bytes([65 + i % 26]) * 900)
    c.receive_data(s.data_to_send())
    got = b"".join(bytes(x) for x in drain(c))
    assert got == b"".join(bytes([65 + i % 26]) * 900 for i in range(30))
    assert CountingSSLObject.reads - before[0] == 30  # one per record
    assert CountingSSLObject.pendings > before[1]


def test_partial_records_across_feeds(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    msgs = [os.urandom(1000) for _ in range(20)]
    for m in msgs:
        s.write(m)
    wire = s.data_to_send()
    got = bytearray()
    want_before = c.want_read_errors
    calls_before = c.read_calls
    for i in range(0, len(wire), 2500):  # every piece ends inside a record
        c.receive_data(wire[i : i + 2500])
        got += b"".join(drain(c))
    assert got == b"".join(msgs)
    # Never a wasted SSL_read: every call decrypted one record.
    assert c.want_read_errors == want_before
    assert c.read_calls - calls_before == 20


def test_want_read_not_paid(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    base_wr = c.want_read_errors
    base_calls = c.read_calls
    assert c.read_chunk() is None
    assert c.read_chunk() is None
    s.write(b"x" * 5000)
    wire = s.data_to_send()
    c.receive_data(wire[:-1])  # one byte short of a complete record
    assert c.read_chunk() is None
    c.receive_data(wire[-1:])
    assert bytes(c.read_chunk()) == b"x" * 5000  # type: ignore[arg-type]
    assert c.read_chunk() is None
    assert c.want_read_errors == base_wr
    assert c.read_calls == base_calls + 1


def test_idle_engine_holds_no_read_buffer(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    c, s = make_pair(ctxs)
    for _ in range(3):  # warm up
        s.write(b"y" * 30_000)
        c.receive_data(s.data_to_send())
        drain(c)
    tracemalloc.start()
    try:
        snap1 = tracemalloc.take_snapshot()
        for _ in range(5):
            s.write(b"z" * 60_000)
            c.receive_data(s.data_to_send())
            assert sum(len(ch) for ch in drain(c)) == 60_000
        snap2 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in snap2.compare_to(snap1, "filename"))
    assert grown < 8192, grown


# ---------------------------------------------------------------------------
# ordering: alerts, handshake records, errors, EOF
# ---------------------------------------------------------------------------


def test_close_notify_after_data(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    c, s = make_pair(ctxs)
    for i in range(10):
        s.write(bytes([65 + i]) * 1000)
    s.start_shutdown()
    assert s.state is TLSState.CLOSING
    wire = s.data_to_send()
    records = split_records(wire)
    c.receive_data(wire)
    first = c.read_chunk()
    assert first is not None and bytes(first) == b"".join(bytes([65 + i]) * 1000 for i in range(10))
    if c.ssl_object.version() == "TLSv1.2":
        # The alert record (type 21) ended the batch: still unread.
        assert records[-1][0] == 21
        assert c.buffered_ciphertext == len(records[-1])
        assert not c.eof_received
    eof = c.read_chunk()
    assert eof is not None and len(eof) == 0
    assert c.eof_received
    assert c.state is TLSState.OPEN  # our side can still write
    # Nothing after close_notify is returned, and no error either.
    c.receive_data(b"\x17\x03\x03\x00\x05hello")
    c.receive_data(b"garbage")
    assert c.read_chunk() == b""
    assert c.read_chunk() == b""
    c.write(b"late reply")
    c.start_shutdown()
    assert c.state is TLSState.CLOSED
    s.receive_data(c.data_to_send())
    assert [bytes(x) for x in drain(s)] == [b"late reply"]
    assert s.read_chunk() == b""
    assert s.state is TLSState.CLOSED


def test_close_notify_inside_a_run_of_equal_records(
    ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    # TLS 1.3 encrypts alerts as application_data: a close_notify record is
    # exactly as long as a record of 2 data bytes, so the scanner plans it
    # into the same run of equal records.
    c, s = make_pair(contexts(ca, server_cert, ssl.TLSVersion.TLSv1_3))
    for i in range(5):
        s.write(bytes([65 + i]) * 2)
    s.start_shutdown()
    records = split_records(s.data_to_send())
    assert len({len(r) for r in records}) == 1 and len(records) == 6
    c.receive_data(b"".join(records))
    chunk = c.read_chunk()
    assert chunk is not None and bytes(chunk) == b"AABBCCDDEE"
    assert c.eof_received
    assert c.read_chunk() == b""
    # A run that starts with close_notify gives EOF and nothing after it,
    # not even an equal record that follows (here: a copy, never decrypted).
    c2, s2 = make_pair(contexts(ca, server_cert, ssl.TLSVersion.TLSv1_3))
    s2.start_shutdown()
    close_notify = s2.data_to_send()
    assert len(close_notify) == len(records[0])
    c2.receive_data(close_notify * 2)
    assert c2.read_chunk() == b""
    assert c2.buffered_ciphertext == len(close_notify)  # the copy: unread
    assert c2.read_chunk() == b""


def test_close_notify_inside_a_batch_of_unequal_records(
    ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    # Records of different sizes are read one by one into one chunk (no
    # shared bound); a TLS 1.3 close_notify, planned into the batch as an
    # application_data record, ends it: the data in front of it comes back
    # in one exact-size chunk, then EOF, and nothing after it.
    c, s = make_pair(contexts(ca, server_cert, ssl.TLSVersion.TLSv1_3))
    sizes = [300, 7, 1200, 45]
    for i, n in enumerate(sizes):
        s.write(bytes([65 + i]) * n)
    s.start_shutdown()
    wire = s.data_to_send()
    calls = c.read_calls
    c.receive_data(wire + wire[-30:])  # and bytes after close_notify
    chunk = c.read_chunk()
    expected = b"".join(bytes([65 + i]) * n for i, n in enumerate(sizes))
    assert chunk is not None and bytes(chunk) == expected
    assert len(chunk.obj) == len(chunk)  # type: ignore[arg-type]
    assert c.read_calls - calls == len(sizes) + 1  # one read a record
    assert c.eof_received
    assert c.read_chunk() == b""
    assert c.read_chunk() == b""


@pytest.mark.parametrize("batch", [3, 100])
def test_session_tickets_inside_a_run_of_equal_records(
    ca: trustme.CA, server_cert: trustme.LeafCert, batch: int
) -> None:
    # TLS 1.3 session tickets travel as application_data records.  Data
    # records of the tickets' length make one run with them, so a planned
    # batch starts with records that carry no data and SSL_read reads on
    # past the plan (an over-read): nothing may be lost, stuck or exceed
    # max_chunk.
    cctx, sctx = contexts(ca, server_cert, ssl.TLSVersion.TLSv1_3)
    c = TLSEngine(cctx, server_hostname=HOST)
    s = TLSEngine(sctx, server_side=True)
    tickets = b""
    for _ in range(10):
        done = c.do_handshake()
        s.receive_data(c.data_to_send())
        s.do_handshake()
        if done:
            tickets += s.data_to_send()
            break
        c.receive_data(s.data_to_send())
    lengths = {len(r) for r in split_records(tickets)}
    assert len(split_records(tickets)) >= 1 and len(lengths) == 1
    cipher = c.ssl_object.cipher()
    assert cipher is not None
    n = lengths.pop() - 5 - record_overhead("TLSv1.3", cipher[0])
    sent = b"".join(bytes([65 + i % 26]) * n for i in range(40))
    for i in range(40):
        s.write(sent[i * n : (i + 1) * n])
    c._max_chunk = batch * n
    c.receive_data(tickets + s.data_to_send())
    chunks = drain(c)
    assert b"".join(bytes(x) for x in chunks) == sent
    assert all(len(x) <= batch * n for x in chunks)
    assert c.buffered_ciphertext == 0 and c.ssl_object.pending() == 0


def test_shutdown_keeps_unread_input(ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    # SSL_shutdown discards application data it reads; the engine must not
    # let it see data the application has not read yet.
    c, s = make_pair(ctxs)
    s.write(b"p" * 3000)
    s.write(b"q" * 3000)
    c.receive_data(s.data_to_send())
    c.start_shutdown()
    assert c.state is TLSState.CLOSING
    with pytest.raises(RuntimeError, match="CLOSING"):
        c.write(b"x")
    s.receive_data(c.data_to_send())
    assert s.read_chunk() == b""  # our close_notify reached the peer
    s.write(b"r" * 10)  # the peer may still send before answering
    s.start_shutdown()
    c.receive_data(s.data_to_send())
    got = b"".join(bytes(x) for x in drain(c))
    assert got == b"p" * 3000 + b"q" * 3000 + b"r" * 10
    assert c.read_chunk() == b""
    assert c.state is TLSState.CLOSED


def test_corrupted_record_after_good_ones(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    c, s = make_pair(ctxs)
    for i in range(6):
        s.write(bytes([97 + i]) * 800)
    records = split_records(s.data_to_send())
    bad = bytearray(records[3])
    bad[-3] ^= 0x55  # break the AEAD tag
    c.receive_data(b"".join(records[:3]) + bytes(bad) + b"".join(records[4:]))
    chunk = c.read_chunk()
    assert chunk is not None
    assert bytes(chunk) == b"a" * 800 + b"b" * 800 + b"c" * 800
    with pytest.raises(ssl.SSLError) as info:
        c.read_chunk()
    assert not isinstance(info.value, TLSRecordError)
    assert c.state is TLSState.BROKEN
    with pytest.raises(ssl.SSLError) as again:
        c.read_chunk()
    assert again.value is info.value
    c.receive_data(b"more")  # ignored
    with pytest.raises(ssl.SSLError):
        c.read_chunk()


def test_invalid_header_after_good_records(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    c, s = make_pair(ctxs)
    for i in range(4):
        s.write(bytes([48 + i]) * 600)
    wire = s.data_to_send()
    c.receive_data(wire[:100])
    c.receive_data(wire[100:] + b"\x17\x09\x09\x00\x10" + b"\x00" * 16)
    assert c.state is TLSState.OPEN
    c.write(b"still writable until the error surfaces")
    got = b"".join(bytes(x) for x in drain_until_error(c))
    assert got == b"0" * 600 + b"1" * 600 + b"2" * 600 + b"3" * 600
    with pytest.raises(TLSRecordError, match=f"offset .*major byte 9"):
        c.read_chunk()
    assert c.state is TLSState.BROKEN


def drain_until_error(e: TLSEngine) -> Iterator[memoryview]:
    while True:
        try:
            chunk = e.read_chunk()
        except ssl.SSLError:
            return
        if chunk is None or not chunk:
            return
        check_chunk(chunk, e)
        yield chunk


@pytest.mark.parametrize("ragged", [False, True])
def test_eof_without_close_notify(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext], ragged: bool
) -> None:
    c, s = make_pair(ctxs, ragged_eof=ragged)
    s.write(b"data before FIN")
    c.receive_data(s.data_to_send())
    c.receive_eof()
    assert bytes(c.read_chunk()) == b"data before FIN"  # type: ignore[arg-type]
    if ragged:
        assert c.read_chunk() == b""
        assert c.read_chunk() == b""
        assert c.state is TLSState.OPEN
        c.start_shutdown()
        assert c.state is TLSState.CLOSED
    else:
        with pytest.raises(TLSTruncatedError, match="close_notify") as info:
            c.read_chunk()
        assert isinstance(info.value, ssl.SSLEOFError)
        assert c.state is TLSState.BROKEN
        with pytest.raises(TLSTruncatedError):
            c.read_chunk()


@pytest.mark.parametrize("ragged", [False, True])
def test_eof_inside_a_record_is_always_truncation(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext], ragged: bool
) -> None:
    c, s = make_pair(ctxs, ragged_eof=ragged)
    s.write(b"complete")
    s.write(b"cut short")
    wire = s.data_to_send()
    c.receive_data(wire[:-4])
    c.receive_eof()
    assert bytes(c.read_chunk()) == b"complete"  # type: ignore[arg-type]
    with pytest.raises(TLSTruncatedError, match="middle of a TLS record"):
        c.read_chunk()


@pytest.mark.parametrize("given", ["eof", "http"])
def test_its_own_ssl_errors_read_as_openssls(
    ctxs: tuple[ssl.SSLContext, ssl.SSLContext], given: str
) -> None:
    # The errors the engine raises itself, where OpenSSL never sees the
    # input, against what OpenSSL's SSLObject raises for the same input:
    # the same reason, library and errno, and a pickled copy reads the same.
    cctx, _ = ctxs
    data = b"HTTP/1.1 400 Bad Request\r\n\r\n"
    c = TLSEngine(cctx, server_hostname=HOST)
    assert c.do_handshake() is False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    theirs = cctx.wrap_bio(incoming, outgoing, server_hostname=HOST)
    with pytest.raises(ssl.SSLWantReadError):
        theirs.do_handshake()
    if given == "eof":
        c.receive_eof()
        incoming.write_eof()
    else:
        c.receive_data(data)
        incoming.write(data)
    with pytest.raises(ssl.SSLError) as info:
        c.do_handshake()
    ours = info.value
    with pytest.raises(ssl.SSLError) as info:
        theirs.do_handshake()
    assert type(ours) is (TLSTruncatedError if given == "eof" else TLSRecordError)
    assert isinstance(ours, type(info.value))
    assert openssl_like(ours) == openssl_like(info.value)
    copy = pickle.loads(pickle.dumps(ours))
    assert (type(copy), str(copy), openssl_like(copy)) == (type(ours), str(ours), openssl_like(ours))


def test_tls12_handshake_record_ends_batch(
    ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    # A handshake record (type 22) between data records must end the batch.
    # Python cannot start a renegotiation, so splice a record the peer would
    # reject into the stream: the data in front of it comes back first, and
    # only the next batch reaches the handshake record (and fails on it).
    c, s = make_pair(contexts(ca, server_cert, ssl.TLSVersion.TLSv1_2))
    for i in range(3):
        s.write(bytes([120 + i]) * 500)
    data = s.data_to_send()
    hs = b"\x16\x03\x03\x00\x20" + os.urandom(32)
    c.receive_data(data + hs)
    chunk = c.read_chunk()
    assert chunk is not None and bytes(chunk) == b"x" * 500 + b"y" * 500 + b"z" * 500
    assert c.buffered_ciphertext == len(hs)  # the handshake record waits
    with pytest.raises(ssl.SSLError):
        c.read_chunk()


# ---------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------

_PROPERTY_CACHE: dict[ssl.TLSVersion, tuple[ssl.SSLContext, ssl.SSLContext]] = {}


def _property_ctxs(version: ssl.TLSVersion) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    if version not in _PROPERTY_CACHE:
        ca = trustme.CA()
        _PROPERTY_CACHE[version] = contexts(ca, ca.issue_cert(HOST), version)
    return _PROPERTY_CACHE[version]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    version=st.sampled_from(VERSIONS),
    sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=12),
    cuts=st.lists(st.integers(0, 300_000), max_size=20),
    corrupt=st.one_of(st.none(), st.integers(0, 300_000)),
    close=st.booleans(),
    eof=st.booleans(),
    lend=st.booleans(),
    pause=st.one_of(st.none(), st.integers(0, 3)),
)
# Lent pieces larger than LEND_PIECE while reading is paused: the rest must
# reach the BIO on release_lent().
@example(ssl.TLSVersion.TLSv1_3, [20000] * 5, [], None, True, False, True, 0)
@example(ssl.TLSVersion.TLSv1_2, [3000] * 40, [70_000], None, False, True, True, 1)
def test_property_real_ciphertext_split_anywhere(
    version: ssl.TLSVersion,
    sizes: list[int],
    cuts: list[int],
    corrupt: int | None,
    close: bool,
    eof: bool,
    lend: bool,
    pause: int | None,
) -> None:
    # lend: pieces go in through lend_data()/release_lent(), and the lent
    # bytes are overwritten after release, as the transport's buffer is.
    # pause: at most that many chunks are read per piece (reading paused),
    # the rest after the last piece.
    c, s = make_pair(_property_ctxs(version))
    sent = bytearray()
    for i, n in enumerate(sizes):
        piece = bytes([i % 251]) * n
        sent += piece
        s.write(piece)
    if close:
        s.start_shutdown()
    wire = bytearray(s.data_to_send())
    if corrupt is not None:
        wire[corrupt % len(wire)] ^= 0x01
    points = sorted({x % (len(wire) + 1) for x in cuts} | {0, len(wire)})
    got = bytearray()
    error: BaseException | None = None
    ended = False
    pristine = bytes(wire)

    def read(limit: int | None) -> bool:
        """Read up to `limit` chunks into `got`; True once the stream ended."""
        nonlocal error
        taken = 0
        try:
            while limit is None or taken < limit:
                chunk = c.read_chunk()
                if chunk is None:
                    return False
                if not chunk:
                    return True
                check_chunk(chunk, c)
                got.extend(chunk)
                taken += 1
        except ssl.SSLError as exc:  # TLSRecordError, TLSTruncatedError too
            error = exc
        return False

    for a, b in zip(points, points[1:]):
        if lend:
            c.lend_data(memoryview(wire)[a:b])
        else:
            c.receive_data(memoryview(wire)[a:b])
        try:
            ended = read(pause)
        finally:
            if lend:
                c.release_lent()
                wire[a:b] = b"\xee" * (b - a)
        if ended or error is not None:
            break
    if pause is not None and not ended and error is None:
        ended = read(None)  # reading resumes
    wire[:] = pristine
    if eof and error is None and not ended:
        c.receive_eof()
        try:
            for chunk in iter(c.read_chunk, None):
                if not chunk:
                    ended = True
                    break
                got += chunk
        except ssl.SSLError as exc:
            error = exc
    # Never a byte the peer did not send, never out of order.
    assert got == sent[: len(got)]
    if corrupt is None:
        assert got == sent
        assert ended == close
        if eof and not close:
            assert isinstance(error, TLSTruncatedError)
        else:
            assert error is None


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    version=st.sampled_from(VERSIONS),
    junk=st.lists(st.binary(max_size=300), min_size=1, max_size=6),
    handshaken=st.booleans(),
)
def test_property_arbitrary_bytes(
    version: ssl.TLSVersion, junk: list[bytes], handshaken: bool
) -> None:
    cctx, sctx = _property_ctxs(version)
    if handshaken:
        c, _ = make_pair((cctx, sctx))
    else:
        c = TLSEngine(cctx, server_hostname=HOST)
        c.do_handshake()
    try:
        for piece in junk:
            c.receive_data(piece)
            if c.state is TLSState.HANDSHAKING:
                c.do_handshake()
            else:
                for chunk in iter(c.read_chunk, None):
                    assert not chunk  # nothing was sent: no bytes may appear
                    break
        c.receive_eof()
        if c.state is TLSState.HANDSHAKING:
            c.do_handshake()
        else:
            assert c.read_chunk() in (None, b"")
    except ssl.SSLError:
        pass  # includes TLSRecordError and TLSTruncatedError


# ---------------------------------------------------------------------------
# interop with the openssl command line tools over real sockets
# ---------------------------------------------------------------------------

OPENSSL = shutil.which("openssl")
pytestmark_interop = pytest.mark.skipif(OPENSSL is None, reason="no openssl CLI")


class Pump:
    """Drive a TLSEngine over a blocking socket (no event loop)."""

    def __init__(self, sock: socket.socket, engine: TLSEngine) -> None:
        self.sock = sock
        self.engine = engine
        self.received = bytearray()
        self.eof = False
        sock.settimeout(15)

    def flush(self) -> None:
        out = self.engine.data_to_send()
        if out:
            self.sock.sendall(out)

    def recv_once(self, timeout: float = 15) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return False
        if data:
            self.engine.receive_data(data)
        else:
            self.engine.receive_eof()
        return True

    def settle(self, min_bytes: int, timeout: float = 10) -> None:
        """Wait until the kernel holds ``min_bytes`` for us (or stops
        receiving), so that the reads that follow carry many records each:
        coalescing is then a property of the engine, not of the timing."""
        deadline = time.monotonic() + timeout
        last, still = -1, 0
        while time.monotonic() < deadline:
            queued = unread(self.sock)
            if queued >= min_bytes:
                return
            still = still + 1 if queued == last else 0
            if still >= 20:  # 0.2 s without growth: the peer has sent it all
                return
            last = queued
            time.sleep(0.01)

    def handshake(self) -> None:
        while True:
            done = self.engine.do_handshake()
            self.flush()
            if done:
                return
            self.recv_once()

    def read_available(self) -> list[memoryview]:
        chunks = []
        while (chunk := self.engine.read_chunk()) is not None:
            if not chunk:
                self.eof = True
                break
            check_chunk(chunk, self.engine)
            chunks.append(chunk)
            self.received += chunk
        self.flush()
        return chunks

    def read_until(self, predicate: object, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # type: ignore[operator]
            assert time.monotonic() < deadline, bytes(self.received[-200:])
            assert not self.eof
            self.recv_once(max(0.1, deadline - time.monotonic()))
            self.read_available()


class OpenSSLProc:
    """An openssl s_server/s_client child with its stdout collected."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [OPENSSL or "openssl", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.out = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        while True:
            data = self.proc.stdout.read1(65536)  # type: ignore[attr-defined]
            if not data:
                return
            with self.lock:
                self.out += data

    def output(self) -> bytes:
        with self.lock:
            return bytes(self.out)

    def wait_for(self, pattern: bytes, timeout: float = 15) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output())
            if m:
                return m
            assert self.proc.poll() is None or time.monotonic() < deadline, self.output()
            assert time.monotonic() < deadline, self.output()[-2000:]
            time.sleep(0.02)

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdin:
            self.proc.stdin.close()
        self.thread.join(5)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def pem_files(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, server_cert: trustme.LeafCert
) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("pem")
    server = str(d / "server.pem")
    cafile = str(d / "ca.pem")
    server_cert.private_key_and_cert_chain_pem.write_to_path(server)
    ca.cert_pem.write_to_path(cafile)
    return server, cafile


def hex_payload(n: int) -> bytes:
    # Uppercase hex lines: no line starts with an s_client/s_server command
    # letter (Q, q, R, r, K, k, ...).
    raw = os.urandom(n // 2).hex().upper().encode()
    return b"\n".join(raw[i : i + 63] for i in range(0, len(raw), 63)) + b"\n"


@pytestmark_interop
@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_interop_s_server(
    version: ssl.TLSVersion, pem_files: tuple[str, str], ca: trustme.CA,
    server_cert: trustme.LeafCert,
) -> None:
    server_pem, _ = pem_files
    flag = "-tls1_2" if version is ssl.TLSVersion.TLSv1_2 else "-tls1_3"
    srv = OpenSSLProc(
        ["s_server", "-accept", "127.0.0.1:0", "-cert", server_pem, flag,
         "-max_send_frag", "512", "-naccept", "1"]
    )
    try:
        port = int(srv.wait_for(rb"ACCEPT 127\.0\.0\.1:(\d+)").group(1))
        cctx, _ = contexts(ca, server_cert, version)
        engine = TLSEngine(cctx, server_hostname="localhost")
        with socket.create_connection(("127.0.0.1", port)) as sock:
            pump = Pump(sock, engine)
            pump.handshake()
            assert engine.ssl_object.version() == (
                "TLSv1.2" if version is ssl.TLSVersion.TLSv1_2 else "TLSv1.3"
            )
            # server -> client: 512-byte records, coalesced into chunks
            srv.wait_for(rb"CIPHER is|Cipher is|Secure Renegotiation|-----END SSL SESSION")
            payload = hex_payload(60_000)
            srv.send(payload)
            pump.settle(len(payload))
            pump.read_until(lambda: len(pump.received) >= len(payload))
            assert bytes(pump.received) == payload
            assert engine.records_read >= len(payload) // 512
            assert engine.chunks_returned < engine.records_read / 4
            # client -> server
            up = hex_payload(40_000)
            engine.write_many([up[i : i + 1000] for i in range(0, len(up), 1000)])
            pump.flush()
            srv.wait_for(re.escape(up[-200:]))
            assert up in srv.output()
            if version is ssl.TLSVersion.TLSv1_2:
                renegotiate_from_s_server(srv, pump, engine)
            else:
                key_update_from_s_server(srv, pump, engine)
    finally:
        srv.close()


def renegotiate_from_s_server(srv: OpenSSLProc, pump: Pump, engine: TLSEngine) -> None:
    # Data, then a HelloRequest, sitting in the socket together: the data
    # comes back first and the handshake record is still unread.
    start = len(pump.received)
    srv.send(b"BEFORE-RENEGOTIATION\n")
    fd = pump.sock.fileno()
    block_until_records(fd, lambda recs: any(r[0] == 23 for r in recs))
    srv.send(b"r\n")  # s_server: renegotiate (a command must come alone)
    block_until_records(fd, lambda recs: any(r[0] == 22 for r in recs))  # HelloRequest
    pump.recv_once()
    pump.sock.setblocking(False)
    try:
        while True:
            data = pump.sock.recv(65536)
            if not data:
                break
            engine.receive_data(data)
    except BlockingIOError:
        pass
    first = engine.read_chunk()
    assert first is not None and bytes(first) == b"BEFORE-RENEGOTIATION\n"
    pump.received += first
    scanner = engine._scanner
    # The HelloRequest waits: a complete record that starts no data run.
    assert scanner.data_run(scanner.fed - engine.buffered_ciphertext, 2**14)[2] == 0
    assert engine.data_to_send() == b""
    assert engine.read_chunk() is None  # processes HelloRequest
    hello = engine.data_to_send()
    assert hello[:1] == b"\x16"  # our new ClientHello (encrypted handshake)
    pump.sock.sendall(hello)
    # A write in the middle of the renegotiation waits if it must.
    engine.write(b"DURING-RENEGOTIATION\n")
    pump.flush()
    srv.send(b"AFTER-RENEGOTIATION\n")
    pump.read_until(lambda: b"AFTER-RENEGOTIATION\n" in pump.received[start:])
    assert bytes(pump.received[start:]) == b"BEFORE-RENEGOTIATION\nAFTER-RENEGOTIATION\n"
    # The held write goes out once the renegotiation has finished, and its
    # last messages may arrive after AFTER-RENEGOTIATION: keep reading.
    deadline = time.monotonic() + 15
    while b"DURING-RENEGOTIATION" not in srv.output():
        assert time.monotonic() < deadline, srv.output()[-2000:]
        pump.recv_once(0.05)
        pump.read_available()
    engine.write(b"AFTER-FROM-CLIENT\n")
    pump.flush()
    srv.wait_for(rb"AFTER-FROM-CLIENT")


@contextlib.contextmanager
def s_server_renegotiating(
    pem_files: tuple[str, str], ca: trustme.CA, server_cert: trustme.LeafCert,
    *options: str,
) -> Iterator[tuple[OpenSSLProc, Pump, bytes]]:
    """A TLS 1.2 engine over a socket to s_server (given ``options``), which
    has sent a HelloRequest; the engine has read it and answered with a
    ClientHello, which is kept back (yielded): the server sends on without
    answering."""
    server_pem, _ = pem_files
    srv = OpenSSLProc(
        ["s_server", "-accept", "127.0.0.1:0", "-cert", server_pem, "-tls1_2", "-naccept", "1",
         *options]
    )
    try:
        port = int(srv.wait_for(rb"ACCEPT 127\.0\.0\.1:(\d+)").group(1))
        cctx, _ = contexts(ca, server_cert, ssl.TLSVersion.TLSv1_2)
        cctx.set_ciphers("ECDHE+AESGCM")  # 29 bytes a record on top of its data
        engine = TLSEngine(cctx, server_hostname="localhost")
        with socket.create_connection(("127.0.0.1", port)) as sock:
            pump = Pump(sock, engine)
            pump.handshake()
            srv.wait_for(rb"Secure Renegotiation")
            srv.send(b"r\n")  # s_server: renegotiate (a command must come alone)
            block_until_records(sock.fileno(), lambda recs: len(recs) == 1 and recs[0][0] == 22)
            engine.receive_data(sock.recv(65536))  # the HelloRequest, all there is
            assert engine.read_chunk() is None
            hello = engine.data_to_send()
            assert hello[:1] == b"\x16"
            yield srv, pump, hello
    finally:
        srv.close()


def until_s_server_has(srv: OpenSSLProc, pump: Pump, needle: bytes) -> None:
    deadline = time.monotonic() + 15
    while needle not in srv.output():
        assert time.monotonic() < deadline, srv.output()[-2000:]
        pump.recv_once(0.05)
        pump.read_available()


@pytestmark_interop
@pytest.mark.parametrize("write", ["before", "after"])
@pytest.mark.parametrize("records", ["16K", "512"])
def test_data_behind_a_hello_request_while_a_write_waits(
    write: str, records: str, pem_files: tuple[str, str], ca: trustme.CA,
    server_cert: trustme.LeafCert,
) -> None:
    """A TLS 1.2 client renegotiates (s_server's HelloRequest, our
    ClientHello) and the server sends data on before it answers. While the
    client waits for the ServerHello, SSLObject.write first runs the
    handshake, which reads the next record: application data there is an
    "unexpected record" (a fatal alert), or, once a read has returned such
    data, a failure with no error at all (SSLEOFError). The engine retried
    a held write after each chunk of a read with more records behind it
    (TLS-in-TLS through stunnel to s_server lost its connection so, one
    run in a hundred under load), and wrote at once with records unread.
    Now the data is read first: every byte arrives, then the write. With
    512-byte records a chunk joins 32 of them and more wait behind it."""
    options = () if records == "16K" else ("-max_send_frag", records)
    with s_server_renegotiating(pem_files, ca, server_cert, *options) as (srv, pump, hello):
        engine, sock = pump.engine, pump.sock
        if write == "before":
            engine.write(b"HELD-WRITE\n")  # nothing to read yet: it waits
            assert engine.held_plaintext == len(b"HELD-WRITE\n")
        data = hex_payload(60_000)  # s_server sends it in records of its -max_send_frag
        srv.send(data)
        block_until_records(sock.fileno(), lambda recs: sum(r[2] - 29 for r in recs) >= len(data))
        sock.setblocking(False)
        while True:
            try:
                engine.receive_data(sock.recv(1 << 20))
            except BlockingIOError:
                break
        if write == "after":
            engine.write(b"HELD-WRITE\n")  # records unread in front of the handshake
        got = bytearray()
        while (chunk := engine.read_chunk()) is not None:
            assert len(chunk)
            got += chunk
        assert got == data
        assert engine.held_plaintext == len(b"HELD-WRITE\n")
        assert engine.data_to_send() == b""  # (no alert)
        sock.setblocking(True)
        sock.sendall(hello)
        pump.received = got
        until_s_server_has(srv, pump, b"HELD-WRITE")
        assert engine.held_plaintext == 0
        srv.send(b"AFTER-RENEGOTIATION\n")
        pump.read_until(lambda: pump.received.endswith(b"AFTER-RENEGOTIATION\n"))
        assert bytes(pump.received) == data + b"AFTER-RENEGOTIATION\n"


@pytestmark_interop
def test_shutdown_during_a_renegotiation_waits_for_it(
    pem_files: tuple[str, str], ca: trustme.CA, server_cert: trustme.LeafCert,
) -> None:
    """OpenSSL refuses SSL_shutdown while a handshake runs
    (SHUTDOWN_WHILE_IN_INIT): the engine broke, and a stream closed during
    a server's renegotiation ended with that SSLError, without close_notify.
    Now the close_notify goes once the renegotiation is done."""
    with s_server_renegotiating(pem_files, ca, server_cert) as (srv, pump, hello):
        engine = pump.engine
        engine.start_shutdown()
        assert engine.state is TLSState.OPEN  # not yet: nothing can be sent
        assert engine.data_to_send() == b""
        with pytest.raises(RuntimeError, match="cannot write"):
            engine.write(b"too late")
        pump.sock.sendall(hello)
        until_s_server_has(srv, pump, b"DONE")  # s_server: close_notify received
        assert engine.state in (TLSState.CLOSING, TLSState.CLOSED)


def key_update_from_s_server(srv: OpenSSLProc, pump: Pump, engine: TLSEngine) -> None:
    start = len(pump.received)
    srv.send(b"BEFORE-KEYUPDATE\n")
    time.sleep(0.2)
    srv.send(b"K\n")  # s_server: KeyUpdate, update_requested
    time.sleep(0.2)
    srv.send(b"AFTER-KEYUPDATE\n")
    pump.read_until(lambda: b"AFTER-KEYUPDATE\n" in pump.received[start:])
    assert bytes(pump.received[start:]) == b"BEFORE-KEYUPDATE\nAFTER-KEYUPDATE\n"
    # We answered the KeyUpdate; the server can still read us.
    engine.write(b"AFTER-KEYUPDATE-FROM-CLIENT\n")
    pump.flush()
    srv.wait_for(rb"AFTER-KEYUPDATE-FROM-CLIENT")


def free_listener() -> socket.socket:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    return lsock


@pytestmark_interop
@pytest.mark.parametrize("version", VERSIONS, ids=VERSION_IDS)
def test_interop_s_client(
    version: ssl.TLSVersion, pem_files: tuple[str, str], ca: trustme.CA,
    server_cert: trustme.LeafCert,
) -> None:
    _, cafile = pem_files
    flag = "-tls1_2" if version is ssl.TLSVersion.TLSv1_2 else "-tls1_3"
    _, sctx = contexts(ca, server_cert, version)
    lsock = free_listener()
    port = lsock.getsockname()[1]
    cli = OpenSSLProc(
        ["s_client", "-connect", f"127.0.0.1:{port}", flag, "-CAfile", cafile,
         "-servername", "localhost", "-verify_return_error", "-max_send_frag", "512"]
    )
    try:
        lsock.settimeout(15)
        sock, _ = lsock.accept()
        with sock:
            engine = TLSEngine(sctx, server_side=True)
            pump = Pump(sock, engine)
            pump.handshake()
            cli.wait_for(rb"Verify return code: 0")
            # client -> server in 512-byte records
            payload = hex_payload(50_000)
            cli.send(payload)
            pump.settle(len(payload))
            pump.read_until(lambda: len(pump.received) >= len(payload))
            assert bytes(pump.received) == payload
            assert engine.chunks_returned < engine.records_read / 4
            # server -> client
            down = hex_payload(30_000)
            engine.write(down)
            pump.flush()
            cli.wait_for(re.escape(down[-200:]))
            assert down in cli.output()
            start = len(pump.received)
            if version is ssl.TLSVersion.TLSv1_2:
                # The stdlib server refuses client-initiated renegotiation
                # (no_renegotiation warning); s_client answers with a fatal
                # handshake_failure alert.  The data in front of it still
                # comes out first, then OpenSSL's error passes through.
                cli.send(b"BEFORE\n")
                time.sleep(0.3)
                cli.send(b"R\n")  # s_client: renegotiate (client-initiated)
                cli.wait_for(rb"RENEGOTIATING")
                with pytest.raises(ssl.SSLError, match="HANDSHAKE_FAILURE"):
                    pump.read_until(lambda: False, timeout=10)
                assert bytes(pump.received[start:]) == b"BEFORE\n"
                assert engine.state is TLSState.BROKEN
                return
            cli.send(b"K\n")  # s_client: KeyUpdate, update_requested
            cli.wait_for(rb"KEYUPDATE")
            time.sleep(0.3)
            pump.recv_once(2)
            pump.read_available()
            cli.send(b"AFTER\n")
            pump.read_until(lambda: b"AFTER\n" in pump.received[start:])
            assert bytes(pump.received[start:]) == b"AFTER\n"
            engine.write(b"SERVER-AFTER\n")
            pump.flush()
            cli.wait_for(rb"SERVER-AFTER")
            # Orderly close: our close_notify, then the client's (s_client
            # answers and exits), then TCP FIN.
            engine.start_shutdown()
            pump.flush()
            assert engine.state is TLSState.CLOSING
            pump.read_until(lambda: pump.eof)
            assert engine.state is TLSState.CLOSED
    finally:
        lsock.close()
        cli.close()
