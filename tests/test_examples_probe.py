"""The example TTS service and voice server under hostile or unlucky peers.

The service runs in-process on 127.0.0.1 (synthetic voice), with slabnet
streams and with asyncio's; slabnet's pytest plugin runs every case on the
stdlib loop and on uvloop. Clients are plain asyncio TLS streams that send
exactly the bytes a case needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import ssl
import struct
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h11
import pytest
import pytest_asyncio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from examples._common import PHRASES, impl_available, make_certs, server_ssl_context  # noqa: E402
from examples.tts_service import ServiceConfig, TTSService, serve  # noqa: E402
from examples.tts_service._server import MAX_REQUEST_BYTES  # noqa: E402
from examples.tts_service._synth import PhraseCache, espeak_pcm  # noqa: E402
from examples.voice_server import VoiceConfig, Worker  # noqa: E402


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def service_speed() -> float:
    """The service's pace, x real time (a test may parametrize it)."""
    return 5.0


@pytest.fixture
def service_voice() -> str:
    return "synthetic"


@pytest_asyncio.fixture(params=["slabnet", "asyncio"])
async def start_service(
    request: pytest.FixtureRequest, certs: Any
) -> AsyncIterator[Callable[..., Any]]:
    """``await start_service(**config)``: a running service (its ``impl`` is
    the param; ``config`` sets ``ServiceConfig`` fields), stopped at the
    end; no loop errors allowed."""
    impl = request.param
    why = impl_available(impl)
    if why:
        pytest.skip(why)
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []

    async def start(**overrides: Any) -> Any:
        config = ServiceConfig(port=0, impl=impl, voice="synthetic", warm_rates=())
        for name, value in overrides.items():
            setattr(config, name, value)
        listening: asyncio.Future[Any] = loop.create_future()
        tasks.append(asyncio.create_task(serve(
            config, server_ssl_context(certs), ready=listening.set_result, stop=stop,
            handle_signals=False,
        )))
        svc = await asyncio.wait_for(listening, 30)
        svc.client_context = ssl.create_default_context(cafile=str(certs.ca))
        return svc

    try:
        yield start
        stop.set()
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        for task in tasks:
            task.cancel()
        loop.set_exception_handler(previous_handler)
    assert loop_errors == []


@pytest_asyncio.fixture
async def service(
    start_service: Callable[..., Any], service_speed: float, service_voice: str
) -> Any:
    """A running service, at ``service_speed`` with ``service_voice``."""
    return await start_service(voice=service_voice, speed=service_speed)


async def close_client(writer: Any) -> None:
    """Close a test client's connection; the service may have dropped it
    (then without a close_notify)."""
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError):
        pass


async def _exchange(svc: Any, request: bytes) -> bytes:
    """Send ``request`` over TLS, then read until the service closes."""
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", svc.port, ssl=svc.client_context, server_hostname="localhost"
        )
        try:
            writer.write(request)
            return await reader.read()
        finally:
            await close_client(writer)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"\x00\x01garbage\r\n\r\n", b"400"),
        (b"GET /v1/health HTTP/1.1\r\n\r\n", b"400"),  # no host header
        # A request line that never ends, one byte more than the service
        # buffers: every byte is read, so the close sends no reset.
        (b"GET /" + b"a" * (MAX_REQUEST_BYTES + 1 - len(b"GET /")), b"431"),
        (b"GET /v1/health HTTP/1.1\r\nhost: x\r\nx-big: "
         + b"a" * MAX_REQUEST_BYTES, b"431"),
    ],
    ids=["garbage", "no-host", "endless-request-line", "huge-header"],
)
async def test_a_request_h11_cannot_parse_is_answered_before_the_close(
    service: Any, request_bytes: bytes, status: bytes
) -> None:
    """Only errors found after a request was parsed were answered: garbage,
    a missing host header, or a request head larger than the service takes
    (MAX_REQUEST_BYTES, "before answering 431") got a bare close, with no
    status, because h11 leaves the server IDLE, not SEND_RESPONSE, then."""
    reply = await _exchange(service, request_bytes)
    assert reply.startswith(b"HTTP/1.1 " + status + b" "), reply[:200]
    assert b"connection: close" in reply.lower()
    assert service.errors == 1



