#!/usr/bin/env bash
# The test command: installs what the tests need into .venv, then runs the
# type check, the benchmark smoke run and the test suite (both loops); then
# the core and version-sensitive tests again on Python 3.12, and those and
# the TLS tests on 3.13, where found on the machine (each in its own
# .venv-3.1x). As root, it first installs the
# Debian packages of the real peers (scripts/_peers.sh). Every test runs
# under a time limit (pytest-timeout, from the test extra; pyproject.toml).
# Arguments (-x, -k ...) go to the Python 3.11 pytest run only; the 3.12
# and 3.13 runs take their file lists below as they are.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_peers.sh"
echo "== mypy --strict"
.venv/bin/python -m mypy
echo "== benchmarks --quick (smoke: every scenario executes; no timing asserted)"
.venv/bin/python -m benchmarks --quick --no-plots
echo "== pytest (Python $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'))"
.venv/bin/python -m pytest "$@"

other_tests=(tests/test_slab.py tests/test_streams.py tests/test_write.py
             tests/test_records.py tests/test_tls_engine.py
             tests/test_plugin.py  # Server.wait_closed() waits for connections from 3.12
             tests/test_reader_hardening.py  # tuple separators from 3.13
             tests/test_writer_hardening.py  # Server.close_clients() from 3.13
             tests/test_lifetime.py tests/test_leaks.py  # reference cycles, per version's gc
             tests/test_loop_lifecycle.py  # Server.wait_closed() waits from 3.12
             tests/test_suite_parity.py  # CPython 3.12's own stream tests, ported
             tests/test_unix_streams.py  # cleanup_socket, the socket file by version
             tests/test_fuzz_parity.py)  # tuple separators from 3.13
# On 3.12 those; on 3.13, the same and the TLS layers' files, where its ssl module and
# timing meet the TLS code (the whole suite runs on 3.11; CI stays under 20
# minutes so).
newest_tests=("${other_tests[@]}" tests/test_tls_streams.py tests/test_tls_parity.py
              tests/test_tls_hardening.py tests/test_tls_audit.py tests/test_tls_in_tls.py
              tests/test_starttls_hardening.py  # asyncio's SSLProtocol over slabnet
              tests/test_record_shapes.py tests/test_transport_api.py tests/test_tls_pause.py
              tests/test_limits_audit.py)  # close_clients()/abort_clients() from 3.13
for minor in 3.12 3.13; do
    py=""
    if command -v pyenv >/dev/null; then
        version=$(pyenv versions --bare 2>/dev/null | grep -E "^${minor//./\\.}\.[0-9]+$" | tail -n 1 || true)
        [ -n "$version" ] && py="$(pyenv root)/versions/$version/bin/python$minor"
    fi
    [ -n "$py" ] || py=$(command -v "python$minor" || true)
    # A pyenv shim answers to the name without being runnable: try it.
    if [ -z "$py" ] || ! "$py" -c "import sys" >/dev/null 2>&1; then
        echo "== Python $minor: not installed here, skipped"
        continue
    fi
    venv=".venv-$minor"
    if [ ! -x "$venv/bin/python" ] || [ pyproject.toml -nt "$venv/.slabnet-installed" ]; then
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q -e ".[test]"
        touch "$venv/.slabnet-installed"
    fi
    if [ "$minor" = 3.13 ]; then tests=("${newest_tests[@]}"); else tests=("${other_tests[@]}"); fi
    echo "== pytest on Python $minor: ${tests[*]}"
    "$venv/bin/python" -m pytest -q "${tests[@]}"
done
