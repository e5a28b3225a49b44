"""``python -m examples.voice_server``: simulate N calls in 1..N processes.

Stopping: SIGTERM or SIGINT (Ctrl-C) stops the run. The parent terminates
its worker processes and waits for them (``STOP_GRACE_S``, then SIGKILL),
prints one line and exits with 128 + the signal's number. The workers
ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the
parent stops them) and exit by themselves if the parent dies.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, TextIO
from urllib.parse import urlsplit

from .._common import IMPLS, LOOPS, SAMPLE_RATES, impl_available, run_loop
from ._report import format_progress, format_table, summarize
from ._worker import VoiceConfig, Worker


# Default call arrival rate while the run ramps up. A thousand callers do not
# dial in the same second; starting them all within 1 s would have every
# call's first prompt stream at 5x real time at once (40 MB/s for 500 calls).
ARRIVALS_PER_S = 250


# How long the parent waits for a terminated worker to go before it kills it.
STOP_GRACE_S = 5.0


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived. A KeyboardInterrupt, so that ``except
    Exception`` does not catch it and asyncio stops its loop for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def default_stagger(calls: int) -> float:
    return max(1.0, calls / ARRIVALS_PER_S)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.voice_server",
        description="Simulate concurrent calls that stream TTS audio over HTTPS and play it "
        "out in real time as 20 ms RTP frames.",
    )
    p.add_argument("--tts", default="https://127.0.0.1:8443", help="TTS service base URL")
    p.add_argument("--ca", required=True, help="CA certificate (PEM) that signed the service's cert")
    p.add_argument("--server-hostname", default="localhost", help="name to verify (default localhost)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--duration", type=float, default=20.0, help="seconds each call lasts")
    p.add_argument("--workers", type=int, default=1, help="processes; calls are split among them")
    p.add_argument("--impl", choices=IMPLS, default="slabnet")
    p.add_argument("--loop", choices=LOOPS, default="asyncio")
    p.add_argument("--rate", type=int, choices=SAMPLE_RATES, default=8000, help="audio sample rate")
    p.add_argument("--low-water", type=float, default=1.0,
                   help="ask for the next prompt below this many seconds of queued audio")
    p.add_argument("--stagger", type=float, default=None,
                   help="spread call starts over this many seconds (default: calls arrive "
                        f"at {ARRIVALS_PER_S} per second, at least over 1 s)")
    p.add_argument("--rtp", metavar="HOST:PORT",
                   help="send RTP here (default: a local UDP socket nobody reads)")
    p.add_argument("--json", metavar="PATH", help="write the summary (with time series) here")
    p.add_argument("--label", help="label for the progress line (default: the impl)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    return p


def config_from_args(args: argparse.Namespace) -> VoiceConfig:
    url = urlsplit(args.tts)
    if url.scheme != "https" or not url.hostname:
        raise SystemExit(f"--tts must be an https:// URL, not {args.tts!r}")
    rtp = None
    if args.rtp:
        host, _, port = args.rtp.rpartition(":")
        rtp = (host.strip("[]"), int(port))
    return VoiceConfig(
        tts_host=url.hostname, tts_port=url.port or 443, ca=args.ca,
        server_hostname=args.server_hostname, impl=args.impl, rate=args.rate,
        duration=args.duration, stagger_s=default_stagger(args.calls) if args.stagger is None
        else args.stagger, low_water_s=args.low_water,
        rtp_sink=rtp,
    )


class Progress:
    """A live status line on a terminal; a line every 5 s otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO, enabled: bool) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self.parts: dict[int, dict[str, Any]] = {}
        self._last = 0.0
        self._shown = False

    def update(self, worker: int, part: dict[str, Any]) -> None:
        self.parts[worker] = part
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last < 5:
            return
        self._last = now
        line = format_progress(self.label, self.total, list(self.parts.values()))
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()


def _exit_with_parent() -> None:
    """In a worker: exit at once when the parent process is gone (killed, say),
    instead of playing on with nobody to report to."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker_main(
    config: VoiceConfig, ids: list[int], total: int, loop: str, barrier: Any, out: Any, w: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    _exit_with_parent()

    def progress(part: dict[str, Any]) -> None:
        out.put(("progress", w, part))

    try:
        result = run_loop(lambda: Worker(config, ids, total, barrier=barrier,
                                         progress=progress).run(), loop)
    except BaseException as exc:
        out.put(("failed", w, f"{type(exc).__name__}: {exc}"))
        raise
    out.put(("result", w, result))


def run_calls(config: VoiceConfig, calls: int, workers: int, loop: str,
              progress: Progress) -> list[dict[str, Any]]:
    """Run ``calls`` calls on ``workers`` processes; the workers' result dicts."""
    if workers == 1:
        worker = Worker(config, list(range(calls)), calls,
                        progress=lambda part: progress.update(0, part))
        return [run_loop(worker.run, loop)]
    spawn = mp.get_context("spawn")
    barrier = spawn.Barrier(workers)
    out = spawn.Queue()
    procs = [
        spawn.Process(target=_worker_main, daemon=True,
                      args=(config, list(range(w, calls, workers)), calls, loop, barrier, out, w))
        for w in range(workers)
    ]
    results: dict[int, dict[str, Any]] = {}
    failures: list[str] = []
    try:
        for proc in procs:
            proc.start()
        while len(results) + len(failures) < workers:
            try:
                kind, w, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead and out.empty():
                    failures.extend(f"worker pid {p.pid} exited {p.exitcode}" for p in dead)
                    break
                continue
            if kind == "progress":
                progress.update(w, payload)
            elif kind == "result":
                results[w] = payload
            else:
                failures.append(f"worker {w}: {payload}")
        for proc in procs:
            proc.join(30)
    except BaseException:  # a signal (Stopped), or an error of the parent's own
        failures.append("stopped")
        raise
    finally:
        if failures:
            _stop_workers(procs, barrier)
    if failures:
        raise RuntimeError("; ".join(failures))
    return [results[w] for w in sorted(results)]


def _stop_workers(procs: list[Any], barrier: Any) -> None:
    """Terminate the workers still running and wait for them (STOP_GRACE_S,
    then SIGKILL). A second SIGINT or SIGTERM meanwhile does not cut it short."""
    ignored = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored} if in_main else {}
    try:
        barrier.abort()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        end = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            if proc.pid is None:  # (never started)
                continue
            proc.join(max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.calls < args.workers:
        raise SystemExit("need --workers >= 1 and --calls >= --workers")
    why = impl_available(args.impl)
    if why:
        raise SystemExit(f"--impl {args.impl}: {why}")
    config = config_from_args(args)
    label = args.label or args.impl
    progress = Progress(label, args.calls, sys.stderr, not args.no_progress)
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)
    try:
        try:
            results = run_calls(config, args.calls, args.workers, args.loop, progress)
        finally:
            progress.finish()
    except Stopped as stop:
        print(f"voice_server: stopped by {stop}", file=sys.stderr)
        return 128 + stop.signum
    summary = summarize(results, impl=args.impl, loop=args.loop, duration=args.duration,
                        rate=args.rate, stagger=config.stagger_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    print(format_table([summary]))
    for err in summary["errors"][:10]:
        print(f"error: {err}", file=sys.stderr)
    ok = (not summary["errors"] and summary["phrases_bad"] == 0
          and summary["connected"] == summary["calls"] and not summary["leftover_tasks"])
    return 0 if ok else 1
