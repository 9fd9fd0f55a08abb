from __future__ import annotations

import random

import numpy as np

from iterserve.loadtests.studies.router_tournament.tournament_stats import (
    Interval,
    best_of,
    bootstrap_mean_rate,
    bootstrap_percentile,
    within,
)


def test_bootstrap_interval_brackets_the_estimate_and_is_seeded():
    rng = random.Random(1)
    values = [rng.expovariate(1.0) for _ in range(2000)]
    iv = bootstrap_percentile(values, 99)
    assert iv.lo <= iv.value <= iv.hi
    assert iv.value == float(np.percentile(values, 99))
    assert bootstrap_percentile(values, 99) == iv
    narrow = bootstrap_percentile(values * 10, 99)
    assert narrow.hi - narrow.lo < iv.hi - iv.lo


def test_goodput_interval():
    iv = bootstrap_mean_rate([True] * 90 + [False] * 10, span_s=10.0)
    assert iv.value == 9.0 and iv.lo < 9.0 < iv.hi


def test_best_and_ties_only_by_non_overlapping_intervals():
    ivs = {"a": Interval(1.0, 0.9, 1.1), "b": Interval(1.05, 1.0, 1.2),
           "c": Interval(2.0, 1.8, 2.2)}
    best, ties = best_of(ivs, lower_is_better=True)
    assert best == "a" and sorted(ties) == ["a", "b"]
    assert within(1.04, 1.0, 0.05, True) and not within(1.06, 1.0, 0.05, True)
    assert within(0.96, 1.0, 0.05, False)
