"""httpx on slabnet: ``AsyncSlabnetTransport``.

The one-liner::

    client = httpx.AsyncClient(transport=AsyncSlabnetTransport())

``httpx.AsyncHTTPTransport`` takes no network backend, so this transport
builds its own ``httpcore.AsyncConnectionPool`` over
``slabnet.contrib.httpcore.SlabnetBackend`` and does what httpx's own does
around it, with httpx's public API only: an ``httpx.Request`` becomes an
``httpcore.Request`` (method, URL parts, raw headers, the body stream and
the extensions, which carry the timeouts), the ``httpcore.Response`` becomes
an ``httpx.Response`` whose stream maps errors while it is read, and every
httpcore exception becomes the httpx exception of the same name, with the
same message, raised from it.

HTTP/1.1 only (keep-alive and streamed bodies). The pool options are
httpx's: ``verify`` (an ``ssl.SSLContext``, or True/False), ``limits``,
``trust_env`` (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when ``verify`` is
True), ``uds``, ``local_address``, ``retries`` (connection attempts),
``socket_options``, and ``proxy``: an ``http://`` or ``https://`` proxy (a
URL, or an ``httpx.Proxy`` with its auth, headers and TLS context). Plain
``http://`` requests go to the proxy in absolute form; ``https://`` ones
through a CONNECT tunnel, their TLS started on slabnet's connection (TLS
inside TLS through an ``https://`` proxy). A transport passed to
``httpx.AsyncClient(transport=...)`` is used as it is, so the client does
not read proxies from the environment for it (``HTTPS_PROXY``...): pass
``proxy=`` here, or mount transports per URL pattern (``mounts=``).
SOCKS proxies are not supported.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from types import TracebackType
from typing import Final, NoReturn

import httpcore
import httpx

from .httpcore import SlabnetBackend

__all__ = ["AsyncSlabnetTransport"]

#: httpx's default limits (``httpx.AsyncClient`` uses the same).
DEFAULT_LIMITS: Final = httpx.Limits(max_connections=100, max_keepalive_connections=20)

#: httpcore's exceptions and httpx's, most specific first: the first match wins.
_ERRORS: Final[tuple[tuple[type[Exception], type[httpx.TransportError]], ...]] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


def _raise_mapped(exc: Exception) -> NoReturn:
    for theirs, ours in _ERRORS:
        if isinstance(exc, theirs):
            raise ours(str(exc)) from exc
    raise exc


class _ResponseStream(httpx.AsyncByteStream):
    """The body of an httpcore response, with httpcore's errors as httpx's."""

    def __init__(self, stream: AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except Exception as exc:
            _raise_mapped(exc)

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is None:
            return
        # httpcore's close hands the connection back to the pool and takes
        # the request out of it. Its shield against cancellation is anyio's,
        # which a plain ``task.cancel()`` goes through: cancelled in there
        # (say the request's task, as its body ends), the request stayed in
        # the pool and its connection ACTIVE for good, one pool slot lost
        # per such cancellation, then PoolTimeout. So the close runs in a
        # task of its own, to its end; a cancellation leaves it running.
        closing = asyncio.ensure_future(aclose())
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            closing.add_done_callback(_retrieve)
            raise
        except Exception as exc:
            _raise_mapped(exc)


def _retrieve(task: asyncio.Future[None]) -> None:
    """Retrieve a close's outcome nobody waits for (its error is the
    connection's, which is closed either way)."""
    if not task.cancelled():
        task.exception()


