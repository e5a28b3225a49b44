"""Runnable examples for slabnet.

``examples.tts_service`` and ``examples.voice_server`` reproduce the production
story of seed 000: a voice server that streams text-to-speech audio over HTTPS,
queues it for seconds and plays it out in real time. ``examples.demo`` runs
both, once on slabnet and once on plain asyncio, and prints them side by side.
See ``examples/README.md``.
"""
