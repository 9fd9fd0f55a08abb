"""The one percentile definition of the simulator, the planner and the tournament.

Linear interpolation between closest ranks: numpy's default (`method="linear"`), so a
figure here equals `numpy.percentile(values, q)`. Pure Python: the library must not need
numpy to report a p99.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of values; NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def percentile_of_counts(counts: Mapping[float, int], q: float) -> float:
    """`percentile` of the multiset {value: how many times}, without expanding it.

    For histograms of millions of inter-token gaps (the simulator keeps gaps rounded to
    0.1 ms as counts): equal to percentile() of the expanded list.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    items = sorted((v, n) for v, n in counts.items() if n > 0)
    total = sum(n for _, n in items)
    if total == 0:
        return math.nan
    rank = (total - 1) * q / 100.0
    lo = math.floor(rank)
    lo_value = hi_value = items[-1][0]
    seen = 0
    for i, (value, n) in enumerate(items):
        if seen + n > lo:
            lo_value = value
            # the next ordered element: still this value, or the next distinct one
            hi_value = value if seen + n > lo + 1 else items[min(i + 1, len(items) - 1)][0]
            break
        seen += n
    return lo_value + (hi_value - lo_value) * (rank - lo)
