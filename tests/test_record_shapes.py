"""Hostile record shapes from a real OpenSSL peer, on the TLS read path.

The peer is a real ``SSLObject`` (in memory, or ``RawTLS`` on a loopback
socket); records no TLS library sends on request are sealed with the keys of
the real session (``Forged13`` here, ``ForgedTLS12`` from conftest). Each
test checks that the bytes in front of a bad record arrive, that the error
names the problem, that nothing after it is delivered, and that the work
done stays bounded: counted in ``SSLObject.read`` calls, ``read_chunk``
calls and chunks, never in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import socket
import ssl
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import slabnet
from conftest import (
    ForgedTLS12, RawTLS, block_until_records, client_ctx, connect_raw_tls, openssl_like, records,
    server_ctx, unread,
)
from slabnet._errors import TLSRecordError
from slabnet._records import HEADER_SIZE
from slabnet._slab import LEND_SIZE
from slabnet._tls import (
    _LEND_LOW, _RUNS_AHEAD, _RUNS_IN_BIO, LEND_PIECE, MAX_FRAGMENT, TLSEngine, TLSState,
)

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])
SIDES = pytest.mark.parametrize("engine_server", [False, True], ids=["client", "server"])
WAKE = 5.0


# ---------------------------------------------------------------- helpers


def _expand_label(digest: Any, secret: bytes, label: bytes, length: int) -> bytes:
    """HKDF-Expand-Label with an empty context (RFC 8446 7.1)."""
    info = struct.pack("!HB", length, 6 + len(label)) + b"tls13 " + label + b"\x00"
    out = block = b""
    counter = 1
    while len(out) < length:
        block = hmac.new(secret, block + info + bytes([counter]), digest).digest()
        out += block
        counter += 1
    return out[:length]


class Forged13:
    """Seals TLS 1.3 application-traffic records as one side of a real
    session, with its first traffic secret from the keylog (RFC 8446 7.3:
    key and IV from HKDF-Expand-Label; 5.3: the nonce is the IV xor the
    sequence number; 5.2: the header is the additional data). The session's
    own sender must send no record after its Finished (no session tickets),
    so sequence numbers start at 0."""

    def __init__(self, keylog: str, cipher: str, *, from_server: bool) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        label = "SERVER_TRAFFIC_SECRET_0" if from_server else "CLIENT_TRAFFIC_SECRET_0"
        with open(keylog) as f:
            line = [ln for ln in f.read().splitlines() if ln.startswith(label + " ")][-1]
        secret = bytes.fromhex(line.split()[2])
        digest: Any = hashlib.sha384 if cipher.endswith("SHA384") else hashlib.sha256
        aead: Any = ChaCha20Poly1305 if "CHACHA20" in cipher else AESGCM
        key_size = 16 if "AES_128" in cipher else 32
        self._aead = aead(_expand_label(digest, secret, b"key", key_size))
        self._iv = _expand_label(digest, secret, b"iv", 12)
        self._seq = 0

    def seal(
        self, inner_type: int, content: bytes, *, pad: int = 0,
        version: int = 0x0303, outer_type: int = 23,
    ) -> bytes:
        inner = content + bytes([inner_type]) + bytes(pad)
        header = struct.pack("!BHH", outer_type, version, len(inner) + 16)
        seq = self._seq.to_bytes(12, "big")
        self._seq += 1
        nonce = bytes(a ^ b for a, b in zip(self._iv, seq))
        return header + self._aead.encrypt(nonce, inner, header)


class Peer:
    """A real SSLObject over memory BIOs, the other side of an engine."""

    def __init__(self, ctx: ssl.SSLContext, *, server_side: bool) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self.incoming, self.outgoing, server_side=server_side,
            server_hostname=None if server_side else "localhost",
        )
        self.first_out = b""

    def step(self) -> bool:
        try:
            self.obj.do_handshake()
            return True
        except ssl.SSLWantReadError:
            return False

    def take(self) -> bytes:
        out = self.outgoing.read()
        self.first_out = self.first_out or out
        return out


def engine_pair(
    tls_ca: Any, cert: Any, version: ssl.TLSVersion, *, engine_server: bool,
    keylog: str | None = None, tickets: int = 0, ciphers: str | None = None,
) -> tuple[TLSEngine, Peer]:
    """An engine, OPEN, and its peer; a server peer sends `tickets` TLS 1.3
    session tickets, which the engine has not been given (peer.take());
    `ciphers` sets the TLS 1.2 server's suites."""
    sctx, cctx = server_ctx(cert, version), client_ctx(tls_ca, version)
    if version is TLS12 and keylog is not None:
        sctx.set_ciphers("ECDHE+AESGCM:!AES256")
    if ciphers is not None:
        sctx.set_ciphers(ciphers)
    sctx.num_tickets = tickets
    if keylog is not None:
        cctx.keylog_filename = keylog
    engine = TLSEngine(
        sctx if engine_server else cctx, server_side=engine_server,
        server_hostname=None if engine_server else "localhost",
    )
    peer = Peer(cctx if engine_server else sctx, server_side=not engine_server)
    server_hello = b""
    for _ in range(10):
        peer_done = peer.step()
        if engine.state is TLSState.OPEN and peer_done:
            break
        engine.receive_data(peer.take())
        engine.do_handshake()
        out = engine.data_to_send()
        server_hello = server_hello or (out if engine_server else peer.first_out)
        peer.incoming.write(out)
    assert engine.state is TLSState.OPEN
    peer.server_hello = server_hello  # type: ignore[attr-defined]
    return engine, peer


