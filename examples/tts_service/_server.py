"""The TTS service: HTTPS + HTTP/1.1 (h11) on slabnet or asyncio streams.

Protocol
--------
``GET /v1/speech?text=<phrase>&rate=8000|16000`` answers ``200`` with the
phrase as raw PCM, 16-bit signed little-endian, mono, at the requested rate
(8000 Hz if omitted), in chunked transfer encoding (RFC 9112 §7.1)::

    content-type: audio/pcm;rate=8000;channels=1;encoding=s16le
    x-audio-source: espeak-ng | synthetic
    x-audio-bytes: <length of the whole PCM body>
    x-audio-sha256: <hex SHA-256 of the whole PCM body>

Like a streaming TTS provider, the body goes out faster than real time
(``speed`` times, 5x by default) in small chunks of ``chunk_ms`` of audio
(20 ms, one RTP frame, by default); each chunk is one ``write()`` and so one
TLS record. ``GET /v1/health`` answers a small JSON document. Connections are
kept alive between requests.

Pacing uses one ticker per process, not one timer per response: every
``TICK_S`` each streaming response sends the next ``speed * TICK_S`` seconds
of audio, then waits for its next tick. Responses are spread over four
phases of the tick, as independent synthesis jobs would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import ssl
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from .._common import FRAME_MS, PHRASES, SAMPLE_RATES, SAMPLE_WIDTH, streams_module
from ._synth import Phrase, PhraseCache

__all__ = ["ServiceConfig", "TTSService", "Ticker", "serve"]

# One pacing tick per 20 ms, the frame period: a response never gets more
# than one tick ahead of "speed x real time".
TICK_S = 0.020
# Largest request we accept before answering 431; a phrase fits easily.
MAX_REQUEST_BYTES = 16 * 1024
# Read size for plain asyncio streams.
READ_SIZE = 64 * 1024
# How long shutdown waits for responses in progress before cancelling them.
SHUTDOWN_GRACE_S = 5.0
# How long a connection may take to send its next request, whole, before it
# is dropped: a client that opens connections (or sends a byte now and then)
# and no request would otherwise hold a descriptor and a task for good. A
# voice-server call waits at most a few seconds between its prompts, and
# for its start after connecting (the calls start over calls/250 s).
REQUEST_TIMEOUT_S = 60.0
# How long a response may wait in drain() for a client to take its bytes
# before the client is dropped: one that stops reading would otherwise hold
# its connection, task and write buffer until it went away. A client that
# reads at the pace of playout (1x) waits a few seconds at most.
SEND_TIMEOUT_S = 30.0


@dataclasses.dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8443
    impl: str = "asyncio"
    voice: str = "auto"
    speed: float = 5.0  # x real time
    chunk_ms: int = FRAME_MS
    reuse_port: bool = False
    warm_rates: tuple[int, ...] = SAMPLE_RATES  # synthesize PHRASES at these rates first


class Ticker:
    """A shared pacing clock: ``await ticker.wait(phase)`` returns at that phase's next tick.

    Every ``interval`` each of ``phases`` groups of waiters is woken once, the
    groups ``interval / phases`` apart, so that responses do not all send at
    the same instant (their bursts would reach the client in one lump).
    Responses take phases round-robin from ``next_phase()``. The timer runs
    only while someone waits, so an idle service does not spin. Each waiter
    has its own ``Event.wait()`` future: cancelling one disturbs no other.
    """

    def __init__(self, interval: float, phases: int = 4) -> None:
        self.step = interval / phases
        self.phases = phases
        self._events: list[asyncio.Event | None] = [None] * phases
        self._handle: asyncio.TimerHandle | None = None
        self._current = 0  # the phase the next tick wakes
        self._assign = 0

    def next_phase(self) -> int:
        phase = self._assign
        self._assign = (phase + 1) % self.phases
        return phase

    async def wait(self, phase: int = 0) -> None:
        event = self._events[phase]
        if event is None:
            event = self._events[phase] = asyncio.Event()
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.step, self._fire)
        await event.wait()

    def _fire(self) -> None:
        self._handle = None
        phase = self._current
        self._current = (phase + 1) % self.phases
        event, self._events[phase] = self._events[phase], None
        if event is not None:
            event.set()
        if any(e is not None for e in self._events):
            self._handle = asyncio.get_running_loop().call_later(self.step, self._fire)


class TTSService:
    """One process's HTTPS listener and its connections."""

    def __init__(self, config: ServiceConfig, ssl_context: ssl.SSLContext) -> None:
        self.config = config
        self.ssl_context = ssl_context
        self.cache = PhraseCache(config.voice)
        self.ticker = Ticker(TICK_S)
        self.server: Any = None
        self.port = config.port
        self._idle: set[asyncio.Task[None]] = set()
        self._busy: set[asyncio.Task[None]] = set()
        self._writers: set[Any] = set()  # every open connection's
        self._closing = False
        self.responses = 0
        self.errors = 0
        self.synth_errors = 0  # requests answered 500: their synthesis failed

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        streams = streams_module(self.config.impl)
        kwargs: dict[str, Any] = {"ssl": self.ssl_context}
        if self.config.reuse_port:
            kwargs["reuse_port"] = True
        self.server = await streams.start_server(
            self._handle, self.config.host, self.config.port, **kwargs
        )
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, let responses in progress finish, close connections."""
        self._closing = True
        if self.server is not None:
            self.server.close()
        for task in list(self._idle):
            task.cancel()
        pending = self._idle | self._busy
        if pending:
            _, late = await asyncio.wait(pending, timeout=SHUTDOWN_GRACE_S)
            # What is left waits on a client that does not read: to take a
            # response, or (TLS) to answer the close_notify, which would keep
            # the service up until its ssl_shutdown_timeout or for good.
            # Those connections are dropped.
            for writer in list(self._writers):
                writer.transport.abort()
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        if self.server is not None:
            await self.server.wait_closed()

    async def __aenter__(self) -> TTSService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections ---------------------------------------------------------

    async def _handle(self, reader: Any, writer: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._idle.add(task)
        self._writers.add(writer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        read = reader.read_chunk if self.config.impl == "slabnet" else None
        try:
            while not self._closing:
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        event = await self._next_request(conn, reader, read)
                except TimeoutError:
                    # Dropped, not closed: a client that sends no request may
                    # not answer a close_notify either.
                    self.errors += 1
                    writer.transport.abort()
                    break
                if event is None:
                    break
                self._idle.discard(task)
                self._busy.add(task)
                await self._respond(conn, event, writer)
                self._busy.discard(task)
                self._idle.add(task)
                if conn.our_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except asyncio.CancelledError:
            pass  # shutdown: closed below
        except h11.RemoteProtocolError as exc:
            self.errors += 1
            # A request h11 could not parse leaves our side IDLE (their side
            # is ERROR): answer it too, 400 or 431 as h11 suggests.
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                body = f"{exc}\n".encode()
                with contextlib.suppress(h11.LocalProtocolError, OSError):
                    writer.write(conn.send(
                        _response(exc.error_status_hint, "text/plain", len(body), close=True)
                    ))
                    writer.write(conn.send(h11.Data(data=body)))
                    writer.write(conn.send(h11.EndOfMessage()))
        except (OSError, ssl.SSLError):
            self.errors += 1  # the peer went away mid-response
        finally:
            self._idle.discard(task)
            self._busy.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, asyncio.CancelledError):
                await writer.wait_closed()
            self._writers.discard(writer)

    @classmethod
    async def _next_request(
        cls, conn: h11.Connection, reader: Any, read: Any
    ) -> h11.Request | None:
        """The next request, read up to its end; None if the client closed first."""
        event = await cls._next_event(conn, reader, read)
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}", 400)
        # We serve no request with a body; read (and drop) any up to its end.
        while not isinstance(await cls._next_event(conn, reader, read), h11.EndOfMessage):
            pass
        return event

    @staticmethod
    async def _next_event(conn: h11.Connection, reader: Any, read: Any) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await (read() if read is not None else reader.read(READ_SIZE))
            conn.receive_data(data)  # empty at EOF: h11 then reports ConnectionClosed

    async def _respond(self, conn: h11.Connection, request: h11.Request, writer: Any) -> None:
        url = urlsplit(request.target.decode("ascii", "replace"))
        if request.method not in (b"GET", b"HEAD"):
            await self._send_simple(conn, writer, 405, "method not allowed\n")
        elif url.path == "/v1/health":
            body = json.dumps(
                {"ok": True, "voice": self.cache.voice, "impl": self.config.impl,
                 "pid": os.getpid(), "cached_phrases": len(self.cache)}
            )
            await self._send_simple(conn, writer, 200, body + "\n", "application/json")
        elif url.path == "/v1/speech":
            query = parse_qs(url.query)
            text = query.get("text", [""])[0].strip()
            try:
                rate = int(query.get("rate", ["8000"])[0])
            except ValueError:
                rate = 0
            if not text or len(text) > 1000 or rate not in SAMPLE_RATES:
                await self._send_simple(
                    conn, writer, 400, f"need text (<= 1000 chars) and rate in {SAMPLE_RATES}\n"
                )
            else:
                try:
                    phrase = await self.cache.get(text, rate)
                except Exception as exc:  # espeak-ng failed, timed out, or is gone
                    self.synth_errors += 1
                    await self._send_simple(
                        conn, writer, 500, f"synthesis failed: {type(exc).__name__}\n"
                    )
                else:
                    await self._stream_speech(conn, writer, phrase, request.method == b"HEAD")
        else:
            await self._send_simple(conn, writer, 404, "not found\n")
        self.responses += 1

    async def _send_simple(
        self, conn: h11.Connection, writer: Any, status: int, text: str,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        body = text.encode()
        writer.write(conn.send(_response(status, content_type, len(body))))
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        async with _send_deadline(writer):
            await writer.drain()

    async def _stream_speech(
        self, conn: h11.Connection, writer: Any, phrase: Phrase, head_only: bool
    ) -> None:
        rate = phrase.rate
        headers = [
            ("content-type", f"audio/pcm;rate={rate};channels=1;encoding=s16le"),
            ("x-audio-source", phrase.source),
            ("x-audio-bytes", str(len(phrase.pcm))),
            ("x-audio-sha256", phrase.sha256),
            ("cache-control", "no-store"),
        ]
        # No content-length: h11 frames an HTTP/1.1 response with chunked encoding.
        writer.write(conn.send(h11.Response(status_code=200, reason=b"OK", headers=headers)))
        if not head_only:
            chunk = max(SAMPLE_WIDTH, rate * self.config.chunk_ms // 1000 * SAMPLE_WIDTH)
            per_tick = max(1, round(self.config.speed * TICK_S * 1000 / self.config.chunk_ms))
            pcm = memoryview(phrase.pcm)
            phase = self.ticker.next_phase()
            loop = asyncio.get_running_loop()
            async with _send_deadline(writer) as deadline:
                for i, start in enumerate(range(0, len(pcm), chunk)):
                    if i and i % per_tick == 0:
                        await writer.drain()
                        # One timer per response: pushed back once half
                        # spent, so a drain that returns costs no timer work.
                        now = loop.time()
                        if (deadline.when() or now) - now < SEND_TIMEOUT_S / 2:
                            deadline.reschedule(now + SEND_TIMEOUT_S)
                        await self.ticker.wait(phase)
                    # h11 accepts any bytes-like object; a memoryview slice is not a copy.
                    piece: Any = pcm[start : start + chunk]
                    writer.write(conn.send(h11.Data(data=piece)))
        writer.write(conn.send(h11.EndOfMessage()))
        async with _send_deadline(writer):
            await writer.drain()


@contextlib.asynccontextmanager
async def _send_deadline(writer: Any) -> AsyncIterator[asyncio.Timeout]:
    """Drop the client (ConnectionAbortedError) when the block takes SEND_TIMEOUT_S."""
    try:
        async with asyncio.timeout(SEND_TIMEOUT_S) as deadline:
            yield deadline
    except TimeoutError:
        # Aborted, not closed: a close would wait for the bytes it does not take.
        writer.transport.abort()
        raise ConnectionAbortedError(f"client took nothing for {SEND_TIMEOUT_S:g} s") from None


def _response(status: int, content_type: str, length: int, close: bool = False) -> h11.Response:
    headers = [("content-type", content_type), ("content-length", str(length))]
    if close:  # (h11 does not say so itself when the request did not parse)
        headers.append(("connection", "close"))
    return h11.Response(
        status_code=status, reason=HTTPStatus(status).phrase.encode(), headers=headers
    )


async def serve(
    config: ServiceConfig,
    ssl_context: ssl.SSLContext,
    *,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
) -> TTSService:
    """Run one service process until SIGINT/SIGTERM (or ``stop`` is set).

    ``ready(service)`` is called once the socket listens and the phrase
    cache is warm.
    """
    service = TTSService(config, ssl_context)
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM) if handle_signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        async with service:
            # Warm the cache for the voice server's phrase list.
            for rate in config.warm_rates:
                await asyncio.gather(*(service.cache.get(p, rate) for p in PHRASES))
            if ready is not None:
                ready(service)
            await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    return service
