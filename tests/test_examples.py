"""The voice/TTS example end to end: byte-exact audio, no underruns, clean exit.

Each case runs the TTS service and 20 calls of 3 s in one event loop, with
slabnet streams and with asyncio's own; slabnet's pytest plugin
(``slabnet_loops`` in pyproject.toml) runs every async test on the stdlib
loop and on uvloop. The
service uses its synthetic voice, so the test recomputes every prompt's PCM
and checks the SHA-256 the voice server computed over what it received.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from examples._common import frame_bytes, impl_available, make_certs, server_ssl_context  # noqa: E402
from examples.tts_service import ServiceConfig, serve, synthetic_pcm  # noqa: E402
from examples.tts_service._synth import PhraseCache  # noqa: E402
from examples.voice_server import VoiceConfig, Worker  # noqa: E402

CALLS = 20
DURATION_S = 3.0
RATE = 8000


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _need(impl: str) -> None:
    why = impl_available(impl)
    if why:
        pytest.skip(why)


async def _scenario(certs: Any, impl: str) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    try:
        return await _run(certs, impl, loop_errors)
    finally:
        loop.set_exception_handler(previous_handler)


async def _run(
    certs: Any, impl: str, loop_errors: list[dict[str, Any]]
) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    listening: asyncio.Future[Any] = loop.create_future()
    stop = asyncio.Event()
    service_task = asyncio.create_task(serve(
        ServiceConfig(port=0, impl=impl, voice="synthetic", warm_rates=(RATE,)),
        server_ssl_context(certs),
        ready=listening.set_result,
        stop=stop,
        handle_signals=False,
    ))
    service = await asyncio.wait_for(listening, 30)
    config = VoiceConfig(
        tts_port=service.port, ca=str(certs.ca), impl=impl, rate=RATE,
        duration=DURATION_S, stagger_s=0.25,
    )
    result = await Worker(config, list(range(CALLS)), CALLS).run()
    stop.set()
    await asyncio.wait_for(service_task, 30)
    result["leftover_tasks"] = [
        repr(t) for t in asyncio.all_tasks() if t is not asyncio.current_task()
    ]
    return result, service, loop_errors


@pytest.mark.asyncio
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
async def test_calls_play_byte_exact_audio_without_underruns(
    certs: Any, impl: str, loop_name: str
) -> None:
    """slabnet's plugin runs this once per loop (ids [asyncio] and [uvloop])."""
    _need(impl)
    if loop_name == "uvloop":
        import uvloop

        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        result, service, loop_errors = await _scenario(certs, impl)
        gc.collect()
    assert result["errors"] == []
    assert result["connected"] == CALLS
    assert result["underruns"] == 0, result["underrun_log"][:10]

    # Byte-exact: every prompt the calls received hashes to the PCM the
    # synthetic voice makes for that text, recomputed here.
    assert result["phrases_bad"] == 0
    assert result["phrases_ok"] >= CALLS
    assert result["sources"] == ["synthetic"]
    assert result["digests"]
    for text, rate, digest in result["digests"]:
        assert digest == hashlib.sha256(synthetic_pcm(text, rate)).hexdigest(), text

    # Every received byte was played or dropped at hang-up, frame by frame.
    assert result["bytes_played"] == result["frames"] * frame_bytes(RATE)
    assert result["bytes_received"] == result["bytes_played"] + result["bytes_dropped"]
    expected_frames = CALLS * DURATION_S / 0.020
    assert expected_frames * 0.95 <= result["frames"] <= expected_frames

    # Clean shutdown: nothing left running, nothing logged, nothing leaked.
    assert result["leftover_tasks"] == []
    assert service.errors == 0
    assert loop_errors == []
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == [], [str(w.message) for w in leaks]
    assert result["reads"] > 0
    if impl == "slabnet":
        assert result["memory_stats"] is not None
        # Seed 000: every TLS chunk owns its whole buffer, so queueing it
        # could never pin a shared slab.
        assert result["reads_shared"] == 0