def forger13(peer: Peer, keylog: str, *, engine_server: bool) -> Forged13:
    cipher = peer.obj.cipher()
    assert cipher is not None
    return Forged13(keylog, cipher[0], from_server=not engine_server)


def read_all(engine: TLSEngine, wire: bytes, piece: int = LEND_SIZE) -> tuple[list[bytes], BaseException | None, int]:
    """Lend `wire` as the transport does (reads of `piece` bytes) and read
    it: (chunks, the error that ended it, read_chunk calls)."""
    chunks: list[bytes] = []
    calls = 0
    try:
        for off in range(0, len(wire), piece):
            engine.lend_data(memoryview(wire)[off : off + piece])
            while True:
                calls += 1
                chunk = engine.read_chunk()
                if chunk is None or not chunk:
                    break
                chunks.append(bytes(chunk))
            engine.release_lent()
    except (ssl.SSLError, TLSRecordError) as exc:
        return chunks, exc, calls
    return chunks, None, calls


def assert_final(engine: TLSEngine, exc: BaseException | None) -> None:
    """The error ends the read side for good: raised again, nothing more."""
    assert exc is not None and engine.state is TLSState.BROKEN
    with pytest.raises(type(exc)):
        engine.read_chunk()


@contextlib.asynccontextmanager
async def served_raw_client(
    listener: socket.socket, tls_ca: Any, server_cert: Any, version: ssl.TLSVersion,
    **server_kw: Any,
) -> AsyncIterator[tuple[RawTLS, slabnet.StreamReader, slabnet.StreamWriter]]:
    """A slabnet TLS server on ``listener`` (``start_server`` keywords
    ``server_kw``) and a ``RawTLS`` client of it, both handshakes done: the
    client and the server's reader and writer. The client's socket and the
    server are closed on exit."""
    loop = asyncio.get_running_loop()
    served: asyncio.Future[tuple[slabnet.StreamReader, slabnet.StreamWriter]] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        served.set_result((reader, writer))

    server = await slabnet.start_server(
        handle, sock=listener, ssl=server_ctx(server_cert, version), **server_kw
    )
    try:
        async with connect_raw_tls(listener.getsockname(), client_ctx(tls_ca, version)) as peer:
            async with asyncio.timeout(WAKE):
                await peer.handshake()
                reader, writer = await served
            yield peer, reader, writer
    finally:
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- floods of tiny records


@VERSIONS
@SIDES
def test_tiny_records_coalesce_across_lent_pieces(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion, engine_server: bool
) -> None:
    # A 256 KiB read of 1-byte records holds 8-11 thousand of them, all
    # arrived, so they make chunks of up to MAX_FRAGMENT bytes. The engine
    # moves lent bytes into its BIO 32 KiB at a time and planned each batch
    # from what was in the BIO only: chunks stopped at 1-1.4 KiB (8 times
    # the chunks; asyncio's SSL transport delivers each read as one piece).
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=engine_server)
    n = 120_000
    sent = bytes(i % 251 for i in range(n))
    for i in range(n):
        peer.obj.write(sent[i : i + 1])
    wire = peer.take()
    size = len(wire) // n  # every record the same size
    assert len(wire) == n * size and LEND_SIZE // size > 2 * LEND_PIECE // size
    chunks, exc, _ = read_all(engine, wire)
    assert exc is None and b"".join(chunks) == sent
    assert max(map(len, chunks)) <= MAX_FRAGMENT
    assert engine.read_calls >= n  # one SSL_read a record, as before
    # One chunk per read, but where a read ends inside a record.
    reads = -(-len(wire) // LEND_SIZE)
    assert len(chunks) <= reads + reads, (len(chunks), reads)


@VERSIONS
def test_tiny_records_coalesce_up_to_the_chunk_bound(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion
) -> None:
    # A read holding more than MAX_FRAGMENT bytes of tiny records (1 MiB
    # lent at once) gives chunks of exactly MAX_FRAGMENT.
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=False)
    n = 3 * MAX_FRAGMENT
    for _ in range(n):
        peer.obj.write(b"q")
    wire = peer.take()
    chunks, exc, _ = read_all(engine, wire, piece=len(wire))
    assert exc is None and [len(c) for c in chunks] == [MAX_FRAGMENT] * 3


