"""slabnet's pytest plugin, run on an inner test suite with pytester.

The inner runs are subprocesses that import the same slabnet as this run
(``_use_this_slabnet``), each with a time limit: a hang fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import slabnet

pytest_plugins = ["pytester"]

# Seconds for one inner pytest run: each takes about 3 s; below the per-test
# timeout (pyproject.toml), so a hang fails the test that saw it.
INNER_TIMEOUT = 30


@pytest.fixture(autouse=True)
def _use_this_slabnet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner pytest loads the plugin of the slabnet this run imports (a
    worktree, not only whatever ``pip install -e`` pointed at)."""
    root = str(Path(slabnet.__file__).resolve().parent.parent)
    path = [root, os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))


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
    return pytester.runpytest_subprocess("-v", "-s", timeout=INNER_TIMEOUT)


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


def test_registers_no_marker(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("--markers", timeout=INNER_TIMEOUT)
    assert result.ret == pytest.ExitCode.OK
    assert "slabnet" not in result.stdout.str()


# Without pytest-asyncio and trustme: installing slabnet registers the plugin
# in every pytest run of the environment, so it must load with pytest alone
# (it used to import pytest_asyncio at load: "Error while loading plugin").

# Put first on the path, these stand in for the packages, and importing them
# fails the way importing a package that is not installed does. (A finder
# on sys.meta_path would not do: pytest's assertion rewriting finds its
# plugins' modules, pytest_asyncio among them, ahead of it.)
NOT_INSTALLED = 'raise ModuleNotFoundError("No module named {0!r}", name={0!r})\n'


INNER_WITHOUT = '''
import pytest

def test_plain():
    assert 1 + 1 == 2

def test_the_packages_are_hidden():
    with pytest.raises(ImportError):
        import pytest_asyncio
    with pytest.raises(ImportError):
        import trustme

def test_wants_echo_server(echo_server):
    pass

def test_wants_loop_name(loop_name):
    pass

def test_wants_tls_client_context(tls_client_context):
    pass
'''


def _run_without(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ini: str
) -> pytest.RunResult:
    """An inner run where pytest-asyncio and trustme cannot be imported
    (NOT_INSTALLED), and ``-p no:asyncio`` stands for the pytest11 entry
    point that pytest-asyncio, not installed, would not have."""
    shim = pytester.mkdir("hide_packages")
    (shim / "pytest_asyncio").mkdir()
    (shim / "pytest_asyncio" / "__init__.py").write_text(NOT_INSTALLED.format("pytest_asyncio"))
    (shim / "trustme.py").write_text(NOT_INSTALLED.format("trustme"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), os.environ["PYTHONPATH"]]))
    pytester.makeini(ini)
    pytester.makepyfile(test_inner=INNER_WITHOUT)
    return pytester.runpytest_subprocess("-p", "no:asyncio", "-rE", timeout=INNER_TIMEOUT)


def test_plugin_loads_without_pytest_asyncio_and_trustme(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run_without(pytester, monkeypatch, "[pytest]\n")
    out = result.stdout.str()
    assert "Error while loading plugin" not in out + result.stderr.str()
    result.assert_outcomes(passed=2, errors=3)
    # A fixture that needs a missing package names it, when a test uses it.
    assert "slabnet's fixture 'echo_server' needs pytest-asyncio" in out
    assert "slabnet's fixture 'loop_name' needs pytest-asyncio" in out
    assert "slabnet's fixture 'tls_ca' needs trustme" in out
    assert "pip install 'trustme>=1.1'" in out


def test_slabnet_loops_without_pytest_asyncio_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run_without(pytester, monkeypatch, "[pytest]\nslabnet_loops = asyncio uvloop\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "slabnet_loops = asyncio uvloop" in err
    assert "needs pytest-asyncio" in err


# A uvloop transport left open must fail its test, not hang the run: under
# filterwarnings = error, uvloop's close() turned its own ResourceWarning
# into an exception inside a libuv callback, which then never closed the
# handle, and close() waited for it forever.

INNER_LEAK = '''
import asyncio
import pytest

KEEP = []  # the transport outlives the test: only the loop's close() sees it

@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("fail", [False, True], ids=["passes", "fails"])
async def test_leaves_a_transport_open(fail):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    KEEP.append(transport)
    server.close()
    assert not fail, "failed with the transport open"
'''


def test_uvloop_transport_left_open_fails_the_test_instead_of_hanging(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(
        "[pytest]\nasyncio_mode = strict\nslabnet_loops = asyncio uvloop\n"
        "asyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.makepyfile(test_inner=INNER_LEAK)
    # No per-test timeout inside: the inner run must end by itself.
    result = pytester.runpytest_subprocess("-p", "no:timeout", "-rfE", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=1, failed=1, errors=2)
    out = result.stdout.str()
    assert "failed with the transport open" in out
    assert out.count("ResourceWarning: unclosed resource <TCPTransport") >= 2


# From Python 3.12 Server.wait_closed() waits for every connection: the echo
# fixtures abort what a failed test left open, so their teardown ends.

INNER_ECHO_LEFT_OPEN = '''
import pytest
import slabnet

KEEP = []

@pytest.mark.asyncio
async def test_fails_with_a_connection_open(echo_server):
    reader, writer = await slabnet.open_connection(*echo_server)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    KEEP.append(writer)
    assert False, "failed with the connection open"
'''


def test_echo_server_teardown_ends_when_a_test_left_its_connection_open(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(
        "[pytest]\nasyncio_mode = strict\nslabnet_loops = asyncio uvloop\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = ignore::ResourceWarning\n"
    )
    pytester.makepyfile(test_inner=INNER_ECHO_LEFT_OPEN)
    result = pytester.runpytest_subprocess("-p", "no:timeout", "-rfE", timeout=INNER_TIMEOUT)
    result.assert_outcomes(failed=2)
    assert result.stdout.str().count("failed with the connection open") >= 2
