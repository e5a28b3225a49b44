"""An httpcore network backend whose connections are slabnet's.

Theory of operation
-------------------
httpcore's connection pools reach the network through one small interface:
a backend opens connections (``connect_tcp``, ``connect_unix_socket``) and
sleeps, and each connection is a stream with ``read``, ``write``,
``start_tls``, ``aclose`` and ``get_extra_info``. ``SlabnetBackend`` opens
them with ``slabnet.open_connection`` / ``open_unix_connection``;
``SlabnetStream`` is a ``StreamReader``/``StreamWriter`` pair behind that
interface, and ``start_tls`` is ``StreamWriter.start_tls``: slabnet's TLS
engine, coalesced records and exact-size chunks included. Pass the backend as
``httpcore.AsyncConnectionPool(network_backend=SlabnetBackend())``;
``slabnet.contrib.httpx.AsyncSlabnetTransport`` does that for httpx.

Reads. httpcore asks for ``read(65536)`` and wants ``bytes``.
``StreamReader.read(n)`` joins what is buffered, up to ``n`` bytes, into one
``bytes``: one copy of each byte after the kernel's (TLS: after the
decryption's), the fewest a ``bytes`` result allows.
``bytes(await reader.read_chunk())`` copies as much but returns one chunk
per call, so a TLS download (16 KiB chunks) would take up to four calls
where ``read`` takes one.

The server's EOF ends the stream for good: a read after it returns
``b""`` even if the connection failed later. The reader holds both then and
raises the error first, as asyncio's does; but the kernel reports EOF for a
FIN that came before a reset (so does httpcore's anyio backend), and a
server that ends a body delimited by the connection's end often resets
next: it closes with bytes unread, and our close_notify, sent in answer to
its own, is refused (a broken pipe).

Timeouts. httpx passes a timeout to every call (5 s unless told). A read
that finds bytes, EOF or an error already buffered returns without waiting,
so it starts no timer; only a read that waits runs under ``asyncio.timeout``
(a timer handle and a context manager per call, which a download of 16 KiB
records would otherwise pay per record). Only that timer's expiry is a
``ReadTimeout``: a ``TimeoutError`` the connection raised itself (the
kernel's ETIMEDOUT) is a ``ReadError``, as with httpcore's anyio backend,
which reports every failure of an open stream as broken. While connecting,
every ``TimeoutError`` is a ``ConnectTimeout``, as there.

Errors are mapped at one place per call, httpcore's way: the new exception
carries the original as its argument (so its message is ``str(exc)``, e.g.
OpenSSL's "certificate verify failed: ...") and is raised from it.
``OSError`` covers the socket's errors, ``ssl.SSLError`` (certificate
verification included) and slabnet's own (``TLSTruncatedError``,
``LocalAbortError``, ``HandshakeTimeoutError``).

``is_readable``. Before it reuses an idle connection the pool asks whether
it is readable: if it is, the server has closed or reset it or sent bytes
nobody asked for, and the pool drops it. slabnet reads ahead, so what the
server sent is usually in the reader already (bytes, EOF, the error); what
the loop has not read yet is still in the socket, where a zero-timeout poll
sees it (the check httpcore's own backends make). Either answers true. Over
TLS, bytes can also have left the socket without making plaintext yet (the
start of a record that never completes): the TLS layer holding them answers
true too.

Closing. ``aclose`` sends TLS close_notify (and FIN) if the socket takes it
at once, then closes the socket without waiting for the server's
close_notify: the pool closes idle connections one after another inside a
request, and a round trip per connection would stall it (httpcore's anyio
backend sends no close_notify at all).

TLS inside TLS (an HTTPS proxy carrying an ``https://`` request: httpcore's
``proxy=httpcore.Proxy("https://...")``) is ``start_tls`` on a TLS stream:
the destination's session runs inside the proxy's, as asyncio's does.
"""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, NoReturn

import httpcore

import slabnet

__all__ = ["SlabnetBackend", "SlabnetStream"]

#: How long ``aclose`` waits for the loop to report the aborted connection
#: closed. It takes two loop iterations; the bound is only a guard against a
#: loop that never gets there, so that closing a pool cannot hang.
_CLOSE_WAIT: Final = 1.0


