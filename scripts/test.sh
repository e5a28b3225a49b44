#!/usr/bin/env bash
# The test command: installs what the tests need into .venv, then runs the
# type check, the test suite (both loops) and the benchmark smoke run.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
echo "== mypy --strict"
.venv/bin/python -m mypy
echo "== benchmarks --quick (smoke: every scenario executes; no timing asserted)"
.venv/bin/python -m benchmarks --quick
echo "== pytest"
.venv/bin/python -m pytest "$@"
