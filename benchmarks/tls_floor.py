"""The memory floor of an idle TLS client connection over ``ssl.MemoryBIO``.

    python -m benchmarks.tls_floor [--n N] [--tls 1.2|1.3]

Any backend that runs TLS through CPython's ``ssl`` module over memory BIOs
(slabnet, and httpx's default backend through anyio) holds at least, per
idle client connection, one ``SSLObject`` after its handshake and its two
``MemoryBIO`` objects: OpenSSL's per-connection state (the ``SSL`` object,
its session with the server's certificate chain, the record layer's cipher
contexts). This measures that and nothing else: ``N`` client ``SSLObject``
pairs are handshaken in memory against a server ``SSLObject`` (a trustme
certificate), the server side is dropped, and the growth of ``VmRSS`` is
divided by ``N`` after ``gc.collect()`` and ``malloc_trim(0)``. No socket,
no event loop, no Python transport: what a backend adds comes on top.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import ssl

import trustme

_WARM_UP = 50


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


class _End:
    __slots__ = ("obj", "incoming", "outgoing")

    def __init__(self, ctx: ssl.SSLContext, server_side: bool) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self.incoming, self.outgoing, server_side=server_side,
            server_hostname=None if server_side else "localhost",
        )

    def step(self) -> None:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            pass

    def send_to(self, other: _End) -> None:
        data = self.outgoing.read()
        if data:
            other.incoming.write(data)


def _connect(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext) -> _End:
    client, server = _End(client_ctx, False), _End(server_ctx, True)
    for _ in range(4):
        client.step()
        client.send_to(server)
        server.step()
        server.send_to(client)
    try:  # TLS 1.3: the session tickets that follow the handshake
        client.obj.read(1)
    except ssl.SSLWantReadError:
        pass
    assert client.obj.version() is not None
    return client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--tls", choices=["1.2", "1.3"], default="1.3")
    args = parser.parse_args()
    ca = trustme.CA()
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(client_ctx)
    version = ssl.TLSVersion.TLSv1_3 if args.tls == "1.3" else ssl.TLSVersion.TLSv1_2
    client_ctx.minimum_version = client_ctx.maximum_version = version
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    held = [_connect(client_ctx, server_ctx) for _ in range(_WARM_UP)]
    gc.collect()
    trim(0)
    before = _rss_kib()
    held += [_connect(client_ctx, server_ctx) for _ in range(args.n)]
    gc.collect()
    trim(0)
    per_conn = (_rss_kib() - before) / args.n
    print(f"{ssl.OPENSSL_VERSION}, TLS {args.tls}, n={args.n}: "
          f"{per_conn:.1f} KiB RSS per idle client SSLObject with its two MemoryBIOs")


if __name__ == "__main__":
    main()
