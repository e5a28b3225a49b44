"""Statistics for the report: median and interquartile range per metric,
Welch's t-test and Node-style significance stars per pair.

Node's ``benchmark/compare.R`` marks a difference with ``*``, ``**``,
``***`` for p < 0.05, 0.01, 0.001 of a Welch two-sample t-test (unequal
variances); this module does the same with scipy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as _scipy_stats


@dataclasses.dataclass(frozen=True)
class Summary:
    n: int
    median: float
    q1: float
    q3: float
    mean: float
    stdev: float

    @property
    def rel_spread(self) -> float:
        """Half the interquartile range relative to the median (the ``±%``
        printed in tables)."""
        if not self.median or self.n < 2:
            return float("nan")
        return (self.q3 - self.q1) / 2 / abs(self.median)


def summarize(values: Sequence[float]) -> Summary:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if arr.size == 0:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan, nan)
    q1, median, q3 = np.percentile(arr, [25, 50, 75])
    stdev = float(arr.std(ddof=1)) if arr.size > 1 else float("nan")
    return Summary(int(arr.size), float(median), float(q1), float(q3), float(arr.mean()), stdev)


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test; NaN when it can't be computed
    (fewer than two runs on a side, or no variance at all)."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    if np.std(a) == 0 and np.std(b) == 0:
        return 0.0 if np.mean(a) != np.mean(b) else 1.0
    result = _scipy_stats.ttest_ind(a, b, equal_var=False)
    return float(result.pvalue)


def stars(p: float) -> str:
    if math.isnan(p):
        return ""
    if p < 0.001:
        return "***"
    if p < 0.01:
        return "**"
    if p < 0.05:
        return "*"
    return ""


def ratio(a: Summary, b: Summary) -> float:
    """Ratio of medians a / b."""
    if b.n == 0 or a.n == 0 or not b.median:
        return float("nan")
    return a.median / b.median
