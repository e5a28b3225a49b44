"""The example TTS service against clients that hang up, flood it with new
texts, hold connections open or send unusual letters.

The service runs in-process on 127.0.0.1 (synthetic voice) over real TLS,
with slabnet streams and with asyncio's; slabnet's pytest plugin runs every
case on the stdlib loop and on uvloop. Where a case needs to see or hold a
synthesis, the service synthesizes in threads of this process
(``synth_processes=False``) and the test replaces ``PhraseCache.synthesize``
with one that waits for a gate: then which texts ran, and how many at once,
are counts, not timings.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import resource
import socket
import ssl
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from examples.tts_service import ServiceConfig, synthetic_pcm  # noqa: E402
from examples.tts_service import _server  # noqa: E402
from examples.tts_service._synth import PhraseCache  # noqa: E402
from tests.test_examples_probe import certs, start_service  # noqa: E402, F401  (fixtures)

pytestmark = pytest.mark.timeout(30)


class GatedSynthesis:
    """PhraseCache.synthesize, held at a gate; records texts and concurrency."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.made: list[str] = []
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()
        self._real = PhraseCache.synthesize

    def __call__(self, cache: PhraseCache, text: str, rate: int) -> Any:
        with self._lock:
            self.made.append(text)
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            self.gate.wait(20)
            return self._real(cache, text, rate)
        finally:
            with self._lock:
                self.active -= 1


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedSynthesis:
    synth = GatedSynthesis()
    monkeypatch.setattr(PhraseCache, "synthesize",
                        lambda cache, text, rate: synth(cache, text, rate))
    yield synth
    synth.gate.set()


async def connect(svc: Any) -> tuple[Any, Any]:
    return await asyncio.open_connection(
        "127.0.0.1", svc.port, ssl=svc.client_context, server_hostname="localhost"
    )


def speech(text: str, method: str = "HEAD", close: bool = False) -> bytes:
    extra = "connection: close\r\n" if close else ""
    return f"{method} /v1/speech?text={text}&rate=8000 HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode()


def reset(writer: Any) -> None:
    """Hang up with a TCP reset."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def status(reader: Any) -> bytes:
    return (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[0]


# -- 1. a client that hangs up ----------------------------------------------


@pytest.mark.asyncio
async def test_a_client_that_hangs_up_cancels_its_queued_synthesis(
    start_service: Any, gated: GatedSynthesis
) -> None:
    """The handler awaited the synthesis without reading its socket, so it
    never saw its client reset: 30 such clients each queued a second of CPU
    work that ran to the end, and a good client's phrase waited behind it.
    Now the hang-up ends the handler while the synthesis is still held, and
    the abandoned text is never synthesized."""
    svc = await start_service(synth_processes=False, synth_jobs=1)
    good_r, good_w = await connect(svc)
    good_w.write(speech("blocker"))
    await until(lambda: gated.made == ["blocker"])
    bad_r, bad_w = await connect(svc)
    bad_w.write(speech("abandoned"))
    await until(lambda: len(svc.cache) == 2)  # (its request waits for a slot)
    reset(bad_w)
    # The hang-up is seen while "blocker" still holds the only slot.
    await until(lambda: len(svc._writers) == 1)
    assert svc.hangups == 1
    assert gated.made == ["blocker"]
    gated.gate.set()
    assert await status(good_r) == b"HTTP/1.1 200 OK"
    good_w.write(speech("last", close=True))
    assert await status(good_r) == b"HTTP/1.1 200 OK"
    assert gated.made == ["blocker", "last"]
    good_w.close()


@pytest.mark.asyncio
async def test_pipelined_bytes_during_a_synthesis_are_kept_for_the_next_request(
    start_service: Any, gated: GatedSynthesis
) -> None:
    """Reading the connection while the synthesis runs (to see a hang-up)
    must not lose a request the client pipelined meanwhile. (A guard for
    the hang-up fix: this passed before it too.)"""
    svc = await start_service(synth_processes=False)
    reader, writer = await connect(svc)
    writer.write(speech("first"))
    await until(lambda: gated.made == ["first"])
    writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    await asyncio.sleep(0.05)  # (either way: read during the synthesis or after)
    gated.gate.set()
    async with asyncio.timeout(10):
        reply = await reader.read()
    assert reply.startswith(b"HTTP/1.1 200 OK")
    assert reply.count(b"HTTP/1.1 200 OK") == 2
    assert b'"ok": true' in reply
    writer.close()


@pytest.mark.asyncio
async def test_a_synthesis_wait_longer_than_its_timeout_is_answered_503(
    start_service: Any, gated: GatedSynthesis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request waited for its synthesis without a limit."""
    monkeypatch.setattr(_server, "SYNTH_TIMEOUT_S", 0.2, raising=False)
    svc = await start_service(synth_processes=False, synth_jobs=1)
    r1, w1 = await connect(svc)
    w1.write(speech("held"))
    await until(lambda: gated.made == ["held"])
    r2, w2 = await connect(svc)
    w2.write(speech("queued", method="GET"))
    async with asyncio.timeout(10):
        assert await status(r2) == b"HTTP/1.1 503 Service Unavailable"
        assert await status(r1) == b"HTTP/1.1 503 Service Unavailable"
    assert svc.synth_timeouts == 2
    gated.gate.set()
    await until(lambda: svc.cache.running == 0)
    assert gated.made == ["held"]  # ("queued" was dropped before it ran)
    w1.close()
    w2.close()


