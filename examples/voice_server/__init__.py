"""Voice server simulation: N calls stream TTS audio over HTTPS and play it out.

Run it with ``python -m examples.voice_server --help``.
"""

from ._call import Call, CallError
from ._report import format_table, summarize
from ._worker import VoiceConfig, Worker

__all__ = ["Call", "CallError", "VoiceConfig", "Worker", "format_table", "summarize"]
