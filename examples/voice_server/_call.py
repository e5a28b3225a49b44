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

The service is a peer that may be broken or hostile, so everything it can
make a call wait for or hold is bounded:

* Connecting: the TCP connect and the TLS handshake together get
  ``CONNECT_TIMEOUT_S``.
* A response: the service may fall silent for ``READ_TIMEOUT_S`` at most,
  and the whole response must be in within its audio's duration (played
  out in real time, the slowest pace a call can use) plus
  ``RESPONSE_SLACK_S``; a response head has ``READ_TIMEOUT_S`` and an
  error body ``MAX_ERROR_BODY`` bytes. All of it runs on one timer per
  response (``asyncio.Timeout.reschedule``).
* Memory: a prompt may announce at most ``max_prompt_bytes(rate)`` of audio
  and may not send more than it announced; and while the call's queue holds
  more than ``QUEUE_AHEAD_S`` of audio above low water, the call does not
  read (flow control): the rest waits in the socket buffers and in the
  service, which its TCP window slows down.
* Hanging up: when the call ends mid-prompt (``end()``), the rest of the
  prompt is abandoned, not awaited.
* A keep-alive connection the service closed while idle, as HTTP/1.1
  allows (RFC 9112 §9.6), is opened again once and the GET (idempotent)
  sent again, if not a byte of the response had come.
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
# response has stalled: the call fails rather than wait for it forever. A
# prompt's chunks come every 20 ms or so.
READ_TIMEOUT_S = 10.0
# TCP connect and TLS handshake together. Without it a service whose SYNs go
# unanswered (a dead host, a firewall that drops) holds a call for the
# kernel's SYN retries: about 130 s on Linux.
CONNECT_TIMEOUT_S = 10.0
# A prompt's response must be in within its audio's duration at real time
# plus this: a service that trickles (a byte now and then, each pushing the
# silence deadline back) can not hold a call for longer.
RESPONSE_SLACK_S = 10.0
# The longest audio one character of a prompt may take: the synthetic
# voice's longest pause (a full stop, 0.35 s). espeak-ng at 160 words a
# minute speaks about 14 characters a second (0.07 s each), so this is a
# margin of about 5x.
MAX_CHAR_S = 0.35
# The most a call reads ahead: above low water plus this much queued audio it
# stops reading until the ticker has played the queue down to low water. The
# longest prompt (about 6 s) fits, so a well-behaved service never meets it.
QUEUE_AHEAD_S = 8.0
# The body of an answer other than 200 (an error text) or of /v1/health is
# read up to this size, for the error message; a larger one fails the call.
MAX_ERROR_BODY = 4096


class CallError(Exception):
    """The TTS service answered something a call can not play."""


def max_prompt_bytes(rate: int) -> int:
    """The most audio a prompt this module asks for may announce, at ``rate``:
    its longest text at ``MAX_CHAR_S`` per character."""
    longest = max(len(text) for text in (*PHRASES, WARMUP_PHRASE))
    return int(longest * MAX_CHAR_S * rate) * SAMPLE_WIDTH


def announced_bytes(value: bytes | None, rate: int) -> int:
    """The audio size an ``x-audio-bytes`` header value announces, checked."""
    if value is None:
        raise CallError("TTS response has no x-audio-bytes header")
    if not value.isdigit():  # (ASCII digits only: no sign, space or "1_000")
        raise CallError(f"x-audio-bytes is not a byte count: {value[:40]!r}")
    limit = max_prompt_bytes(rate)
    # (Compare the length first: int() of thousands of digits is slow, or refused.)
    if len(value) > len(str(limit)) or int(value) > limit:
        raise CallError(
            f"x-audio-bytes {value[:40].decode()} is more than any prompt this call "
            f"asks for can be ({limit} bytes at {rate} Hz)"
        )
    return int(value)


