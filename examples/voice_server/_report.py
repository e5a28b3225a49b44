"""Combine per-process results into one summary, and print summaries as a table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._common import percentile

__all__ = ["format_progress", "format_table", "summarize"]

MB = 1024 * 1024


def summarize(results: Sequence[dict[str, Any]], **info: Any) -> dict[str, Any]:
    """One summary dict out of the workers' result dicts (JSON-serializable)."""
    lag = [x for r in results for x in r["lag_ms"]]
    first = [x for r in results for x in r["first_audio_ms"]]
    series = _combine_series([r["series"] for r in results])
    peak_queued = max((s[1] for s in series), default=0)
    peak_retained = max((s[2] for s in series), default=0)
    has_pinned = any(r["memory_stats"] for r in results)

    def total(key: str) -> Any:
        return sum(r[key] for r in results)

    return {
        **info,
        "workers": len(results),
        "calls": total("calls"),
        "connected": total("connected"),
        "frames": total("frames"),
        "underruns": total("underruns"),
        "late_frames": total("late_frames"),
        "phrases_ok": total("phrases_ok"),
        "phrases_bad": total("phrases_bad"),
        "bytes_received": total("bytes_received"),
        "bytes_played": total("bytes_played"),
        "bytes_dropped": total("bytes_dropped"),
        "reads": total("reads"),
        "read_bytes": total("read_bytes"),
        "reads_shared": total("reads_shared"),
        "sources": sorted({s for r in results for s in r["sources"]}),
        "lag_p50_ms": percentile(lag, 50),
        "lag_p99_ms": percentile(lag, 99),
        "lag_max_ms": max(lag, default=0.0),
        "tick_late_max_ms": max(r["tick_late_max_ms"] for r in results),
        "first_audio_p50_ms": percentile(first, 50),
        "first_audio_p99_ms": percentile(first, 99),
        "cpu_pct": 100 * total("cpu_s") / max(1e-9, max(r["talk_s"] for r in results)),
        "host_busy_pct": 100 * max(r["host_busy"] for r in results),
        "connect_s": max(r["connect_s"] for r in results),
        "talk_s": max(r["talk_s"] for r in results),
        "rss_baseline": total("rss_baseline"),
        "rss_per_connection": (total("rss_baseline") - total("rss_start"))
        / max(1, total("connected")),
        "peak_queued": peak_queued,
        "peak_retained": peak_retained,
        "retained_ratio": peak_retained / peak_queued if peak_queued else 0.0,
        "peak_pinned": max((s[3] for s in series), default=0) if has_pinned else None,
        "memory_stats": [r["memory_stats"] for r in results] if has_pinned else None,
        "series": series,
        "digests": sorted({tuple(d) for r in results for d in r["digests"]}),
        "errors": [e for r in results for e in r["errors"]],
        "rtp_errors": total("rtp_errors"),
        "underrun_log": sorted(u for r in results for u in r["underrun_log"])[:100],
        "leftover_tasks": [t for r in results for t in r["leftover_tasks"]],
    }


def _combine_series(per_worker: Sequence[Sequence[Sequence[Any]]]) -> list[tuple[Any, ...]]:
    """Sum the workers' samples on a common 0.25 s grid.

    Each worker samples on its own schedule (late when its loop is late);
    at every grid time each worker contributes its latest sample taken at
    or before that time. Rows are (seconds since start, queued audio bytes,
    retained bytes, pinned bytes, max loop lag in ms since the previous
    sample of any worker).
    """
    if not per_worker or not all(per_worker):
        return []
    end = min(s[-1][0] for s in per_worker)
    out: list[tuple[Any, ...]] = []
    index = [0] * len(per_worker)
    grid = 0.0
    while grid <= end + 1e-9:
        queued = retained = pinned = 0
        lag = 0.0
        for w, samples in enumerate(per_worker):
            i = index[w]
            while i + 1 < len(samples) and samples[i + 1][0] <= grid + 1e-9:
                i += 1
                lag = max(lag, samples[i][4])
            index[w] = i
            _, q, r, p, _lag = samples[i]
            queued += q
            retained += r
            pinned += p or 0
        out.append((round(grid, 2), queued, retained, pinned, lag))
        grid += 0.25
    return out


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.1f} MB"


