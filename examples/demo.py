"""``python -m examples.demo``: the seed-000 voice scenario, slabnet vs asyncio.

Starts the TTS service and then, once per implementation, the voice server,
all on loopback with a throwaway trustme CA, and prints the two summaries
side by side. The TTS service is the same process for both runs (it plays
the remote provider), so the columns differ only in the voice server's
streams: slabnet's, or asyncio's own streams and ``ssl``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._common import IMPLS, LOOPS, impl_available, make_certs
from .voice_server._report import format_table

ROOT = Path(__file__).resolve().parent.parent

# What "the voice server keeps up" means here: loop lag and retained memory.
TARGET_LAG_P99_MS = 20.0
TARGET_RETAINED_RATIO = 1.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Stream TTS audio over HTTPS to N simulated calls, on slabnet and on "
        "plain asyncio, and compare underruns, loop lag and retained memory.",
    )
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--duration", type=float, default=20.0, help="seconds each call lasts")
    p.add_argument("--workers", type=int, default=2, help="voice server processes")
    p.add_argument("--loop", choices=LOOPS, default="asyncio")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated, in run order (default slabnet,asyncio)")
    p.add_argument("--rate", type=int, choices=(8000, 16000), default=8000)
    p.add_argument("--stagger", type=float,
                   help="spread call starts over this many seconds (default: 250 calls/s, >= 1 s)")
    p.add_argument("--tts-impl", choices=IMPLS,
                   help="TTS service streams (default: slabnet if importable, else asyncio)")
    p.add_argument("--tts-loop", choices=LOOPS,
                   help="TTS service loop (default: uvloop if importable, else asyncio)")
    p.add_argument("--tts-workers", type=int, default=2)
    p.add_argument("--tts-nice", type=int, default=0, help="lower the TTS service's CPU priority")
    p.add_argument("--voice", choices=("auto", "espeak-ng", "synthetic"), default="auto")
    p.add_argument("--plot", metavar="PNG", help="plot queued audio vs retained memory over time")
    p.add_argument("--json", metavar="PATH", help="write both summaries here")
    return p


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_tts(args: argparse.Namespace, impl: str, certs_dir: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "examples.tts_service", "--port", "0", "--impl", impl,
        "--loop", args.tts_loop, "--workers", str(args.tts_workers), "--certs", certs_dir,
        "--voice", args.voice, "--nice", str(args.tts_nice),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            print(line.rstrip(), file=sys.stderr)
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].split()[0]
                return proc, url
    except BaseException:  # (Ctrl-C, SIGTERM: the service goes with the demo)
        stop_tts(proc)
        raise
    raise RuntimeError(f"TTS service exited with {proc.wait()} before listening")


def stop_tts(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.strip()


def run_voice(args: argparse.Namespace, impl: str, url: str, ca: Path, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "examples.voice_server", "--tts", url, "--ca", str(ca),
        "--impl", impl, "--loop", args.loop, "--calls", str(args.calls),
        "--duration", str(args.duration), "--workers", str(args.workers),
        "--rate", str(args.rate), "--json", str(out), "--label", impl,
    ]
    if args.stagger is not None:
        cmd += ["--stagger", str(args.stagger)]
    rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL).returncode
    if not out.exists():
        raise RuntimeError(f"voice server ({impl}) exited with {rc} and wrote no summary")
    summary: dict[str, Any] = json.loads(out.read_text())
    summary["exit_code"] = rc
    return summary


def verdict(s: dict[str, Any]) -> str:
    checks = [
        (s["underruns"] == 0, f"{s['underruns']} underruns"),
        (s["lag_p99_ms"] < TARGET_LAG_P99_MS, f"lag p99 {s['lag_p99_ms']:.1f} ms"),
        (s["retained_ratio"] <= TARGET_RETAINED_RATIO, f"retained {s['retained_ratio']:.2f}x queued"),
        (s["phrases_bad"] == 0 and not s["errors"], "audio byte-exact, no errors"),
    ]
    failed = [what for ok, what in checks if not ok]
    return "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"


def plot(summaries: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = 1024 * 1024
    fig, axes = plt.subplots(1, len(summaries), figsize=(6 * len(summaries), 4.2),
                             sharey=True, squeeze=False)
    for ax, s in zip(axes[0], summaries):
        t = [row[0] for row in s["series"]]
        ax.plot(t, [row[1] / mb for row in s["series"]], label="queued audio")
        ax.plot(t, [row[2] / mb for row in s["series"]], label="retained (RSS - baseline)")
        if s.get("peak_pinned") is not None:
            ax.plot(t, [row[3] / mb for row in s["series"]], label="slabnet pinned")
        ax.set_title(f"{s['impl']}: {s['calls']} calls, {s['workers']} workers, {s['loop']}")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    axes[0][0].set_ylabel("MB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # (so the finally clauses stop the services)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"unknown impl {impl!r}")
    skipped = {}
    for impl in list(impls):
        why = impl_available(impl)
        if why:
            skipped[impl] = why
            impls.remove(impl)
            print(f"demo: skipping {impl}: {why}", file=sys.stderr)
    if not impls:
        raise SystemExit("demo: nothing to run")
    tts_impl = args.tts_impl or ("slabnet" if not impl_available("slabnet") else "asyncio")
    if args.tts_loop is None:
        args.tts_loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"

    started = time.monotonic()
    summaries = []
    with tempfile.TemporaryDirectory(prefix="slabnet-demo-") as tmp:
        certs = make_certs(tmp)
        tts, url = start_tts(args, tts_impl, tmp)
        try:
            for impl in impls:
                summaries.append(run_voice(args, impl, url, certs.ca, Path(tmp) / f"{impl}.json"))
        finally:
            tts_report = stop_tts(tts)
    elapsed = time.monotonic() - started

    print()
    stagger = summaries[0].get("stagger", 0)
    print(f"{args.calls} calls x {args.duration:g} s (starting over {stagger:g} s), "
          f"{args.workers} voice worker(s), loop={args.loop}, "
          f"{args.rate} Hz s16le in 20 ms frames; TTS service: {tts_impl} on {args.tts_loop}, "
          f"{args.tts_workers} worker(s), 5x real time")
    print(format_table(summaries))
    print()
    for s in summaries:
        print(f"target for {s['impl']:8s} (0 underruns, lag p99 < {TARGET_LAG_P99_MS:g} ms, "
              f"retained <= {TARGET_RETAINED_RATIO}x queued): {verdict(s)}")
    for impl, why in skipped.items():
        print(f"{impl}: not run ({why})")
    print(tts_report)
    print(f"total {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f)
    if args.plot:
        plot(summaries, args.plot)
        print(f"plot written to {args.plot}")
    ok = all(s["exit_code"] == 0 for s in summaries)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