class Call:
    """Queue, connection and counters of one call. Driven by ``run()``."""

    __slots__ = (
        "index", "worker", "reader", "writer", "conn", "read", "chunks", "queued",
        "playing", "start_at", "end_at", "wake", "waiting", "done", "first_frame_at",
        "underruns", "frames", "late_frames", "phrases_ok", "phrases_bad",
        "bytes_received", "bytes_dropped", "fetching", "reads", "read_bytes", "reads_shared",
        "seq", "timestamp", "ssrc", "source", "deadline", "response_end",
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
        self.response_end = 0.0  # loop time by which the whole response must be in

    # -- connection ----------------------------------------------------------

    async def connect(self) -> None:
        if self.worker.config.impl == "slabnet":
            self.read = self._read_chunk
        else:
            self.read = self._read_bytes
        await self._open()
        async with self._read_deadline():
            response = await self._request("/v1/health")
            body = await self._small_body(response, "/v1/health")
        if response.status_code != 200:
            raise CallError(f"health check answered {response.status_code}: {body[:200]!r}")
        # Warm the connection: stream one short prompt (checked, not queued)
        # so the TLS and HTTP read buffers have their working size before the
        # memory baseline is taken, as on a long-lived connection.
        await self.fetch(WARMUP_PHRASE, keep=False)

    async def _open(self) -> None:
        """Open the connection: TCP connect and TLS handshake in CONNECT_TIMEOUT_S."""
        cfg = self.worker.config
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                self.reader, self.writer = await self.worker.streams.open_connection(
                    cfg.tts_host, cfg.tts_port, ssl=self.worker.ssl_context,
                    server_hostname=cfg.server_hostname,
                )
        except TimeoutError:
            raise CallError(
                f"TTS service not connected (TCP and TLS) in {CONNECT_TIMEOUT_S:g} s"
            ) from None
        self.conn = h11.Connection(h11.CLIENT)

    async def hang_up(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()

    @contextlib.asynccontextmanager
    async def _read_deadline(self) -> AsyncIterator[None]:
        """Bound one response (module docstring): fail with CallError once the
        service sends nothing for READ_TIMEOUT_S, or once ``response_end``
        has passed; when the call ends meanwhile (``end()``), stop quietly.

        One timer per response: each read pushes it back, but only once it
        is half spent, so that a read costs no timer work."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.response_end = start + READ_TIMEOUT_S  # for the head; _fetch extends it
        try:
            async with asyncio.timeout(READ_TIMEOUT_S) as self.deadline:
                yield
        except TimeoutError:
            if self.done:
                return  # hung up mid-prompt: the rest of it is not wanted
            if loop.time() >= self.response_end:
                raise CallError(
                    f"TTS response not complete in {self.response_end - start:.3g} s"
                ) from None
            raise CallError(f"TTS service sent nothing for {READ_TIMEOUT_S:g} s") from None
        finally:
            self.deadline = None

    def _set_deadline(self, when: float) -> None:
        """Move the response's timer to ``when``, never past ``response_end``."""
        deadline = self.deadline
        if deadline is not None and not deadline.expired() and not self.done:
            deadline.reschedule(min(when, self.response_end))

    def _got_data(self) -> None:
        deadline = self.deadline
        if deadline is not None:
            now = asyncio.get_running_loop().time()
            when = deadline.when()
            if when is not None and when - now < READ_TIMEOUT_S / 2 and when < self.response_end:
                self._set_deadline(now + READ_TIMEOUT_S)

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

    async def _request(self, target: str) -> h11.Response:
        """Send a GET; return the response head once it has arrived.

        A service may close a keep-alive connection while it is idle (RFC
        9112 §9.6), and the close may cross the next request. So when a
        reused connection ends (closed or reset) before a byte of the
        response has come, it is opened again once and the GET, which is
        idempotent, sent again. Any other failure fails the call."""
        conn = self.conn
        reused = conn.our_state is h11.DONE and conn.their_state is h11.DONE
        if reused:
            conn.start_next_cycle()
        elif conn.our_state is not h11.IDLE:  # the service said "connection: close"
            await self._reopen()
        read_before = self.read_bytes
        try:
            return await self._send_get(target)
        except (h11.RemoteProtocolError, OSError, ssl.SSLError) as exc:
            if self.read_bytes != read_before:
                raise  # the response had begun: not a closed idle connection
            if not reused:
                raise CallError(
                    f"TTS service closed the connection before answering {target}"
                ) from exc
        await self._reopen()
        try:
            return await self._send_get(target)
        except (h11.RemoteProtocolError, OSError, ssl.SSLError) as exc:
            if self.read_bytes != read_before:
                raise
            raise CallError(
                f"TTS service closed the connection before answering {target}, "
                "on a new connection too"
            ) from exc

    async def _reopen(self) -> None:
        await self.hang_up()
        await self._open()

    async def _send_get(self, target: str) -> h11.Response:
        conn = self.conn
        host = self.worker.config.server_hostname
        self.writer.write(conn.send(h11.Request(
            method="GET", target=target,
            headers=[("host", host), ("accept", "audio/pcm"), ("user-agent", "voice-server")],
        )))
        self.writer.write(conn.send(h11.EndOfMessage()))
        event = await self._next_event()
        if not isinstance(event, h11.Response):
            raise CallError(f"expected a response, got {type(event).__name__}")
        return event

    async def _small_body(self, response: h11.Response, target: str) -> bytes:
        """The body of an error or health answer, up to MAX_ERROR_BODY bytes."""
        body = bytearray()
        while True:
            event = await self._next_event()
            if type(event) is h11.EndOfMessage:
                return bytes(body)
            if type(event) is not h11.Data:
                raise CallError(f"unexpected {type(event).__name__} in a response body")
            body += event.data
            if len(body) > MAX_ERROR_BODY:
                raise CallError(
                    f"TTS answered {response.status_code} for {target} with a body "
                    f"over {MAX_ERROR_BODY} bytes"
                )

    # -- audio ---------------------------------------------------------------

    async def fetch(self, text: str, keep: bool = True) -> None:
        """Request one prompt and queue its audio as it streams in.

        With ``keep=False`` the audio is only checked, not queued or counted.
        Returns early, the rest of the prompt abandoned, if the call ends.
        """
        async with self._read_deadline():
            await self._fetch(text, keep)

    async def _fetch(self, text: str, keep: bool) -> None:
        cfg = self.worker.config
        start = asyncio.get_running_loop().time()
        target = f"/v1/speech?text={quote(text)}&rate={cfg.rate}"
        response = await self._request(target)
        if response.status_code != 200:
            body = await self._small_body(response, target)
            raise CallError(f"TTS answered {response.status_code} for {text!r}: {body[:200]!r}")
        headers = dict(response.headers)
        expect_sha = headers.get(b"x-audio-sha256", b"").decode()
        expect_len = announced_bytes(headers.get(b"x-audio-bytes"), cfg.rate)
        per_second = cfg.rate * SAMPLE_WIDTH
        self.response_end = start + expect_len / per_second + RESPONSE_SLACK_S
        # Flow control (module docstring): read no more while this much is queued.
        high_water = self.worker.low_water_bytes + int(QUEUE_AHEAD_S * cfg.rate) * SAMPLE_WIDTH
        if keep:
            self.source = headers.get(b"x-audio-source", b"?").decode()
        digest = hashlib.sha256()
        received = 0
        chunks = self.chunks
        worker = self.worker
        conn = self.conn
        read = self.read
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if keep and self.queued > high_water:
                        await self._wait_for_room()
                    conn.receive_data(await read())
                    continue
                if type(event) is h11.Data:
                    data = event.data
                    digest.update(data)
                    n = len(data)
                    if received + n > expect_len:
                        # A service that sends more than it announced may send
                        # without end: the queue would grow as fast as it sends.
                        raise CallError(f"TTS sent more than its x-audio-bytes ({expect_len})")
                    received += n
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
        finally:
            if keep:  # (a prompt cut short too: its bytes were queued)
                self.bytes_received += received
        hexdigest = digest.hexdigest()
        good = hexdigest == expect_sha and received == expect_len and received % SAMPLE_WIDTH == 0
        if not keep:
            if not good:
                raise CallError(f"warm-up prompt arrived damaged ({received} bytes)")
            return
        if good:
            self.phrases_ok += 1
            worker.digests.add((text, cfg.rate, hexdigest))
        else:
            self.phrases_bad += 1

    async def _wait_for_room(self) -> None:
        """Stop reading until the ticker has played the queue down to low water.

        Not reading is the call's choice, not the service's silence: only the
        response's overall deadline runs meanwhile."""
        self._set_deadline(self.response_end)
        self.waiting = True
        await self._sleep_until_woken()
        self._set_deadline(asyncio.get_running_loop().time() + READ_TIMEOUT_S)

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

    def end(self) -> None:
        """The call's time is up (the ticker calls this at ``end_at``):
        ``run()`` returns, abandoning the prompt it may be fetching."""
        self.done = True
        deadline = self.deadline
        if deadline is not None and not deadline.expired():
            deadline.reschedule(asyncio.get_running_loop().time())
        self.wake.set()

    async def _sleep_until_woken(self) -> None:
        self.wake.clear()
        await self.wake.wait()