@pytest.fixture
def request_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.tts_service import _server

    monkeypatch.setattr(_server, "REQUEST_TIMEOUT_S", 0.5)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /v1/health HTTP/1.1\r\nhost: x\r\n",
     b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n"],
    ids=["nothing", "half-a-request", "one-request-then-nothing"],
)
async def test_a_connection_that_sends_no_request_in_time_is_dropped(
    request_timeout: None, service: Any, sent: bytes
) -> None:
    """A client that did its TLS handshake and then sent no request (or half
    of one, or nothing after its first) held its connection and handler
    task for good, with either impl: 200 such clients held 200 descriptors
    as long as they liked. Now each has REQUEST_TIMEOUT_S per request."""
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", service.port, ssl=service.client_context, server_hostname="localhost"
        )
        try:
            writer.write(sent)
            if sent.endswith(b"\r\n\r\n"):
                assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200 ")
            try:
                while await reader.read(65536):
                    pass
            except (ConnectionResetError, ssl.SSLError):
                pass  # (a dropped TLS connection has no close_notify)
            while service._writers:
                await asyncio.sleep(0.01)
        finally:
            await close_client(writer)
    assert service.errors == 1



@pytest.mark.asyncio
@pytest.mark.parametrize("service_speed", [100.0])
@pytest.mark.parametrize("what", ["speech", "pipelined-health"])
async def test_a_client_that_stops_reading_is_dropped(
    service: Any, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stopped reading held its handler in drain() for good
    (its connection, task and write buffer too), with either impl, until it
    went away or the service stopped. Now a drain may take SEND_TIMEOUT_S.

    Both ends' socket buffers are set small, so that the response (2.2 MB
    of audio, or thousands of pipelined health answers) is far more than
    the kernel and the transport hold (uvloop's TLS buffers ~0.5 MB)."""
    from examples.tts_service import _server

    monkeypatch.setattr(_server, "SEND_TIMEOUT_S", 0.5)
    if what == "speech":
        # Pauses only: 70 s of 16 kHz audio that costs no synthesis time.
        request = b"GET /v1/speech?text=a" + b"+" * 998 + b"a&rate=16000 HTTP/1.1\r\nhost: x\r\n\r\n"
    else:
        request = b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n" * 20000
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: window
    sock.setblocking(False)
    async with asyncio.timeout(10):
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", service.port))
        reader, writer = await asyncio.open_connection(
            sock=sock, ssl=service.client_context, server_hostname="localhost"
        )
        try:
            while not service._writers:
                await asyncio.sleep(0.01)
            (server_writer,) = service._writers
            server_writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
            )
            writer.write(request)
            while service._writers:
                await asyncio.sleep(0.01)
        finally:
            writer.transport.abort()
    assert service.errors == 1