def _buffered(reader: slabnet.StreamReader) -> int:
    """Bytes buffered in ``reader``. (The one place this module looks inside
    slabnet: ``StreamReader`` has no public count of them.)"""
    return reader._size


def _socket_readable(sock: Any) -> bool:
    """A zero-timeout poll of the connection's socket; a socket without a
    descriptor (closed) counts as readable: the next read returns at once."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class SlabnetStream(httpcore.AsyncNetworkStream):
    """One slabnet connection as an ``httpcore.AsyncNetworkStream``."""

    def __init__(self, reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._closed = False

    def __repr__(self) -> str:
        return f"<SlabnetStream {self._writer!r}>"

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        reader = self._reader
        if timeout is not None and not (
            _buffered(reader) or reader.at_eof() or reader.exception() is not None
        ):
            return await self._read_waiting(max_bytes, timeout)
        try:
            return await reader.read(max_bytes)
        except OSError as exc:
            if self._ended():
                return b""
            raise httpcore.ReadError(exc) from exc

    async def _read_waiting(self, max_bytes: int, timeout: float) -> bytes:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await self._reader.read(max_bytes)
        except OSError as exc:  # TimeoutError included
            if self._ended():
                return b""
            if deadline.expired():
                raise httpcore.ReadTimeout(exc) from exc
            raise httpcore.ReadError(exc) from exc

    def _ended(self) -> bool:
        """The server's EOF came, every byte before it was read, and we have
        not closed the stream: the server is done, whatever failed after
        (see "Reads" in the module docstring)."""
        return self._reader.at_eof() and not self._closed

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        writer = self._writer
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                request = writer.write(buffer)
                if request is not None:
                    await request  # queued: wait until the kernel has it
                # Raises the connection's error (a write after its loss is
                # dropped), and waits while the transport is over its limit.
                await writer.drain()
        except OSError as exc:
            if deadline.expired():
                raise httpcore.WriteTimeout(exc) from exc
            raise httpcore.WriteError(exc) from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        writer = self._writer
        writer.close()  # TLS: close_notify; plain: FIN (queued bytes first)
        writer.transport.abort()  # ... but no wait for the server's answer
        try:
            async with asyncio.timeout(_CLOSE_WAIT):
                await writer.wait_closed()
        except OSError:  # the connection had failed before; TimeoutError too
            pass

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> SlabnetStream:
        writer = self._writer
        try:
            async with asyncio.timeout(timeout):
                await writer.start_tls(ssl_context, server_hostname=server_hostname)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, TimeoutError):
                raise httpcore.ConnectTimeout(exc) from exc
            if isinstance(exc, OSError):
                raise httpcore.ConnectError(exc) from exc
            raise
        return self

    def get_extra_info(self, info: str) -> Any:
        writer = self._writer
        if info == "ssl_object":
            return writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return writer.get_extra_info("sockname")
        if info == "server_addr":
            return writer.get_extra_info("peername")
        if info == "socket":
            return writer.get_extra_info("socket")
        if info == "is_readable":
            return self._is_readable()
        return None

    def _is_readable(self) -> bool:
        reader = self._reader
        transport = self._writer.transport
        if (
            _buffered(reader)
            or reader.at_eof()
            or reader.exception() is not None
            or transport.is_closing()
            or (isinstance(transport, slabnet.TLSTransport) and transport.has_pending_input())
        ):
            return True
        return _socket_readable(self._writer.get_extra_info("socket"))

    def _set_options(self, options: Iterable[httpcore.SOCKET_OPTION]) -> None:
        sock = self._writer.get_extra_info("socket")
        for option in options:
            sock.setsockopt(*option)


class SlabnetBackend(httpcore.AsyncNetworkBackend):
    """``httpcore.AsyncNetworkBackend`` over slabnet: TCP, Unix sockets, and
    slabnet's TLS for ``start_tls``. Runs on any asyncio loop (uvloop too).

    ``limit`` is each connection's ``StreamReader`` limit: reading pauses
    above twice that many bytes buffered (asyncio's default, 64 KiB).
    """

    def __init__(self, *, limit: int = 2**16) -> None:
        self._limit = limit

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> SlabnetStream:
        if not 0 <= port <= 0xFFFF:
            # (getaddrinfo takes it modulo 65536: another port's server.)
            raise httpcore.ConnectError(f"port must be 0-65535, not {port}")
        try:
            async with asyncio.timeout(timeout):
                sock = await _connect_racing(host, port, local_address)
                try:
                    reader, writer = await slabnet.open_connection(sock=sock, limit=self._limit)
                except BaseException:
                    sock.close()
                    raise
        except OSError as exc:  # TimeoutError included
            _raise_connect_error(exc)
        return await self._stream(reader, writer, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> SlabnetStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await slabnet.open_unix_connection(path, limit=self._limit)
        except OSError as exc:
            _raise_connect_error(exc)
        return await self._stream(reader, writer, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    @staticmethod
    async def _stream(
        reader: slabnet.StreamReader,
        writer: slabnet.StreamWriter,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
    ) -> SlabnetStream:
        stream = SlabnetStream(reader, writer)
        if socket_options:
            # After the connect, as httpcore's own backends set them.
            try:
                stream._set_options(socket_options)
            except OSError as exc:
                await stream.aclose()
                raise httpcore.ConnectError(exc) from exc
        return stream


#: RFC 8305's Connection Attempt Delay (250 ms), httpcore's anyio backend's.
ATTEMPT_DELAY: Final = 0.25


async def _connect_racing(
    host: str, port: int, local_address: str | None, delay: float = ATTEMPT_DELAY,
    resolve: Callable[..., Awaitable[list[Any]]] | None = None,
) -> socket.socket:
    """A socket connected to ``host``: its addresses, families interleaved,
    tried one more every ``delay`` seconds, or at once when the last one
    tried fails, until one connects (RFC 8305's Happy Eyeballs, as
    httpcore's anyio backend connects). Neither loop's ``create_connection``
    does that here: uvloop takes no ``happy_eyeballs_delay``, and without it
    an address that drops SYNs (a broken IPv6 route) takes the whole
    timeout. Attempts still running when one wins, or when the caller is
    cancelled, close their sockets themselves. ``resolve``: the loop's
    ``getaddrinfo`` unless given."""
    loop = asyncio.get_running_loop()
    resolve = resolve or loop.getaddrinfo
    infos = _interleaved(await resolve(host, port, type=socket.SOCK_STREAM))
    errors: list[BaseException] = []
    running: set[asyncio.Task[socket.socket]] = set()
    try:
        while infos or running:
            if infos:
                family, type_, proto, _, address = infos.pop(0)
                running.add(loop.create_task(
                    _attempt(loop, family, type_, proto, address, local_address)))
            done, _ = await asyncio.wait(
                running, timeout=delay if infos else None, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                running.discard(task)
                exc = task.exception()
                if exc is None:
                    return task.result()  # (any other winner: closed below)
                errors.append(exc)
    finally:
        for task in running:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
            else:
                task.cancel()
    if len(errors) == 1:
        raise errors[0]
    reasons = "; ".join(map(str, errors)) or "no address"
    raise OSError(f"could not connect to {host}:{port}: {reasons}")


def _interleaved(infos: list[Any]) -> list[Any]:
    """``getaddrinfo``'s answers, alternating families from the first's on."""
    if not infos:
        return []
    family = infos[0][0]
    first = [info for info in infos if info[0] == family]
    other = [info for info in infos if info[0] != family]
    out: list[Any] = []
    for pair in itertools.zip_longest(first, other):
        out.extend(info for info in pair if info is not None)
    return out


async def _attempt(
    loop: asyncio.AbstractEventLoop, family: int, type_: int, proto: int,
    address: Any, local_address: str | None,
) -> socket.socket:
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        if local_address is not None:
            sock.bind((local_address, 0))
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


def _raise_connect_error(exc: OSError) -> NoReturn:
    if isinstance(exc, TimeoutError):
        raise httpcore.ConnectTimeout(exc) from exc
    raise httpcore.ConnectError(exc) from exc
