"""TLS against other real implementations: GnuTLS (``gnutls-serv``,
``gnutls-cli``) and stunnel in front of ``openssl s_server``.

Each test starts its peer processes itself (``peers`` kills every one of
them, whatever the test did) on free ports, and bounds every wait. A test
whose program is not installed skips, naming the Debian package; CI installs
them with ``apt-get install -y gnutls-bin stunnel4 haproxy nginx-light``.

What the peers do differently from OpenSSL and Python's ``ssl``:

* ``gnutls-serv --echo`` is line based and string based (it echoes what it
  holds once a ``\\n`` arrived, up to the first NUL), so the data here is hex
  text in lines. Its command ``**REHANDSHAKE**`` is, under TLS 1.3, a
  KeyUpdate that asks us for one of our own (``gnutls_rehandshake``).
* ``gnutls-serv --http --httpdata FILE`` answers one GET with the file and
  closes with close_notify.
* ``gnutls-cli --inline-commands`` sends KeyUpdates on ``^rekey1^`` (its
  own) and ``^rekey^`` (its own, asking for ours).
* nginx sends a static file in records of ``ssl_buffer_size`` and closes
  an idle keep-alive connection with close_notify, then FIN.
* ``openssl s_server`` (without ``-quiet``) takes a stdin read of ``k\\n`` /
  ``K\\n`` as a KeyUpdate (``K`` asks for ours) and ``R\\n`` as a TLS 1.2
  renegotiation, and prints status lines into the data it writes to stdout,
  so the data is hex text without newlines and is picked out of its output.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import slabnet
from test_tls_streams import free_port, pem_files  # noqa: F401 (a fixture)

WAKE = 15.0  # seconds any one step may take (a peer process starting, a transfer)
MAX_CHUNK = 16384  # slabnet's chunk bound: one TLSPlaintext fragment
TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
GNUTLS_PRIORITY = {
    TLS12: "NORMAL:-VERS-ALL:+VERS-TLS1.2",
    TLS13: "NORMAL:-VERS-ALL:+VERS-TLS1.3",
}


def which(program: str) -> str | None:
    """``program``'s path; Debian puts nginx and haproxy in /usr/sbin, which
    a user's PATH may not hold."""
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")


def needs(program: str, package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        which(program) is None, reason=f"needs {program} (Debian package {package})"
    )


GNUTLS_SERV = needs("gnutls-serv", "gnutls-bin")
GNUTLS_CLI = needs("gnutls-cli", "gnutls-bin")
STUNNEL = needs("stunnel", "stunnel4")
NGINX = needs("nginx", "nginx-light")
HAPROXY = needs("haproxy", "haproxy")
OPENSSL = needs("openssl", "openssl")


