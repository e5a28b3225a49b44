"""Runnable examples for slabnet.

``examples.tts_service`` and ``examples.voice_server`` reproduce the production
case behind slabnet's exact-size chunks: a voice server that streams
text-to-speech audio over HTTPS, queues it for seconds and plays it out in
real time, so every chunk it keeps must pin only its own bytes. ``examples.demo`` runs
both, once on slabnet and once on plain asyncio, and prints them side by side.
See ``examples/README.md``.
"""
