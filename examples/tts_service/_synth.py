"""Speech synthesis for the TTS service, with a per-process phrase cache.

Two voices:

* ``espeak-ng``: real speech from the espeak-ng command line program (the
  Debian package of the same name). It writes 22050 Hz WAV; we resample to
  the rate asked for (8 or 16 kHz) with a windowed-sinc low-pass filter.
* ``synthetic``: a deterministic, speech-like signal computed from the text
  alone (one short voiced tone per letter, pauses at spaces and
  punctuation). The receiver can recompute it, which is what the tests do to
  check that the audio arrived byte for byte.

``auto`` picks espeak-ng when the program is installed. Every phrase is
synthesized once per (text, rate) and then served from memory, as TTS
frontends cache their prompts.

Synthesis is CPU work in pure Python (the synthetic voice: ~0.7 s for 1000
letters at 16 kHz) that holds the GIL. Run in threads of the serving
process, it starves that process's event loop: every time the loop thread
gives up the GIL for a system call it waits up to the switch interval (5 ms)
to get it back, and the audio of every response is late. So a PhraseCache
runs at most ``jobs`` syntheses at a time, in the executor it is given (the
service gives it a process pool of that many workers); the others wait their
turn in the cache, where one that nobody waits for any more is dropped
before it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import math
import shutil
import subprocess
import sys
import tempfile
import wave
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .._common import SAMPLE_RATES, SAMPLE_WIDTH

__all__ = ["VOICES", "Phrase", "PhraseCache", "espeak_pcm", "resolve_voice", "synthetic_pcm"]

VOICES = ("auto", "espeak-ng", "synthetic")

# Words per minute for espeak-ng: its default is 175; 160 sounds like an IVR.
ESPEAK_WPM = 160


@dataclasses.dataclass(frozen=True)
class Phrase:
    text: str
    rate: int
    pcm: bytes  # s16le mono
    source: str  # "espeak-ng" or "synthetic"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.pcm).hexdigest()

    @property
    def seconds(self) -> float:
        return len(self.pcm) / (self.rate * SAMPLE_WIDTH)


def resolve_voice(voice: str) -> str:
    if voice not in VOICES:
        raise ValueError(f"unknown voice {voice!r}; choose from {VOICES}")
    if voice == "auto":
        return "espeak-ng" if shutil.which("espeak-ng") else "synthetic"
    if voice == "espeak-ng" and not shutil.which("espeak-ng"):
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    return voice


def _to_s16le(samples: array[int]) -> bytes:
    if sys.byteorder == "big":
        samples = array("h", samples)
        samples.byteswap()
    return samples.tobytes()


# --------------------------------------------------------------------------
# Synthetic voice

# Each letter is one 70 ms voiced segment; a space or punctuation mark is a
# pause. At ~14 characters per second that is an ordinary speaking rate.
_SEGMENT_S = 0.07
_PAUSE_S = {" ": 0.07, ",": 0.2, ".": 0.35, "?": 0.35, "!": 0.35, ";": 0.25, ":": 0.25}


def synthetic_pcm(text: str, rate: int) -> bytes:
    """Deterministic speech-like PCM for ``text`` (s16le mono at ``rate``).

    Only integer arithmetic on the output side and a fixed formula per letter,
    so the same text gives the same bytes on every machine.
    """
    if rate not in SAMPLE_RATES:
        raise ValueError(f"rate must be one of {SAMPLE_RATES}, not {rate}")
    out = array("h")
    seg = int(_SEGMENT_S * rate)
    for ch in text:
        pause = _PAUSE_S.get(ch)
        if pause is not None or not ch.isprintable():
            out.extend(array("h", [0]) * int((pause or _SEGMENT_S) * rate))
            continue
        # (The first letter of the lower case: "İ".lower() is "i" and a
        # combining dot, two characters.)
        code = ord(ch.lower()[0])
        f0 = 95 + (code * 37) % 130  # pitch 95..224 Hz
        formant = 500 + (code * 113) % 1800  # a crude vowel colour
        for i in range(seg):
            t = i / rate
            env = math.sin(math.pi * i / seg)  # smooth on/off, no clicks
            v = (
                0.55 * math.sin(2 * math.pi * f0 * t)
                + 0.25 * math.sin(4 * math.pi * f0 * t)
                + 0.2 * math.sin(2 * math.pi * formant * t)
            )
            out.append(int(round(9000 * env * v)))
    return _to_s16le(out)


# --------------------------------------------------------------------------
# espeak-ng voice


def _resample(samples: array[int], src: int, dst: int) -> array[int]:
    """Resample 16-bit samples from ``src`` Hz to ``dst`` Hz."""
    try:
        import numpy as np
    except ImportError:  # linear interpolation only; aliasing, but audible
        n = int(len(samples) * dst / src)
        out = array("h")
        for i in range(n):
            pos = i * src / dst
            j = int(pos)
            frac = pos - j
            a = samples[j]
            b = samples[j + 1] if j + 1 < len(samples) else a
            out.append(int(a + (b - a) * frac))
        return out
    x = np.frombuffer(samples.tobytes(), dtype=np.int16).astype(np.float64)
    # Low-pass at 90% of the new Nyquist frequency: 101-tap windowed sinc.
    cutoff = 0.9 * (dst / 2) / src
    taps = np.arange(-50, 51)
    h = 2 * cutoff * np.sinc(2 * cutoff * taps) * np.hamming(len(taps))
    y = np.convolve(x, h / h.sum(), mode="same")
    n = int(len(x) * dst / src)
    z = np.interp(np.arange(n) * (src / dst), np.arange(len(y)), y)
    return array("h", np.clip(np.round(z), -32768, 32767).astype(np.int16).tobytes())


def espeak_pcm(text: str, rate: int) -> bytes:
    """Speak ``text`` with espeak-ng and return s16le mono PCM at ``rate``."""
    with tempfile.TemporaryDirectory(prefix="tts-") as tmp:
        wav_path = Path(tmp) / "out.wav"
        # The text goes in a file, not on the command line: there, a client's
        # "-w/some/path" would be read as an option (espeak-ng's getopt takes
        # options after operands), and a NUL could not be passed at all.
        text_path = Path(tmp) / "text.txt"
        text_path.write_text(text, encoding="utf-8")
        subprocess.run(
            ["espeak-ng", "-v", "en-us", "-s", str(ESPEAK_WPM), "-w", str(wav_path),
             "-f", str(text_path)],
            check=True,
            capture_output=True,
            timeout=30,
        )
        with wave.open(str(wav_path), "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise RuntimeError("espeak-ng produced unexpected WAV format")
            src_rate = w.getframerate()
            samples = array("h")
            samples.frombytes(w.readframes(w.getnframes()))
    if sys.byteorder == "big":
        samples.byteswap()
    if src_rate != rate:
        samples = _resample(samples, src_rate, rate)
    return _to_s16le(samples)


# --------------------------------------------------------------------------
# Cache


#: Audio a PhraseCache keeps, at most (the warm phrase list takes about 2 MiB).
CACHE_BYTES = 32 * 1024 * 1024
#: Syntheses a PhraseCache runs at once: one CPU core's worth. The service
#: shares its machine with the clients (the demo runs the voice server on
#: the same cores), and a queue of texts goes no faster for running them
#: side by side on a core or two.
SYNTH_JOBS = 1


class PhraseCache:
    """Synthesize each (text, rate) once; concurrent requests share the work.

    At most ``max_bytes`` of audio stay cached; the phrases used least
    recently are dropped first. The clients pick the texts, so a cache
    without a bound would grow by a few MB for each new one they ask for.

    A synthesis that every request for it gave up on (its clients went
    away) is cancelled: if it has not started, it never runs. Otherwise a
    client could queue up any amount of work (a second of CPU per long
    text) by asking for new texts and hanging up, and the requests behind
    it would wait for all of it.

    At most ``jobs`` syntheses run at once, in ``executor`` (None: the
    loop's default thread pool). One that was given up on after it started
    runs to its end (a thread cannot be stopped midway), and its slot is
    taken until then."""

    def __init__(
        self,
        voice: str = "auto",
        max_bytes: int = CACHE_BYTES,
        jobs: int = SYNTH_JOBS,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self.voice = resolve_voice(voice)
        self.max_bytes = max_bytes
        self.executor = executor
        self.running = 0  # syntheses started and not yet ended
        self._slots = asyncio.Semaphore(jobs)
        self.cached_bytes = 0  # of the phrases made and still cached
        self._sizes: dict[tuple[str, int], int] = {}  # their sizes
        self._phrases: OrderedDict[tuple[str, int], asyncio.Future[Phrase]] = OrderedDict()
        self._waiting: dict[tuple[str, int], int] = {}  # requests awaiting a phrase being made

    def synthesize(self, text: str, rate: int) -> Phrase:
        """Blocking synthesis, no cache."""
        if rate not in SAMPLE_RATES:
            raise ValueError(f"rate must be one of {SAMPLE_RATES}, not {rate}")
        if self.voice == "espeak-ng":
            pcm = espeak_pcm(text, rate)
        else:
            pcm = synthetic_pcm(text, rate)
        return Phrase(text, rate, pcm, self.voice)

    async def get(self, text: str, rate: int) -> Phrase:
        key = (text, rate)
        fut = self._phrases.get(key)
        if fut is None or fut.cancelled():  # (given up on, and not yet forgotten)
            fut = asyncio.ensure_future(self._make(text, rate))
            self._phrases[key] = fut
            fut.add_done_callback(lambda done: self._made(key, done))
        else:
            self._phrases.move_to_end(key)
        if fut.done():
            return fut.result()
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            return await asyncio.shield(fut)
        finally:
            left = self._waiting[key] = self._waiting[key] - 1
            if not left:
                del self._waiting[key]
                if not fut.done():
                    fut.cancel()  # (one already running finishes, unused)

    async def _make(self, text: str, rate: int) -> Phrase:
        await self._slots.acquire()  # (cancelled while it waits here, it never runs)
        self.running += 1
        job = asyncio.get_running_loop().run_in_executor(
            self.executor, self.synthesize, text, rate
        )
        job.add_done_callback(self._job_done)
        return await asyncio.shield(job)  # (cancelled, the job runs on, unused)

    def _job_done(self, job: asyncio.Future[Phrase]) -> None:
        self.running -= 1
        self._slots.release()

    def __reduce__(self) -> tuple[Any, ...]:
        # What a process pool sends its worker with each job (the bound
        # method self.synthesize): a cache of the same voice, empty.
        return (PhraseCache, (self.voice,))

    def _made(self, key: tuple[str, int], fut: asyncio.Future[Phrase]) -> None:
        if self._phrases.get(key) is not fut:
            return
        if fut.cancelled() or fut.exception() is not None:
            del self._phrases[key]  # let a later request retry
            return
        size = self._sizes[key] = len(fut.result().pcm)
        self.cached_bytes += size
        for old in list(self._phrases):
            if self.cached_bytes <= self.max_bytes:
                break
            if old in self._sizes:  # (one still being made counts once it is)
                del self._phrases[old]
                self.cached_bytes -= self._sizes.pop(old)

    def __len__(self) -> int:
        return len(self._phrases)
