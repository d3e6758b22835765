"""The statistics of every report: mean ± standard deviation over seeds, and bootstrap intervals over seeds of a
mean and of a ratio of two means, with censored seeds carried as bounds."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # 95% intervals
RESAMPLES = 2000  # bootstrap resamples of the seeds


def mean_std(values, pattern="{:.3f}"):
    """``mean ± standard deviation`` of the values (over seeds; 0 for one seed)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{pattern.format(statistics.mean(values))} ± {pattern.format(spread)}"


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95% bootstrap interval; ``bound``: ``"="`` (measured), ``">="`` (point and ends are
    lower bounds), ``"<="`` (upper bounds) or ``"?"`` (censored on both sides of a ratio: no bound)."""

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
        low, high = (f"{mark}{pattern.format(v)}" for v in (self.low, self.high))
        return f"{mark}{pattern.format(self.point)} [{low}, {high}]"


def _percentiles(draws):
    draws = np.asarray(draws, dtype=float)
    draws = draws[np.isfinite(draws)]
    if not len(draws):
        return float("nan"), float("nan")
    return tuple(
        float(v) for v in np.percentile(draws, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)], method="inverted_cdf")
    )


def bootstrap_mean(values, rng, resamples=RESAMPLES):
    """The seed mean of ``values`` (``(value, censored)`` per seed) with its bootstrap interval; a lower bound if a
    seed is censored."""
    points = np.array([v for v, _ in values], dtype=float)
    draws = points[rng.integers(0, len(points), (resamples, len(points)))].mean(axis=1)
    bound = ">=" if any(c for _, c in values) else "="
    return Interval(float(points.mean()), *_percentiles(draws), bound)


def bootstrap_ratio(arm, base, rng, resamples=RESAMPLES):
    """The arm's seed mean over the baseline's (``(value, censored)`` per seed each), with a percentile interval
    from resampling each side's seeds independently; bounded as :class:`Interval` says: a lower bound where only
    the arm has censored seeds, an upper bound where only the baseline has, none where both have."""
    a, b = (np.array([v for v, _ in values], dtype=float) for values in (arm, base))
    censored = (any(c for _, c in arm), any(c for _, c in base))
    bound = {(False, False): "=", (True, False): ">=", (False, True): "<=", (True, True): "?"}[censored]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = a.mean() / b.mean()
        draws = a[rng.integers(0, len(a), (resamples, len(a)))].mean(axis=1) / b[
            rng.integers(0, len(b), (resamples, len(b)))
        ].mean(axis=1)
    if not np.isfinite(point):  # the baseline's mean is 0: it had the threshold at the warm start
        return Interval(float("nan"), float("nan"), float("nan"), bound)
    return Interval(float(point), *_percentiles(draws), bound)


def overlap(a, b):
    """Whether two seed-mean intervals (:func:`bootstrap_mean`, measured or lower bounds) overlap: ``"yes"``,
    ``"no"`` or ``"unknown"`` (a censored interval may still move up)."""
    if a.bound == b.bound == "=":
        return "yes" if a.low <= b.high and b.low <= a.high else "no"
    if a.bound == b.bound == ">=":
        return "unknown"
    exact, bounded = (a, b) if a.bound == "=" else (b, a)
    return "no" if bounded.low > exact.high else "unknown"  # already above, and it can only move up
