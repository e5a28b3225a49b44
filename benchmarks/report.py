"""Reporters: the progress line (stderr), the Markdown report (stdout and
results.md), CSV files and PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from .core import ALL_IMPLS, Metric, Scenario, format_value
from .driver import RunResult
from .results import ConfigResults, common_params, pairs, varying_keys
from .stats import Summary, stars
from .targets import Verdict

# ------------------------------------------------------------- progress ----


class Progress:
    """``[ 12/340  3%] tls_s2c record=1K shape=a  streams/asyncio #2  512 MiB/s  0:41 left``

    On a terminal the line is rewritten in place; otherwise (CI logs) one
    line per run is printed.
    """

    def __init__(self, total: int, stream: IO[str] = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.current = ""

    def config(self, text: str) -> None:
        self.current = text

    def __call__(self, result: RunResult) -> None:
        self.done += 1
        if not result.ok:
            self.failed += 1
        elapsed = time.monotonic() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        if result.ok:
            key = "mibps" if "mibps" in result.metrics else next(iter(result.metrics), "")
            outcome = f"{result.metrics.get(key, float('nan')):.4g} {key}"
        else:
            outcome = f"{result.status.upper()}: {result.error[:80]}"
        line = (f"[{self.done:4d}/{self.total} {100 * self.done // max(self.total, 1):3d}%] "
                f"{self.current}  {result.impl} #{result.run + 1}  {outcome}  "
                f"{_clock(elapsed)} elapsed, {_clock(left)} left")
        if self.tty:
            self.stream.write("\r\x1b[K" + line[: os.get_terminal_size(self.stream.fileno()).columns - 1])
            if not result.ok:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.write(f"{self.done} runs in {_clock(time.monotonic() - self.t0)}, {self.failed} not ok\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


# ------------------------------------------------------------- markdown ----


def _cell(s: Summary, metric: Metric) -> str:
    if s.n == 0:
        return "–"
    text = metric.fmt.format(s.median)
    if s.n > 1 and not math.isnan(s.rel_spread):
        text += f" ±{100 * s.rel_spread:.0f}%"
    return text


def _ratio_cell(r: float, p: float) -> str:
    if math.isnan(r):
        return "–"
    return f"{r:.2f}x {stars(p)}".strip()


def markdown(configs: Sequence[ConfigResults], verdicts: Sequence[Verdict], meta: dict[str, Any]) -> str:
    out: list[str] = []
    out.append(f"Run {meta['date']} on {meta['machine']}; {meta['versions']}.  ")
    out.append(f"Command: `{meta['command']}`  ")
    out.append("Cells: median ±half the interquartile range (relative); ratios are A/B of medians with "
               "Welch t-test stars (* p<0.05, ** p<0.01, *** p<0.001). For CPU s/GiB and memory, lower is "
               "better, so a ratio below 1 favours A.\n")
    if verdicts:
        out.append("### Targets\n")
        out.append("| target | config | measured | |")
        out.append("|---|---|---:|---|")
        for v in verdicts:
            out.append(f"| {v.target.text} | {v.config} | {v.shown} | {v.status} |")
        out.append("")
    for scenario, group in _by_scenario(configs):
        out += _scenario_section(scenario, group)
    return "\n".join(out) + "\n"


def _by_scenario(configs: Sequence[ConfigResults]) -> list[tuple[Scenario, list[ConfigResults]]]:
    groups: dict[str, tuple[Scenario, list[ConfigResults]]] = {}
    for c in configs:
        groups.setdefault(c.scenario.name, (c.scenario, []))[1].append(c)
    return list(groups.values())


def _scenario_section(scenario: Scenario, group: list[ConfigResults]) -> list[str]:
    out = [f"### {scenario.name}: {scenario.title}\n"]
    common = common_params([c.params for c in group])
    runs = max((r.run + 1 for c in group for r in c.runs), default=0)
    out.append("Parameters: " + " ".join(f"{k}={format_value(v)}" for k, v in common.items())
               + f"; {runs} run(s) per implementation.\n")
    metrics = list(scenario.metrics)
    out.append("| config | implementation | " + " | ".join(m.label for m in metrics) + " |")
    out.append("|---|---|" + "---:|" * len(metrics))
    problems: list[str] = []
    for c in group:
        for impl in c.impls:
            status, error = c.status(impl.name)
            cells = [_cell(c.summary(impl.name, m.key), m) for m in metrics]
            if status != "ok":
                problems.append(f"- {c.label} {impl.name}: {status} ({error})")
                if all(cell == "–" for cell in cells):
                    cells = [status.upper()] + ["–"] * (len(cells) - 1)
            out.append(f"| {c.label} | {impl.name} | " + " | ".join(cells) + " |")
    out.append("")
    compared = [m for m in metrics if m.key in scenario.plot_metrics]
    rows = []
    for c in group:
        for a, b in pairs(c.impls):
            cells = [_ratio_cell(*c.compare(a, b, m.key)) for m in compared]
            if any(cell != "–" for cell in cells):
                rows.append(f"| {c.label} | {a} / {b} | " + " | ".join(cells) + " |")
    if rows:
        out.append("| config | A / B | " + " | ".join(m.label for m in compared) + " |")
        out.append("|---|---|" + "---:|" * len(compared))
        out += rows
        out.append("")
    if problems:
        out.append("Not measured:\n")
        out += problems
        out.append("")
    return out


# ------------------------------------------------------------------ CSV ----


def write_csv(configs: Sequence[ConfigResults], outdir: str) -> list[str]:
    raw_path = os.path.join(outdir, "raw.csv")
    summary_path = os.path.join(outdir, "summary.csv")
    pairs_path = os.path.join(outdir, "pairs.csv")
    metric_keys: list[str] = []
    for c in configs:
        for r in c.runs:
            metric_keys += [k for k in r.metrics if k not in metric_keys]
    with open(raw_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "config", "params", "impl", "run", "status", "error", "run_seconds", *metric_keys])
        for c in configs:
            for r in c.runs:
                w.writerow([c.scenario.name, c.label, json.dumps(c.params), r.impl, r.run, r.status, r.error,
                            f"{r.seconds:.3f}", *(r.metrics.get(k, "") for k in metric_keys)])
    with open(summary_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "config", "impl", "metric", "n", "median", "q1", "q3", "mean", "stdev", "status"])
        for c in configs:
            for impl in c.impls:
                status = c.status(impl.name)[0]
                for m in c.scenario.metrics:
                    s = c.summary(impl.name, m.key)
                    w.writerow([c.scenario.name, c.label, impl.name, m.key, s.n, s.median, s.q1, s.q3,
                                s.mean, s.stdev, status])
    with open(pairs_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "config", "a", "b", "metric", "ratio", "p", "stars"])
        for c in configs:
            for a, b in pairs(c.impls):
                for m in c.scenario.metrics:
                    value, p = c.compare(a, b, m.key)
                    w.writerow([c.scenario.name, c.label, a, b, m.key, value, p, stars(p)])
    return [raw_path, summary_path, pairs_path]


# ---------------------------------------------------------------- plots ----

_COLORS = {impl.name: i for i, impl in enumerate(ALL_IMPLS)}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def write_plots(configs: Sequence[ConfigResults], outdir: str) -> list[str]:
    """One PNG per scenario and facet: one panel per plotted metric, the
    plot parameter on the x axis, one bar per implementation (error bars:
    interquartile range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab20")
    paths: list[str] = []
    for scenario, group in _by_scenario(configs):
        x = scenario.plot_x
        varying = varying_keys([c.params for c in group])
        facet_keys = [k for k in varying if k != x]
        facets: dict[str, list[ConfigResults]] = {}
        for c in group:
            facets.setdefault(" ".join(f"{k}={format_value(c.params[k])}" for k in facet_keys), []).append(c)
        metrics = [m for m in scenario.metrics if m.key in scenario.plot_metrics]
        for facet, cs in facets.items():
            impls: list[str] = []
            for c in cs:
                impls += [i.name for i in c.impls if i.name not in impls]
            fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
            width = 0.8 / max(len(impls), 1)
            for ax, metric in zip(axes[0], metrics):
                for i, impl in enumerate(impls):
                    pos, med, lo, hi = [], [], [], []
                    for j, c in enumerate(cs):
                        s = c.summary(impl, metric.key)
                        if s.n:
                            pos.append(j - 0.4 + width * (i + 0.5))
                            med.append(s.median)
                            lo.append(s.median - s.q1)
                            hi.append(s.q3 - s.median)
                    ax.bar(pos, med, width, yerr=[lo, hi] if pos else None, capsize=2,
                           color=cmap(_COLORS.get(impl, 0) % 20), label=impl)
                ax.set_xticks(range(len(cs)))
                ax.set_xticklabels([f"{x}={format_value(c.params[x])}" if x else "" for c in cs])
                ax.set_ylabel(metric.label + (" (higher is better)" if metric.better == "higher"
                                              else " (lower is better)"))
                ax.grid(axis="y", alpha=0.3)
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="center right", fontsize=8)
            fig.suptitle(f"{scenario.title}" + (f" ({facet})" if facet else ""))
            fig.tight_layout(rect=(0, 0, 0.8, 1))
            path = os.path.join(outdir, scenario.name + (f"_{_slug(facet)}" if facet else "") + ".png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths


# --------------------------------------------------------------- README ----

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"


def update_readme(readme: str, imgdir: str, results_dir: str) -> None:
    """Put ``results_dir``'s results.md and PNGs into the README between the
    result markers, and copy the PNGs into ``imgdir``."""
    import glob
    import shutil

    with open(os.path.join(results_dir, "results.md")) as f:
        table = f.read().strip()
    os.makedirs(imgdir, exist_ok=True)
    for old in glob.glob(os.path.join(imgdir, "*.png")):
        os.remove(old)
    images = []
    for png in sorted(glob.glob(os.path.join(results_dir, "*.png"))):
        shutil.copy(png, imgdir)
        rel = os.path.relpath(os.path.join(imgdir, os.path.basename(png)), os.path.dirname(readme))
        images.append(f"![{os.path.basename(png)[:-4]}]({rel})")
    with open(readme) as f:
        text = f.read()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    body = f"\n{table}\n\n#### Plots\n\n" + "\n".join(images) + "\n"
    with open(readme, "w") as f:
        f.write(text[:start] + body + text[end:])