def hex_lines(size: int, seed: int) -> bytes:
    """About ``size`` bytes of hex text in lines of random length."""
    rnd = random.Random(seed)
    out = []
    total = 0
    while total < size:
        n = rnd.randrange(1, 3000)
        line = rnd.randbytes((n + 1) // 2).hex().encode()[:n] + b"\n"
        out.append(line)
        total += len(line)
    return b"".join(out)


def _die_with_us() -> None:
    """In the child, before exec: SIGKILL when this process ends (Linux's
    PR_SET_PDEATHSIG), so that a peer outlives no run, even one the
    watchdog in conftest.py ends before any teardown."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Peers:
    """The peer processes of one test; ``kill_all`` ends every one."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, stdin: bool = False, out: str | None = None) -> subprocess.Popen[bytes]:
        stdout: Any = subprocess.DEVNULL if out is None else open(self.tmp / out, "wb")
        stderr = open(self.tmp / f"{Path(args[0]).name}-{len(self.procs)}.err", "wb")
        try:
            proc = subprocess.Popen(
                [which(args[0]) or args[0], *args[1:]],
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=stdout, stderr=stderr,
                preexec_fn=_die_with_us if sys.platform == "linux" else None,
            )
        finally:
            stderr.close()
            if out is not None:
                stdout.close()
        self.procs.append(proc)
        return proc

    def output(self, name: str) -> bytes:
        return (self.tmp / name).read_bytes()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(WAKE)
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:  # its pipe is broken: the process is gone
                    pass


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Peers]:
    p = Peers(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()


async def wait_listening(port: int) -> None:
    """Until something accepts on ``port`` (a plain connection, closed at
    once: gnutls-serv and stunnel drop it and go on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAKE
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if loop.time() > deadline:
                raise AssertionError(f"nothing listens on port {port}") from None
            await asyncio.sleep(0.02)
            continue
        w.close()
        await w.wait_closed()
        return


async def wait_output(peers: Peers, name: str, needle: bytes) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAKE
    while needle not in peers.output(name):
        if loop.time() > deadline:
            raise AssertionError(f"{needle!r} never appeared in {name}")
        await asyncio.sleep(0.02)


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` (a blocking pipe write, a process wait) in a daemon
    thread of its own, bounded: a peer that stops reading its input holds
    the thread only until ``peers`` kills it, and never the loop's
    executor, which the loop's close would wait for."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(result)
        else:
            done.set_exception(exc)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting test
            outcome: tuple[Any, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: its test is over, failed
            pass

    threading.Thread(target=run, daemon=True).start()
    return await asyncio.wait_for(done, WAKE)


def pipe_write(pipe: BinaryIO | None, data: bytes) -> None:
    assert pipe is not None
    pipe.write(data)
    pipe.flush()


def client_context(pems: dict[str, str], version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pems["ca"])
    if version is not None:
        ctx.minimum_version = ctx.maximum_version = version
    return ctx


def server_context(pems: dict[str, str], version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pems["server"])
    ctx.minimum_version = ctx.maximum_version = version
    return ctx


def gnutls_serv(peers: Peers, pems: dict[str, str], version: ssl.TLSVersion, *mode: str) -> int:
    port = free_port()
    peers.start(
        "gnutls-serv", "-q", "-p", str(port), "--x509certfile", pems["server"],
        "--x509keyfile", pems["server"], "--priority", GNUTLS_PRIORITY[version], *mode,
    )
    return port


async def close(writer: slabnet.StreamWriter) -> None:
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), WAKE)


# ------------------------------------------------------ GnuTLS as the server


@GNUTLS_SERV
@pytest.mark.parametrize("version", [TLS12, TLS13], ids=["tls12", "tls13"])
@pytest.mark.asyncio
async def test_download_from_gnutls_is_exact_and_ends_at_its_close_notify(
    peers: Peers, pem_files: dict[str, str], tmp_path: Path, version: ssl.TLSVersion
) -> None:
    body = os.urandom(8 << 20)
    (tmp_path / "body").write_bytes(body)
    port = gnutls_serv(peers, pem_files, version, "--http", "--httpdata", str(tmp_path / "body"))
    await wait_listening(port)
    # ssl_ragged_eof=False: a FIN without close_notify would raise, so the
    # clean EOF below is GnuTLS's close_notify.
    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_context(pem_files, version),
        server_hostname="localhost", ssl_ragged_eof=False,
    ), WAKE)
    assert writer.get_extra_info("ssl_object").version() == {TLS12: "TLSv1.2", TLS13: "TLSv1.3"}[version]
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAKE)
    assert head.startswith(b"HTTP/1.0 200 OK\r\n")
    assert f"Content-Length: {len(body)}\r\n".encode() in head
    parts = []
    async with asyncio.timeout(WAKE):
        async for chunk in reader.chunks():
            assert 0 < len(chunk) <= MAX_CHUNK
            parts.append(bytes(chunk))
    assert b"".join(parts) == body
    # 16 KiB records: about one chunk each, never hundreds of slivers
    assert len(parts) <= 2 * len(body) // MAX_CHUNK + 2, len(parts)
    assert reader.at_eof()
    await close(writer)


@GNUTLS_SERV
@pytest.mark.asyncio
async def test_gnutls_server_key_update_mid_stream_both_ways(
    peers: Peers, pem_files: dict[str, str]
) -> None:
    # Under TLS 1.3 gnutls-serv's **REHANDSHAKE** sends a KeyUpdate that
    # asks for ours: what we send after it must be under our new key (or
    # GnuTLS fails to decrypt it), what it sends under its new one.
    data = hex_lines(2 << 20, seed=1)
    cut = data.index(b"\n", len(data) // 2) + 1
    port = gnutls_serv(peers, pem_files, TLS13, "--echo")
    await wait_listening(port)
    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_context(pem_files, TLS13), server_hostname="localhost",
    ), WAKE)
    writer.write(data[:cut])
    writer.write(b"**REHANDSHAKE**\n")
    writer.write(data[cut:])
    expected = data[:cut] + b"Successfully executed command\n" + data[cut:]
    got = await asyncio.wait_for(reader.readexactly(len(expected)), WAKE)
    assert got == expected
    # and one more round trip, well after both sides changed keys
    writer.write(b"after\n")
    assert await asyncio.wait_for(reader.readline(), WAKE) == b"after\n"
    await close(writer)


@GNUTLS_SERV
@pytest.mark.asyncio
async def test_one_byte_writes_to_gnutls(peers: Peers, pem_files: dict[str, str]) -> None:
    data = hex_lines(20000, seed=2)
    port = gnutls_serv(peers, pem_files, TLS13, "--echo")
    await wait_listening(port)
    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_context(pem_files, TLS13), server_hostname="localhost",
    ), WAKE)
    for i in range(len(data)):
        writer.write(data[i : i + 1])
        if i % 64 == 0:
            await asyncio.wait_for(writer.drain(), WAKE)
    got = await asyncio.wait_for(reader.readexactly(len(data)), WAKE)
    assert got == data
    await close(writer)


# ----------------------------------------------------------- nginx as origin


def nginx_config(tmp: Path, port: int, pem: str, buffer_size: str) -> str:
    (tmp / "www").mkdir(exist_ok=True)
    path = tmp / "nginx.conf"
    path.write_text(
        f"daemon off; master_process off; pid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/nginx-error.log;\n"
        "events { worker_connections 16; }\n"
        f"http {{ access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp};"
        f" fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp};\n"
        # one second: the idle connection's close is part of the test
        " keepalive_timeout 1; sendfile off;\n"
        f" server {{ listen 127.0.0.1:{port} ssl; ssl_certificate {pem};"
        f" ssl_certificate_key {pem}; ssl_buffer_size {buffer_size};"
        f" ssl_early_data off; root {tmp}/www; }}\n}}\n"
    )
    return str(path)


async def http_get(reader: slabnet.StreamReader, writer: slabnet.StreamWriter, path: str) -> list[bytes]:
    writer.write(f"GET /{path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAKE)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
    match = re.search(rb"\r\nContent-Length: (\d+)\r\n", head)
    assert match is not None, head
    left = int(match.group(1))
    parts = []
    async with asyncio.timeout(WAKE):
        while left:
            chunk = await reader.read_chunk()
            assert 0 < len(chunk) <= min(left, MAX_CHUNK), (len(chunk), left)
            parts.append(bytes(chunk))
            left -= len(chunk)
    return parts


@NGINX
@pytest.mark.asyncio
async def test_nginx_keep_alive_downloads_then_its_idle_close(
    peers: Peers, pem_files: dict[str, str], tmp_path: Path
) -> None:
    # 1 KiB records: slabnet joins them into chunks of at most 16 KiB
    port = free_port()
    conf = nginx_config(tmp_path, port, pem_files["server"], "1k")
    big, small = os.urandom(4 << 20), os.urandom(100_000)
    (tmp_path / "www" / "big").write_bytes(big)
    (tmp_path / "www" / "small").write_bytes(small)
    peers.start("nginx", "-c", conf, "-p", str(tmp_path))
    await wait_listening(port)
    # ssl_ragged_eof=False: nginx's idle close must come with close_notify
    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        "127.0.0.1", port, ssl=client_context(pem_files), server_hostname="localhost",
        ssl_ragged_eof=False,
    ), WAKE)
    assert b"".join(await http_get(reader, writer, "big")) == big
    assert b"".join(await http_get(reader, writer, "small")) == small
    assert b"".join(await http_get(reader, writer, "big")) == big
    assert await asyncio.wait_for(reader.read(), WAKE) == b""
    await close(writer)


# ---------------------------------- haproxy, stunnel: terminating, originating


def proxy_args(tmp: Path, proxy: str, tls_side: str, front: int, back: int, pems: dict[str, str]) -> list[str]:
    """``proxy`` between ``front`` and ``back``; TLS on its ``tls_side``
    ("front": it terminates TLS; "back": it opens TLS to the server)."""
    if proxy == "haproxy":
        bind = f"bind 127.0.0.1:{front}" + (f" ssl crt {pems['server']}" if tls_side == "front" else "")
        server = f"server s1 127.0.0.1:{back}" + (
            f" ssl verify required ca-file {pems['ca']} sni str(localhost)" if tls_side == "back" else ""
        )
        path = tmp / "haproxy.cfg"
        path.write_text(
            "defaults\n mode tcp\n timeout connect 5s\n timeout client 30s\n timeout server 30s\n"
            f"frontend f\n {bind}\n default_backend b\nbackend b\n {server}\n"
        )
        return ["haproxy", "-db", "-f", str(path)]
    conf = f"foreground = yes\npid =\n[p]\naccept = 127.0.0.1:{front}\nconnect = 127.0.0.1:{back}\n"
    if tls_side == "front":
        conf += f"cert = {pems['server']}\n"
    else:
        conf += f"client = yes\nCAfile = {pems['ca']}\nverifyChain = yes\ncheckHost = localhost\nsni = localhost\n"
    path = tmp / "stunnel.conf"
    path.write_text(conf)
    return ["stunnel", str(path)]


@pytest.mark.parametrize("tls_side", ["front", "back"])
@pytest.mark.parametrize(
    "proxy", [pytest.param("haproxy", marks=HAPROXY), pytest.param("stunnel", marks=STUNNEL)]
)
@pytest.mark.asyncio
async def test_through_a_tls_proxy_bytes_exact_both_ways(
    peers: Peers, pem_files: dict[str, str], tmp_path: Path, proxy: str, tls_side: str
) -> None:
    # front: slabnet's TLS client -> proxy -> slabnet's plain server;
    # back: slabnet's plain client -> proxy -> slabnet's TLS server.
    data = os.urandom(4 << 20)
    # bytes the server read from the connection that carried data (the
    # proxy may also connect for wait_listening's probe, which carries none)
    ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def echo(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        n = 0
        try:
            async with asyncio.timeout(WAKE):
                async for chunk in reader.chunks():
                    n += len(chunk)
                    writer.write(chunk)
                    await writer.drain()
        except ConnectionResetError:
            pass  # haproxy may reset its server side once the client left
        finally:
            writer.close()
            if n and not ended.done():
                ended.set_result(n)
        try:
            await asyncio.wait_for(writer.wait_closed(), WAKE)
        except (ConnectionError, ssl.SSLError):
            pass  # the proxy may be gone before our close_notify's answer

    server = await slabnet.start_server(
        echo, "127.0.0.1", 0,
        ssl=server_context(pem_files, TLS13) if tls_side == "back" else None,
    )
    try:
        front = free_port()
        peers.start(*proxy_args(
            tmp_path, proxy, tls_side, front, server.sockets[0].getsockname()[1], pem_files
        ))
        await wait_listening(front)
        reader, writer = await asyncio.wait_for(slabnet.open_connection(
            "127.0.0.1", front,
            ssl=client_context(pem_files) if tls_side == "front" else None,
            server_hostname="localhost" if tls_side == "front" else None,
        ), WAKE)

        async def send() -> None:
            for i in range(0, len(data), 1 << 16):
                writer.write(data[i : i + (1 << 16)])
                await writer.drain()
            # (no write_eof: both proxies turn a half-close into a full
            # close of the TLS side, the echo's last bytes lost -- asyncio's
            # streams too)

        sending = asyncio.ensure_future(asyncio.wait_for(send(), WAKE))
        got = await asyncio.wait_for(reader.readexactly(len(data)), WAKE)
        await sending
        assert got == data
        await close(writer)
        # the server's connection ended after every byte
        assert await asyncio.wait_for(ended, WAKE) == len(data)
    finally:
        server.close()
        await server.wait_closed()


# ------------------------------------------------------ GnuTLS as the client


async def serve_gnutls_cli(
    peers: Peers, pem_files: dict[str, str], version: ssl.TLSVersion, command: bytes | None,
) -> None:
    """A slabnet server that sends ``down`` to a ``gnutls-cli`` and reads
    ``up`` from it, with ``command`` in gnutls-cli's input half way."""
    # gnutls-cli takes its input line by line (about 0.5 MB/s here)
    up = hex_lines(512 << 10, seed=3)
    down = hex_lines(512 << 10, seed=4)
    cut = up.index(b"\n", len(up) // 2) + 1
    received = bytearray()
    served: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        try:
            writer.write(down)
            # read while the download drains: gnutls-cli writes while it reads
            draining = asyncio.ensure_future(writer.drain())
            async with asyncio.timeout(WAKE):
                async for chunk in reader.chunks():
                    received.extend(chunk)
                await draining
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), WAKE)
        except BaseException as exc:
            served.set_exception(exc)
        else:
            served.set_result(None)

    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=server_context(pem_files, version)
    )
    try:
        port = server.sockets[0].getsockname()[1]
        cli = peers.start(
            "gnutls-cli", "--inline-commands", "--x509cafile", pem_files["ca"],
            "-p", str(port), "--priority", GNUTLS_PRIORITY[version], "localhost",
            stdin=True, out="cli.out",
        )
        await in_thread(pipe_write, cli.stdin, up[:cut] + (command + b"\n" if command else b""))
        await in_thread(pipe_write, cli.stdin, up[cut:])
        # gnutls-cli sends close_notify at the end of its input: end it only
        # once everything came both ways.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAKE
        while len(received) < len(up) or down not in peers.output("cli.out"):
            assert loop.time() < deadline, (len(received), len(peers.output("cli.out")))
            assert not served.done(), served
            await asyncio.sleep(0.02)
        assert cli.stdin is not None
        cli.stdin.close()
        await asyncio.wait_for(served, WAKE)
        assert bytes(received) == up
        assert await in_thread(cli.wait) == 0
    finally:
        server.close()
        await server.wait_closed()


