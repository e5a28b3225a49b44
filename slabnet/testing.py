"""slabnet's pytest plugin, registered through the ``pytest11`` entry point
under the name ``slabnet`` (``-p no:slabnet`` turns it off).

Running async tests on both loops
---------------------------------
Set ``slabnet_loops = asyncio uvloop`` in the ``[tool.pytest.ini_options]``
(or ``pytest.ini``) of a project that uses pytest-asyncio >= 1.4: every test
marked ``@pytest.mark.asyncio`` (or every async test in auto mode) then runs
once per loop, with ids ``[asyncio]`` and ``[uvloop]``; sync tests run once,
as before. The plugin does it through pytest-asyncio's
``pytest_asyncio_loop_factories`` hook (new in 1.4), so a test can narrow
the list with ``@pytest.mark.asyncio(loop_factories=["uvloop"])``; with a
single loop (and pytest >= 8.4) pytest-asyncio leaves the id out. Without
the option the plugin leaves loop creation to pytest-asyncio's default.

``slabnet_loops`` is a usage error, with a message that says what to change,
when the run cannot honour it: a loop slabnet does not know or the
environment lacks (``uvloop`` not installed), no pytest-asyncio, its plugin
disabled (``-p no:asyncio``), or a pytest-asyncio older than 1.4. Those have
no hook, and the only way in was to override their ``event_loop_policy``
fixture: autouse, so it ran every sync test once per loop too, and pytest 9
deprecates a session fixture defined as a method of a plugin object, as that
override was (an error under ``-W error``). The fixtures below work with any
pytest-asyncio.

Fixtures
--------
``tls_ca``
    a ``trustme.CA`` for the session.
``tls_server_context`` / ``tls_client_context``
    ``ssl.SSLContext``\\ s: a server certificate for ``localhost`` and
    ``127.0.0.1``, and a client that trusts the CA (hostname checks on).
``echo_server`` / ``tls_echo_server``
    a slabnet echo server on 127.0.0.1, plain or TLS, yielding
    ``(host, port)``; it echoes until EOF, then closes. It runs on an event
    loop of its own in a thread, so any test can use it: async tests of any
    loop scope, anyio tests, sync tests with plain sockets. Under
    ``slabnet_loops`` its loop is of the test's kind (``[uvloop]``: uvloop).
    Connections a test left open are aborted when it tears down.
``loop_name``
    ``"asyncio"`` or ``"uvloop"``: the loop the current test runs on (an
    async fixture: pytest-asyncio runs it).

What the plugin needs
---------------------
Installing slabnet registers the plugin in every pytest run of the
environment, so it loads with pytest alone: pytest-asyncio and trustme are
imported only where they are used. Without pytest-asyncio ``loop_name``
fails when a test asks for it, and ``slabnet_loops`` is a usage error;
without trustme the TLS fixtures do; each message names the package to
install.

Closing uvloop
--------------
uvloop's ``Loop.close()`` warns (``ResourceWarning``) about each transport
still open and then closes it, from a libuv callback that cannot raise. Under
``filterwarnings = error`` the warning becomes an exception there, the
callback gives up before closing the handle, and ``close()`` then waits in
libuv forever for a handle nobody closes: the run hangs in the teardown of the
test that leaked the transport. The plugin's uvloop factory therefore records
the warnings of ``close()`` and issues them again once the loop is closed,
where the project's filters apply as usual: the leak fails that test instead
of hanging the run. That includes a test that failed with a connection to an
echo fixture open: the fixture aborts its own end, on its own loop, but the
test's end is on the test's loop, which closes first.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import ssl
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import pytest

try:
    import pytest_asyncio
except ImportError:
    pytest_asyncio = None  # type: ignore[assignment]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
_F = TypeVar("_F", bound=Callable[..., Any])

#: The loops ``slabnet_loops`` can name.
LOOPS = ("asyncio", "uvloop")
#: The oldest pytest-asyncio ``slabnet_loops`` works with: the first with the
#: ``pytest_asyncio_loop_factories`` hook.
MIN_PYTEST_ASYNCIO = (1, 4)
#: Seconds the echo fixtures wait for their server thread to start or stop.
SERVER_THREAD_TIMEOUT = 30.0


def _factories() -> dict[str, LoopFactory]:
    factories: dict[str, LoopFactory] = {"asyncio": asyncio.SelectorEventLoop}
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        pass
    else:
        factories["uvloop"] = _new_uvloop
    return factories


def _new_uvloop() -> asyncio.AbstractEventLoop:
    """A plain ``uvloop.Loop`` whose ``close()`` cannot hang on a warning
    (module docstring, "Closing uvloop")."""
    import uvloop

    loop = uvloop.new_event_loop()
    loop.close = functools.partial(_close_then_warn, loop.close)  # type: ignore[method-assign]
    return loop


def _close_then_warn(close: Callable[[], None]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        close()
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "slabnet_loops",
        "event loops to run each async test on (asyncio, uvloop)",
        type="args",
        default=[],
    )


def _pytest_asyncio_version() -> str:
    return str(getattr(pytest_asyncio, "__version__", "unknown"))


def _pytest_asyncio_active(config: pytest.Config) -> bool:
    """Whether pytest-asyncio's plugin is registered in this run (it is not
    under ``-p no:asyncio``, though the module imports)."""
    return any(
        getattr(plugin, "__name__", None) == "pytest_asyncio.plugin"
        for plugin in config.pluginmanager.get_plugins()
    )


def pytest_configure(config: pytest.Config) -> None:
    names = config.getini("slabnet_loops")
    if not names:
        return
    setting = f"slabnet_loops = {' '.join(names)}"
    unknown = [n for n in names if n not in LOOPS]
    if unknown:
        raise pytest.UsageError(
            f"slabnet_loops: unknown loop(s) {unknown}; slabnet_loops takes: {', '.join(LOOPS)}"
        )
    available = _factories()
    missing = [n for n in names if n not in available]
    if missing:
        raise pytest.UsageError(
            f"{setting}: {', '.join(missing)} is not installed (pip install "
            f"{' '.join(missing)}), or leave it out of slabnet_loops"
        )
    minimum = ".".join(map(str, MIN_PYTEST_ASYNCIO))
    if pytest_asyncio is None:
        raise pytest.UsageError(
            f"{setting}: running async tests on chosen loops needs pytest-asyncio "
            f">= {minimum}, which is not installed (pip install 'pytest-asyncio>={minimum}')"
        )
    version = _pytest_asyncio_version()
    if not _has_loop_factories_hook():
        raise pytest.UsageError(
            f"{setting} needs pytest-asyncio >= {minimum} (its loop-factory hook); this "
            f"environment has pytest-asyncio {version} (pip install 'pytest-asyncio>={minimum}')"
        )
    if not _pytest_asyncio_active(config):
        raise pytest.UsageError(
            f"{setting} needs pytest-asyncio's plugin, which is disabled in this "
            "run (-p no:asyncio?)"
        )
    chosen = {n: available[n] for n in names}
    config.pluginmanager.register(_LoopFactories(chosen), "slabnet-loops")


def _has_loop_factories_hook() -> bool:
    try:
        from pytest_asyncio.plugin import PytestAsyncioSpecs
    except ImportError:
        return False
    return hasattr(PytestAsyncioSpecs, "pytest_asyncio_loop_factories")


class _LoopFactories:
    """Registered only when ``slabnet_loops`` asks for it."""

    def __init__(self, factories: dict[str, LoopFactory]) -> None:
        self._factories = factories

    @pytest.hookimpl
    def pytest_asyncio_loop_factories(
        self, config: pytest.Config, item: pytest.Item
    ) -> Mapping[str, LoopFactory]:
        return self._factories


def _test_loop_name(request: pytest.FixtureRequest) -> str:
    """The loop ``slabnet_loops`` gave the requesting test, or "asyncio"."""
    callspec = getattr(request.node, "callspec", None)
    params: dict[str, object] = getattr(callspec, "params", {})
    factory = params.get("_asyncio_loop_factory")  # pytest-asyncio's parameter
    for name, known in _factories().items():
        if factory is known:
            return name
    return "asyncio"


def _missing(fixture: str, package: str, requirement: str) -> NoReturn:
    pytest.fail(
        f"slabnet's fixture {fixture!r} needs {package}, which is not installed "
        f"(pip install '{requirement}')",
        pytrace=False,
    )


def _async_fixture(func: _F) -> _F:
    """``pytest_asyncio.fixture``, or without pytest-asyncio a fixture of the
    same name that fails, naming the package, when a test asks for it."""
    if pytest_asyncio is not None:
        return pytest_asyncio.fixture(func)  # type: ignore[return-value]

    def unavailable() -> NoReturn:
        _missing(func.__name__, "pytest-asyncio", "pytest-asyncio")

    unavailable.__doc__ = func.__doc__
    return pytest.fixture(name=func.__name__)(unavailable)


@_async_fixture
async def loop_name() -> str:
    """Name of the running loop: ``asyncio`` or ``uvloop``."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


