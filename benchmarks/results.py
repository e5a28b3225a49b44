"""Results of one configuration, and the comparisons the report makes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .core import Impl, Params, Scenario, config_label, impl_by_name
from .driver import RunResult
from .stats import Summary, ratio, summarize, welch_p


@dataclasses.dataclass
class ConfigResults:
    scenario: Scenario
    params: Params
    impls: list[Impl]
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    label: str = ""

    def of(self, impl: str) -> list[RunResult]:
        return [r for r in self.runs if r.impl == impl]

    def values(self, impl: str, metric: str) -> list[float]:
        return [r.metrics[metric] for r in self.of(impl) if r.ok and metric in r.metrics]

    def summary(self, impl: str, metric: str) -> Summary:
        return summarize(self.values(impl, metric))

    def status(self, impl: str) -> tuple[str, str]:
        """("ok" | "failed" | "unavailable" | "missing", first error)."""
        runs = self.of(impl)
        if not runs:
            return "missing", ""
        bad = [r for r in runs if not r.ok]
        if not bad:
            return "ok", ""
        kind = "unavailable" if all(r.status == "unavailable" for r in bad) else "failed"
        errors = [r.error for r in bad if r.status == "failed"] or [bad[0].error]
        return kind, f"{len(bad)}/{len(runs)} runs: {errors[0]}"

    def compare(self, a: str, b: str, metric: str) -> tuple[float, float]:
        """(ratio of medians a/b, Welch p-value)."""
        va, vb = self.values(a, metric), self.values(b, metric)
        return ratio(summarize(va), summarize(vb)), welch_p(va, vb)


def label_configs(configs: Sequence[ConfigResults]) -> None:
    """Label each configuration by the parameters that vary between them."""
    keys = varying_keys([c.params for c in configs])
    for c in configs:
        c.label = config_label(c.params, keys) or "default"


def varying_keys(params: Sequence[Params]) -> list[str]:
    if not params:
        return []
    keys = list(params[0])
    return [k for k in keys if len({repr(p.get(k)) for p in params}) > 1]


def common_params(params: Sequence[Params]) -> Params:
    varying = set(varying_keys(params))
    return {k: v for k, v in params[0].items() if k not in varying} if params else {}


def pairs(impls: Sequence[Impl]) -> list[tuple[str, str]]:
    """Comparisons reported for a configuration: every slabnet
    implementation against every baseline on the same loop, and against the
    loop-less references (the TLS socket floor and decrypt ceiling) where
    there are some."""
    out: list[tuple[str, str]] = []
    baselines = [i for i in impls if not i.is_slabnet and i.on_loop]
    ceilings = [i for i in impls if not i.on_loop]
    for s in (i for i in impls if i.is_slabnet):
        out += [(s.name, b.name) for b in baselines if b.loop == s.loop]
        out += [(s.name, c.name) for c in ceilings]
    return out


def impl_names(impls: Sequence[Impl]) -> list[str]:
    return [i.name for i in impls]


__all__ = ["ConfigResults", "label_configs", "varying_keys", "common_params", "pairs",
           "impl_names", "impl_by_name"]
