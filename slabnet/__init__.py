"""slabnet: asyncio sockets with a shared read slab, exact-size TLS chunks,
TLS record coalescing and a write path that allocates nothing for writes
that complete at once.

Everything public is re-exported here; the modules behind it are private.
"""

from ._errors import (
    HandshakeTimeoutError,
    LocalAbortError,
    ShutdownTimeoutError,
    TLSRecordError,
    TLSTruncatedError,
)
from ._pool import DEFAULT_POOL_SIZE, BufferPool
from ._slab import DEFAULT_SLAB_SIZE, MemoryStats, ReadSizer, ReadSlab, memory_stats
from ._streams import (
    StreamReader,
    StreamWriter,
    open_connection,
    open_unix_connection,
    start_server,
    start_unix_server,
)
from ._tls import TLSEngine, TLSState
from ._tls_transport import TLSTransport
from ._transport import ChunkProtocol, SlabProtocol, SlabTransport, get_pool, get_slab
from ._write import WriteRequest

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_POOL_SIZE",
    "DEFAULT_SLAB_SIZE",
    "BufferPool",
    "ChunkProtocol",
    "HandshakeTimeoutError",
    "LocalAbortError",
    "MemoryStats",
    "ReadSizer",
    "ReadSlab",
    "ShutdownTimeoutError",
    "SlabProtocol",
    "SlabTransport",
    "StreamReader",
    "StreamWriter",
    "TLSEngine",
    "TLSRecordError",
    "TLSState",
    "TLSTransport",
    "TLSTruncatedError",
    "WriteRequest",
    "get_pool",
    "get_slab",
    "memory_stats",
    "open_connection",
    "open_unix_connection",
    "start_server",
    "start_unix_server",
]
