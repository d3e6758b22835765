"""The statistics of every report: mean ± standard deviation over seeds, and Student-t intervals over seeds of a
mean and of a ratio of two arms' times (on the log scale), with censored seeds carried as bounds. With 2 to 4 seeds
a percentile bootstrap is narrower than these few degrees of freedom allow: on the speed study's ratios (section 1,
4 seeds a side) the t-intervals are 1.4-1.6x as wide on the log scale (2026-11-28), so the reports use t."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

ALPHA = 0.05  # 95% intervals


def mean_std(values, pattern="{:.3f}"):
    """``mean ± standard deviation`` of the values (over seeds; 0 for one seed)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{pattern.format(statistics.mean(values))} ± {pattern.format(spread)}"


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95% interval (NaN ends: none, one seed); ``bound``: ``"="`` (measured), ``">="``
    (point and ends are lower bounds), ``"<="`` (upper bounds) or ``"?"`` (censored on both sides of a ratio: no
    bound)."""

    point: float
    low: float
    high: float
    bound: str = "="

    def text(self, pattern="{:.2f}"):
        if self.bound == "?":
            return "- (censored in both)"
        if math.isnan(self.point):
            return "-"
        mark = "" if self.bound == "=" else self.bound
        if math.isnan(self.low):
            return f"{mark}{pattern.format(self.point)} (one seed)"
        low, high = (f"{mark}{pattern.format(v)}" for v in (self.low, self.high))
        return f"{mark}{pattern.format(self.point)} [{low}, {high}]"


def _bound(values):
    """``">="`` where a seed of ``values`` (``(value, censored)`` each) is censored, else ``"="``."""
    return ">=" if any(c for _, c in values) else "="


def _t(df):
    return float(scipy_stats.t.ppf(1 - ALPHA / 2, df))


def t_mean(values):
    """The seed mean of ``values`` (``(value, censored)`` per seed) with its t-interval (n - 1 degrees of freedom);
    a lower bound if a seed is censored."""
    points = np.array([v for v, _ in values], dtype=float)
    mean, n = float(points.mean()), len(points)
    if n < 2:
        return Interval(mean, float("nan"), float("nan"), _bound(values))
    half = _t(n - 1) * float(points.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, _bound(values))


def log_ratio(arm, base):
    """The arm's geometric seed mean over the baseline's (``(value, censored)`` per seed each, values > 0):
    ``exp(mean log a - mean log b)``, with the Welch t-interval of that difference of log means (Welch-Satterthwaite
    degrees of freedom), mapped back by ``exp``. Bounded as :class:`Interval` says: a lower bound where only the arm
    has censored seeds, an upper bound where only the baseline has, none where both have. A baseline value of 0 (the
    threshold held at the warm start) gives no ratio."""
    a, b = (np.array([v for v, _ in values], dtype=float) for values in (arm, base))
    censored = (any(c for _, c in arm), any(c for _, c in base))
    bound = {(False, False): "=", (True, False): ">=", (False, True): "<=", (True, True): "?"}[censored]
    if (b <= 0).any() or (a <= 0).any():
        return Interval(float("nan"), float("nan"), float("nan"), bound)
    la, lb = np.log(a), np.log(b)
    point = float(la.mean() - lb.mean())
    if min(len(la), len(lb)) < 2:
        return Interval(math.exp(point), float("nan"), float("nan"), bound)
    va, vb = la.var(ddof=1) / len(la), lb.var(ddof=1) / len(lb)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(math.exp(point), math.exp(point), math.exp(point), bound)
    df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1))
    half = _t(df) * se
    return Interval(math.exp(point), math.exp(point - half), math.exp(point + half), bound)


def overlap(a, b):
    """Whether two seed-mean intervals (:func:`t_mean`, measured or lower bounds) overlap: ``"yes"``,
    ``"no"`` or ``"unknown"`` (a censored interval may still move up; no interval, one seed)."""
    if math.isnan(a.low) or math.isnan(b.low):
        return "unknown"
    if a.bound == b.bound == "=":
        return "yes" if a.low <= b.high and b.low <= a.high else "no"
    if a.bound == b.bound == ">=":
        return "unknown"
    exact, bounded = (a, b) if a.bound == "=" else (b, a)
    return "no" if bounded.low > exact.high else "unknown"  # already above, and it can only move up
