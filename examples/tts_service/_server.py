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

Synthesis of a text not yet cached runs in a pool of ``synth_jobs`` worker
processes, so that its CPU work never holds this process's GIL (see
``_synth``). While a request waits for it, the service keeps reading the
connection: a client that hangs up stops waiting, and a synthesis that no
one waits for any more is dropped before it starts. A wait longer than
``SYNTH_TIMEOUT_S`` is answered ``503``.

At most ``max_connections`` connections are served at once, below the
descriptor limit; one over the cap is dropped as soon as its handshake is
done. A connection gets ``FIRST_REQUEST_TIMEOUT_S`` for its TLS handshake,
and as long again for its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import resource
import signal
import ssl
from concurrent.futures import ProcessPoolExecutor
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from .._common import FRAME_MS, PHRASES, SAMPLE_RATES, SAMPLE_WIDTH, streams_module
from ._synth import SYNTH_JOBS, Phrase, PhraseCache

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
# How long a new connection may take for its TLS handshake, and then for
# its first request, whole. A voice-server call sends its first request (a health
# check) as soon as it is connected; a client that opens connections and
# sends nothing holds a descriptor each, and the cap counts them.
FIRST_REQUEST_TIMEOUT_S = 10.0
# How long a request may wait for its synthesis, queue included, before it
# is answered 503: a 1000-letter text takes 0.7 s at 16 kHz (synthetic
# voice) or about 1 s (espeak-ng), so this is a queue of a dozen long texts.
SYNTH_TIMEOUT_S = 10.0
# Descriptors kept out of max_connections (when it derives from the soft
# RLIMIT_NOFILE): the listening socket, the loop's own (epoll, self-pipe),
# the synthesis pool's pipes and espeak-ng's files and pipes, with room to spare.
FD_RESERVE = 64
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
    synth_jobs: int = SYNTH_JOBS  # syntheses at once
    synth_processes: bool = True  # in worker processes (False: threads of this one)
    max_connections: int = 0  # 0: the soft RLIMIT_NOFILE less FD_RESERVE


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
        self._pool = (
            ProcessPoolExecutor(config.synth_jobs, mp_context=multiprocessing.get_context("spawn"))
            if config.synth_processes else None
        )
        self.cache = PhraseCache(config.voice, jobs=config.synth_jobs, executor=self._pool)
        self.max_connections = config.max_connections or _connection_cap()
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
        self.synth_timeouts = 0  # requests answered 503: their synthesis took too long
        self.hangups = 0  # requests whose client went away while they waited for synthesis
        self.refused = 0  # connections closed at once: max_connections were open

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        streams = streams_module(self.config.impl)
        kwargs: dict[str, Any] = {
            "ssl": self.ssl_context, "ssl_handshake_timeout": FIRST_REQUEST_TIMEOUT_S,
        }
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
        if self._pool is not None:
            # (a synthesis under way, that no one waits for, ends first)
            await asyncio.to_thread(self._pool.shutdown, cancel_futures=True)

    async def __aenter__(self) -> TTSService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections ---------------------------------------------------------

    async def _handle(self, reader: Any, writer: Any) -> None:
        if len(self._writers) >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._idle.add(task)
        self._writers.add(writer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        read = reader.read_chunk if self.config.impl == "slabnet" else None
        first = True
        try:
            while not self._closing:
                try:
                    async with asyncio.timeout(
                        min(FIRST_REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_S) if first
                        else REQUEST_TIMEOUT_S
                    ):
                        event = await self._next_request(conn, reader, read)
                    first = False
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
                await self._respond(conn, event, reader, read, writer)
                self._busy.discard(task)
                self._idle.add(task)
                if conn.our_state is not h11.DONE:
                    break  # MUST_CLOSE, or no response: the client hung up
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

    async def _respond(
        self, conn: h11.Connection, request: h11.Request, reader: Any, read: Any, writer: Any
    ) -> None:
        url = urlsplit(request.target.decode("ascii", "replace"))
        head = request.method == b"HEAD"
        if request.method not in (b"GET", b"HEAD"):
            await self._send_simple(conn, writer, head, 405, "method not allowed\n")
        elif url.path == "/v1/health":
            body = json.dumps(
                {"ok": True, "voice": self.cache.voice, "impl": self.config.impl,
                 "pid": os.getpid(), "cached_phrases": len(self.cache)}
            )
            await self._send_simple(conn, writer, head, 200, body + "\n", "application/json")
        elif url.path == "/v1/speech":
            query = parse_qs(url.query)
            text = query.get("text", [""])[0].strip()
            try:
                rate = int(query.get("rate", ["8000"])[0])
            except ValueError:
                rate = 0
            if not text or len(text) > 1000 or rate not in SAMPLE_RATES:
                await self._send_simple(conn, writer, head, 400,
                                        f"need text (<= 1000 chars) and rate in {SAMPLE_RATES}\n")
            else:
                try:
                    async with asyncio.timeout(SYNTH_TIMEOUT_S):
                        phrase = await self._synthesize(conn, reader, read, text, rate)
                except TimeoutError:
                    self.synth_timeouts += 1
                    await self._send_simple(conn, writer, head, 503, "synthesis busy, try again\n")
                except Exception as exc:  # espeak-ng failed, timed out, or is gone
                    self.synth_errors += 1
                    await self._send_simple(
                        conn, writer, head, 500, f"synthesis failed: {type(exc).__name__}\n"
                    )
                else:
                    if phrase is None:  # the client went away: no response
                        self.hangups += 1
                        writer.transport.abort()
                        return
                    await self._stream_speech(conn, writer, phrase, head)
        else:
            await self._send_simple(conn, writer, head, 404, "not found\n")
        self.responses += 1

    async def _synthesize(
        self, conn: h11.Connection, reader: Any, read: Any, text: str, rate: int
    ) -> Phrase | None:
        """The phrase, or None if the client hung up (EOF or reset) first.

        The connection is read meanwhile, so that a hang-up cancels this
        request's wait, and with it a synthesis that no one else waits for.
        What the client sends meanwhile (its next requests, pipelined) goes
        to h11, which keeps it for the next cycle; once that holds
        MAX_REQUEST_BYTES the connection is no longer read."""
        job = asyncio.ensure_future(self.cache.get(text, rate))
        peek: asyncio.Future[Any] | None = None
        try:
            while not job.done() and len(conn.trailing_data[0]) < MAX_REQUEST_BYTES:
                peek = asyncio.ensure_future(read() if read is not None else reader.read(READ_SIZE))
                await asyncio.wait((job, peek), return_when=asyncio.FIRST_COMPLETED)
                if not peek.done():
                    break  # (the job is)
                try:
                    data = peek.result()
                except (OSError, ssl.SSLError):
                    data = b""  # reset
                peek = None
                if not data:
                    return None
                conn.receive_data(data)
            return await job
        finally:
            # A read left waiting must be gone before the next one starts; a
            # job given up on is cancelled (the cache then drops its synthesis
            # if no other request waits for it).
            for fut in (peek, job):
                if fut is not None and not fut.done():
                    fut.cancel()
                    await asyncio.wait((fut,))

    async def _send_simple(
        self, conn: h11.Connection, writer: Any, head: bool, status: int, text: str,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        """A whole response; to a HEAD request without its body (RFC 9110 §9.3.2)."""
        body = text.encode()
        writer.write(conn.send(_response(status, content_type, len(body))))
        if not head:
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


def _connection_cap() -> int:
    """Connections to allow: the soft RLIMIT_NOFILE less FD_RESERVE."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft - FD_RESERVE)


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