ROWS: list[tuple[str, Any]] = [
    ("calls connected", lambda s: f"{s['connected']}/{s['calls']}"),
    ("workers x loop", lambda s: f"{s['workers']} x {s.get('loop', '?')}"),
    ("audio source", lambda s: ",".join(s["sources"]) or "-"),
    ("frames played (20 ms)", lambda s: f"{s['frames']}"),
    ("underruns", lambda s: f"{s['underruns']}"),
    ("late frames (>20 ms)", lambda s: f"{s['late_frames']}"),
    ("prompts byte-exact", lambda s: f"{s['phrases_ok']}/{s['phrases_ok'] + s['phrases_bad']}"),
    ("loop lag p50", lambda s: f"{s['lag_p50_ms']:.1f} ms"),
    ("loop lag p99", lambda s: f"{s['lag_p99_ms']:.1f} ms"),
    ("loop lag max", lambda s: f"{s['lag_max_ms']:.1f} ms"),
    ("first audio p99", lambda s: f"{s['first_audio_p99_ms']:.0f} ms"),
    ("TLS reads: count, avg size", lambda s: f"{s['reads']}, {s['read_bytes'] / max(1, s['reads']):.0f} B"),
    ("chunks owning their buffer",
     lambda s: f"{s['reads'] - s['reads_shared']}/{s['reads']}" if s["impl"] == "slabnet" else "-"),
    ("peak queued audio", lambda s: _mb(s["peak_queued"])),
    ("peak retained (RSS-base)", lambda s: _mb(s["peak_retained"])),
    ("retained / queued", lambda s: f"{s['retained_ratio']:.2f}x"),
    ("slabnet pinned (peak)", lambda s: _mb(s["peak_pinned"])),
    ("RSS at baseline", lambda s: _mb(s["rss_baseline"])),
    ("RSS per connection", lambda s: f"{s['rss_per_connection'] / 1024:.0f} KB"),
    ("voice server CPU", lambda s: f"{s['cpu_pct']:.0f}% of a core"),
    ("host CPU busy (all procs)", lambda s: f"{s['host_busy_pct']:.0f}%"),
    ("errors", lambda s: f"{len(s['errors']) + s['rtp_errors']}"),
]


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Summaries side by side, one column per run."""
    heads = [s.get("impl", "?") for s in summaries]
    cells = [[fmt(s) for s in summaries] for _, fmt in ROWS]
    w0 = max(len(name) for name, _ in ROWS)
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join([" " * w0, *(h.rjust(w) for h, w in zip(heads, widths))])]
    lines.append("  ".join(["-" * w0, *("-" * w for w in widths)]))
    for (name, _), row in zip(ROWS, cells):
        lines.append("  ".join([name.ljust(w0), *(c.rjust(w) for c, w in zip(row, widths))]))
    return "\n".join(lines)


def format_progress(label: str, total_calls: int, parts: Sequence[dict[str, Any]]) -> str:
    """One live status line from the workers' latest progress reports."""
    if not parts:
        return f"[{label}] connecting {total_calls} calls..."
    t = min(p["t"] for p in parts)
    pinned = [p["pinned"] for p in parts if p.get("pinned") is not None]
    line = (
        f"[{label}] t={t:4.0f}s calls={sum(p['active'] for p in parts):5d} "
        f"underruns={sum(p['underruns'] for p in parts)} "
        f"lag_p99={max(p['lag_p99_ms'] for p in parts):5.1f}ms "
        f"queued={_mb(sum(p['queued'] for p in parts))} "
        f"retained={_mb(sum(p['retained'] for p in parts))}"
    )
    if pinned:
        line += f" pinned={_mb(sum(pinned))}"
    return line