@VERSIONS
@pytest.mark.asyncio
async def test_stream_tiny_records_arrive_in_few_chunks(
    listener: socket.socket, tls_ca: Any, server_cert: Any, version: ssl.TLSVersion
) -> None:
    # The same through the stream: 4000 one-byte records waiting together
    # in the socket are one read, one chunk (three on main, as asyncio's
    # streams get them: one data_received per read).
    async with served_raw_client(listener, tls_ca, server_cert, version) as (peer, reader, writer):
        n = 4000
        wire = peer.seal(*[bytes([65 + i % 26]) for i in range(n)])
        await peer.send(wire)
        fd = writer.get_extra_info("socket").fileno()
        block_until_records(fd, lambda recs: len(recs) >= n)
        async with asyncio.timeout(WAKE):
            chunk = await reader.read_chunk()
            assert len(chunk) == n
            assert bytes(chunk) == bytes(65 + i % 26 for i in range(n))
            await peer.send(peer.close_notify())
            assert await reader.read() == b""
        writer.close()



@VERSIONS
@SIDES
@pytest.mark.parametrize("lead", [0, 3 * LEND_PIECE // 2], ids=["junk_first", "data_first"])
def test_headers_of_a_read_are_parsed_only_as_they_reach_the_bio(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion, engine_server: bool, lead: int
) -> None:
    # One 256 KiB read: data records (`lead` bytes of 1 KiB records after
    # the first), then records of alternating lengths, so that each is a
    # scanner run of its own (about 130 bytes of bookkeeping each). Found
    # with 0- and 1-byte records, which the scanner now refuses at once
    # (see test_a_record_shorter_than_any_encrypted_one_fails_at_once), so
    # 24- and 25-byte ones (_junk_record) here. The scanner parsed a
    # read's every header at once: a reader that paused after the first
    # chunk held 47,661 records' bookkeeping, 6.1 MB by tracemalloc, for
    # as long as it stayed paused, and one that read on paused for their
    # parse (25 ms) before OpenSSL refused the first. Headers are parsed ahead of the BIO only
    # while they start few runs (_RUNS_AHEAD): a bulk stream's read at once,
    # junk as its bytes go in, a LEND_PIECE at a time; the rest of a read
    # waits as the engine's copy of its bytes. "data_first" puts the junk
    # beyond the first piece, where only that bound stops the parse.
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=engine_server)
    peer.obj.write(b"first")
    for _ in range(lead // 1024):
        peer.obj.write(bytes(1024))
    wire = bytearray(peer.take())
    data_records = 1 + lead // 1024
    i = 0
    while len(wire) < LEND_SIZE:
        wire += _junk_record(i)
        i += 1
    # Records of 5 bytes or more, in what the BIO holds at most, and the
    # runs parsed ahead of it.
    bound = data_records + (LEND_PIECE + _LEND_LOW) // 5 + _RUNS_AHEAD
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        engine.lend_data(memoryview(wire))
        first = engine.read_chunk()
        engine.release_lent()  # the reader paused after one chunk
        wire[:] = bytes(len(wire))  # the lender reuses its buffer
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert first is not None and bytes(first[:5]) == b"first"
    scanner = engine._scanner
    assert scanner.records_consumed + scanner.buffered_records <= bound
    assert held <= 8 * len(wire), held  # (the read's copy, the BIO's records)
    # Reading on: every data byte, then OpenSSL refuses the first junk
    # record; only the BIO's records were parsed.
    got = len(first)
    with pytest.raises(ssl.SSLError):
        while (chunk := engine.read_chunk()) is not None:
            got += len(chunk)
    assert got == 5 + lead // 1024 * 1024
    assert scanner.records_consumed + scanner.buffered_records <= bound
    assert_final(engine, engine._error)


def _junk_record(i: int) -> bytes:
    """The `i`-th of alternating 24- and 25-byte application_data records:
    each a scanner run of its own, and long enough to pass the length
    minimum of every cipher (OpenSSL refuses them, by their MAC, only when
    it reads them)."""
    return b"\x17\x03\x03\x00" + bytes([24 + i % 2]) + bytes(24 + i % 2)


def _listed_runs(engine: TLSEngine) -> int:
    scanner = engine._scanner
    return len(scanner._runs) - scanner._head


#: The runs a paused reader's scanner may list: _RUNS_IN_BIO for the BIO,
#: plus two parses ahead of it. Well below the 25-byte records of one
#: LEND_PIECE, so that the bound is what the tests below see.
_RUNS_LISTED = _RUNS_IN_BIO + 2 * _RUNS_AHEAD + 1
assert _RUNS_LISTED < LEND_PIECE // 25 // 2


@VERSIONS
def test_junk_in_the_bio_of_a_paused_reader_keeps_little_bookkeeping(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion
) -> None:
    # The headers of what goes into the BIO are parsed first. A read of
    # records of alternating lengths (each a scanner run, some 130 bytes of
    # bookkeeping) behind one data record: a reader that paused after the
    # data held a run for every junk record in the BIO, until it resumed
    # and OpenSSL refused the first. Found with 0- and 1-byte records: 5,951
    # runs, 996 KB by tracemalloc with the read's copy (up to 9,600 once the
    # BIO was topped up); those are now refused as they are parsed, so
    # 24- and 25-byte ones here. Now a piece goes into the BIO only as far
    # as _RUNS_IN_BIO runs are listed; the rest waits in the read's copy.
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=False)
    peer.obj.write(b"first")
    wire = bytearray(peer.take())
    i = 0
    while len(wire) < LEND_SIZE:
        wire += _junk_record(i)
        i += 1
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        engine.lend_data(memoryview(wire))
        first = engine.read_chunk()
        engine.release_lent()  # the reader paused after one chunk
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert first is not None and bytes(first) == b"first"
    assert _listed_runs(engine) <= _RUNS_LISTED
    assert held <= len(wire) + 100_000, held  # (the read's copy, the runs)
    with pytest.raises(ssl.SSLError):
        while engine.read_chunk() is not None:
            pass
    assert_final(engine, engine._error)


@VERSIONS
def test_tiny_records_of_changing_sizes_all_arrive_through_the_run_bound(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion
) -> None:
    # Valid records that each start a run (1, 2 and 3 bytes of data, in
    # turn) go into the BIO _RUNS_IN_BIO runs at a time: every byte arrives,
    # in order, in chunks as large as one run of 1-byte records gives, and
    # the bookkeeping stays bounded while the reader pauses after each.
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=False)
    sent = bytearray()
    for i in range(30_000):
        data = bytes([65 + i % 26]) * (1 + i % 3)
        peer.obj.write(data)
        sent += data
    wire = peer.take()
    assert len(wire) > 2 * LEND_SIZE
    chunks: list[bytes] = []
    for off in range(0, len(wire), LEND_SIZE):
        engine.lend_data(memoryview(wire)[off : off + LEND_SIZE])
        while (chunk := engine.read_chunk()) is not None:
            chunks.append(bytes(chunk))
            engine.release_lent()
            assert _listed_runs(engine) <= _RUNS_LISTED
        engine.release_lent()
    assert b"".join(chunks) == sent
    assert max(map(len, chunks)) <= MAX_FRAGMENT
    reads = -(-len(wire) // LEND_SIZE)
    assert len(chunks) <= 2 * (reads + len(sent) // MAX_FRAGMENT), len(chunks)


@VERSIONS
@SIDES
@pytest.mark.parametrize("length", [0, 1, 15])
def test_a_record_shorter_than_any_encrypted_one_fails_at_once(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion, engine_server: bool, length: int
) -> None:
    # No encrypted record is shorter than its cipher's tag (16 bytes in TLS
    # 1.2, the tag and the inner content type in TLS 1.3), so such a record
    # can only fail to decrypt: the scanner refuses it as it parses its
    # header, after the data in front of it, with OpenSSL's reason for it
    # in TLS 1.3 (OpenSSL 3.0 says only "[SSL] internal error" in TLS 1.2),
    # and keeps no bookkeeping for what follows.
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=engine_server)
    peer.obj.write(b"first")
    wire = peer.take()
    junk = b"".join(b"\x17\x03\x03\x00" + bytes([n]) + bytes(n) for n in [length, 1] * 2000)
    chunks, exc, _ = read_all(engine, wire + junk)
    assert b"".join(chunks) == b"first"
    assert isinstance(exc, TLSRecordError), repr(exc)
    assert exc.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
    assert f"offset {engine._scanner.fed}: application_data record length {length} is below" in str(exc)
    assert engine._scanner.buffered_records == 0
    assert_final(engine, exc)
    if version is TLS13:
        # OpenSSL's own error for the record, from its peer's twin.
        twin, twin_peer = engine_pair(tls_ca, server_cert, version, engine_server=engine_server)
        sslobj = twin.ssl_object
        twin._incoming.write(junk[: HEADER_SIZE + length])
        with pytest.raises(ssl.SSLError) as theirs:
            sslobj.read(100)
        assert openssl_like(exc) == openssl_like(theirs.value)


@SIDES
@pytest.mark.parametrize(
    "ciphers, shortest",
    [("ECDHE+AESGCM", 24), ("ECDHE+CHACHA20", 16)],
    ids=["gcm", "chacha20"],
)
def test_a_tls12_record_shorter_than_its_suite_makes_fails_clearly(
    tls_ca: Any, server_cert: Any, engine_server: bool, ciphers: str, shortest: int
) -> None:
    # TLS 1.2 GCM seals an empty record in 24 bytes (explicit nonce and
    # tag), ChaCha20-Poly1305 in 16. A shorter one is refused where it
    # starts, after the data in front of it, with the reason OpenSSL gives
    # a record that fails to decrypt; OpenSSL 3.0 itself says only "[SSL]
    # internal error" (reason None) of a 16-23-byte GCM record. A record of
    # the suite's shortest length is left to OpenSSL, which fails to
    # decrypt these (their bytes are not sealed).
    engine, peer = engine_pair(tls_ca, server_cert, TLS12, engine_server=engine_server, ciphers=ciphers)
    assert ("GCM" if shortest == 24 else "CHACHA20") in engine.ssl_object.cipher()[0]
    peer.obj.write(b"first")
    wire = peer.take()
    for length in (16, shortest - 1):
        if length >= shortest:
            continue
        twin, twin_peer = engine_pair(tls_ca, server_cert, TLS12, engine_server=engine_server, ciphers=ciphers)
        twin_peer.obj.write(b"first")
        chunks, exc, _ = read_all(twin, twin_peer.take() + b"\x17\x03\x03\x00" + bytes([length]) + bytes(length))
        assert b"".join(chunks) == b"first"
        assert isinstance(exc, TLSRecordError), repr(exc)
        assert exc.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
        assert f"application_data record length {length} is below {shortest}" in str(exc)
        assert_final(twin, exc)
    chunks, exc, _ = read_all(engine, wire + b"\x17\x03\x03\x00" + bytes([shortest]) + bytes(shortest))
    assert b"".join(chunks) == b"first"
    assert isinstance(exc, ssl.SSLError) and not isinstance(exc, TLSRecordError), repr(exc)


# ---------------------------------------------------------------- forged records, engine level

Seal = Callable[[int, bytes], bytes]  # (content type, plaintext) -> wire record


@pytest.fixture(params=[TLS12, TLS13], ids=["tls12", "tls13"])
def version(request: pytest.FixtureRequest) -> ssl.TLSVersion:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=[False, True], ids=["client", "server"])
def engine_server(request: pytest.FixtureRequest) -> bool:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def forged(
    tls_ca: Any, server_cert: Any, tmp_path: Any, version: ssl.TLSVersion, engine_server: bool,
) -> tuple[TLSEngine, Seal, Forged13 | None]:
    """An OPEN engine and a sealer of the peer's next records (plus the
    TLS 1.3 forger, for padding and header fields)."""
    keylog = str(tmp_path / "keys.log")
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=engine_server, keylog=keylog)
    if version is TLS13:
        f13 = forger13(peer, keylog, engine_server=engine_server)
        return engine, f13.seal, f13
    f12 = ForgedTLS12(keylog, peer.server_hello)  # type: ignore[attr-defined]
    return engine, (lambda ctype, plain: f12.seal(ctype, plain, from_server=not engine_server)), None


