"""The example voice server against a broken or hostile TTS upstream.

The upstream is a small TLS server in this file (``Upstream``, h11 on
127.0.0.1) that serves like the TTS service, except where a case tells it to
misbehave, mostly on call 0's first prompt (``PHRASES[0]``). Its audio is any
bytes: the voice server checks only their length and SHA-256. The voice
server runs in-process (``Worker``) with slabnet streams and with asyncio's,
or as the command line; slabnet's pytest plugin runs every case on the
stdlib loop and on uvloop. Small limits come in by monkeypatching the
example's constants, so that no case sleeps for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import ssl
import struct
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import pytest
import pytest_asyncio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from examples._common import PHRASES, impl_available, server_ssl_context  # noqa: E402
from examples.voice_server import Call, VoiceConfig, Worker, _call  # noqa: E402
from tests.test_examples_probe import certs  # noqa: E402, F401  (the module's CA and cert)

RATE = 8000
PER_SECOND = RATE * 2
HOSTILE = PHRASES[0]  # call 0's first prompt


def audio(size: int) -> bytes:
    return (bytes(range(1, 251)) * (size // 250 + 1))[:size]


class Upstream:
    """A TTS service for one test. ``mode`` picks the misbehaviour; the
    default serves every prompt as ``prompt_bytes`` of audio in 320-byte
    chunks, as fast as the client reads."""

    def __init__(self, mode: str = "ok", prompt_bytes: int = PER_SECOND // 2, **opts: Any) -> None:
        self.mode = mode
        self.prompt_bytes = prompt_bytes
        self.opts = opts
        self.port = 0
        self.connections = 0
        self.texts: list[str] = []  # of the speech requests, in order
        self.unanswered = 0
        self._server: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[Any] = set()
        self._closing = asyncio.Event()  # ends the stalls

    async def start(self, ctx: ssl.SSLContext) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=ctx)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._server.close()
        self._closing.set()
        for writer in self._writers:
            writer.transport.abort()
        async with asyncio.timeout(5):
            await asyncio.gather(*self._tasks)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        nth = 0
        how = "close"
        try:
            while True:
                request = None
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        conn.receive_data(data)
                        if not data and conn.their_state is h11.IDLE:
                            return
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.EndOfMessage):
                        break
                assert request is not None
                nth += 1
                how = await self._answer(conn, writer, request.target.decode(), nth)
                if how != "keep":
                    return
                conn.start_next_cycle()
        except (OSError, ssl.SSLError, h11.ProtocolError):
            how = "reset"  # the voice server hung up (or close() aborted us)
        finally:
            self._tasks.discard(task)
            if how == "reset":
                sock = writer.get_extra_info("socket")
                if sock is not None:  # (None: already closed)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:  # (what is written goes out first, then close_notify)
                writer.close()

    async def _answer(self, conn: h11.Connection, writer: Any, target: str, nth: int) -> str:
        """Answer one GET; then "keep" the connection, "close" it or "reset" it."""
        mode = self.mode
        if mode == "reset-next" and nth > 1:  # a reset as the next request arrives
            return "reset"
        url = urlsplit(target)
        if url.path == "/v1/health":
            body = b'{"ok": true}'
            writer.write(conn.send(h11.Response(status_code=200, headers=[
                ("content-length", str(len(body)))])))
            writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            return "close" if mode == "close-idle" else "keep"
        text = parse_qs(url.query)["text"][0]
        self.texts.append(text)
        if text == HOSTILE and mode != "ok" and mode not in ("close-idle", "reset-next"):
            return await self._misbehave(conn, writer)
        pcm = audio(self.prompt_bytes)
        await self._send_head(conn, writer, 200, str(len(pcm)), pcm)
        for start in range(0, len(pcm), 320):
            writer.write(conn.send(h11.Data(data=pcm[start:start + 320])))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        return "close" if mode == "close-idle" else "keep"

    async def _send_head(
        self, conn: h11.Connection, writer: Any, status: int, length: str | None, pcm: bytes
    ) -> None:
        headers = [("x-audio-sha256", hashlib.sha256(pcm).hexdigest()),
                   ("x-audio-source", "synthetic")]
        if length is not None:
            headers.append(("x-audio-bytes", length))
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))

    async def _misbehave(self, conn: h11.Connection, writer: Any) -> str:
        mode, opts = self.mode, self.opts
        if mode == "close-unanswered":
            self.unanswered += 1
            return "close"
        if mode == "announce":  # a head with this x-audio-bytes, then the right audio
            pcm = audio(opts.get("size", PER_SECOND))
            await self._send_head(conn, writer, 200, opts["value"], pcm)
            writer.write(conn.send(h11.Data(data=pcm)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            return "keep"
        if mode == "error":  # 500 and an error text, or one without end
            await self._send_head(conn, writer, 500, None, b"")
            if not opts.get("endless"):
                writer.write(conn.send(h11.Data(data=b"synthesis failed: boom"))
                             + conn.send(h11.EndOfMessage()))
                await writer.drain()
                return "keep"
            while True:
                writer.write(conn.send(h11.Data(data=b"e" * 1024)))
                await writer.drain()
                await asyncio.sleep(0)
        # "flood", "trickle", "stall": announce, send some chunks, then...
        announced = opts["announce"]
        await self._send_head(conn, writer, 200, str(announced), b"")
        first = audio(opts.get("first", 5 * 320))
        for start in range(0, len(first), 320):
            writer.write(conn.send(h11.Data(data=first[start:start + 320])))
        await writer.drain()
        if mode == "flood":  # ...the end (they were all the audio)
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            return "keep"
        if mode == "trickle":  # ...2 bytes now and then, without end
            while True:
                await asyncio.sleep(opts["every"])
                writer.write(conn.send(h11.Data(data=b"\x00\x00")))
                await writer.drain()
        await self._closing.wait()  # "stall": nothing more
        return "close"


def need(impl: str) -> None:
    why = impl_available(impl)
    if why:
        pytest.skip(why)


@pytest_asyncio.fixture
async def upstream_factory(certs: Any) -> AsyncIterator[Any]:  # noqa: F811
    started: list[Upstream] = []

    async def start(mode: str = "ok", **kwargs: Any) -> Upstream:
        up = Upstream(mode, **kwargs)
        await up.start(server_ssl_context(certs))
        started.append(up)
        return up

    try:
        yield start
    finally:
        for up in started:
            await up.close()


async def run_voice(
    certs: Any, port: int, impl: str, *, calls: int = 1, duration: float = 1.0,  # noqa: F811
    limit: float = 10.0, low_water_s: float = 1.0,
) -> tuple[dict[str, Any], Worker]:
    config = VoiceConfig(tts_port=port, ca=str(certs.ca), impl=impl, rate=RATE,
                         duration=duration, stagger_s=0.0, low_water_s=low_water_s)
    worker = Worker(config, list(range(calls)), calls)
    async with asyncio.timeout(limit):
        result = await worker.run()
    # (The upstream's handlers run in this loop too.)
    assert [t for t in result["leftover_tasks"] if "Upstream._handle" not in t] == []
    return result, worker


IMPLS = pytest.mark.parametrize("impl", ["slabnet", "asyncio"])


# -- 1. memory: what a prompt may announce, and flow control ----------------


@pytest.mark.asyncio
@IMPLS
async def test_a_prompt_that_announces_more_audio_than_any_prompt_takes_fails_at_its_head(
    certs: Any, upstream_factory: Any, impl: str  # noqa: F811
) -> None:
    """x-audio-bytes was the only bound on what a call queued: an upstream
    announcing 10**12 and streaming fast grew the voice server ~200 MB/s.
    Now a prompt may announce at most its longest text's audio (here the
    upstream sends 1 MiB and ends: before, the call queued it all and
    counted the prompt bad, without an error)."""
    need(impl)
    up = await upstream_factory("announce", value=str(10**12), size=1 << 20)
    result, worker = await run_voice(certs, up.port, impl)
    assert len(result["errors"]) == 1, result["errors"]
    assert result["errors"][0].startswith(
        "call 0: CallError: x-audio-bytes 1000000000000 is more than any prompt this call"
    ), result["errors"]
    assert worker.calls[0].bytes_received == 0  # (refused at the head)


@pytest.mark.asyncio
@IMPLS
@pytest.mark.parametrize(
    ("value", "error"),
    [("n/a", "x-audio-bytes is not a byte count: b'n/a'"),
     ("-2", "x-audio-bytes is not a byte count: b'-2'"),
     ("1e3", "x-audio-bytes is not a byte count: b'1e3'"),
     (None, "TTS response has no x-audio-bytes header")],
    ids=["n/a", "negative", "float", "missing"],
)
async def test_an_x_audio_bytes_that_is_no_byte_count_fails_the_call_naming_the_header(
    certs: Any, upstream_factory: Any, impl: str, value: str | None, error: str  # noqa: F811
) -> None:
    """"n/a" failed the call with "ValueError: invalid literal for int()";
    a negative or missing one with "sent more than its x-audio-bytes (-1)"."""
    need(impl)
    up = await upstream_factory("announce", value=value)
    result, _ = await run_voice(certs, up.port, impl)
    assert result["errors"] == [f"call 0: CallError: {error}"]


@pytest.mark.asyncio
@IMPLS
async def test_a_call_reads_no_more_while_its_queue_is_full(
    certs: Any, upstream_factory: Any, impl: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The call read its socket however full its queue was: a prompt sent
    faster than real time was queued whole (here 20 s of audio, far more
    than any one read). Now the call stops reading above low water plus
    QUEUE_AHEAD_S of audio and reads on at low water: the queue is never
    above that bound when the call reads. (Low water is 3 s here, so that
    even after a first read of 64 KiB, 4 s of audio, the call reads on
    before it ends.)"""
    need(impl)
    monkeypatch.setattr(_call, "QUEUE_AHEAD_S", 0.25, raising=False)
    high_water = PER_SECOND * 3 + PER_SECOND // 4  # low water + 0.25 s
    queued_at_read: list[int] = []
    resumed_at: list[int] = []  # len(queued_at_read) when a pause mid-prompt ended
    for name in ("_read_chunk", "_read_bytes"):
        real = getattr(Call, name)

        async def read(self: Call, real: Any = real) -> Any:
            if self.index == 0 and self.fetching:
                queued_at_read.append(self.queued)
            return await real(self)

        monkeypatch.setattr(Call, name, read)
    real_sleep = Call._sleep_until_woken

    async def sleep(self: Call) -> None:
        await real_sleep(self)
        if self.index == 0 and self.fetching and not self.done:
            resumed_at.append(len(queued_at_read))

    monkeypatch.setattr(Call, "_sleep_until_woken", sleep)
    up = await upstream_factory("flood", announce=20 * PER_SECOND, first=20 * PER_SECOND)
    result, worker = await run_voice(certs, up.port, impl, duration=2.0, low_water_s=3.0)
    assert result["errors"] == []
    assert max(queued_at_read) <= high_water, (max(queued_at_read), high_water)
    assert resumed_at and resumed_at[0] < len(queued_at_read)  # paused, then read on
    call = worker.calls[0]
    assert call.underruns == 0
    assert call.bytes_received < 20 * PER_SECOND