@GNUTLS_CLI
@pytest.mark.parametrize(
    "version, command",
    [(TLS12, None), (TLS13, None), (TLS13, b"^rekey1^"), (TLS13, b"^rekey^")],
    ids=["tls12", "tls13", "tls13-keyupdate", "tls13-keyupdate-requested"],
)
@pytest.mark.asyncio
async def test_gnutls_client_bytes_exact_both_ways(
    peers: Peers, pem_files: dict[str, str], version: ssl.TLSVersion, command: bytes | None,
) -> None:
    await serve_gnutls_cli(peers, pem_files, version, command)


# -------------------------------- TLS inside TLS: stunnel, then openssl s_server


def stunnel_config(tmp: Path, accept: int, connect: int, pem: str) -> str:
    path = tmp / "stunnel.conf"
    path.write_text(
        "foreground = yes\npid =\ndebug = 3\n[tls]\n"
        f"accept = 127.0.0.1:{accept}\nconnect = 127.0.0.1:{connect}\ncert = {pem}\n"
    )
    return str(path)


def s_server_data(output: bytes) -> bytes:
    """The hex data in s_server's stdout, without its status lines (each
    piece of data is far longer than any hex run in them)."""
    return b"".join(re.findall(rb"[0-9a-f]{400,}", output))