def test_long_run_of_empty_records_fails_clearly(
    forged: tuple[TLSEngine, Seal, Forged13 | None],
) -> None:
    # Zero-length application data is legal (RFC 5246 6.2.1, RFC 8446
    # 5.1); OpenSSL refuses more than 32 in a row (RECORD_TOO_SMALL), as
    # asyncio's transport, on the same OpenSSL, does. The data in front
    # comes first, and the run costs a handful of reads, not one a record.
    engine, seal, _ = forged
    wire = seal(23, b"first") + b"".join(seal(23, b"") for _ in range(5000)) + seal(23, b"never")
    chunks, exc, calls = read_all(engine, wire)
    assert chunks == [b"first"]
    assert isinstance(exc, ssl.SSLError) and "RECORD_TOO_SMALL" in str(exc)
    assert engine.read_calls <= 4 and calls <= 4
    assert_final(engine, exc)


def test_empty_records_between_data_are_skipped(
    forged: tuple[TLSEngine, Seal, Forged13 | None],
) -> None:
    # Up to 32 in a row are ignored by OpenSSL; interleaved with data
    # (3000 of each) nothing is lost and each record costs one read.
    engine, seal, _ = forged
    wire = b"".join(seal(23, b"") + seal(23, bytes([48 + i % 10])) for i in range(3000))
    wire += b"".join(seal(23, b"") for _ in range(30)) + seal(23, b"end")
    chunks, exc, calls = read_all(engine, wire)
    assert exc is None
    assert b"".join(chunks) == bytes(48 + i % 10 for i in range(3000)) + b"end"
    assert engine.read_calls <= 3001 and calls <= 2 * 3001 + 4
    assert engine.state is TLSState.OPEN


