"""HTTPS text-to-speech service built on slabnet (or asyncio) streams and h11.

Run it with ``python -m examples.tts_service --help``.
"""

from ._server import ServiceConfig, Ticker, TTSService, serve
from ._synth import VOICES, Phrase, PhraseCache, resolve_voice, synthetic_pcm

__all__ = [
    "VOICES",
    "Phrase",
    "PhraseCache",
    "ServiceConfig",
    "TTSService",
    "Ticker",
    "resolve_voice",
    "serve",
    "synthetic_pcm",
]