@STUNNEL
@OPENSSL
@pytest.mark.parametrize(
    "inner, command",
    [(TLS13, b"k"), (TLS13, b"K"), (TLS12, b"R")],
    ids=["tls13-keyupdate", "tls13-keyupdate-requested", "tls12-renegotiation"],
)
@pytest.mark.asyncio
async def test_tls_in_tls_through_stunnel_to_s_server(
    peers: Peers, pem_files: dict[str, str], tmp_path: Path,
    inner: ssl.TLSVersion, command: bytes,
) -> None:
    # outer layer: slabnet to stunnel (TLS 1.3); stunnel forwards the
    # plaintext, the inner session, to s_server, which changes keys (or
    # renegotiates) on the inner layer half way.
    up = os.urandom(2 << 20).hex().encode()
    down = os.urandom(2 << 20).hex().encode()
    half = len(down) // 2
    backend, front = free_port(), free_port()
    s_server = peers.start(
        "openssl", "s_server", "-accept", str(backend), "-cert", pem_files["server"],
        {TLS12: "-tls1_2", TLS13: "-tls1_3"}[inner], stdin=True, out="s_server.out",
    )
    await wait_output(peers, "s_server.out", b"ACCEPT")
    peers.start("stunnel", stunnel_config(tmp_path, front, backend, pem_files["server"]))
    await wait_listening(front)

    reader, writer = await asyncio.wait_for(slabnet.open_connection(
        "127.0.0.1", front, ssl=client_context(pem_files), server_hostname="localhost",
    ), WAKE)
    await asyncio.wait_for(writer.start_tls(
        client_context(pem_files, inner), server_hostname="localhost"
    ), WAKE)
    assert writer.get_extra_info("ssl_object").version() == {TLS12: "TLSv1.2", TLS13: "TLSv1.3"}[inner]

    # read while s_server's input is written: it stops reading its input
    # while its socket is full
    writer.write(up[: len(up) // 2])
    reading = asyncio.ensure_future(asyncio.wait_for(reader.readexactly(half), WAKE))
    await in_thread(pipe_write, s_server.stdin, down[:half])
    assert await reading == down[:half]
    # s_server has read all of its input: the command is a read of its own,
    # and so must the input after it be (s_server drops the rest of a read
    # that starts with a command): it is written once the command's status
    # line shows (s_server flushes it with the next data it prints).
    await in_thread(pipe_write, s_server.stdin, command + b"\n")
    writer.write(up[len(up) // 2 :])
    await wait_output(peers, "s_server.out", b"SSL_do_handshake -> ")
    reading = asyncio.ensure_future(asyncio.wait_for(reader.readexactly(len(down) - half), WAKE))
    await in_thread(pipe_write, s_server.stdin, down[half:])
    assert await reading == down[half:]
    await asyncio.wait_for(writer.drain(), WAKE)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAKE
    while len(s_server_data(peers.output("s_server.out"))) < len(up):
        assert loop.time() < deadline, len(s_server_data(peers.output("s_server.out")))
        await asyncio.sleep(0.02)
    assert s_server_data(peers.output("s_server.out")) == up
    # s_server took the command as one (not as data: the data is exact) and
    # its handshake step for it completed.
    status = re.sub(rb"[0-9a-f]{400,}", b"", peers.output("s_server.out"))
    assert b"SSL_do_handshake -> 1" in status, status
    await close(writer)


# ------------------------------------ close_notify, bare FIN: gnutls-cli ends


@GNUTLS_CLI
@pytest.mark.parametrize("ending", ["close_notify", "killed"])
@pytest.mark.asyncio
async def test_gnutls_client_close_notify_is_eof_and_a_bare_fin_is_truncation(
    peers: Peers, pem_files: dict[str, str], ending: str
) -> None:
    # gnutls-cli sends close_notify at the end of its input; killed, its
    # kernel sends a bare FIN. TLS 1.2: the server sends nothing after the
    # handshake (no tickets), so the killed client has nothing unread and
    # its kernel sends FIN, never RST.
    data = b"x" * 100000 + b"\n"
    outcome: asyncio.Future[tuple[int, BaseException | None]] = (
        asyncio.get_running_loop().create_future()
    )

    async def handler(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        n = 0
        try:
            async with asyncio.timeout(WAKE):
                async for chunk in reader.chunks():
                    n += len(chunk)
                    if n == len(data):
                        received.set()
        except Exception as exc:
            outcome.set_result((n, exc))
        else:
            outcome.set_result((n, None))
        writer.close()

    received = asyncio.Event()
    server = await slabnet.start_server(
        handler, "127.0.0.1", 0, ssl=server_context(pem_files, TLS12), ssl_ragged_eof=False
    )
    try:
        port = server.sockets[0].getsockname()[1]
        cli = peers.start(
            "gnutls-cli", "--x509cafile", pem_files["ca"], "-p", str(port),
            "--priority", GNUTLS_PRIORITY[TLS12], "localhost", stdin=True,
        )
        await in_thread(pipe_write, cli.stdin, data)
        await asyncio.wait_for(received.wait(), WAKE)
        if ending == "killed":
            cli.kill()
        else:
            assert cli.stdin is not None
            cli.stdin.close()
        n, exc = await asyncio.wait_for(outcome, WAKE)
        assert n == len(data)
        if ending == "close_notify":
            assert exc is None
        else:
            assert isinstance(exc, slabnet.TLSTruncatedError), exc
            # OpenSSL's reason, then the message itself (not the tuple of
            # args ssl.SSLError's str gives), naming the streams' keyword,
            # which the app passed
            assert str(exc).startswith(
                "[SSL: UNEXPECTED_EOF_WHILE_READING] the peer closed the connection without"
            ), str(exc)
            assert "ssl_ragged_eof=True" in str(exc), str(exc)
    finally:
        server.close()
        await server.wait_closed()