@pytest.mark.parametrize("shape", ["full", "overflow", "max_padding", "too_long"])
@pytest.mark.parametrize("engine_server", [False, True], ids=["client", "server"])
@pytest.mark.parametrize("version", [TLS13], ids=["tls13"])
def test_tls13_record_size_limits(
    forged: tuple[TLSEngine, Seal, Forged13 | None], shape: str
) -> None:
    # 2^14 bytes of plaintext is the limit (RFC 8446 5.1) and 2^14 + 256
    # the record's (5.2), padding included. One byte of plaintext over:
    # OpenSSL's record_overflow (DATA_LENGTH_TOO_LONG); one byte of record
    # over: the scanner's TLSRecordError. Either comes after the data.
    engine, _, f13 = forged
    assert f13 is not None
    first = f13.seal(23, b"a")
    if shape == "full":
        body = f13.seal(23, b"x" * MAX_FRAGMENT)
    elif shape == "overflow":
        body = f13.seal(23, b"x" * (MAX_FRAGMENT + 1))
    else:
        # content (1) + type (1) + padding + tag (16): 2^14 + 256 (+ 1)
        body = f13.seal(23, b"p", pad=MAX_FRAGMENT + 256 - 18 + (shape == "too_long"))
    chunks, exc, _ = read_all(engine, first + body + f13.seal(23, b"z"))
    data = b"".join(chunks)
    if shape == "full":
        assert exc is None and data == b"a" + b"x" * MAX_FRAGMENT + b"z"
    elif shape == "max_padding":
        assert exc is None and data == b"apz"
    elif shape == "overflow":
        assert data == b"a" and isinstance(exc, ssl.SSLError)
        assert "DATA_LENGTH_TOO_LONG" in str(exc)
        assert_final(engine, exc)
    else:
        assert data == b"a" and isinstance(exc, TLSRecordError)
        assert "length 16641 is above the limit of 16640" in str(exc)
        assert_final(engine, exc)


