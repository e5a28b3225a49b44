"""slabnet's pytest plugin, registered through the ``pytest11`` entry point.

Running async tests on both loops
---------------------------------
Set ``slabnet_loops = asyncio uvloop`` in the ``[tool.pytest.ini_options]``
(or ``pytest.ini``) of a project that uses pytest-asyncio >= 1.5: every test
marked ``@pytest.mark.asyncio`` (or every async test in auto mode) then runs
once per loop, with ids ``[asyncio]`` and ``[uvloop]``. Without the option
the plugin leaves loop creation to pytest-asyncio's default. A test can
narrow the list with ``@pytest.mark.asyncio(loop_factories=["uvloop"])``.
With pytest-asyncio 1.0 to 1.4, which lack the loop-factory hook, the plugin
parametrizes their ``event_loop_policy`` fixture instead (same ids).

Fixtures
--------
``tls_ca``
    a ``trustme.CA`` for the session.
``tls_server_context`` / ``tls_client_context``
    ``ssl.SSLContext``\\ s: a server certificate for ``localhost`` and
    ``127.0.0.1``, and a client that trusts the CA (hostname checks on).
``echo_server`` / ``tls_echo_server``
    a slabnet echo server on 127.0.0.1, plain or TLS, yielding
    ``(host, port)``; it echoes until EOF, then closes.
``loop_name``
    ``"asyncio"`` or ``"uvloop"``: the loop the current test runs on.

What the plugin needs
---------------------
Installing slabnet registers the plugin in every pytest run of the
environment, so it loads with pytest alone: pytest-asyncio and trustme are
imported only where they are used. Without pytest-asyncio the async fixtures
(``loop_name``, ``echo_server``, ``tls_echo_server``) fail when a test asks
for them, and ``slabnet_loops`` is a usage error; without trustme the TLS
fixtures do; each message names the package to install.

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
of hanging the run.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn, TypeVar

import pytest

try:
    import pytest_asyncio
except ImportError:
    pytest_asyncio = None  # type: ignore[assignment]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
_F = TypeVar("_F", bound=Callable[..., Any])


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


def pytest_configure(config: pytest.Config) -> None:
    names = config.getini("slabnet_loops")
    available = _factories()
    unknown = [n for n in names if n not in available]
    if unknown:
        raise pytest.UsageError(
            f"slabnet_loops: unknown loop(s) {unknown}; available: {sorted(available)}"
        )
    if not names:
        return
    if pytest_asyncio is None:
        raise pytest.UsageError(
            f"slabnet_loops = {' '.join(names)}: running async tests on chosen loops "
            "needs pytest-asyncio (pip install 'pytest-asyncio>=1.5')"
        )
    chosen = {n: available[n] for n in names}
    if _has_loop_factories_hook():
        config.pluginmanager.register(_LoopFactories(chosen), "slabnet-loops")
    else:
        # pytest-asyncio 1.0 to 1.4: parametrize its event_loop_policy fixture.
        config.pluginmanager.register(_loop_policies(chosen), "slabnet-loops")


def _has_loop_factories_hook() -> bool:
    try:
        from pytest_asyncio.plugin import PytestAsyncioSpecs
    except ImportError:
        return False
    return hasattr(PytestAsyncioSpecs, "pytest_asyncio_loop_factories")


class _FactoryPolicy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, factory: LoopFactory) -> None:
        super().__init__()
        self._factory = factory

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return self._factory()


def _loop_policies(factories: dict[str, LoopFactory]) -> object:
    """The same choice for pytest-asyncio < 1.5, through event_loop_policy."""
    names = list(factories)

    class LoopPolicies:
        @pytest.fixture(scope="session", params=names, ids=names)
        def event_loop_policy(
            self, request: pytest.FixtureRequest
        ) -> asyncio.AbstractEventLoopPolicy:
            return _FactoryPolicy(factories[request.param])

    return LoopPolicies()


class _LoopFactories:
    """Registered only when ``slabnet_loops`` asks for it."""

    def __init__(self, factories: dict[str, LoopFactory]) -> None:
        self._factories = factories

    @pytest.hookimpl
    def pytest_asyncio_loop_factories(
        self, config: pytest.Config, item: pytest.Item
    ) -> Mapping[str, LoopFactory]:
        return self._factories


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
        _missing(func.__name__, "pytest-asyncio", "pytest-asyncio>=1.5")

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
        import trustme
    except ImportError:
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


async def _serve(ssl_context: ssl.SSLContext | None) -> AsyncIterator[tuple[str, int]]:
    """Serve echo until the fixture's teardown, which aborts the connections a
    test left open: from Python 3.12 ``Server.wait_closed()`` waits for every
    connection, so a test that failed before closing its own would otherwise
    hang the teardown."""
    import slabnet

    open_writers: set[Any] = set()

    async def echo(reader: Any, writer: Any) -> None:
        open_writers.add(writer)
        try:
            async for chunk in reader.chunks():
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            open_writers.discard(writer)
            writer.close()

    server = await slabnet.start_server(echo, "127.0.0.1", 0, ssl=ssl_context)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        yield host, port
    finally:
        server.close()
        for writer in list(open_writers):
            writer.transport.abort()
        await server.wait_closed()


@_async_fixture
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    async for addr in _serve(None):
        yield addr


@_async_fixture
async def tls_echo_server(tls_server_context: ssl.SSLContext) -> AsyncIterator[tuple[str, int]]:
    async for addr in _serve(tls_server_context):
        yield addr