# -- 2. time: a response's deadline, error bodies, hanging up ---------------


@pytest.mark.asyncio
@IMPLS
async def test_an_upstream_that_trickles_fails_the_call_by_the_prompts_deadline(
    certs: Any, upstream_factory: Any, impl: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Each read pushed the silence deadline back, so 2 bytes every little
    while held the call (and Worker.run()) for good, past the call's end.
    Now a response must be in by its audio's duration plus
    RESPONSE_SLACK_S (here 0.25 s of audio + 0.5 s)."""
    need(impl)
    monkeypatch.setattr(_call, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_call, "RESPONSE_SLACK_S", 0.5, raising=False)
    up = await upstream_factory("trickle", announce=PER_SECOND // 4, every=0.1)
    result, _ = await run_voice(certs, up.port, impl, duration=30.0, limit=5.0)
    assert len(result["errors"]) == 1, result["errors"]
    assert result["errors"][0].startswith("call 0: CallError: TTS response not complete in 0.7")


@pytest.mark.asyncio
@IMPLS
@pytest.mark.parametrize("endless", [False, True], ids=["error-text", "endless-error-body"])
async def test_an_error_answer_fails_the_call_with_its_text_and_a_bounded_body(
    certs: Any, upstream_factory: Any, impl: str, endless: bool  # noqa: F811
) -> None:
    """An error status's body was read to its end, which an endless chunked
    body never reaches (each chunk pushed the deadline back): the call hung.
    Now it is read up to MAX_ERROR_BODY and its text goes in the error."""
    need(impl)
    up = await upstream_factory("error", endless=endless)
    result, _ = await run_voice(certs, up.port, impl, duration=30.0, limit=5.0)
    assert len(result["errors"]) == 1, result["errors"]
    error = result["errors"][0]
    assert error.startswith("call 0: CallError: TTS answered 500 for "), error
    if endless:
        assert error.endswith(f"with a body over {_call.MAX_ERROR_BODY} bytes"), error
    else:
        assert error.endswith(": b'synthesis failed: boom'"), error


@pytest.mark.asyncio
@IMPLS
async def test_a_call_that_ends_mid_prompt_abandons_the_rest_of_it(
    certs: Any, upstream_factory: Any, impl: str  # noqa: F811
) -> None:
    """At its end time the ticker set call.done, but the prompt being
    fetched ran on: with an upstream that stalled mid-prompt the call (and
    Worker.run()) waited READ_TIMEOUT_S (10 s) and failed. Now the call ends
    on time, without an error, and the audio it got is counted."""
    need(impl)
    up = await upstream_factory("stall", announce=10 * PER_SECOND)
    result, worker = await run_voice(certs, up.port, impl, duration=0.5, limit=5.0)
    assert result["errors"] == []
    assert worker.calls[0].bytes_received == 5 * 320
    assert result["bytes_received"] == result["bytes_played"] + result["bytes_dropped"]


# -- 3. connecting -----------------------------------------------------------


@contextlib.contextmanager
def syn_dropping_port() -> Iterator[int]:
    """A listening port whose accept queue is full: Linux drops further SYNs,
    as a firewall or a dead host does."""
    lst = socket.socket()
    fillers: list[socket.socket] = []
    try:
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        port = lst.getsockname()[1]
        for _ in range(64):
            s = socket.socket()
            fillers.append(s)
            s.settimeout(0.2)
            try:
                s.connect(("127.0.0.1", port))
            except (TimeoutError, OSError):
                break
        else:
            pytest.fail("the accept queue never filled")
        yield port
    finally:
        for s in fillers:
            s.close()
        lst.close()


@pytest.mark.asyncio
@IMPLS
@pytest.mark.parametrize("how", ["syn-dropped", "no-tls-answer"])
async def test_a_call_whose_connect_and_handshake_take_too_long_fails(
    certs: Any, impl: str, how: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """open_connection had only an ssl_handshake_timeout: a TCP connect to an
    address that drops SYNs took the kernel's retries (~130 s). Now the
    connect and the handshake together get CONNECT_TIMEOUT_S."""
    need(impl)
    monkeypatch.setattr(_call, "CONNECT_TIMEOUT_S", 0.25, raising=False)
    if how == "syn-dropped":
        with syn_dropping_port() as port:
            result, _ = await run_voice(certs, port, impl, limit=5.0)
    else:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            result, _ = await run_voice(
                certs, server.sockets[0].getsockname()[1], impl, limit=5.0
            )
        finally:
            server.close()
            await server.wait_closed()
    assert result["errors"] == [
        "connect call 0: CallError: TTS service not connected (TCP and TLS) in 0.25 s"
    ]


# -- 5. a keep-alive connection the upstream closed --------------------------


@pytest.mark.asyncio
@IMPLS
@pytest.mark.parametrize("mode", ["close-idle", "reset-next"])
async def test_a_keep_alive_connection_the_upstream_closed_is_opened_again(
    certs: Any, upstream_factory: Any, impl: str, mode: str  # noqa: F811
) -> None:
    """An upstream that closes its idle keep-alive connections (or resets
    one as the next request comes) failed the call with "RemoteProtocolError:
    can't handle event type ConnectionClosed when role=SERVER and
    state=SEND_RESPONSE". Here every connection serves one request only:
    each prompt needs a new connection, and the call plays on."""
    need(impl)
    up = await upstream_factory(mode, prompt_bytes=PER_SECOND // 4)
    result, worker = await run_voice(certs, up.port, impl, duration=0.5)
    assert result["errors"] == []
    call = worker.calls[0]
    assert call.phrases_ok >= 2 and call.phrases_bad == 0
    assert up.connections >= 2 + call.phrases_ok  # health, warm-up, then one per prompt


@pytest.mark.asyncio
@IMPLS
async def test_an_upstream_that_closes_without_answering_is_retried_once(
    certs: Any, upstream_factory: Any, impl: str  # noqa: F811
) -> None:
    """The GET goes once more on a new connection, and no more: a second
    close fails the call with an error that says so."""
    need(impl)
    up = await upstream_factory("close-unanswered")
    result, _ = await run_voice(certs, up.port, impl)
    assert result["errors"] == [
        "call 0: CallError: TTS service closed the connection before answering "
        f"/v1/speech?text={_call.quote(HOSTILE)}&rate={RATE}, on a new connection too"
    ]
    assert up.unanswered == 2


# -- 4. stopping the command line --------------------------------------------


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.asyncio
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", ["TERM", "INT", "KILL"])
async def test_stopping_the_command_line_stops_its_workers(
    certs: Any, upstream_factory: Any, loop_name: str, sig: str  # noqa: F811
) -> None:
    """SIGTERM to ``python -m examples.voice_server --workers 2`` killed the
    parent only: its workers played on, orphans, for the whole run. Ctrl-C
    printed a traceback per process. A killed parent left its workers too.
    Now the parent stops and waits for its workers on SIGTERM and SIGINT,
    says so in one line, and workers exit when their parent is gone."""
    need("slabnet")
    up = await upstream_factory("ok")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "examples.voice_server", "--tts", f"https://127.0.0.1:{up.port}",
        "--ca", str(certs.ca), "--calls", "2", "--workers", "2", "--duration", "60",
        "--loop", loop_name, "--no-progress",
        cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        async with asyncio.timeout(30):
            while not {PHRASES[0], PHRASES[1]} <= set(up.texts):  # both workers play
                await asyncio.sleep(0.05)
            workers = _children(proc.pid)
            assert workers
            if sig == "TERM":
                proc.send_signal(signal.SIGTERM)
            elif sig == "INT":  # a terminal's Ctrl-C: to the whole process group
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.kill()
            assert proc.stderr is not None
            stderr = (await proc.stderr.read()).decode()
            code = await proc.wait()
            while any(_running(pid) for pid in workers):
                await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in workers:  # (orphans, if the test failed)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    if sig == "KILL":
        assert code == -signal.SIGKILL
        return
    signum = signal.Signals[f"SIG{sig}"]
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1:] == [f"voice_server: stopped by {signum.name}"]
    assert code == 128 + signum
