"""Where slabnet's streams and asyncio's disagreed, found by running
CPython's own stream tests with slabnet's streams swapped in.

Every test runs on the asyncio loop and on uvloop, on loopback sockets, and
bounds each wait, so a hang fails fast.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from typing import Any

import pytest

import slabnet
from conftest import client_ctx, hard_close, server_ctx, until

WAKE = 5.0  # seconds any waiter may take to wake


async def connect(
    listener: socket.socket, limit: int = 2**16
) -> tuple[slabnet.StreamReader, slabnet.StreamWriter, socket.socket]:
    """A slabnet client connected to a raw peer accepted on ``listener``."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAKE):
        opening = asyncio.ensure_future(
            slabnet.open_connection(*listener.getsockname(), limit=limit)
        )
        peer, _ = await loop.sock_accept(listener)
        reader, writer = await opening
    peer.setblocking(False)
    return reader, writer, peer


@pytest.mark.asyncio
async def test_reader_repr_has_asyncio_fields(listener: socket.socket) -> None:
    # asyncio's reader repr is "<StreamReader [N bytes] [eof] [limit=L]
    # [waiter=...] [exception=...] [transport=...] [paused]>". slabnet's
    # said "N bytes in K chunks" and named neither the transport nor the
    # waiter of a pending read, so a log line could not tell which
    # connection, or that a read was stuck.
    reader, writer, peer = await connect(listener, limit=123)
    loop = asyncio.get_running_loop()

    def tr() -> str:  # (the transport's repr shows its state)
        return f"transport={writer.transport!r}"

    try:
        assert repr(reader) == f"<StreamReader limit=123 {tr()}>"
        pending = asyncio.ensure_future(reader.readexactly(4))
        await asyncio.sleep(0)
        text = repr(reader)
        assert text.startswith("<StreamReader limit=123 waiter=<Future pending"), text
        assert text.endswith(f"> {tr()}>"), text
        await loop.sock_sendall(peer, b"abcd")
        async with asyncio.timeout(WAKE):
            assert await pending == b"abcd"
        await loop.sock_sendall(peer, b"xyz")
        await until(lambda: "bytes" in repr(reader), "3 bytes buffered", timeout=WAKE)
        assert repr(reader) == f"<StreamReader 3 bytes limit=123 {tr()}>"
        peer.shutdown(socket.SHUT_WR)
        await until(lambda: "eof" in repr(reader), "EOF seen", timeout=WAKE)
        assert repr(reader) == f"<StreamReader 3 bytes eof limit=123 {tr()}>"
    finally:
        writer.close()
        peer.close()


@pytest.mark.asyncio
async def test_zero_byte_reads_raise_the_connections_error(listener: socket.socket) -> None:
    # A reader whose connection was reset, with nothing buffered: asyncio's
    # read(0) and readexactly(0) raise the error, as every other read does;
    # slabnet's returned b"", so a framing loop that reads an empty body
    # with readexactly(0) went on as if the connection were fine.
    reader, writer, peer = await connect(listener)
    try:
        hard_close(peer)
        async with asyncio.timeout(WAKE):
            with pytest.raises(ConnectionResetError):
                await reader.read(10)
        with pytest.raises(ConnectionResetError):
            await reader.read(0)
        with pytest.raises(ConnectionResetError):
            await reader.readexactly(0)
        with pytest.raises(ValueError):  # (the argument is checked first, as asyncio)
            await reader.readexactly(-1)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_feed_data_takes_only_bytes_like_objects() -> None:
    # asyncio's feed_data(5) raises TypeError; slabnet's made bytes(5) of
    # it and buffered five zero bytes the peer never sent.
    reader = slabnet.StreamReader()
    for bad in (5, "text"):
        with pytest.raises(TypeError):
            reader.feed_data(bad)  # type: ignore[arg-type]
    for nothing in (b"", None, 0):  # asyncio's takes these as nothing
        reader.feed_data(nothing)  # type: ignore[arg-type]
    assert not reader._size
    reader.feed_data(memoryview(array.array("H", [0x4142])))  # any bytes-like object
    reader.feed_data(bytearray(b"!"))
    reader.feed_eof()
    async with asyncio.timeout(WAKE):
        assert await reader.read() == array.array("H", [0x4142]).tobytes() + b"!"


@pytest.mark.asyncio
async def test_feed_data_takes_what_asyncio_extends_its_buffer_with() -> None:
    """asyncio's feed_data is ``bytearray.extend``: an iterable of ints
    (a list, a tuple, a generator) is bytes too, and anything else raises
    extend's TypeError. slabnet's raised TypeError for a list of ints."""
    got = {}
    for cls in (asyncio.StreamReader, slabnet.StreamReader):
        reader = cls()
        reader.feed_data([97, 98])  # type: ignore[arg-type]
        reader.feed_data((99,))  # type: ignore[arg-type]
        reader.feed_data(x for x in b"d")  # type: ignore[arg-type]
        errors = []
        for bad in ("text", 5, [256], [b"x"]):
            with pytest.raises((TypeError, ValueError)) as info:
                reader.feed_data(bad)  # type: ignore[arg-type]
            errors.append((info.type, str(info.value)))
        reader.feed_eof()
        async with asyncio.timeout(WAKE):
            got[cls] = (await reader.read(), errors)
    assert got[slabnet.StreamReader] == got[asyncio.StreamReader]
    assert got[slabnet.StreamReader][0] == b"abcd"


