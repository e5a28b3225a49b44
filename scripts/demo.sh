#!/usr/bin/env bash
# The main demo: a voice server fetching TTS audio over HTTPS, slabnet vs
# plain asyncio side by side. Extra arguments go to examples.demo.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m examples.demo "$@"
