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
    # the echo servers run on a loop of their own: no pytest-asyncio needed
    import socket
    with socket.create_connection(echo_server, timeout=5) as sock:
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"

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
    result.assert_outcomes(passed=3, errors=2)
    # A fixture that needs a missing package names it, when a test uses it.
    assert "slabnet's fixture 'loop_name' needs pytest-asyncio" in out
    assert "slabnet's fixture 'tls_ca' needs trustme" in out
    assert "pip install 'trustme>=1.1'" in out
    # The message alone, not chained to the ImportError behind it.
    assert "During handling of the above exception" not in out


def test_slabnet_loops_without_pytest_asyncio_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run_without(pytester, monkeypatch, "[pytest]\nslabnet_loops = asyncio uvloop\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "slabnet_loops = asyncio uvloop" in err
    assert "needs pytest-asyncio >= 1.4, which is not installed" in err


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


# The echo servers serve any test. They ran as async fixtures on the loop
# pytest-asyncio gave them: function-scoped, so a test on a module- or
# session-scoped loop (loop_scope), a sync test and an anyio test in auto
# mode ran while that loop stood still, and their first read waited forever
# (the connect went through: the kernel's backlog). They now run on a loop of
# their own, in a thread.

INNER_ANY_TEST = '''
import asyncio
import socket
import pytest
import slabnet

async def round_trip(addr, **tls):
    reader, writer = await asyncio.wait_for(slabnet.open_connection(*addr, **tls), 2)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
    writer.close()
    await writer.wait_closed()

@pytest.mark.asyncio(loop_scope="module")
async def test_module_loop(echo_server, tls_echo_server, tls_client_context):
    await round_trip(echo_server)
    await round_trip(tls_echo_server, ssl=tls_client_context, server_hostname="localhost")

@pytest.mark.asyncio(loop_scope="session")
async def test_session_loop(echo_server):
    await round_trip(echo_server)

def test_sync(echo_server, tls_echo_server, tls_client_context):
    with socket.create_connection(echo_server, timeout=2) as sock:
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
    with socket.create_connection(tls_echo_server, timeout=2) as raw:
        with tls_client_context.wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"

@pytest.mark.anyio
async def test_anyio(echo_server):
    import anyio
    with anyio.fail_after(2):
        async with await anyio.connect_tcp(*echo_server) as stream:
            await stream.send(b"ping")
            assert await stream.receive(4) == b"ping"
'''


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_echo_servers_serve_tests_of_any_loop_scope_sync_and_anyio(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytest.importorskip("anyio")
    pytester.makeini(
        f"[pytest]\nasyncio_mode = {mode}\nslabnet_loops = asyncio uvloop\n"
        "asyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.makepyfile(test_inner=INNER_ANY_TEST)
    result = pytester.runpytest_subprocess(
        "-v", "--strict-markers", "-p", "anyio", timeout=INNER_TIMEOUT
    )
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out
    for loop in ("asyncio", "uvloop"):
        assert f"test_module_loop[{loop}] PASSED" in out
        assert f"test_session_loop[{loop}] PASSED" in out
    # A sync test runs once, under its own id.
    assert "test_inner.py::test_sync PASSED" in out
    assert "test_sync[" not in out
    assert "warning" not in out.lower()


# Under slabnet_loops the echo server's loop is of the test's kind.

INNER_SERVER_LOOP = '''
import threading
import pytest

@pytest.mark.asyncio
async def test_server_loop(echo_server, loop_name):
    names = [t.name for t in threading.enumerate() if t.name.startswith("slabnet-echo-server")]
    assert names == [f"slabnet-echo-server ({loop_name})"]
'''


def test_echo_server_runs_on_the_loop_kind_of_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\nasyncio_mode = strict\nslabnet_loops = asyncio uvloop\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_inner=INNER_SERVER_LOOP)
    result = pytester.runpytest_subprocess("-v", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=2)


def _shim(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    """Put files first on the inner run's path, standing in for packages."""
    shim = pytester.mkdir("shim")
    for name, text in files.items():
        (shim / name).parent.mkdir(parents=True, exist_ok=True)
        (shim / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), os.environ["PYTHONPATH"]]))


INNER_SYNC = '''
def test_plain():
    assert 1 + 1 == 2
'''


# uvloop is optional (a dependency on POSIX, but a project can remove it):
# slabnet_loops naming it without it said "unknown loop(s) ['uvloop']".

def test_slabnet_loops_naming_uvloop_without_uvloop_says_it_is_not_installed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _shim(pytester, monkeypatch, {"uvloop/__init__.py": NOT_INSTALLED.format("uvloop")})
    pytester.makepyfile(test_inner=INNER_SYNC)
    pytester.makeini(
        "[pytest]\nslabnet_loops = asyncio uvloop\nasyncio_default_fixture_loop_scope = function\n"
    )
    result = pytester.runpytest_subprocess(timeout=INNER_TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "slabnet_loops = asyncio uvloop: uvloop is not installed (pip install uvloop)"
        in result.stderr.str()
    )
    # The asyncio loop alone needs no uvloop.
    pytester.makeini(
        "[pytest]\nslabnet_loops = asyncio\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-s", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=2)
    assert "RAN-ON asyncio" in result.stdout.str()