# TLS 1.3: (what follows "a", the error's class, words in its message).
_TLS13_BAD: dict[str, tuple[Callable[[Forged13], bytes], type[BaseException], str]] = {
    "inner_heartbeat": (lambda f: f.seal(24, b"\x01\x00\x10" + bytes(16)), ssl.SSLError, "BAD_RECORD_TYPE"),
    "inner_type_99": (lambda f: f.seal(99, b"hi"), ssl.SSLError, "BAD_RECORD_TYPE"),
    "outer_heartbeat": (lambda f: f.seal(23, b"h", outer_type=24), TLSRecordError, "unknown content type 24"),
    "outer_type_99": (lambda f: f.seal(23, b"h", outer_type=99), TLSRecordError, "unknown content type 99"),
    "change_cipher_spec": (lambda f: b"\x14\x03\x03\x00\x01\x01", ssl.SSLError, "BAD_RECORD_TYPE"),
    "plaintext_handshake": (lambda f: b"\x16\x03\x03\x00\x04\x04\x00\x00\x00", ssl.SSLError, "BAD_RECORD_TYPE"),
    "version_0301": (lambda f: f.seal(23, b"v", version=0x0301), ssl.SSLError, "WRONG_VERSION_NUMBER"),
    "version_03ff": (lambda f: f.seal(23, b"v", version=0x03FF), ssl.SSLError, "WRONG_VERSION_NUMBER"),
    "version_0203": (lambda f: f.seal(23, b"v", version=0x0203), TLSRecordError, "major byte 2 is not 3"),
    "warning_alerts": (lambda f: b"".join(f.seal(21, b"\x01\x5a") for _ in range(10)), ssl.SSLError, "TOO_MANY_WARN_ALERTS"),
    "bad_mac": (lambda f: b"\x17\x03\x03\x00\x20" + bytes(32), ssl.SSLError, "BAD_RECORD_MAC"),
    "not_tls": (lambda f: b"GET / HTTP/1.1\r\n\r\n", TLSRecordError, "unknown content type 71"),
}


