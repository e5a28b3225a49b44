"""One simulated phone call: an HTTPS TTS client plus a playout queue.

A call keeps one keep-alive HTTPS connection to the TTS service. It asks for
a prompt, queues the audio as it arrives (faster than real time), and asks
for the next prompt when less than ``low_water_s`` of audio is left, so the
queue holds between ~1 s and ~1 s + one prompt of audio, as a voice agent's
queue does. The process-wide playout ticker (see ``_worker``) takes one
20 ms frame per call per tick.

A call queues one exact-size ``bytes`` object per h11 ``Data`` event (one
HTTP chunk, 20 ms of audio); nothing is joined on the way in. Every prompt's
bytes are hashed on arrival and checked against the service's
``x-audio-sha256`` header.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import h11

from .._common import PHRASES, SAMPLE_WIDTH

if TYPE_CHECKING:
    from ._worker import Worker

__all__ = ["Call", "CallError"]

# Read size for plain asyncio streams (slabnet hands out its own chunks);
# the same as asyncio's default StreamReader limit.
READ_SIZE = 64 * 1024
# Streamed once per connection before the memory baseline; about 1 s of speech.
WARMUP_PHRASE = "One moment please."
# A service that sends nothing for this long while a call waits for a
# response (or its TLS handshake) has stalled: the call fails rather than
# wait for it forever. A prompt's chunks come every 20 ms or so.
READ_TIMEOUT_S = 10.0


class CallError(Exception):
    """The TTS service answered something a call can not play."""


class Call:
    """Queue, connection and counters of one call. Driven by ``run()``."""

    __slots__ = (
        "index", "worker", "reader", "writer", "conn", "read", "chunks", "queued",
        "playing", "start_at", "end_at", "wake", "waiting", "done", "first_frame_at",
        "underruns", "frames", "late_frames", "phrases_ok", "phrases_bad",
        "bytes_received", "bytes_dropped", "fetching", "reads", "read_bytes", "reads_shared",
        "seq", "timestamp", "ssrc", "source", "deadline",
    )

    def __init__(self, index: int, worker: Worker) -> None:
        self.index = index
        self.worker = worker
        self.reader: Any = None
        self.writer: Any = None
        self.conn = h11.Connection(h11.CLIENT)
        self.read: Any = None
        self.chunks: collections.deque[Any] = collections.deque()
        self.queued = 0  # audio bytes in self.chunks
        self.playing = False
        self.start_at = 0.0
        self.end_at = 0.0
        self.wake = asyncio.Event()
        self.waiting = False  # run() sleeps until the queue falls below low water
        self.done = False
        self.first_frame_at: float | None = None
        self.underruns = 0
        self.frames = 0
        self.late_frames = 0
        self.phrases_ok = 0
        self.phrases_bad = 0
        self.bytes_received = 0
        self.bytes_dropped = 0  # still queued at hang-up
        self.fetching = False
        self.reads = 0  # network reads (TLS plaintext chunks) and their bytes
        self.read_bytes = 0
        self.reads_shared = 0  # slabnet chunks that view part of a larger buffer
        self.seq = index * 7919 & 0xFFFF
        self.timestamp = index * 104729 & 0xFFFFFFFF
        self.ssrc = 0x5AB0000 + index
        self.source = ""
        self.deadline: asyncio.Timeout | None = None  # while a response is awaited

    # -- connection ----------------------------------------------------------

    async def connect(self) -> None:
        cfg = self.worker.config
        streams = self.worker.streams
        self.reader, self.writer = await streams.open_connection(
            cfg.tts_host, cfg.tts_port, ssl=self.worker.ssl_context,
            server_hostname=cfg.server_hostname, ssl_handshake_timeout=READ_TIMEOUT_S,
        )
        if cfg.impl == "slabnet":
            self.read = self._read_chunk
        else:
            self.read = self._read_bytes
        async with self._read_deadline():
            status, _ = await self._request("/v1/health")
        if status != 200:
            raise CallError(f"health check answered {status}")
        # Warm the connection: stream one short prompt (checked, not queued)
        # so the TLS and HTTP read buffers have their working size before the
        # memory baseline is taken, as on a long-lived connection.
        await self.fetch(WARMUP_PHRASE, keep=False)

    async def hang_up(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()

    @contextlib.asynccontextmanager
    async def _read_deadline(self) -> AsyncIterator[None]:
        """Fail with CallError once the service sends nothing for READ_TIMEOUT_S.

        One timer per response: each read pushes it back, but only once it
        is half spent, so that a read costs no timer work."""
        try:
            async with asyncio.timeout(READ_TIMEOUT_S) as self.deadline:
                yield
        except TimeoutError:
            raise CallError(f"TTS service sent nothing for {READ_TIMEOUT_S:g} s") from None
        finally:
            self.deadline = None

    def _got_data(self) -> None:
        deadline = self.deadline
        if deadline is not None:
            now = asyncio.get_running_loop().time()
            when = deadline.when()
            if when is not None and when - now < READ_TIMEOUT_S / 2:
                deadline.reschedule(now + READ_TIMEOUT_S)

    async def _read_chunk(self) -> Any:
        """slabnet: one read-only chunk as the transport delivered it, no copy.

        Counts reads and checks the seed-000 property on each: the chunk is
        the whole of the object it views, so holding it could pin nothing
        else.
        """
        chunk = await self.reader.read_chunk()
        n = len(chunk)
        if n:
            self._got_data()
            self.reads += 1
            self.read_bytes += n
            owner = chunk.obj
            if owner is None or len(owner) != n:
                self.reads_shared += 1
        return chunk

    async def _read_bytes(self) -> bytes:
        data: bytes = await self.reader.read(READ_SIZE)
        if data:
            self._got_data()
            self.reads += 1
            self.read_bytes += len(data)
        return data

    async def _next_event(self) -> Any:
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await self.read())

    async def _request(self, target: str) -> tuple[int, h11.Response]:
        """Send a GET; return the status once the response head has arrived."""
        conn = self.conn
        if conn.our_state is h11.DONE:
            conn.start_next_cycle()
        host = self.worker.config.server_hostname
        self.writer.write(conn.send(h11.Request(
            method="GET", target=target,
            headers=[("host", host), ("accept", "audio/pcm"), ("user-agent", "voice-server")],
        )))
        self.writer.write(conn.send(h11.EndOfMessage()))
        event = await self._next_event()
        if isinstance(event, h11.ConnectionClosed):
            raise CallError("TTS service closed the connection")
        if not isinstance(event, h11.Response):
            raise CallError(f"expected a response, got {type(event).__name__}")
        if event.status_code != 200 or target == "/v1/health":
            while not isinstance(await self._next_event(), h11.EndOfMessage):
                pass
        return event.status_code, event

    # -- audio ---------------------------------------------------------------

    async def fetch(self, text: str, keep: bool = True) -> None:
        """Request one prompt and queue its audio as it streams in.

        With ``keep=False`` the audio is only checked, not queued or counted.
        """
        async with self._read_deadline():
            await self._fetch(text, keep)

    async def _fetch(self, text: str, keep: bool) -> None:
        cfg = self.worker.config
        status, response = await self._request(f"/v1/speech?text={quote(text)}&rate={cfg.rate}")
        if status != 200:
            raise CallError(f"TTS answered {status} for {text!r}")
        headers = dict(response.headers)
        expect_sha = headers.get(b"x-audio-sha256", b"").decode()
        expect_len = int(headers.get(b"x-audio-bytes", b"-1"))
        if keep:
            self.source = headers.get(b"x-audio-source", b"?").decode()
        digest = hashlib.sha256()
        received = 0
        chunks = self.chunks
        worker = self.worker
        conn = self.conn
        read = self.read
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await read())
                continue
            if type(event) is h11.Data:
                data = event.data
                digest.update(data)
                n = len(data)
                received += n
                if received > expect_len:
                    # A service that sends more than it announced may send
                    # without end: the queue would grow as fast as it sends.
                    raise CallError(f"TTS sent more than its x-audio-bytes ({expect_len})")
                if not keep:
                    continue
                # h11 hands out a bytearray (a header and a separate buffer);
                # a bytes object is one allocation: ~1.15x the audio for a
                # 320-byte chunk instead of ~1.25x.
                chunks.append(bytes(data))
                self.queued += n
                worker.queued += n
                if not self.playing and self.queued >= worker.prebuffer_bytes:
                    self.playing = True
            elif type(event) is h11.EndOfMessage:
                break
            else:
                raise CallError(f"unexpected {type(event).__name__} in audio body")
        hexdigest = digest.hexdigest()
        good = hexdigest == expect_sha and received == expect_len and received % SAMPLE_WIDTH == 0
        if not keep:
            if not good:
                raise CallError(f"warm-up prompt arrived damaged ({received} bytes)")
            return
        self.bytes_received += received
        if good:
            self.phrases_ok += 1
            worker.digests.add((text, cfg.rate, hexdigest))
        else:
            self.phrases_bad += 1

    def take_frame(self, size: int) -> Any:
        """Pop exactly ``size`` bytes of audio, or None if fewer are queued."""
        if self.queued < size:
            return None
        chunks = self.chunks
        head = chunks[0]
        n = len(head)
        if n == size:
            chunks.popleft()
        elif n > size:
            view = memoryview(head)
            chunks[0] = view[size:]
            head = view[:size]
        else:
            out = bytearray()
            while len(out) < size:
                piece = chunks.popleft()
                need = size - len(out)
                if len(piece) > need:
                    view = memoryview(piece)
                    chunks.appendleft(view[need:])
                    piece = view[:need]
                out += piece
            head = out
        self.queued -= size
        self.worker.queued -= size
        return head

    def drop_queue(self) -> None:
        self.bytes_dropped += self.queued
        self.worker.queued -= self.queued
        self.queued = 0
        self.chunks.clear()

    # -- life of a call ------------------------------------------------------

    async def run(self) -> None:
        """Fetch prompts until the call ends, keeping the queue above low water."""
        loop = asyncio.get_running_loop()
        worker = self.worker
        low_water = worker.low_water_bytes
        per_second = worker.config.rate * SAMPLE_WIDTH
        await asyncio.sleep(max(0.0, self.start_at - loop.time()))
        worker.activate(self)
        phrase = self.index
        try:
            while not self.done:
                remaining = self.end_at - loop.time()
                if self.queued >= remaining * per_second:
                    # Enough audio to the end of the call: wait for hang-up.
                    self.waiting = False
                    await self._sleep_until_woken()
                    continue
                if self.queued > low_water:
                    self.waiting = True
                    await self._sleep_until_woken()
                    continue
                self.fetching = True
                await self.fetch(PHRASES[phrase % len(PHRASES)])
                self.fetching = False
                phrase += 1
        finally:
            self.done = True
            worker.deactivate(self)
            self.drop_queue()

    async def _sleep_until_woken(self) -> None:
        self.wake.clear()
        await self.wake.wait()