# pytest-asyncio before 1.4 has no loop-factory hook. The plugin used to
# parametrize their event_loop_policy fixture instead: it is autouse, so every
# sync test ran once per loop too (ids [asyncio], [uvloop]), and pytest 9
# deprecates a session fixture defined on a plugin object (with pytest 9.2,
# pytest-asyncio 1.3 and -W error every test errored on
# PytestRemovedIn10Warning). slabnet_loops now needs 1.4 and says so; this
# stands in for 1.3 (its entry point loads the stand-in plugin).

OLD_PYTEST_ASYNCIO = {
    "pytest_asyncio/__init__.py": (
        '__version__ = "1.3.0"\n'
        "import pytest\n"
        "def fixture(fixture_function=None, **kwargs):\n"
        "    if fixture_function is None:\n"
        "        return pytest.fixture(**kwargs)\n"
        "    return pytest.fixture(fixture_function, **kwargs)\n"
    ),
    "pytest_asyncio/plugin.py": "# before 1.4: no PytestAsyncioSpecs, no loop-factory hook\n",
}


def test_slabnet_loops_with_pytest_asyncio_before_1_4_is_a_usage_error_naming_the_minimum(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _shim(pytester, monkeypatch, OLD_PYTEST_ASYNCIO)
    pytester.makepyfile(test_inner=INNER_SYNC)
    pytester.makeini("[pytest]\nslabnet_loops = asyncio uvloop\n")
    result = pytester.runpytest_subprocess(timeout=INNER_TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "slabnet_loops = asyncio uvloop needs pytest-asyncio >= 1.4 (its loop-factory hook); "
        "this environment has pytest-asyncio 1.3.0 (pip install 'pytest-asyncio>=1.4')"
        in result.stderr.str()
    )
    # Without slabnet_loops the run goes on as before.
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("-v", "-W", "error", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=1)
    assert "test_inner.py::test_plain PASSED" in result.stdout.str()


# With pytest-asyncio's plugin disabled the loop-factory hook had no spec, and
# registering slabnet's implementation of it ended the run in an
# INTERNALERROR (PluginValidationError: unknown hook).

def test_slabnet_loops_with_pytest_asyncio_disabled_is_a_usage_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_inner=INNER_SYNC)
    pytester.makeini("[pytest]\nslabnet_loops = asyncio uvloop\n")
    result = pytester.runpytest_subprocess("-p", "no:asyncio", timeout=INNER_TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "needs pytest-asyncio's plugin, which is disabled" in result.stderr.str()


def test_no_slabnet_turns_the_plugin_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=INNER_SYNC + "\ndef test_wants_echo_server(echo_server):\n    pass\n"
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_subprocess("-p", "no:slabnet", "-W", "error", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=1, errors=1)
    assert "fixture 'echo_server' not found" in result.stdout.str()


# From Python 3.12 Server.wait_closed() waits for every connection, one in
# its TLS handshake too, which has no handler yet: the echo fixtures abort
# those as well, or a test that connected and never shook hands held the
# teardown until the handshake timed out (60 s). Including a connection the
# server had not made a protocol for yet when the test ended; and the server
# closes only once each has its transport: asyncio's accept task, run after
# Server.close(), fails in Server._attach ("Error on transport creation for
# incoming connection") and leaves the socket unclosed.

INNER_NO_HANDSHAKE = '''
import socket
import pytest

KEEP = []

@pytest.mark.parametrize("i", range(20))  # ends while the server accepts it, at times
def test_connects_and_never_shakes_hands(tls_echo_server, i):
    KEEP.append(socket.create_connection(tls_echo_server, timeout=2))

@pytest.mark.parametrize("i", range(20))
def test_connects_and_sends_nothing(echo_server, i):
    KEEP.append(socket.create_connection(echo_server, timeout=2))

def test_sends_half_a_client_hello(tls_echo_server):
    sock = socket.create_connection(tls_echo_server, timeout=2)
    sock.sendall(b"\\x16\\x03\\x01\\x00\\x05hel")
    KEEP.append(sock)
'''


def test_tls_echo_server_teardown_ends_with_a_handshake_never_finished(
    pytester: pytest.Pytester,
) -> None:
    # The clients' sockets live in KEEP to the end; a server-side one left
    # unclosed is a ResourceWarning when it is collected, an error here.
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.makepyfile(test_inner=INNER_NO_HANDSHAKE)
    # Each test has 5 s here, far below the fixture's own 30 s limit.
    result = pytester.runpytest_subprocess(
        "-p", "timeout", "--timeout", "5", "-rE", timeout=INNER_TIMEOUT
    )
    result.assert_outcomes(passed=41)
