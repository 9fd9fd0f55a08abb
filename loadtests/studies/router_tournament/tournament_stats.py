"""Statistics of the tournament: bootstrap intervals and who wins a cell.

A win is claimed only where intervals do not overlap: router A beats B on p99 TTFT when A's
upper 95 % bound is below B's lower bound. Goodput (requests/s meeting the SLO) gets the
same treatment: its interval comes from resampling requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 1000


@dataclass(frozen=True)
class Interval:
    value: float
    lo: float
    hi: float

    def to_list(self) -> list[float]:
        return [self.value, self.lo, self.hi]

    def overlaps(self, other: Interval) -> bool:
        return not (self.hi < other.lo or other.hi < self.lo)


def bootstrap_percentile(values: Sequence[float], q: float, seed: int = 0,
                         resamples: int = BOOTSTRAP_RESAMPLES) -> Interval:
    """The q-th percentile (numpy 'linear', as `autoscale.percentile`) with a percentile
    bootstrap 95 % interval over `resamples` resamples of the values."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, data.size, size=(resamples, data.size))
    stats = np.percentile(data[idx], q, axis=1)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return Interval(float(np.percentile(data, q)), float(lo), float(hi))


def bootstrap_mean_rate(good: Sequence[bool], span_s: float, seed: int = 0,
                        resamples: int = BOOTSTRAP_RESAMPLES) -> Interval:
    """Goodput (good requests / span) with a bootstrap interval over requests."""
    data = np.asarray(good, dtype=np.float64)
    if data.size == 0 or span_s <= 0:
        return Interval(0.0, 0.0, 0.0)
    rng = np.random.default_rng(seed)
    sums = data[rng.integers(0, data.size, size=(resamples, data.size))].sum(axis=1)
    lo, hi = np.percentile(sums / span_s, [2.5, 97.5])
    return Interval(float(data.sum() / span_s), float(lo), float(hi))


def best_of(intervals: dict[str, Interval], lower_is_better: bool) -> tuple[str, list[str]]:
    """(the best point estimate's name, every name whose interval overlaps the best's:
    the statistical tie group; a win over these is not claimed)."""
    finite = {k: v for k, v in intervals.items() if not math.isnan(v.value)}
    if not finite:
        return "", []
    pick = min if lower_is_better else max
    best = pick(finite, key=lambda k: finite[k].value)
    ties = [k for k, v in finite.items() if v.overlaps(finite[best])]
    return best, ties


def within(value: float, best: float, tolerance: float, lower_is_better: bool) -> bool:
    """Is value the best or within `tolerance` (a fraction) of it?"""
    if lower_is_better:
        return value <= best * (1 + tolerance)
    return value >= best * (1 - tolerance)
