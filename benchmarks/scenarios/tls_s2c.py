"""TLS, server to client, by record size.

Sender shape ``a`` (pre-encrypted): after the handshake the server encrypts
the whole transfer through its ``ssl.SSLObject`` (one ``write`` per record, so
every record carries ``record`` plaintext bytes), then blasts the ciphertext
with ``sendchunk``-byte ``sendall`` calls.  The server is never the
bottleneck and each client read carries many records.

Sender shape ``b`` (record per send): ``openssl s_server -HTTP
-max_send_frag RECORD`` serves a ``size``-byte file; OpenSSL writes every
record with its own ``send``, so reads carry only a few records.

``ceiling`` is the pure-Python limit: the same records decrypted from a
``MemoryBIO`` in a tight ``SSLObject.read(readsize, buffer)`` loop with no
sockets and no event loop work (fed ``readsize`` bytes of ciphertext at a time).

``floor`` is that loop fed from the real socket instead: a blocking
``recv_into`` of 256 KiB (the TLS read size of slabnet and asyncio) whenever the BIO runs dry,
no event loop, no stream.  What it costs above the ceiling is the kernel's
share of receiving over loopback (copying, and the ACKs: on loopback the
receiver's ACK makes the sender transmit in the receiver's context), which
every socket client pays and the ceiling does not.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from typing import Any, cast

from ..common import (
    SERVER_HOSTNAME,
    KiB,
    MiB,
    BlockingTLS,
    Meter,
    accept,
    client_ssl_context,
    close_quietly,
    drain_until_closed,
    encrypt_records,
    memory_tls_pair,
    receive,
    send_in_chunks,
    server_ssl_context,
    set_rcvbuf,
)
from ..core import (
    CEILING,
    FLOOR,
    PROTO,
    SLABNET_CHUNKS,
    SLABNET_READ,
    STREAMS,
    ClientContext,
    ExternalServer,
    Files,
    Impl,
    Params,
    Scenario,
)


def serve_preencrypted(listener: socket.socket, params: Params, files: Files) -> None:
    conn = accept(listener)
    tls = BlockingTLS(conn, server_ssl_context(files))
    tls.handshake()
    ciphertext = tls.encrypt(int(params["size"]), int(params["record"]))
    send_in_chunks(conn, ciphertext, int(params["sendchunk"]))
    tls.wait_close()
    close_quietly(conn)


def _data_file(params: Params) -> str:
    return f"data-{int(params['size'])}"


def external_server(params: Params, files: Files) -> ExternalServer | None:
    if params["shape"] != "b":
        return None
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("shape b needs the openssl command")
    path = os.path.join(files.tmpdir, _data_file(params))
    if not os.path.exists(path) or os.path.getsize(path) != int(params["size"]):
        with open(path, "wb") as f:
            f.write(os.urandom(int(params["size"])))
    argv = [
        openssl, "s_server", "-accept", "127.0.0.1:0", "-cert", files.server_pem,
        "-naccept", "1", "-HTTP", "-http_server_binmode",
        "-max_send_frag", str(int(params["record"])),
    ]
    return ExternalServer(argv=argv, cwd=files.tmpdir)


async def ceiling(ctx: ClientContext) -> dict[str, Any]:
    size, record = int(ctx.params["size"]), int(ctx.params["record"])
    readsize = int(ctx.params.get("readsize", 64 * KiB))
    client, incoming, server, server_out = memory_tls_pair(ctx.files)
    ciphertext = memoryview(encrypt_records(server, server_out, size, record))
    buf = bytearray(readsize)
    read, feed = client.read, incoming.write
    total = 0
    meter = Meter()
    meter.start()
    for off in range(0, len(ciphertext), readsize):
        feed(ciphertext[off:off + readsize])
        while True:
            try:
                total += cast(int, read(readsize, buf))  # with a buffer: a count
            except ssl.SSLWantReadError:
                break
    meter.stop()
    if total != size:
        raise RuntimeError(f"decrypted {total} of {size} bytes")
    return meter.result(total)


async def floor(ctx: ClientContext, request: bytes) -> dict[str, Any]:
    """The ceiling's loop over the real socket (see the module docstring)."""
    size = int(ctx.params["size"])
    readsize = int(ctx.params.get("readsize", 64 * KiB))
    conn = socket.create_connection((ctx.host, ctx.port))
    try:
        set_rcvbuf(conn, int(ctx.params.get("rcvbuf", 0)))
        tls = BlockingTLS(conn, client_ssl_context(ctx.files), server_hostname=SERVER_HOSTNAME)
        tls.handshake()
        if request:
            tls.obj.write(request)
            tls.flush()
        buf = bytearray(256 * KiB)
        view = memoryview(buf)
        out = bytearray(readsize)
        read, feed, recv_into = tls.obj.read, tls.incoming.write, conn.recv_into
        first = total = 0
        meter = Meter()
        while not first:  # the first piece starts the meter, as for every client
            try:
                first = cast(int, read(readsize, out))
            except ssl.SSLWantReadError:
                got = recv_into(buf)
                if not got:
                    raise ConnectionError("EOF before any data") from None
                feed(view[:got])
        meter.start()
        while True:
            try:
                n = cast(int, read(readsize, out))
            except ssl.SSLWantReadError:
                if first + total >= size:
                    break
                got = recv_into(buf)
                if not got:
                    break
                feed(view[:got])
                continue
            if not n:
                break  # close_notify
            total += n
        meter.stop()
    finally:
        close_quietly(conn)
    if first + total < size:
        raise ConnectionError(f"EOF after {first + total} of {size} bytes")
    return meter.result(total)


async def client(ctx: ClientContext) -> dict[str, Any]:
    if ctx.impl.api == "ceiling":
        return await ceiling(ctx)
    request = b""
    if ctx.params["shape"] == "b":
        request = f"GET /{_data_file(ctx.params)} HTTP/1.0\r\n\r\n".encode()
    if ctx.impl.api == "floor":
        return await floor(ctx, request)
    return await receive(ctx, int(ctx.params["size"]), tls=True, request=request)


SCENARIO = Scenario(
    name="tls_s2c",
    title="TLS, server to client, by record size",
    doc=__doc__ or "",
    params={
        "record": [1 * KiB, 4 * KiB, 16 * KiB],
        "shape": ["a", "b"],
        "size": [128 * MiB],
        "sendchunk": [256 * KiB],
        "readsize": [64 * KiB],
        "rcvbuf": [0],
    },
    quick={"size": [2 * MiB], "record": [1 * KiB, 16 * KiB]},
    impls=SLABNET_CHUNKS + SLABNET_READ + STREAMS + PROTO + [FLOOR, CEILING],
    client=client,
    server=serve_preencrypted,
    external_server=external_server,
    plot_x="record",
)
