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
import hashlib
import hmac
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any

import pytest

import slabnet
from conftest import ForgedTLS12, RawTLS, block_until_records, client_ctx, forgeable, server_ctx
from slabnet._errors import TLSRecordError
from slabnet._slab import LEND_SIZE
from slabnet._tls import LEND_PIECE, MAX_FRAGMENT, TLSEngine, TLSState

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
    keylog: str | None = None, tickets: int = 0,
) -> tuple[TLSEngine, Peer]:
    """An engine, OPEN, and its peer; a server peer sends `tickets` TLS 1.3
    session tickets, which the engine has not been given (peer.take())."""
    sctx, cctx = server_ctx(cert, version), client_ctx(tls_ca, version)
    if version is TLS12 and keylog is not None:
        sctx.set_ciphers("ECDHE+AESGCM:!AES256")
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
    loop = asyncio.get_running_loop()
    served: asyncio.Future[tuple[slabnet.StreamReader, slabnet.StreamWriter]] = loop.create_future()

    async def handle(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        served.set_result((reader, writer))

    server = await slabnet.start_server(handle, sock=listener, ssl=server_ctx(server_cert, version))
    sock = socket.socket()
    try:
        await loop.sock_connect(sock, listener.getsockname())
        peer = RawTLS(sock, client_ctx(tls_ca, version), server_side=False, server_hostname="localhost")
        async with asyncio.timeout(WAKE):
            await peer.handshake()
            reader, writer = await served
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
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