def test_command_line_two_workers_each(certs: Any) -> None:
    """The CLIs as the README runs them: 2 service and 2 voice processes, SIGTERM stop."""
    impl = "slabnet" if impl_available("slabnet") is None else "asyncio"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    service = subprocess.Popen(
        [sys.executable, "-m", "examples.tts_service", "--port", "0", "--workers", "2",
         "--impl", impl, "--voice", "synthetic", "--certs", str(certs.ca.parent)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert service.stdout is not None
        line = service.stdout.readline()
        assert "listening on https://" in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        voice = subprocess.run(
            [sys.executable, "-m", "examples.voice_server", "--tts", url, "--ca", str(certs.ca),
             "--impl", impl, "--calls", "6", "--duration", "1", "--workers", "2",
             "--no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )
        assert voice.returncode == 0, voice.stderr
        assert voice.stderr == ""
        rows = dict(r.rsplit(None, 1) for r in voice.stdout.splitlines() if r.startswith(
            ("underruns", "errors")))
        assert rows == {"underruns": "0", "errors": "0"}, voice.stdout
    finally:
        service.send_signal(signal.SIGTERM)
        out, _ = service.communicate(timeout=30)
    assert service.returncode == 0
    assert "stopped cleanly" in out and "0 connection errors" in out, out


@pytest.mark.parametrize("cli", ["tts_service", "demo"])
def test_a_worker_that_fails_to_start_ends_the_command(certs: Any, cli: str) -> None:
    """With two workers, the service's supervisor waited for each worker's
    "ready" with no end: a worker that failed at start (``--voice espeak-ng``
    with no espeak-ng installed, as here: no PATH) left it waiting for good,
    deaf to SIGINT and SIGTERM, and the demo waiting for it. Both now exit
    with an error. (One worker, in the supervisor's own process, always
    did.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=str(certs.ca.parent))  # no espeak-ng
    if cli == "tts_service":
        cmd = ["-m", "examples.tts_service", "--port", "0", "--workers", "2",
               "--voice", "espeak-ng", "--certs", str(certs.ca.parent)]
    else:
        cmd = ["-m", "examples.demo", "--calls", "2", "--duration", "1", "--workers", "1",
               "--tts-workers", "2", "--voice", "espeak-ng"]
    done = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "espeak-ng is not installed" in done.stderr
    if cli == "tts_service":
        assert "a worker exited before it was ready" in done.stderr
    else:
        assert "TTS service exited with 1 before listening" in done.stderr


@pytest.mark.asyncio
@pytest.mark.parametrize("impl", ["slabnet", "asyncio"])
async def test_service_stops_in_its_grace_time_with_a_client_that_never_reads(
    certs: Any, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client mid-response that reads nothing (nor answers a close_notify)
    kept the service from stopping: its handler, cancelled after the grace
    time, then waited in wait_closed() for the TLS shutdown, 30 s."""
    _need(impl)
    from examples.tts_service import _server

    monkeypatch.setattr(_server, "SHUTDOWN_GRACE_S", 0.3)
    loop = asyncio.get_running_loop()
    listening: asyncio.Future[Any] = loop.create_future()
    stop = asyncio.Event()
    service_task = asyncio.create_task(serve(
        ServiceConfig(port=0, impl=impl, voice="synthetic", speed=1.0, warm_rates=()),
        server_ssl_context(certs), ready=listening.set_result, stop=stop,
        handle_signals=False,
    ))
    service = await asyncio.wait_for(listening, 30)
    context = ssl.create_default_context(cafile=str(certs.ca))

    def connect() -> ssl.SSLSocket:
        sock = socket.create_connection(("127.0.0.1", service.port), timeout=10)
        client = context.wrap_socket(sock, server_hostname="localhost")
        # Several seconds of audio at real time: mid-response at the stop.
        client.sendall(b"GET /v1/speech?text=" + b"hello+there+" * 20
                       + b"&rate=8000 HTTP/1.1\r\nhost: localhost\r\n\r\n")
        return client

    client = await asyncio.to_thread(connect)
    try:
        async with asyncio.timeout(10):
            while not service._busy:
                await asyncio.sleep(0.01)
        stop.set()
        async with asyncio.timeout(10):
            await service_task
        assert service._writers == set()
    finally:
        client.close()
        if not service_task.done():
            service_task.cancel()


@pytest.mark.asyncio
async def test_the_phrase_cache_keeps_at_most_its_bound() -> None:
    """Every text a client asked for stayed cached (a few MB each): the
    cache keeps at most max_bytes, dropping the least recently used."""
    one = len(synthetic_pcm("phrase 0", RATE))
    cache = PhraseCache("synthetic", max_bytes=3 * one + one // 2)
    first = await cache.get("phrase 0", RATE)
    for i in range(1, 10):
        assert await cache.get("phrase 0", RATE) is first  # (the most recent use)
        await cache.get(f"phrase {i}", RATE)
        await asyncio.sleep(0)  # (the cache counts a phrase in a callback)
        assert cache.cached_bytes <= cache.max_bytes
    assert len(cache) == 3
    assert await cache.get("phrase 0", RATE) is first
    assert cache.cached_bytes == sum(len(synthetic_pcm(f"phrase {i}", RATE)) for i in (0, 8, 9))
