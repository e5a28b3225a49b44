"""The performance targets of slabnet's issues, checked against a run.

Each target compares medians of one metric between two implementations on
the configurations that match ``where`` (or bounds one implementation's own
value when ``b`` is None).  A target is *met* when the value satisfies the
bound; the Welch p-value (and its stars) says how sure the run is that the
two implementations differ at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

from .results import ConfigResults
from .stats import stars, summarize

K = 1024


@dataclasses.dataclass(frozen=True)
class Target:
    text: str
    scenario: str
    where: dict[str, Any]
    metric: str
    a: str
    b: str | None
    op: Literal[">=", "<="]
    bound: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    target: Target
    config: str
    value: float
    p: float
    status: str  # "met", "MISSED", "no data"

    @property
    def shown(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        unit = "x" if self.target.b else ""
        return f"{self.value:.2f}{unit} {stars(self.p)}".strip()


def _tcp(a: str, b: str, bound: float) -> Target:
    return Target(f"plain TCP s2c: {a} MiB/s >= {bound}x {b}", "tcp_s2c", {}, "mibps", a, b, ">=", bound)


def _tls(record: int, shape: str, b: str, bound: float, a: str = "slabnet-chunks/asyncio") -> Target:
    return Target(f"TLS s2c {record // K} KiB records shape {shape}: {a} CPU/GiB <= {bound}x {b}",
                  "tls_s2c", {"record": record, "shape": shape}, "cpu_s_per_gib", a, b, "<=", bound)


def _write(wsize: int, loop: str, op: Literal[">=", "<="], bound: float, burst: int = 1) -> Target:
    a, b = f"slabnet/{loop}", f"streams/{loop}"
    shape = f"{burst}x{wsize // K} KiB writes, then drain" if burst > 1 else f"{wsize // K} KiB writes"
    return Target(f"c2s {shape}: {a} MiB/s {op} {bound}x {b}", "c2s", {"wsize": wsize, "burst": burst},
                  "mibps", a, b, op, bound)


# Issue 14: the data path at scale (busy connections, idle memory).

def _busy(record: int, a: str, b: str, bound: float) -> list[Target]:
    kind = f"TLS {record // K} KiB records" if record else "plain"
    return [Target(f"busy {kind}, n={n}: {a} CPU/GiB <= {bound}x {b}", "busy", {"record": record, "n": n},
                   "cpu_s_per_gib", a, b, "<=", bound)
            for n in (1, 64)]


def _idle(tls: int, a: str, b: str, bound: float) -> Target:
    kind = "TLS" if tls else "plain"
    return Target(f"idle server {kind}: {a} RSS/conn <= {bound}x {b}", "idle", {"side": "server", "tls": tls},
                  "rss_per_conn_kib", a, b, "<=", bound)


TARGETS: tuple[Target, ...] = (
    _tcp("slabnet-chunks/asyncio", "streams/asyncio", 4.0),
    _tcp("slabnet-chunks/uvloop", "streams/uvloop", 3.0),
    _tcp("slabnet-chunks/asyncio", "proto/asyncio", 0.8),
    _tcp("slabnet-chunks/uvloop", "proto/uvloop", 0.8),
    _tcp("slabnet-read/asyncio", "streams/asyncio", 1.3),
    _tls(1 * K, "a", "streams/asyncio", 0.65),
    _tls(1 * K, "a", "proto/asyncio", 1.0),
    _tls(1 * K, "a", "ceiling", 1.3),
    _tls(1 * K, "b", "streams/asyncio", 0.8),
    _tls(16 * K, "a", "proto/asyncio", 0.5),
    _tls(16 * K, "b", "proto/asyncio", 0.5),
    _write(1 * K, "asyncio", ">=", 2.0),
    _write(1 * K, "uvloop", ">=", 2.0),
    # "Large writes no worse": allow 5% for noise.
    _write(1024 * K, "asyncio", ">=", 0.95),
    _write(1024 * K, "uvloop", ">=", 0.95),
    Target("retention over TLS: slabnet-chunks/asyncio retained <= 1.5x kept bytes", "retention",
           {"tls": 1}, "retained_ratio", "slabnet-chunks/asyncio", None, "<=", 1.5),
    # Issue 14.
    *_busy(0, "slabnet-chunks/asyncio", "proto/asyncio", 1.25),
    *_busy(0, "slabnet-chunks/uvloop", "proto/uvloop", 1.25),
    *_busy(0, "slabnet-read/asyncio", "streams/asyncio", 0.6),
    *_busy(0, "slabnet-read/uvloop", "streams/uvloop", 0.6),
    *_busy(16 * K, "slabnet-chunks/asyncio", "proto/asyncio", 1.0),
    *_busy(1 * K, "slabnet-chunks/asyncio", "proto/asyncio", 1.0),
    _idle(0, "slabnet/asyncio", "streams/asyncio", 1.0),
    _idle(0, "slabnet/uvloop", "streams/uvloop", 1.0),
    _idle(1, "slabnet/asyncio", "streams/uvloop", 0.8),
    _idle(1, "slabnet/uvloop", "streams/uvloop", 0.8),
    *(Target(f"idle server {'TLS' if tls else 'plain'}: slabnet/{loop} fds/conn <= 1", "idle",
             {"side": "server", "tls": tls}, "fds_per_conn", f"slabnet/{loop}", None, "<=", 1.0)
      for tls in (0, 1) for loop in ("asyncio", "uvloop")),
    Target("retention over TLS (issue 14): slabnet-chunks/asyncio retained <= 1.2x kept bytes", "retention",
           {"tls": 1}, "retained_ratio", "slabnet-chunks/asyncio", None, "<=", 1.2),
    _write(1 * K, "asyncio", ">=", 2.0, burst=64),
    _write(1 * K, "uvloop", ">=", 2.0, burst=64),
)


def _matches(cr: ConfigResults, target: Target) -> bool:
    return cr.scenario.name == target.scenario and all(cr.params.get(k) == v for k, v in target.where.items())


def evaluate(configs: Sequence[ConfigResults], targets: Sequence[Target] = TARGETS) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for target in targets:
        for cr in (c for c in configs if _matches(c, target)):
            if target.b is None:
                value, p = summarize(cr.values(target.a, target.metric)).median, float("nan")
            else:
                value, p = cr.compare(target.a, target.b, target.metric)
            if math.isnan(value):
                status = "no data"
            elif (value >= target.bound) if target.op == ">=" else (value <= target.bound):
                status = "met"
            else:
                status = "MISSED"
            verdicts.append(Verdict(target, cr.label, value, p, status))
    return verdicts
