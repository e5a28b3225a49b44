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
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
import pytest_asyncio

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _factories() -> dict[str, LoopFactory]:
    factories: dict[str, LoopFactory] = {"asyncio": asyncio.SelectorEventLoop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "slabnet_loops",
        "event loops to run each async test on (asyncio, uvloop)",
        type="args",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slabnet_slow: long slabnet soak tests")
    names = config.getini("slabnet_loops")
    available = _factories()
    unknown = [n for n in names if n not in available]
    if unknown:
        raise pytest.UsageError(
            f"slabnet_loops: unknown loop(s) {unknown}; available: {sorted(available)}"
        )
    if not names:
        return
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


@pytest_asyncio.fixture
async def loop_name() -> str:
    """Name of the running loop: ``asyncio`` or ``uvloop``."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


@pytest.fixture(scope="session")
def tls_ca() -> Any:
    import trustme

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


async def _echo(reader: Any, writer: Any) -> None:
    try:
        async for chunk in reader.chunks():
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _serve(ssl_context: ssl.SSLContext | None) -> AsyncIterator[tuple[str, int]]:
    import slabnet

    server = await slabnet.start_server(_echo, "127.0.0.1", 0, ssl=ssl_context)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        yield host, port
    finally:
        server.close()
        await server.wait_closed()


@pytest_asyncio.fixture
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    async for addr in _serve(None):
        yield addr


@pytest_asyncio.fixture
async def tls_echo_server(tls_server_context: ssl.SSLContext) -> AsyncIterator[tuple[str, int]]:
    async for addr in _serve(tls_server_context):
        yield addr
