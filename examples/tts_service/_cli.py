"""``python -m examples.tts_service``: run the TTS service, in 1..N processes."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .._common import IMPLS, LOOPS, make_certs, reserve_port, run_loop, server_ssl_context
from ._server import ServiceConfig, serve
from ._synth import VOICES

DEFAULT_CERTS = Path(tempfile.gettempdir()) / "slabnet-examples-certs"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.tts_service",
        description="HTTPS text-to-speech service: GET /v1/speech?text=...&rate=8000 "
        "streams s16le mono PCM with chunked transfer encoding, faster than real time.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8443, help="0 picks a free port (default 8443)")
    p.add_argument("--impl", choices=IMPLS, default="slabnet")
    p.add_argument("--loop", choices=LOOPS, default="asyncio")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port via SO_REUSEPORT")
    p.add_argument("--voice", choices=VOICES, default="auto",
                   help="espeak-ng if installed (auto), else a synthetic speech-like signal")
    p.add_argument("--speed", type=float, default=5.0, help="send rate, times real time (default 5)")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio per chunk/write (default 20 ms)")
    p.add_argument("--certs", type=Path, default=DEFAULT_CERTS,
                   help="directory with ca.pem, server.pem, server.key; created with trustme "
                        f"if missing (default {DEFAULT_CERTS})")
    p.add_argument("--nice", type=int, default=0, help="lower this service's CPU priority")
    return p


def _config(args: argparse.Namespace, port: int, reuse_port: bool) -> ServiceConfig:
    return ServiceConfig(
        host=args.host, port=port, impl=args.impl, voice=args.voice,
        speed=args.speed, chunk_ms=args.chunk_ms, reuse_port=reuse_port,
    )


def _worker(args: argparse.Namespace, port: int, reuse_port: bool, status: Any) -> None:
    """One service process; reports ("ready", port, voice) then ("done", responses, errors)."""
    if args.nice:
        os.nice(args.nice)
    ctx = server_ssl_context(make_certs(args.certs))
    config = _config(args, port, reuse_port)

    def ready(service: Any) -> None:
        status.put(("ready", service.port, service.cache.voice))

    service = run_loop(lambda: serve(config, ctx, ready=ready), args.loop)
    status.put(("done", service.responses, service.errors, _cpu_s()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    raise_nofile_limit()  # (inherited by the workers)
    certs = make_certs(args.certs)
    spawn = mp.get_context("spawn")
    status = spawn.SimpleQueue()
    holder = None
    if args.workers == 1:
        procs: list[Any] = []
        port = args.port
    else:
        holder = reserve_port(args.host, args.port)
        port = holder.getsockname()[1]
        # Not daemonic: a worker starts its own synthesis processes, which a
        # daemonic process may not. The supervisor stops them (SIGTERM) itself.
        procs = [spawn.Process(target=_worker, args=(args, port, True, status))
                 for _ in range(args.workers)]
        for proc in procs:
            proc.start()

    # The supervisor only waits; SIGINT/SIGTERM set a flag and it stops the workers.
    stop = {"flag": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["flag"] = True

    if procs:
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        voices = _wait_ready(procs, status, stop)
        if voices is not None:
            _announce(args, port, ",".join(sorted(voices)), certs.ca)
        while voices is not None and not stop["flag"] and all(p.is_alive() for p in procs):
            procs[0].join(0.2)
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        responses = errors = 0
        cpu = 0.0
        for proc in procs:
            proc.join(10)
        while not status.empty():
            kind, a, b, *c = status.get()
            if kind == "done":
                responses += a
                errors += b
                cpu += c[0]
        for s, h in old.items():
            signal.signal(s, h)
        if holder is not None:
            holder.close()
        codes = [p.exitcode for p in procs]
        if voices is None and not stop["flag"]:
            print(f"tts_service: a worker exited before it was ready (exit codes {codes})",
                  file=sys.stderr, flush=True)
            return 1
        clean = all(c == 0 for c in codes)
        print(f"tts_service: stopped {'cleanly' if clean else f'with exit codes {codes}'}"
              f" ({responses} responses, {errors} connection errors, {cpu:.1f} s CPU)", flush=True)
        return 0 if clean else 1

    # Single process: serve in this process.
    if args.nice:
        os.nice(args.nice)
    ctx = server_ssl_context(certs)
    config = _config(args, port, False)
    service = run_loop(
        lambda: serve(config, ctx, ready=lambda s: _announce(args, s.port, s.cache.voice, certs.ca)),
        args.loop,
    )
    print(f"tts_service: stopped cleanly ({service.responses} responses, "
          f"{service.errors} connection errors, {_cpu_s():.1f} s CPU)", flush=True)
    return 0


def _wait_ready(procs: list[Any], status: Any, stop: dict[str, bool]) -> set[str] | None:
    """The workers' voices once each said it is ready; None if one exited
    first (its error is on stderr: espeak-ng missing, say) or a signal came.
    (A SimpleQueue's get() has no timeout: it is polled, with the workers'
    lives and the signal flag, so a worker that dies never hangs us.)"""
    voices: set[str] = set()
    ready = 0
    while ready < len(procs):
        if stop["flag"]:
            return None
        if not status.empty():
            kind, _port, voice, *_ = status.get()
            if kind == "ready":
                voices.add(voice)
                ready += 1
            continue
        if not all(p.is_alive() for p in procs):
            return None
        time.sleep(0.05)
    return voices


def raise_nofile_limit() -> None:
    """Lift the soft limit on open files to the hard one, as benchmarks/ does:
    each connection takes a descriptor, and the service caps its connections
    below the soft limit (ServiceConfig.max_connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _announce(args: argparse.Namespace, port: int, voice: str, ca: Path) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"tts_service: listening on https://{host}:{port} impl={args.impl} loop={args.loop} "
        f"workers={args.workers} voice={voice} speed={args.speed:g}x chunk={args.chunk_ms}ms "
        f"ca={ca}",
        flush=True,
    )
    if voice == "synthetic":
        print("tts_service: espeak-ng not in use; serving a generated speech-like signal",
              file=sys.stderr, flush=True)
