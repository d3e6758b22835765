"""The statistics of the report: Welch's t-test, mean ± standard deviation over seeds, trailing means, thirds."""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
from scipy import stats


def trailing_mean(values, window):
    """Mean of each value and the ``window - 1`` before it (fewer at the start): a per-step curve, smoothed."""
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def thirds(values):
    """Means of the first, middle and last third of a run's per-step values; nan for a third with no value."""
    chunks = np.array_split(np.asarray(values, dtype=float), 3)
    return [float(np.nanmean(c)) if np.isfinite(c).any() else float("nan") for c in chunks]  # short runs: nan


def mean_std(values, pattern="{:.3f}"):
    """``mean ± standard deviation`` of the values (over seeds; 0 for one seed)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{pattern.format(statistics.mean(values))} ± {pattern.format(spread)}"


def welch_t_test(a, b):
    """Two-sided Welch t-test of mean(a) != mean(b): ``(t, p)``. ``(nan, nan)`` when a sample has fewer than 2
    values or both have no spread: no test is possible there."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2 or a.var(ddof=1) + b.var(ddof=1) == 0:
        return float("nan"), float("nan")
    # SciPy warns of precision loss when a sample's values are all equal (every seed at the same accuracy): its
    # variance is then exactly 0, which Welch's test handles
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        test = stats.ttest_ind(a, b, equal_var=False)
    return float(test.statistic), float(test.pvalue)


def p_text(test):
    """A test's p as the document prints it: 2 decimals, ``-`` where there was no test."""
    return "-" if math.isnan(test[1]) else f"{test[1]:.2f}"
