"""Pieces shared by the TTS service, the voice server and the demo.

Everything here is plain Python; the only networking choice it makes is which
streams module to hand out. ``--impl asyncio`` and ``--impl slabnet`` run the
very same example code: both modules offer ``open_connection`` and
``start_server`` with asyncio's signatures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import math
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "FRAME_MS",
    "IMPLS",
    "LOOPS",
    "SAMPLE_RATES",
    "SAMPLE_WIDTH",
    "CertPaths",
    "client_ssl_context",
    "frame_bytes",
    "make_certs",
    "memory_stats",
    "percentile",
    "rss_bytes",
    "run_loop",
    "server_ssl_context",
    "streams_module",
]

T = TypeVar("T")

IMPLS = ("slabnet", "asyncio")
LOOPS = ("asyncio", "uvloop")

# Telephony audio: 16-bit signed little-endian mono PCM. 8 kHz is the G.711 /
# PSTN rate; 16 kHz is "wideband" (G.722, most TTS providers' default).
SAMPLE_RATES = (8000, 16000)
SAMPLE_WIDTH = 2
# 20 ms is the default RTP packetization time for voice (RFC 3551 §4.2).
FRAME_MS = 20


def frame_bytes(rate: int, ms: int = FRAME_MS) -> int:
    """Bytes of PCM in one frame of ``ms`` milliseconds at ``rate`` Hz."""
    return rate * ms // 1000 * SAMPLE_WIDTH


# --------------------------------------------------------------------------
# Implementation and loop selection


def streams_module(impl: str) -> ModuleType:
    """The module whose ``open_connection``/``start_server`` the example uses."""
    if impl not in IMPLS:
        raise ValueError(f"unknown --impl {impl!r}; choose from {IMPLS}")
    return importlib.import_module(impl)


def impl_available(impl: str) -> str | None:
    """None if ``impl`` can be used, otherwise why not."""
    try:
        mod = streams_module(impl)
    except ImportError as exc:
        return f"cannot import {impl}: {exc}"
    missing = [n for n in ("open_connection", "start_server") if not hasattr(mod, n)]
    if missing:
        return f"{impl} has no {', '.join(missing)}"
    return None


def run_loop(main: Callable[[], Awaitable[T]], loop: str) -> T:
    """Run ``main()`` to completion on the stdlib loop or on uvloop."""
    if loop == "asyncio":
        return asyncio.run(main())  # type: ignore[arg-type]
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())  # type: ignore[arg-type]
    raise ValueError(f"unknown --loop {loop!r}; choose from {LOOPS}")


# --------------------------------------------------------------------------
# TLS


@dataclasses.dataclass(frozen=True)
class CertPaths:
    ca: Path
    cert: Path  # server certificate chain, PEM
    key: Path  # server private key, PEM


def make_certs(directory: str | os.PathLike[str]) -> CertPaths:
    """Create (or reuse) a trustme CA and a server cert for localhost/127.0.0.1."""
    d = Path(directory)
    paths = CertPaths(d / "ca.pem", d / "server.pem", d / "server.key")
    if all(p.exists() for p in (paths.ca, paths.cert, paths.key)):
        return paths
    import trustme

    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1", "::1")
    ca.cert_pem.write_to_path(str(paths.ca))
    leaf.private_key_pem.write_to_path(str(paths.key))
    with open(paths.cert, "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return paths


def server_ssl_context(certs: CertPaths) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.cert, certs.key)
    return ctx


def client_ssl_context(ca: str | os.PathLike[str]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


# --------------------------------------------------------------------------
# Sockets


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """A bound, not listening SO_REUSEPORT socket that holds a port number.

    Worker processes then each listen on the same port with reuse_port=True
    and the kernel spreads connections among them. The holder never listens,
    so it is never handed a connection.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


# --------------------------------------------------------------------------
# Measurement

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return (0, 0)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return (total - idle, total)


def memory_stats(impl: str) -> dict[str, int] | None:
    """``slabnet.memory_stats()`` as a flat dict of numbers (None for asyncio)."""
    if impl != "slabnet":
        return None
    import slabnet

    fn = getattr(slabnet, "memory_stats", None)
    if fn is None:
        return None
    raw: Any = fn()
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        items: Iterable[tuple[str, Any]] = dataclasses.asdict(raw).items()
    elif isinstance(raw, Mapping):
        items = raw.items()
    elif hasattr(raw, "_asdict"):
        items = raw._asdict().items()
    else:
        items = ((k, getattr(raw, k)) for k in dir(raw) if not k.startswith("_"))
    return {k: int(v) for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)}


def pinned_bytes(stats: Mapping[str, int] | None) -> int | None:
    """The pinned-bytes figure out of ``memory_stats`` (first key with 'pinned')."""
    if not stats:
        return None
    if "pinned_bytes" in stats:
        return stats["pinned_bytes"]
    for key in sorted(stats):
        if "pinned" in key and "count" not in key:
            return stats[key]
    return None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# The prompts a simulated call asks for, in turn. Lengths vary from about 2 to
# 6 seconds of speech, like the prompts of an IVR or a voice agent.
PHRASES = (
    "Thank you for calling. Your call is important to us.",
    "Please hold while I look up your account.",
    "I found your order. It shipped this morning and should arrive on Thursday.",
    "Is there anything else I can help you with today?",
    "Please say or enter your eight digit customer number.",
    "Sorry, I did not catch that. Could you repeat it?",
    "Your balance is forty two dollars and seventeen cents.",
    "One moment please.",
    "To speak with an agent, say agent. To hear these options again, say repeat.",
    "Thanks for waiting. I am connecting you now.",
)