# -- 2. synthesis does not starve the event loop -----------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("jobs", [1, 2])
async def test_at_most_synth_jobs_syntheses_run_at_once(
    start_service: Any, gated: GatedSynthesis, jobs: int
) -> None:
    """Every request for a new text started its synthesis at once, in the
    default thread pool: 3 clients asking for new 1000-letter texts held
    the GIL in 3 threads and the service's audio fell behind (1000-6000
    underruns in 8000 frames). Now the others wait their turn."""
    svc = await start_service(synth_processes=False, synth_jobs=jobs)
    clients = [await connect(svc) for _ in range(4)]
    for i, (_, writer) in enumerate(clients):
        writer.write(speech(f"text{i}"))
    await until(lambda: len(svc.cache) == 4 and len(gated.made) >= jobs)
    # (before the limit the other texts started too, within microseconds)
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert len(gated.made) == jobs
    assert svc.cache.running == jobs
    gated.gate.set()
    for reader, _ in clients:
        assert await status(reader) == b"HTTP/1.1 200 OK"
    assert sorted(gated.made) == [f"text{i}" for i in range(4)]
    assert gated.most_active == jobs
    for _, writer in clients:
        writer.close()


@pytest.mark.asyncio
async def test_synthesis_runs_outside_the_service_process(
    start_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synthesis ran in threads of the service's process, holding its GIL."""
    in_process: list[str] = []
    real = PhraseCache.synthesize

    def synthesize(cache: PhraseCache, text: str, rate: int) -> Any:
        in_process.append(text)
        return real(cache, text, rate)

    monkeypatch.setattr(PhraseCache, "synthesize", synthesize)
    svc = await start_service()  # (worker processes import the real synthesize)
    reader, writer = await connect(svc)
    writer.write(speech("hello%20there", close=True))
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    assert head.startswith("HTTP/1.1 200 OK")
    assert f"x-audio-sha256: {hashlib.sha256(synthetic_pcm('hello there', 8000)).hexdigest()}" in head
    assert in_process == []
    writer.close()


# -- 3. connections: a cap, and short first-request and handshake timeouts ----


@pytest.mark.asyncio
async def test_a_connection_over_the_cap_is_refused(start_service: Any) -> None:
    """Connections had no cap: ~250 idle ones used up a 256-descriptor limit
    and every client was locked out (on the stdlib loop with an EMFILE
    traceback a second). Now one over ``max_connections`` is dropped and
    those within it are served."""
    svc = await start_service(max_connections=2)
    held = [await connect(svc) for _ in range(2)]
    await until(lambda: len(svc._writers) == 2)
    reader, writer = await connect(svc)
    async with asyncio.timeout(10):
        try:
            assert await reader.read() == b""
        except (ConnectionResetError, ssl.SSLError):
            pass  # (dropped without a close_notify)
    assert svc.refused == 1
    for r, w in held:
        w.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await status(r) == b"HTTP/1.1 200 OK"
        w.close()
    writer.transport.abort()


def test_the_connection_cap_stays_below_the_descriptor_limit() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    config = ServiceConfig(voice="synthetic")
    svc = _server.TTSService(config, ssl.create_default_context(ssl.Purpose.CLIENT_AUTH))
    assert 0 < svc.max_connections <= soft - 32


def test_the_command_line_lifts_the_soft_descriptor_limit() -> None:
    """The CLI served with the soft limit it was given (often 1024)."""
    code = ("import resource\n"
            "from examples.tts_service import _cli\n"
            "_cli.raise_nofile_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")

    def lower() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, preexec_fn=lower,
                         capture_output=True, text=True, timeout=20, check=True).stdout
    soft, hard = out.split()
    assert soft == hard


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["no-handshake", "no-request"])
async def test_a_new_connection_that_sends_nothing_is_dropped_soon(
    start_service: Any, monkeypatch: pytest.MonkeyPatch, tls: bool
) -> None:
    """A connection that sent nothing was held for the 60 s handshake (or
    request) timeout, so that a few hundred a minute held every descriptor.
    Now it gets FIRST_REQUEST_TIMEOUT_S; later requests keep
    REQUEST_TIMEOUT_S."""
    monkeypatch.setattr(_server, "FIRST_REQUEST_TIMEOUT_S", 0.3, raising=False)
    svc = await start_service()
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        if tls:
            reader, writer = await connect(svc)
            try:
                assert await reader.read() == b""
            except (ConnectionResetError, ssl.SSLError):
                pass
            writer.transport.abort()
            assert svc.errors == 1
        else:
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", svc.port))
                try:
                    assert await loop.sock_recv(sock, 1024) == b""
                except ConnectionResetError:
                    pass
            finally:
                sock.close()


