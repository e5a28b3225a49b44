"""``python -m benchmarks``: parse the command line, run, report."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .core import HEAP_STATES, Files, Scenario, config_label, format_value, parse_value
from .driver import ROOT, Driver
from .report import Progress, markdown, update_readme, write_csv, write_plots
from .results import ConfigResults, label_configs
from .scenarios import all_scenarios
from .targets import evaluate

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results")
README = os.path.join(ROOT, "benchmarks", "README.md")
IMGDIR = os.path.join(ROOT, "benchmarks", "img")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark slabnet against asyncio and uvloop. Each run is a fresh client "
                    "process against a fresh server process; implementations alternate run by run.")
    p.add_argument("--filter", action="append", default=[], metavar="REGEX",
                   help="run only scenarios whose name matches (repeatable)")
    p.add_argument("--impl", action="append", default=[], metavar="REGEX",
                   help="run only implementations whose name matches (repeatable)")
    p.add_argument("--runs", type=int, default=None, help="runs per implementation and configuration "
                   "(default 6; 1 with --quick)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V[,V...]",
                   help="override a parameter (comma-separated values: one configuration each); "
                        "sizes take K/M/G suffixes; dur=SECONDS bounds every run (default 120)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: every scenario with tiny sizes, 1 run each")
    p.add_argument("--out", default=None, help="directory for CSV, Markdown and PNG files "
                   "(default benchmarks/results, with --quick benchmarks/results/quick)")
    p.add_argument("--heap", choices=HEAP_STATES, default="settled",
                   help="glibc malloc state of every worker: 'settled' (default) frees one 1 MiB "
                        "block first, which raises glibc's mmap threshold as in a process that has "
                        "run a while; 'pinned' fixes the threshold at its initial 128 KiB, as in a "
                        "process that never freed a larger block (asyncio's 256 KiB reads are then "
                        "mmapped and unmapped every time)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--allow-unavailable", action="store_true",
                   help="exit 0 even if slabnet could not be imported")
    p.add_argument("--list", action="store_true", help="list scenarios, parameters and implementations")
    p.add_argument("--update-readme", action="store_true",
                   help="after the run, put its table and plots into benchmarks/README.md and img/")
    p.add_argument("--readme-from", metavar="DIR",
                   help="don't run: put the results in DIR into benchmarks/README.md and img/")
    return p.parse_args(argv)


def _overrides(items: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants KEY=VALUE, got {item!r}")
        out[key.strip()] = [parse_value(v) for v in value.split(",")]
    return out


def _selected(scenarios: list[Scenario], patterns: Sequence[str]) -> list[Scenario]:
    if not patterns:
        return scenarios
    return [s for s in scenarios if any(re.search(p, s.name) for p in patterns)]


def _make_files(tmpdir: str) -> Files:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = Files(ca_pem=os.path.join(tmpdir, "ca.pem"), server_pem=os.path.join(tmpdir, "server.pem"),
                  tmpdir=tmpdir)
    ca.cert_pem.write_to_path(files.ca_pem)
    cert.private_key_and_cert_chain_pem.write_to_path(files.server_pem)
    return files


def _meta(argv: Sequence[str] | None) -> dict[str, Any]:
    def version(module: str) -> str:
        try:
            return str(__import__(module).__version__)
        except Exception:
            return "n/a"

    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python -m benchmarks " + shlex.join(args),
        "machine": f"{os.cpu_count()} cores ({cpu or platform.machine()}), {platform.system()} {platform.release()}",
        "versions": f"Python {platform.python_version()}, uvloop {version('uvloop')}, {ssl.OPENSSL_VERSION}, "
                    f"git {rev}",
    }


def _list(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        print(f"{s.name}: {s.title}")
        for key, values in s.params.items():
            quick = s.quick.get(key)
            extra = f"  (--quick: {','.join(map(format_value, quick))})" if quick else ""
            print(f"    {key} = {','.join(map(format_value, values))}{extra}")
        print("    impls: " + " ".join(i.name for i in s.impls))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.out is None:
        args.out = os.path.join(DEFAULT_OUT, "quick") if args.quick else DEFAULT_OUT
    if args.readme_from:
        update_readme(README, IMGDIR, args.readme_from)
        return 0
    scenarios = _selected(all_scenarios(), args.filter)
    if args.list:
        _list(scenarios)
        return 0
    if not scenarios:
        print("no scenario matches --filter", file=sys.stderr)
        return 2
    overrides = _overrides(args.set)
    timeout = float(overrides.pop("dur", [120])[0])
    runs = args.runs if args.runs is not None else (1 if args.quick else 6)

    plan: list[ConfigResults] = []
    for scenario in scenarios:
        group = []
        for params in scenario.configs(overrides, args.quick):
            impls = [i for i in scenario.impls_for(params)
                     if not args.impl or any(re.search(p, i.name) for p in args.impl)]
            if impls:
                group.append(ConfigResults(scenario, params, impls))
        label_configs(group)
        plan += group
    total = sum(len(c.impls) for c in plan) * runs
    progress = Progress(total)
    os.makedirs(args.out, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="slabnet-bench-") as tmpdir:
        driver = Driver(_make_files(tmpdir), timeout, progress, heap=args.heap)
        for c in plan:
            progress.config(f"{c.scenario.name} {c.label}")
            c.runs = driver.run_config(c.scenario, c.params, c.impls, runs)
    progress.finish()

    meta = _meta(argv)
    meta["versions"] += f"; heap {args.heap}"
    verdicts = evaluate(plan)
    report = markdown(plan, verdicts, meta)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report)
    files = write_csv(plan, args.out)
    if not args.no_plots:
        files += write_plots(plan, args.out)
    sys.stdout.write(report)
    print(f"wrote {os.path.join(args.out, 'results.md')} and {len(files)} more files to {args.out}",
          file=sys.stderr)

    failed = [(c, r) for c in plan for r in c.runs if r.status == "failed"]
    unavailable = [(c, r) for c in plan for r in c.runs if r.status == "unavailable"]
    for c, r in failed:
        print(f"FAILED {c.scenario.name} {config_label(c.params, list(c.params))} {r.impl}: {r.error}",
              file=sys.stderr)
    if args.update_readme:
        update_readme(README, IMGDIR, args.out)
    if unavailable:
        print(f"slabnet unavailable in {len(unavailable)} runs: {unavailable[0][1].error}", file=sys.stderr)
    if failed or (unavailable and not args.allow_unavailable):
        return 1
    return 0
