"""Scenario and implementation registry.

A *scenario* is one kind of measurement (plain TCP server-to-client, TLS
server-to-client, ...).  It declares

* a parameter grid: every parameter has a list of default values and the
  runner measures the cross product of them, one *configuration* each;
* the implementations it runs on every configuration;
* the metrics its client reports, and which of them are plotted;
* a server (a blocking Python function run in its own process, or an
  external command such as ``openssl s_server``) and an async client.

This module is imported by the driver *and* by every worker process, so it
only imports the standard library: numpy, scipy and matplotlib are for the
parent process alone and a worker's start-up time stays small.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import socket
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal

Params = dict[str, Any]
Better = Literal["higher", "lower"]

# Loops an implementation can run on.
LOOPS = ("asyncio", "uvloop")

# The glibc malloc states a run can put its workers in (``--heap``), and the
# variable that tells a worker which one it is in.
HEAP_STATES = ("settled", "pinned")
HEAP_ENV = "SLABNET_BENCH_HEAP"


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: an API (``streams``, ``slabnet-chunks``, ...) on a loop.

    ``needs_server`` is False for in-memory implementations (the TLS decrypt
    ceiling) that run their client without a peer.  ``on_loop`` is False for
    reference clients that do blocking work and use no event loop (the
    ceiling, and the TLS socket floor); they are named without a loop and
    every slabnet implementation is compared with them.
    """

    api: str
    loop: str = "asyncio"
    needs_server: bool = True
    on_loop: bool = True

    @property
    def name(self) -> str:
        return f"{self.api}/{self.loop}" if self.on_loop else self.api

    @property
    def is_slabnet(self) -> bool:
        return self.api.startswith("slabnet")


def impl_by_name(name: str) -> Impl:
    for impl in ALL_IMPLS:
        if impl.name == name:
            return impl
    raise KeyError(f"unknown implementation {name!r}")


def _on_both_loops(*apis: str) -> list[Impl]:
    return [Impl(api, loop) for loop in LOOPS for api in apis]


# The read-side implementations, in the order tables list them.
SLABNET_CHUNKS = _on_both_loops("slabnet-chunks")
SLABNET_READ = _on_both_loops("slabnet-read")
SLABNET_PROTO = _on_both_loops("slabnet-proto")
# SlabProtocol with an app that keeps each chunk until the next loop
# iteration, as a stream's consumer task does (busy: what that hop costs).
SLABNET_HELD = _on_both_loops("slabnet-held")
STREAMS = _on_both_loops("streams")
PROTO = _on_both_loops("proto")
SLABNET_WRITER = _on_both_loops("slabnet")
# httpx with slabnet.contrib's transport, and with httpx's default one.
HTTPX = _on_both_loops("slabnet-httpx", "httpx")
CEILING = Impl("ceiling", "asyncio", needs_server=False, on_loop=False)
FLOOR = Impl("floor", "asyncio", on_loop=False)

ALL_IMPLS: tuple[Impl, ...] = tuple(
    SLABNET_CHUNKS + SLABNET_READ + SLABNET_PROTO + SLABNET_HELD + SLABNET_WRITER + STREAMS + PROTO
    + [FLOOR, CEILING] + HTTPX
)


@dataclasses.dataclass(frozen=True)
class Metric:
    key: str
    label: str
    better: Better
    fmt: str = "{:.1f}"


# Metrics every throughput client reports (see common.Meter).
MIBPS = Metric("mibps", "MiB/s", "higher", "{:.0f}")
CPU_PER_GIB = Metric("cpu_s_per_gib", "CPU s/GiB", "lower", "{:.2f}")
PEAK_RSS = Metric("peak_rss_mib", "peak RSS MiB", "lower", "{:.1f}")
THROUGHPUT_METRICS = (MIBPS, CPU_PER_GIB, PEAK_RSS)


@dataclasses.dataclass(frozen=True)
class ExternalServer:
    """A server that is a command, not Python: the driver starts ``argv`` in
    ``cwd`` and reads its stdout until ``port_pattern`` matches."""

    argv: list[str]
    cwd: str
    port_pattern: str = r"ACCEPT \S*:(\d+)"


@dataclasses.dataclass(frozen=True)
class Files:
    """Files made once per invocation: certificates and a scratch dir."""

    ca_pem: str
    server_pem: str  # key and certificate chain in one PEM
    tmpdir: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ClientContext:
    """Everything a client coroutine gets in its worker process."""

    impl: Impl
    params: Params
    port: int
    files: Files
    host: str = "127.0.0.1"


ServerFn = Callable[[socket.socket, Params, Files], None]
ClientFn = Callable[[ClientContext], Coroutine[Any, Any, dict[str, Any]]]
ExternalFn = Callable[[Params, Files], ExternalServer | None]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    doc: str
    params: Mapping[str, Sequence[Any]]
    quick: Mapping[str, Sequence[Any]]
    impls: Sequence[Impl]
    client: ClientFn
    server: ServerFn | None = None
    # Returns an external server for a configuration, or None to use
    # ``server`` (lets one scenario use both, e.g. TLS sender shapes a and b).
    external_server: ExternalFn | None = None
    metrics: Sequence[Metric] = THROUGHPUT_METRICS
    # The parameter on the x axis of the plots; the other grid parameters
    # split the plots into panels.
    plot_x: str | None = None
    plot_metrics: Sequence[str] = ("mibps", "cpu_s_per_gib")
    # Which implementations run on a given configuration (e.g. no
    # pure-Python ceiling for a shape that has no pre-encrypted records).
    impl_filter: Callable[[Impl, Params], bool] | None = None

    def configs(self, overrides: Mapping[str, Sequence[Any]], quick: bool) -> list[Params]:
        """The cross product of the grid after ``--quick`` and ``--set``."""
        grid: dict[str, Sequence[Any]] = dict(self.params)
        if quick:
            grid.update(self.quick)
        for key, values in overrides.items():
            if key in grid or key in ("size", "dur"):
                grid[key] = values
        keys = list(grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]

    def impls_for(self, params: Params) -> list[Impl]:
        if self.impl_filter is None:
            return list(self.impls)
        return [i for i in self.impls if self.impl_filter(i, params)]

    def grid_keys(self) -> list[str]:
        """Parameters that label a configuration (those with several values
        by default, plus the plot axis)."""
        return [k for k, v in self.params.items() if len(v) > 1 or k == self.plot_x]


def config_label(params: Params, keys: Sequence[str]) -> str:
    return " ".join(f"{k}={format_value(params[k])}" for k in keys if k in params)


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_value(text: str) -> Any:
    """``--set`` values: ints, floats, sizes with a K/M/G suffix, else strings."""
    m = _SIZE_RE.match(text.strip())
    if m:
        number, unit = m.group(1), (m.group(2) or "")[:1].lower()
        value = float(number) * _UNITS[unit]
        return int(value) if value == int(value) and (unit or "." not in number) else value
    return text


def format_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value % scale == 0:
                return f"{value // scale}{unit}"
    return str(value)