@pytest.mark.asyncio
async def test_a_phrase_every_request_gave_up_on_is_not_synthesized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that went away left its synthesis queued (shielded): a
    client could queue any amount of CPU work (0.7 s per 1000-letter text
    at 16 kHz) by asking for new texts and hanging up, and later requests
    waited behind it. 10 abandoned texts were all synthesized; now none is."""
    made: list[str] = []
    gate = threading.Event()
    real = PhraseCache.synthesize

    def synthesize(self: PhraseCache, text: str, rate: int) -> Any:
        made.append(text)
        gate.wait(10)
        return real(self, text, rate)

    monkeypatch.setattr(PhraseCache, "synthesize", synthesize)
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(executor)  # (this test's loop only)
    try:
        cache = PhraseCache("synthetic")
        first = asyncio.create_task(cache.get("first", 8000))
        while not made:  # the one thread is busy with it
            await asyncio.sleep(0.01)
        abandoned = [asyncio.create_task(cache.get(f"text {i}", 8000)) for i in range(10)]
        await asyncio.sleep(0)
        for task in abandoned:
            task.cancel()
        await asyncio.gather(*abandoned, return_exceptions=True)
        gate.set()
        async with asyncio.timeout(10):
            assert (await first).text == "first"
            # One more phrase after them all: the queue holds nothing else.
            assert (await cache.get("last", 8000)).text == "last"
        assert made == ["first", "last"]
        assert len(cache) == 2
    finally:
        gate.set()
        executor.shutdown(wait=True)



@pytest.fixture
def failing_espeak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An espeak-ng on the PATH that fails as a broken install does."""
    script = tmp_path / "espeak-ng"
    script.write_text("#!/bin/sh\necho 'espeak-ng: cannot load voice' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.asyncio
@pytest.mark.parametrize("service_voice", ["espeak-ng"])
async def test_a_synthesis_that_fails_is_answered_500(
    failing_espeak: None, service: Any
) -> None:
    """espeak-ng's failure (CalledProcessError; a timeout or a NUL in the
    text likewise) escaped the connection handler: no answer, just a close,
    and "Unhandled exception in client_connected_cb" in the service's log."""
    get = b"GET /v1/speech?text=hello&rate=8000 HTTP/1.1\r\nhost: x\r\n"
    reply = await _exchange(service, get + b"\r\n" + get + b"connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 500 "), reply[:200]
    assert reply.count(b"synthesis failed: CalledProcessError") == 2  # (kept alive after one)
    assert service.synth_errors == 2
    assert service.errors == 0



FAKE_ESPEAK = """\
import getopt, sys, wave
# Options as espeak-ng's getopt_long takes them: anywhere, the last -w wins.
opts, words = getopt.gnu_getopt(sys.argv[1:], "v:s:w:f:")
opts = dict(opts)
text = open(opts["-f"], encoding="utf-8").read() if "-f" in opts else " ".join(words)
with wave.open(opts["-w"], "wb") as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(8000)
    w.writeframes(len(text).to_bytes(2, "little") * 80)
"""


@pytest.mark.asyncio
async def test_the_text_never_reaches_espeak_ngs_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text was espeak-ng's last argument, so a client's text
    "-w/any/path" was read as an option: espeak-ng wrote the WAV there, over
    any file the service may write (and the request failed, its own out.wav
    missing). The fake espeak-ng parses its options as espeak-ng's
    getopt_long does."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "espeak-ng"
    script.write_text(f"#!{sys.executable}\n{FAKE_ESPEAK}")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    target = tmp_path / "overwritten.wav"
    text = f"-w{target}"
    pcm = await asyncio.to_thread(espeak_pcm, text, 8000)
    assert not target.exists()
    assert pcm == len(text).to_bytes(2, "little") * 80  # (the fake's "speech")


# -- the voice server against a TTS service that fails mid-prompt -----------


class _FailingService(TTSService):
    """Serves like the real one, except call 0's first prompt: after its
    head and a few chunks it resets the connection, closes it cleanly,
    sends nothing more, or sends more audio without end (``how``)."""

    how = ""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.failed = asyncio.Event()
        self.release = asyncio.Event()  # ends the stall at shutdown

    async def _stream_speech(
        self, conn: Any, writer: Any, phrase: Any, head_only: bool
    ) -> None:
        if phrase.text != PHRASES[0] or self.failed.is_set():
            return await super()._stream_speech(conn, writer, phrase, head_only)
        writer.write(conn.send(h11.Response(status_code=200, headers=[
            ("x-audio-bytes", str(len(phrase.pcm))), ("x-audio-sha256", phrase.sha256),
        ])))
        for start in range(0, 5 * 320, 320):
            writer.write(conn.send(h11.Data(data=phrase.pcm[start:start + 320])))
        await writer.drain()
        self.failed.set()
        if self.how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            raise ConnectionResetError  # (ends the handler as a peer's reset would)
        if self.how == "truncate":
            raise ConnectionAbortedError  # the handler closes: close_notify, mid-body
        while self.how == "endless" and not self.release.is_set():
            for _ in range(10):
                writer.write(conn.send(h11.Data(data=phrase.pcm[:320])))
            await writer.drain()
            await self.ticker.wait()
        await self.release.wait()  # "stall"


@pytest.mark.asyncio
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
@pytest.mark.parametrize("how", ["reset", "truncate", "stall", "endless"])
async def test_a_prompt_that_fails_mid_body_fails_its_call_and_the_others_play_on(
    certs: Any, impl: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TTS service that stopped sending mid-prompt hung the voice server:
    the call waited for the rest of the body forever, so Worker.run() never
    returned. One that sent more than its x-audio-bytes without end did too,
    the call queueing all of it. A reset or a truncated body fail the call
    at once."""
    why = impl_available(impl)
    if why:
        pytest.skip(why)
    from examples.tts_service import _server
    from examples.voice_server import _call

    monkeypatch.setattr(_server, "SHUTDOWN_GRACE_S", 0.3)
    monkeypatch.setattr(_call, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(_FailingService, "how", how)
    service = _FailingService(
        ServiceConfig(port=0, impl=impl, voice="synthetic", warm_rates=()),
        server_ssl_context(certs),
    )
    async with service:
        config = VoiceConfig(
            tts_port=service.port, ca=str(certs.ca), impl=impl, duration=1.5, stagger_s=0.1,
        )
        worker = Worker(config, [0, 1, 2], 3)
        try:
            async with asyncio.timeout(15):
                result = await worker.run()
        finally:
            service.release.set()
    assert service.failed.is_set()
    assert len(result["errors"]) == 1, result["errors"]
    assert result["errors"][0].startswith("call 0: "), result["errors"]
    # (The service's handlers run in this loop too: the stalled one is left.)
    assert [t for t in result["leftover_tasks"] if "TTSService._handle" not in t] == []
    for call in worker.calls[1:]:
        assert call.phrases_ok >= 1 and call.phrases_bad == 0
        assert call.underruns == 0