@pytest.fixture(scope="session")
def tls_ca() -> Any:
    """A ``trustme.CA`` for the session."""
    try:
        trustme = importlib.import_module("trustme")
    except ImportError:
        trustme = None
    if trustme is None:  # outside the except: the message alone, no chained ImportError
        _missing("tls_ca", "trustme", "trustme>=1.1")
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_server_context(tls_ca: Any) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.issue_cert("localhost", "127.0.0.1").configure_cert(ctx)
    return ctx


@pytest.fixture(scope="session")
def tls_client_context(tls_ca: Any) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    tls_ca.configure_trust(ctx)
    return ctx


class _EchoServer:
    """A slabnet echo server on a loop of its own, in a thread: it serves
    whatever loop the test runs on, or none (a sync test), and whichever
    plugin runs the test. ``stop()`` aborts the connections a test left
    open: from Python 3.12 ``Server.wait_closed()`` waits for every
    connection, so a test that failed before closing its own would otherwise
    hang the teardown."""

    def __init__(self, ssl_context: ssl.SSLContext | None, loop_name: str) -> None:
        self._ssl = ssl_context
        self._factory = _factories()[loop_name]
        self._ready = threading.Event()
        self._address: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"slabnet-echo-server ({loop_name})", daemon=True
        )

    def start(self) -> tuple[str, int]:
        self._thread.start()
        if not self._ready.wait(SERVER_THREAD_TIMEOUT):
            pytest.fail(f"slabnet's echo server did not start in {SERVER_THREAD_TIMEOUT} s")
        if self._error is not None:
            raise self._error
        assert self._address is not None
        return self._address

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has closed: the server is gone
                pass
        self._thread.join(SERVER_THREAD_TIMEOUT)
        if self._thread.is_alive():
            pytest.fail(f"slabnet's echo server did not stop in {SERVER_THREAD_TIMEOUT} s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            loop = self._factory()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
            loop.run_until_complete(loop.shutdown_asyncgens())
        except BaseException as exc:
            self._error = exc
        finally:
            try:
                loop.close()
            except BaseException as exc:  # a warning made an error (uvloop)
                if self._error is None:
                    self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        # slabnet.start_server's own parts, to see each connection from its
        # start: one still in its TLS handshake has no handler yet, and from
        # Python 3.12 Server.wait_closed() waits for it too.
        from slabnet._streams import _DEFAULT_LIMIT, _server_factory
        from slabnet._transport import SlabProtocol, _abort_ours_first

        self._stop = asyncio.Event()
        protocols: set[SlabProtocol] = set()
        handlers: set[asyncio.Task[Any]] = set()

        async def echo(reader: Any, writer: Any) -> None:
            task = asyncio.current_task()
            if task is not None:
                handlers.add(task)
            try:
                async for chunk in reader.chunks():
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                writer.close()

        make_protocol = _server_factory(echo, _DEFAULT_LIMIT, self._ssl, None, None, True)

        def factory() -> SlabProtocol:
            protocol = make_protocol()
            protocols.add(protocol)
            return protocol

        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, "127.0.0.1", 0)
        _abort_ours_first(server)
        try:
            host, port = server.sockets[0].getsockname()[:2]
            self._address = (host, port)
            self._ready.set()
            await self._stop.wait()
        finally:
            await self._abort_all(server, protocols)
            if handlers:
                await asyncio.wait(handlers, timeout=SERVER_THREAD_TIMEOUT)

    @staticmethod
    async def _abort_all(server: asyncio.Server, protocols: set[Any]) -> None:
        """Abort every connection, then close the server.

        Connections the test made are in the kernel's accept queue or
        accepted already; each gets its protocol, then its transport, over a
        few loop iterations. The server stays open until all have theirs and
        are aborted: asyncio's accept task, when it runs after ``close()``,
        fails in ``Server._attach`` and leaves the socket unclosed
        (``ResourceWarning``). From Python 3.12 ``wait_closed()`` waits for
        every connection, a TLS one still in its handshake too (no handler
        yet): the sweep goes on until it returns."""

        def sweep() -> bool:
            """Abort what has a transport; whether all had one."""
            for protocol in protocols - aborted:
                transport = protocol._transport or protocol._raw
                if transport is not None:
                    transport.abort()
                    aborted.add(protocol)
            return aborted == protocols

        aborted: set[Any] = set()
        quiet = 0
        while quiet < 3:  # loop iterations with nothing new to abort
            quiet = quiet + 1 if sweep() else 0
            await asyncio.sleep(0)
        server.close()
        closing = asyncio.ensure_future(server.wait_closed())
        while not closing.done():
            sweep()
            await asyncio.wait({closing}, timeout=0.01)
        closing.result()


def _serve(
    request: pytest.FixtureRequest, ssl_context: ssl.SSLContext | None
) -> Iterator[tuple[str, int]]:
    server = _EchoServer(ssl_context, _test_loop_name(request))
    address = server.start()
    try:
        yield address
    finally:
        server.stop()


@pytest.fixture
def echo_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """``(host, port)`` of a slabnet echo server (module docstring)."""
    yield from _serve(request, None)


@pytest.fixture
def tls_echo_server(
    request: pytest.FixtureRequest, tls_server_context: ssl.SSLContext
) -> Iterator[tuple[str, int]]:
    """``(host, port)`` of a slabnet TLS echo server (module docstring)."""
    yield from _serve(request, tls_server_context)