@pytest.mark.parametrize("shape", sorted(_TLS13_BAD))
@pytest.mark.parametrize("engine_server", [False, True], ids=["client", "server"])
@pytest.mark.parametrize("version", [TLS13], ids=["tls13"])
def test_tls13_hostile_records_after_data(
    forged: tuple[TLSEngine, Seal, Forged13 | None], shape: str
) -> None:
    # Data first, then a specific error; the record behind is never read.
    engine, _, f13 = forged
    assert f13 is not None
    make, kind, words = _TLS13_BAD[shape]
    wire = f13.seal(23, b"before") + make(f13)
    wire += f13.seal(23, b"never")
    chunks, exc, calls = read_all(engine, wire)
    assert chunks == [b"before"]
    assert isinstance(exc, kind) and words in str(exc), exc
    assert engine.read_calls <= 3 and calls <= 3
    assert_final(engine, exc)


_TLS12_BAD: dict[str, tuple[Callable[[Seal], bytes], type[BaseException], str]] = {
    "heartbeat": (lambda s: s(24, b"\x01\x00\x10" + bytes(16)), TLSRecordError, "unknown content type 24"),
    "type_99": (lambda s: s(99, b"hi"), TLSRecordError, "unknown content type 99"),
    "change_cipher_spec": (lambda s: s(20, b"\x01"), ssl.SSLError, "CCS_RECEIVED_EARLY"),
    "unasked_no_renegotiation": (lambda s: s(21, b"\x01\x64"), ssl.SSLError, "NO_RENEGOTIATION"),
    "warning_alerts": (lambda s: b"".join(s(21, b"\x01\x5a") for _ in range(10)), ssl.SSLError, "TOO_MANY_WARN_ALERTS"),
    "data_over_2_14": (lambda s: s(23, b"x" * (MAX_FRAGMENT + 1)), ssl.SSLError, "DATA_LENGTH_TOO_LONG"),
    "not_tls": (lambda s: b"\x00garbage", TLSRecordError, "unknown content type 0"),
    # OpenSSL checks the version before the record's MAC.
    "version_0301": (lambda s: b"\x17\x03\x01" + s(23, b"v")[3:], ssl.SSLError, "WRONG_VERSION_NUMBER"),
    "version_0203": (lambda s: b"\x17\x02\x03" + s(23, b"v")[3:], TLSRecordError, "major byte 2 is not 3"),
}


@pytest.mark.parametrize("shape", sorted(_TLS12_BAD))
@pytest.mark.parametrize("engine_server", [False, True], ids=["client", "server"])
@pytest.mark.parametrize("version", [TLS12], ids=["tls12"])
def test_tls12_hostile_records_after_data(
    forged: tuple[TLSEngine, Seal, Forged13 | None], shape: str
) -> None:
    engine, seal, _ = forged
    make, kind, words = _TLS12_BAD[shape]
    wire = seal(23, b"before") + make(seal) + seal(23, b"never")
    chunks, exc, calls = read_all(engine, wire)
    assert chunks == [b"before"]
    assert isinstance(exc, kind) and words in str(exc), exc
    assert engine.read_calls <= 3 and calls <= 3
    assert_final(engine, exc)


def test_user_canceled_alerts_between_data_are_ignored(
    forged: tuple[TLSEngine, Seal, Forged13 | None], version: ssl.TLSVersion,
) -> None:
    # A warning user_canceled (RFC 8446 6.1) before every data record, 3000
    # times: OpenSSL ignores each (it counts only alerts in a row), so all
    # the data comes, one read a record.
    engine, seal, _ = forged
    wire = b"".join(seal(21, b"\x01\x5a") + seal(23, bytes([97 + i % 26])) for i in range(3000))
    chunks, exc, calls = read_all(engine, wire)
    assert exc is None and b"".join(chunks) == bytes(97 + i % 26 for i in range(3000))
    assert engine.read_calls <= 2 * 3000 and calls <= 2 * 3000 + 2


