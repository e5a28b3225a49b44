"""slabnet's pytest plugin, run on an inner test suite with pytester."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import asyncio
import pytest
import slabnet

@pytest.mark.asyncio
async def test_loop(loop_name):
    loop = asyncio.get_running_loop()
    assert ("uvloop" in type(loop).__module__) == (loop_name == "uvloop")
    print("RAN-ON", loop_name)

@pytest.mark.asyncio
async def test_tls_echo(tls_echo_server, tls_client_context):
    reader, writer = await slabnet.open_connection(
        *tls_echo_server, ssl=tls_client_context, server_hostname="localhost")
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    writer.close()
    await writer.wait_closed()
'''


def _run(pytester: pytest.Pytester, loops: str) -> pytest.RunResult:
    pytester.makeini(f"[pytest]\nasyncio_mode = strict\nslabnet_loops = {loops}\n"
                     "asyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_subprocess("-v", "-s")


def test_both_loops_give_two_ids_per_test(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "asyncio uvloop")
    result.assert_outcomes(passed=4)
    out = result.stdout.str()
    assert "test_inner.py::test_loop[asyncio]" in out
    assert "test_inner.py::test_loop[uvloop]" in out
    assert result.stdout.str().count("RAN-ON asyncio") == 1
    assert result.stdout.str().count("RAN-ON uvloop") == 1


def test_one_loop_only(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "uvloop")
    result.assert_outcomes(passed=2)
    assert "RAN-ON uvloop" in result.stdout.str()
    assert "RAN-ON asyncio" not in result.stdout.str()


def test_unknown_loop_name_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "asyncio trio")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "slabnet_loops: unknown loop(s) ['trio']" in result.stderr.str()
