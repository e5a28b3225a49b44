"""One voice-server process: its calls, its playout ticker and its measurements.

Theory of operation
-------------------
1. Connect: every call opens its HTTPS connection, makes one health
   request and streams one short warm-up prompt that it checks and drops,
   at most ``CONNECT_CONCURRENCY`` calls at a time.
2. Baseline: after a ``gc.collect()`` the process's RSS is recorded. From here
   on, "retained" memory is RSS minus that baseline, so connection setup is
   not counted against the audio. (With several processes they first meet at
   a barrier, so all start playing together.)
3. Talk: call i starts asking for prompts at ``t0 + i/N * stagger_s`` and
   hangs up ``duration`` seconds later. ONE ticker per process wakes every
   20 ms and takes one frame from every playing call's queue; a frame that is
   not there at its deadline is an underrun. Frames go out as RTP (RFC 3550,
   dynamic payload type 96 = s16le mono at the call's rate) over UDP to a
   loopback sink. If the ticker wakes late it catches up, frame by frame,
   and counts those frames as late.
4. Meanwhile a probe sleeps 10 ms at a time and records how late it wakes
   (event loop lag), and a sampler records queued audio bytes, retained
   memory and slabnet's pinned bytes four times a second.
5. Hang up: at its end time the ticker ends a call (``Call.end()``), which
   abandons the prompt it may still be fetching; then every connection is
   closed (TLS close_notify) and awaited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import resource
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from .._common import (
    FRAME_MS,
    SAMPLE_WIDTH,
    client_ssl_context,
    frame_bytes,
    host_cpu_ticks,
    memory_stats,
    percentile,
    pinned_bytes,
    rss_bytes,
    streams_module,
)
from ._call import Call

__all__ = ["VoiceConfig", "Worker"]

PERIOD_S = FRAME_MS / 1000
# Concurrent TLS handshakes while connecting: enough to connect 500 calls in
# about a second, few enough not to starve the loop.
CONNECT_CONCURRENCY = 64
PROBE_S = 0.010  # lag probe interval
SAMPLE_S = 0.25  # memory sample interval
# RTP fixed header (RFC 3550 §5.1): V=2, no padding/extension/CSRC, M=0.
RTP_HEADER = struct.Struct("!BBHII")
RTP_PAYLOAD_TYPE = 96


@dataclasses.dataclass
class VoiceConfig:
    tts_host: str = "127.0.0.1"
    tts_port: int = 8443
    ca: str = ""
    server_hostname: str = "localhost"
    impl: str = "asyncio"
    rate: int = 8000
    duration: float = 20.0
    stagger_s: float = 1.0  # calls start evenly spread over this long
    low_water_s: float = 1.0  # ask for the next prompt below this much audio
    prebuffer_ms: int = 60  # jitter buffer before a call starts playing
    rtp_sink: tuple[str, int] | None = None  # None: a local UDP socket nobody reads


class Worker:
    def __init__(
        self,
        config: VoiceConfig,
        call_ids: list[int],
        total_calls: int,
        *,
        barrier: Any = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config
        self.streams = streams_module(config.impl)
        self.ssl_context = client_ssl_context(config.ca)
        self.calls = [Call(i, self) for i in call_ids]
        self.total_calls = total_calls
        self.barrier = barrier
        self.progress = progress
        self.frame_size = frame_bytes(config.rate)
        self.prebuffer_bytes = frame_bytes(config.rate, config.prebuffer_ms)
        self.low_water_bytes = int(config.low_water_s * config.rate) * SAMPLE_WIDTH
        self.active: dict[Call, None] = {}
        self.queued = 0  # audio bytes queued over all calls
        self.digests: set[tuple[str, int, str]] = set()
        self.lag_ms: list[float] = []
        self.tick_late_max_ms = 0.0
        self.series: list[tuple[float, int, int, int | None, float]] = []
        self.errors: list[str] = []
        self.rtp_errors = 0
        self.underrun_log: list[tuple[float, int, int, bool]] = []
        self.t0 = 0.0
        self.cpu_s = 0.0
        self.host_busy = 0.0
        self._rtp: socket.socket | None = None
        self._sink: socket.socket | None = None
        self._running = False

    # -- call bookkeeping (used by Call.run) ---------------------------------

    def activate(self, call: Call) -> None:
        self.active[call] = None

    def deactivate(self, call: Call) -> None:
        self.active.pop(call, None)

    # -- the run -------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        t_begin = time.monotonic()
        gc.collect()
        rss_start = rss_bytes()
        self._open_rtp()
        sem = asyncio.Semaphore(CONNECT_CONCURRENCY)

        async def connect(call: Call) -> None:
            async with sem:
                await call.connect()

        results = await asyncio.gather(*(connect(c) for c in self.calls), return_exceptions=True)
        connected = []
        for call, result in zip(self.calls, results):
            if isinstance(result, BaseException):
                self._error(f"connect call {call.index}", result)
                await call.hang_up()
            else:
                connected.append(call)
        connect_s = time.monotonic() - t_begin

        if self.barrier is not None:
            await loop.run_in_executor(None, self.barrier.wait, 300)
        gc.collect()
        # Objects alive now (connections, calls, modules) live for the whole
        # run: move them out of the collector's view so that a full
        # collection does not walk them all while audio is playing.
        gc.freeze()
        baseline = rss_bytes()
        t0 = self.t0 = loop.time() + 0.05
        for call in connected:
            call.start_at = t0 + call.index / max(1, self.total_calls) * self.config.stagger_s
            call.end_at = call.start_at + self.config.duration

        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        host0 = host_cpu_ticks()
        self._running = True
        background = [
            asyncio.create_task(self._playout(t0)),
            asyncio.create_task(self._probe()),
            asyncio.create_task(self._sample(t0, baseline)),
        ]
        outcomes = await asyncio.gather(*(c.run() for c in connected), return_exceptions=True)
        for call, result in zip(connected, outcomes):
            if isinstance(result, BaseException):
                self._error(f"call {call.index}", result)
        talk_s = loop.time() - t0
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        host1 = host_cpu_ticks()
        self.cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
        self.host_busy = (host1[0] - host0[0]) / max(1, host1[1] - host0[1])
        self._running = False
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        hang = await asyncio.gather(*(c.hang_up() for c in connected), return_exceptions=True)
        for call, result in zip(connected, hang):
            if isinstance(result, BaseException):
                self._error(f"hang up call {call.index}", result)
        self._close_rtp()
        gc.unfreeze()
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return self._result(len(connected), connect_s, talk_s, rss_start, baseline, leftover)

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}")

    # -- RTP -----------------------------------------------------------------

    def _open_rtp(self) -> None:
        sink = self.config.rtp_sink
        if sink is None:
            # A discard sink: bound, never read; the kernel drops what does
            # not fit its small receive buffer.
            self._sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self._sink.bind(("127.0.0.1", 0))
            sink = self._sink.getsockname()
        family = socket.AF_INET6 if ":" in sink[0] else socket.AF_INET
        self._rtp = socket.socket(family, socket.SOCK_DGRAM)
        self._rtp.setblocking(False)
        self._rtp.connect(sink)

    def _close_rtp(self) -> None:
        for sock in (self._rtp, self._sink):
            if sock is not None:
                sock.close()

    # -- the playout ticker --------------------------------------------------

    async def _playout(self, t0: float) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        deadline = t0
        while True:
            now = loop.time()
            if now < deadline:
                await asyncio.sleep(deadline - now)
                continue
            late = now - deadline
            if late * 1000 > self.tick_late_max_ms:
                self.tick_late_max_ms = late * 1000
            while deadline <= now:
                self._tick(deadline, now - deadline > PERIOD_S)
                tick += 1
                # From the tick count, not by adding 0.02 up: no drift.
                deadline = t0 + tick * PERIOD_S

    def _tick(self, deadline: float, late: bool) -> None:
        size = self.frame_size
        samples_per_frame = size // SAMPLE_WIDTH
        low_water = self.low_water_bytes
        send = self._rtp.sendmsg  # type: ignore[union-attr]
        pack = RTP_HEADER.pack
        ended = []
        for call in self.active:
            # A call plays the ticks in [start_at, end_at); the 1 µs keeps
            # float rounding from granting a 20 ms frame past the end.
            if deadline >= call.end_at - 1e-6:
                ended.append(call)
                continue
            if not call.playing:
                continue
            frame = call.take_frame(size)
            if frame is None:
                call.underruns += 1
                if len(self.underrun_log) < 100:
                    self.underrun_log.append(
                        (round(deadline - self.t0, 3), call.index, call.queued, call.fetching)
                    )
                continue
            try:
                send((pack(0x80, RTP_PAYLOAD_TYPE, call.seq, call.timestamp, call.ssrc), frame))
            except OSError:
                self.rtp_errors += 1
            call.seq = (call.seq + 1) & 0xFFFF
            call.timestamp = (call.timestamp + samples_per_frame) & 0xFFFFFFFF
            call.frames += 1
            if late:
                call.late_frames += 1
            if call.first_frame_at is None:
                call.first_frame_at = deadline
            if call.waiting and call.queued <= low_water:
                call.waiting = False
                call.wake.set()
        for call in ended:
            call.end()
            del self.active[call]

    # -- measurements --------------------------------------------------------

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        lag = self.lag_ms
        while True:
            before = loop.time()
            await asyncio.sleep(PROBE_S)
            lag.append(max(0.0, (loop.time() - before - PROBE_S) * 1000))

    async def _sample(self, t0: float, baseline: int) -> None:
        loop = asyncio.get_running_loop()
        impl = self.config.impl
        k = lag_seen = 0
        next_progress = 1.0
        while True:
            # Sample on a fixed grid; when the loop is late, skip the grid
            # points already missed rather than taking them back to back.
            await asyncio.sleep(max(0.0, t0 + k * SAMPLE_S - loop.time()))
            elapsed = loop.time() - t0
            k = int(elapsed / SAMPLE_S) + 1
            retained = rss_bytes() - baseline
            pinned = pinned_bytes(memory_stats(impl))
            recent_lag = max(self.lag_ms[lag_seen:], default=0.0)
            lag_seen = len(self.lag_ms)
            self.series.append((round(elapsed, 3), self.queued, retained, pinned, recent_lag))
            if self.progress is not None and elapsed >= next_progress:
                next_progress = int(elapsed) + 1.0
                recent = self.lag_ms[-round(1 / PROBE_S):]
                self.progress({
                    "t": round(elapsed, 1),
                    "active": len(self.active),
                    "underruns": sum(c.underruns for c in self.calls),
                    "lag_p99_ms": percentile(recent, 99),
                    "queued": self.queued,
                    "retained": retained,
                    "pinned": pinned,
                })

    def _result(
        self, connected: int, connect_s: float, talk_s: float, rss_start: int, baseline: int,
        leftover: list[Any],
    ) -> dict[str, Any]:
        calls = self.calls
        first_audio_ms = [
            (c.first_frame_at - c.start_at) * 1000 for c in calls if c.first_frame_at is not None
        ]
        return {
            "pid": os.getpid(),
            "impl": self.config.impl,
            "calls": len(calls),
            "connected": connected,
            "connect_s": connect_s,
            "talk_s": talk_s,
            "frames": sum(c.frames for c in calls),
            "underruns": sum(c.underruns for c in calls),
            "late_frames": sum(c.late_frames for c in calls),
            "phrases_ok": sum(c.phrases_ok for c in calls),
            "phrases_bad": sum(c.phrases_bad for c in calls),
            "bytes_received": sum(c.bytes_received for c in calls),
            "bytes_played": sum(c.frames for c in calls) * self.frame_size,
            "bytes_dropped": sum(c.bytes_dropped for c in calls),
            "reads": sum(c.reads for c in calls),
            "read_bytes": sum(c.read_bytes for c in calls),
            "reads_shared": sum(c.reads_shared for c in calls),
            "sources": sorted({c.source for c in calls if c.source}),
            "digests": sorted(self.digests),
            "first_audio_ms": first_audio_ms,
            "lag_ms": self.lag_ms,
            "tick_late_max_ms": self.tick_late_max_ms,
            "rss_start": rss_start,
            "rss_baseline": baseline,
            "series": self.series,
            "memory_stats": memory_stats(self.config.impl),
            "rtp_errors": self.rtp_errors,
            "cpu_s": self.cpu_s,
            "host_busy": self.host_busy,
            "underrun_log": self.underrun_log,
            "errors": self.errors,
            "leftover_tasks": [repr(t) for t in leftover],
        }