class _Tunnel(httpcore.AsyncConnectionInterface):
    """httpcore's connection through a CONNECT tunnel, closed when a
    request on it fails.

    httpcore (1.0.9, encode/httpcore#1023) leaves a tunnel whose set-up
    failed after the proxy's 200 (the destination's TLS handshake failed,
    the proxy hung up) ACTIVE in the pool for good: each such failure takes
    a pool slot, and after ``max_connections`` of them every request waits
    for ``PoolTimeout``. Closed, the pool drops it. A request that fails on
    a tunnel already set up has closed its HTTP/1.1 connection itself, so
    closing it again changes nothing there."""

    def __init__(self, connection: httpcore.AsyncConnectionInterface) -> None:
        self._connection = connection

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        try:
            return await self._connection.handle_async_request(request)
        except httpcore.ConnectionNotAvailable:
            # Not a failure: the tunnel is another request's now (the pool
            # gave an idle one to each request waiting), and the pool tries
            # this one elsewhere. Closing it would cut that other request.
            raise
        except BaseException:
            if not self._connection.is_closed():
                # In a task of its own, to its end, whatever cancels the
                # caller meanwhile (then the CancelledError goes up).
                closing = asyncio.ensure_future(self._connection.aclose())
                closing.add_done_callback(_retrieve)
                await asyncio.shield(closing)
            raise

    def can_handle_request(self, origin: httpcore.Origin) -> bool:
        return self._connection.can_handle_request(origin)

    async def aclose(self) -> None:
        await self._connection.aclose()

    def info(self) -> str:
        return self._connection.info()

    def is_available(self) -> bool:
        return self._connection.is_available()

    def has_expired(self) -> bool:
        return self._connection.has_expired()

    def is_idle(self) -> bool:
        return self._connection.is_idle()

    def is_closed(self) -> bool:
        return self._connection.is_closed()

    def __repr__(self) -> str:
        return repr(self._connection)


class _HTTPProxy(httpcore.AsyncHTTPProxy):
    """httpcore's HTTP proxy pool, its tunnels closed when a request fails."""

    def create_connection(self, origin: httpcore.Origin) -> httpcore.AsyncConnectionInterface:
        connection = super().create_connection(origin)
        return connection if origin.scheme == b"http" else _Tunnel(connection)


class AsyncSlabnetTransport(httpx.AsyncBaseTransport):
    """An httpx transport whose connections are slabnet's (HTTP/1.1)."""

    def __init__(
        self,
        verify: ssl.SSLContext | bool = True,
        *,
        limits: httpx.Limits = DEFAULT_LIMITS,
        trust_env: bool = True,
        uds: str | None = None,
        local_address: str | None = None,
        retries: int = 0,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
        proxy: httpx.Proxy | httpx.URL | str | None = None,
        backend: SlabnetBackend | None = None,
    ) -> None:
        options = dict(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=trust_env),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            uds=uds,
            local_address=local_address,
            retries=retries,
            socket_options=socket_options,
            network_backend=backend or SlabnetBackend(),
        )
        if proxy is None:
            self._pool = httpcore.AsyncConnectionPool(**options)  # type: ignore[arg-type]
            return
        if not isinstance(proxy, httpx.Proxy):
            proxy = httpx.Proxy(url=proxy)
        url = proxy.url
        if url.scheme not in ("http", "https"):
            raise ValueError(
                f"AsyncSlabnetTransport takes http:// and https:// proxies, "
                f"not {url.scheme}:// ({url})"
            )
        self._pool = _HTTPProxy(
            proxy_url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            proxy_auth=proxy.raw_auth,
            proxy_headers=proxy.headers.raw,
            proxy_ssl_context=proxy.ssl_context,
            **options,  # type: ignore[arg-type]
        )

    @property
    def pool(self) -> httpcore.AsyncConnectionPool:
        """The httpcore pool behind the transport (``pool.connections``)."""
        return self._pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not isinstance(request.stream, httpx.AsyncByteStream):
            raise TypeError("AsyncSlabnetTransport needs an async request body")
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            response = await self._pool.handle_async_request(core_request)
        except Exception as exc:
            _raise_mapped(exc)
        assert isinstance(response.stream, AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        try:
            await self._pool.aclose()
        except Exception as exc:
            _raise_mapped(exc)

    async def __aenter__(self) -> AsyncSlabnetTransport:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()