@pytest.mark.asyncio
async def test_a_second_read_all_names_read_in_its_error() -> None:
    """A second coroutine's ``read()`` while another waits: RuntimeError
    naming read(), as asyncio's (slabnet's named read_chunk(), a method the
    caller never called)."""
    messages = []
    for cls in (asyncio.StreamReader, slabnet.StreamReader):
        reader = cls()
        first = asyncio.ensure_future(reader.read(10))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError) as info:
            await reader.read()
        messages.append(str(info.value))
        reader.feed_data(b"x")
        async with asyncio.timeout(WAKE):
            assert await first == b"x"
    assert messages[1] == messages[0]
    assert messages[0].startswith("read() called while another coroutine")


class _FlowRecorder:
    """The reader's transport, as far as its flow control goes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


@pytest.mark.asyncio
@pytest.mark.parametrize("empty_read", ["read", "read_all", "readexactly"])
async def test_a_paused_reader_emptied_at_eof_resumes_on_its_next_read(empty_read: str) -> None:
    """Reading paused (buffer over twice the limit), then EOF, then the
    buffer emptied by readexactly's IncompleteReadError: asyncio's next read
    (which returns b"") resumes the transport; slabnet's left it paused."""
    seen = []
    for cls in (asyncio.StreamReader, slabnet.StreamReader):
        reader = cls(limit=4)
        transport = _FlowRecorder()
        reader.set_transport(transport)  # type: ignore[arg-type]
        reader.feed_data(b"0123456789")
        reader.feed_eof()
        async with asyncio.timeout(WAKE):
            with pytest.raises(asyncio.IncompleteReadError):
                await reader.readexactly(20)
            if empty_read == "read":
                assert await reader.read(5) == b""
            elif empty_read == "read_all":
                assert await reader.read() == b""
            else:
                with pytest.raises(asyncio.IncompleteReadError):
                    await reader.readexactly(1)
        seen.append(transport.calls)
    if empty_read == "readexactly":
        # asyncio's readexactly does not resume (nothing was read): nor ours.
        assert seen[1] == seen[0] == ["pause"]
    else:
        assert seen[1] == seen[0] == ["pause", "resume"]


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_writing_a_non_bytes_object_names_its_type(
    tls: bool, tls_ca: Any, server_cert: Any
) -> None:
    # The message was memoryview()'s ("memoryview: a bytes-like object is
    # required"), naming a function the caller never called; it is now the
    # default loop's. The connection is unharmed either way.
    async def echo(reader: slabnet.StreamReader, writer: slabnet.StreamWriter) -> None:
        writer.write(await reader.readexactly(2))
        await writer.drain()
        writer.close()

    server = await slabnet.start_server(
        echo, "127.0.0.1", 0, ssl=server_ctx(server_cert) if tls else None
    )
    try:
        host, port = server.sockets[0].getsockname()[:2]
        async with asyncio.timeout(WAKE):
            reader, writer = await slabnet.open_connection(
                host, port, ssl=client_ctx(tls_ca) if tls else None,
                server_hostname="localhost" if tls else None,
            )
            for bad, name in (("ok", "str"), (5, "int"), (None, "NoneType")):
                with pytest.raises(TypeError, match=rf"^data argument must be a bytes-like object, not '{name}'$"):
                    writer.write(bad)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match=rf"not '{name}'$"):
                    writer.writelines([b"", bad])  # type: ignore[list-item]
            writer.write(b"ok")
            assert await reader.read() == b"ok"
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()


@pytest.mark.asyncio
async def test_asyncio_stream_reader_protocol_feeds_a_slabnet_reader() -> None:
    # The recipe for reading a pipe as a stream: asyncio.StreamReaderProtocol
    # around a reader. It read the reader's _source_traceback, which
    # slabnet's did not have, and raised AttributeError.
    loop = asyncio.get_running_loop()
    rfd, wfd = os.pipe()
    payload = bytes(range(256)) * 300
    reader = slabnet.StreamReader()
    with open(rfd, "rb", buffering=0) as pipe:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            writing = loop.run_in_executor(None, _write_and_close, wfd, payload)
            async with asyncio.timeout(WAKE):
                assert await reader.readexactly(5) == payload[:5]
                assert await reader.read() == payload[5:]
                await writing
            assert reader.at_eof()
        finally:
            transport.close()


def _write_and_close(fd: int, data: bytes) -> None:
    with open(fd, "wb", buffering=0) as f:
        f.write(data)
