"""slabnet's exceptions.

The hierarchy is small and rooted in the stdlib classes that asyncio code
already catches: a TLS failure is an ``ssl.SSLError``, a timeout is a
``TimeoutError``, a connection problem is a ``ConnectionError``. slabnet adds
subclasses only where a caller needs to tell cases apart.
"""

from __future__ import annotations

import ssl

__all__ = [
    "HandshakeTimeoutError",
    "LocalAbortError",
    "ShutdownTimeoutError",
    "TLSRecordError",
    "TLSTruncatedError",
]


class TLSTruncatedError(ssl.SSLEOFError):
    """The peer closed TCP without sending a TLS close_notify alert.

    An attacker who can inject a FIN could otherwise cut a response short
    unnoticed (RFC 8446 §6.1). Pass ``ssl_ragged_eof=True`` where the
    application protocol frames its own messages (HTTP with Content-Length or
    chunked encoding) and a plain EOF should be accepted.
    """


class TLSRecordError(ssl.SSLError):
    """The peer sent a TLS record header that cannot be valid."""


class HandshakeTimeoutError(ConnectionAbortedError, TimeoutError):
    """The TLS handshake did not finish within ``ssl_handshake_timeout``.

    It is a ``ConnectionAbortedError``, as asyncio raises, and also a
    ``TimeoutError`` so that ``except TimeoutError`` catches it.
    """


class ShutdownTimeoutError(TimeoutError):
    """The peer did not answer close_notify within ``ssl_shutdown_timeout``."""


class LocalAbortError(ConnectionAbortedError):
    """This side aborted the connection (``transport.abort()``).

    Every waiter of the connection raises it: queued data was dropped, so an
    EOF would hide the loss. ``wait_closed()`` does not.
    """
