"""slabnet's exceptions.

The hierarchy is small and rooted in the stdlib classes that asyncio code
already catches: a TLS failure is an ``ssl.SSLError``, a timeout is a
``TimeoutError``, a connection problem is a ``ConnectionError``. slabnet adds
subclasses only where a caller needs to tell cases apart.
"""

from __future__ import annotations

import ssl
from typing import TypeVar

__all__ = [
    "HandshakeTimeoutError",
    "LocalAbortError",
    "ShutdownTimeoutError",
    "TLSRecordError",
    "TLSTruncatedError",
]


class _LikeOpenSSL(ssl.SSLError):
    """An ``ssl.SSLError`` that slabnet raises itself, with what the ``ssl``
    module's own errors carry: ``errno`` (the ``SSL_ERROR_*`` code),
    ``library`` and ``reason`` (OpenSSL's name for the failure, the one its
    own check would have given), and ``str()`` reading ``[SSL: REASON]
    message``. Code branches on ``exc.reason`` -- a client that falls back
    to plaintext on ``WRONG_VERSION_NUMBER``, a server that does not log
    ``HTTP_REQUEST`` -- and a bare ``ssl.SSLError`` has no such attribute.
    """

    errno_code = int(ssl.SSL_ERROR_SSL)
    reason: str
    library: str

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(self.errno_code, f"[SSL: {reason}] {message}")
        self.message = message
        self.reason = reason
        self.library = "SSL"

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return self.__class__, (self.message, self.reason)


class TLSTruncatedError(_LikeOpenSSL, ssl.SSLEOFError):
    """The peer closed TCP without sending a TLS close_notify alert.

    An attacker who can inject a FIN could otherwise cut a response short
    unnoticed (RFC 8446 §6.1). Pass ``ssl_ragged_eof=True`` where the
    application protocol frames its own messages (HTTP with Content-Length or
    chunked encoding) and a plain EOF should be accepted. ``reason`` is
    ``UNEXPECTED_EOF_WHILE_READING``, as OpenSSL 3's.
    """

    errno_code = int(ssl.SSL_ERROR_EOF)

    def __init__(self, message: str, reason: str = "UNEXPECTED_EOF_WHILE_READING") -> None:
        super().__init__(message, reason)


class TLSRecordError(_LikeOpenSSL):
    """The peer sent a TLS record header that cannot be valid. ``reason``
    is what OpenSSL's record layer says of such a header (``HTTP_REQUEST``
    for an HTTP request where TLS was expected, ``WRONG_VERSION_NUMBER``
    for other bytes that are not TLS, ...; see ``RecordScanner``)."""


class HandshakeTimeoutError(ConnectionAbortedError, TimeoutError):
    """The TLS handshake did not finish within ``ssl_handshake_timeout``.

    It is a ``ConnectionAbortedError``, as asyncio raises, and also a
    ``TimeoutError`` so that ``except TimeoutError`` catches it.
    """


class ShutdownTimeoutError(TimeoutError):
    """The peer did not answer close_notify within ``ssl_shutdown_timeout``."""


class LocalAbortError(ConnectionAbortedError, ConnectionResetError):
    """This side aborted the connection (``transport.abort()``).

    Every waiter of the connection raises it: queued data was dropped, so an
    EOF would hide the loss. ``wait_closed()`` does not. It is also a
    ``ConnectionResetError``, what asyncio's ``drain()`` raises after an
    abort (``Server.abort_clients()`` too), so that a handler's ``except
    ConnectionResetError`` around ``drain()`` catches it there as well.
    """


_E = TypeVar("_E", bound=BaseException)


def untraced(exc: _E) -> _E:
    """``exc`` without its traceback: for an error that slabnet catches in
    its own frames and keeps, to deliver later (a transport's ``_error``,
    a waiter, a ``WriteRequest``).

    The traceback holds those frames, and each frame its ``self`` and its
    locals: kept on the object whose method caught it, the error would form
    a reference cycle (object, error, traceback, frame, object) that holds
    the connection -- and what the frames held, such as the buffers a
    failed send was given -- until the cyclic garbage collector runs, which
    for a long-lived connection may be a long time. Those frames tell the
    app nothing: where the error is delivered (``drain()``, a read, the
    awaited request) it is raised, and gets a traceback, there.
    Exceptions raised by the app's own callbacks keep theirs.
    """
    return exc.with_traceback(None)