@pytest.mark.asyncio
async def test_an_error_answer_to_a_head_request_has_no_body(start_service: Any) -> None:
    """A HEAD request answered 400/404/500/503 made h11 raise (a body after
    a HEAD): no answer, and "Unhandled exception in client_connected_cb"."""
    svc = await start_service()
    reader, writer = await connect(svc)
    writer.write(b"HEAD /nowhere HTTP/1.1\r\nhost: x\r\n\r\n"
                 b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    async with asyncio.timeout(10):
        reply = await reader.read()
    assert reply.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert reply.split(b"\r\n\r\n", 1)[1].startswith(b"HTTP/1.1 200 OK")
    writer.close()


# -- 4. letters whose lower case is two characters ---------------------------


def test_synthetic_pcm_takes_a_letter_whose_lower_case_is_two_characters() -> None:
    """"İ".lower() is "i" and a combining dot: ord() of it raised TypeError."""
    pcm = synthetic_pcm("İstanbul", 8000)
    assert len(pcm) == len("İstanbul") * int(0.07 * 8000) * 2
    assert pcm[: len(pcm) // 8] == synthetic_pcm("i", 8000)


@pytest.mark.asyncio
async def test_a_dotted_capital_i_is_answered_200(start_service: Any) -> None:
    """It was answered "500 synthesis failed: TypeError", every time."""
    svc = await start_service()
    reader, writer = await connect(svc)
    writer.write(speech("%C4%B0stanbul", method="GET", close=True))
    assert await status(reader) == b"HTTP/1.1 200 OK"
    writer.close()
    assert svc.synth_errors == 0