@pytest.mark.parametrize("engine_server", [False], ids=["client"])
@pytest.mark.parametrize("version", [TLS13], ids=["tls13"])
def test_thousands_of_session_tickets(
    tls_ca: Any, server_cert: Any, version: ssl.TLSVersion, engine_server: bool
) -> None:
    # A TLS 1.3 server may send any number of NewSessionTicket messages
    # (RFC 8446 4.6.1): 4000 of them (1 MB) before data. Each replaces the
    # last in OpenSSL; the engine keeps none, and they cost a few reads per
    # lent piece (SSL_read goes through every complete one in the BIO).
    engine, peer = engine_pair(tls_ca, server_cert, version, engine_server=False, tickets=4000)
    tickets = peer.take()
    peer.obj.write(b"after the tickets")
    wire = tickets + peer.take()
    assert len(wire) > 4000 * 200
    chunks, exc, calls = read_all(engine, wire)
    assert exc is None and chunks == [b"after the tickets"]
    pieces = -(-len(wire) // LEND_PIECE)
    assert engine.read_calls <= 2 * pieces and calls <= 2 * pieces
    assert engine.ssl_object.session is not None
    assert engine.buffered_ciphertext == 0


# ---------------------------------------------------------------- streams


async def _taken(fd: int) -> None:
    """Until the kernel holds nothing unread on `fd` (the loop took it)."""
    async with asyncio.timeout(WAKE):
        while unread(fd):
            await asyncio.sleep(0)


@VERSIONS
@pytest.mark.asyncio
async def test_headers_split_at_every_offset_while_the_reader_pauses(
    listener: socket.socket, tls_ca: Any, server_cert: Any, version: ssl.TLSVersion,
) -> None:
    # Each header cut at each of its offsets (and inside the body), the
    # first part taken by the loop before the second is sent, while a
    # 64-byte limit pauses and resumes the reading all along; then a valid
    # record and bytes that are not TLS: every byte in front arrives, then
    # TLSRecordError, and nothing after it.
    async with served_raw_client(
        listener, tls_ca, server_cert, version, limit=64
    ) as (peer, reader, writer):
        fd = writer.get_extra_info("socket").fileno()
        got = bytearray()

        async def consume() -> None:
            while chunk := await reader.read(7):
                got.extend(chunk)

        consumer = asyncio.create_task(consume())
        sent = bytearray()
        for cut in range(12):  # 1-4: inside the header, 5-11: the body
            plain = [bytes([65 + cut]) * 200, bytes([97 + cut]) * 150]
            wire = peer.seal(*plain)
            sent += b"".join(plain)
            at = records(wire)[1][1]  # the second record's header
            await peer.send(wire[: at + cut])
            await _taken(fd)
            await peer.send(wire[at + cut :])
            await _taken(fd)
        last = peer.seal(b"last")
        sent += b"last"
        await peer.send(last + b"\x17\x03\x03\xff\xffnot tls")
        with pytest.raises(TLSRecordError, match="length 65535 is above the limit"):
            async with asyncio.timeout(WAKE):
                await consumer
        assert bytes(got) == bytes(sent)
        writer.close()


@VERSIONS
@pytest.mark.parametrize("shape", ["overflow", "not_tls", "empty_run"])
@pytest.mark.asyncio
async def test_stream_data_in_front_of_a_bad_record_arrives(
    listener: socket.socket, tls_ca: Any, server_cert: Any, tmp_path: Any,
    version: ssl.TLSVersion, shape: str,
) -> None:
    # Data and a bad record in one read: the data, then the error, and
    # nothing after it. asyncio's streams (both loops) lose the data here:
    # their SSL transport fails the read before handing over what it
    # decrypted in front of the error.
    loop = asyncio.get_running_loop()
    keylog = str(tmp_path / "keys.log")
    cctx = client_ctx(tls_ca, version)
    cctx.keylog_filename = keylog
    sctx = server_ctx(server_cert, version)
    sctx.num_tickets = 0
    if version is TLS12:
        sctx.set_ciphers("ECDHE+AESGCM:!AES256")
    opening = asyncio.ensure_future(slabnet.open_connection(
        *listener.getsockname(), ssl=cctx, server_hostname="localhost"
    ))
    sock, _ = await loop.sock_accept(listener)
    try:
        peer = RawTLS(sock, sctx, server_side=True)
        async with asyncio.timeout(WAKE):
            await peer.handshake()
            reader, writer = await opening
        seal: Seal
        if version is TLS13:
            cipher = peer.obj.cipher()
            assert cipher is not None
            seal = Forged13(keylog, cipher[0], from_server=True).seal
        else:
            f12 = ForgedTLS12(keylog, peer.first_out)
            seal = lambda ctype, plain: f12.seal(ctype, plain, from_server=True)  # noqa: E731
        bad = {
            "overflow": lambda: seal(23, b"x" * (MAX_FRAGMENT + 1)),
            "not_tls": lambda: b"\x00garbage, not TLS",
            "empty_run": lambda: b"".join(seal(23, b"") for _ in range(100)),
        }[shape]
        await peer.send(seal(23, b"before") + bad() + seal(23, b"never"))
        words = {"overflow": "DATA_LENGTH_TOO_LONG", "not_tls": "unknown content type 0",
                 "empty_run": "RECORD_TOO_SMALL"}[shape]
        async with asyncio.timeout(WAKE):
            assert await reader.readexactly(6) == b"before"
            with pytest.raises(ssl.SSLError, match=words):
                await reader.read(100)
            with pytest.raises(ssl.SSLError):
                await reader.read(100)
        writer.close()
    finally:
        sock.close()
