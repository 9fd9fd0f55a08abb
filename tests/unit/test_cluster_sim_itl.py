"""The batched ITL counter gives the definitions' floats: request_itl and count_gaps below,
one request at a time in plain Python, are the readable oracle of autoscale/sim/itl.py."""

from __future__ import annotations

import collections
import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.autoscale.percentile import percentile
from iterserve.autoscale.sim.itl import ITL_BINS_PER_S, ItlCounter


def request_itl(token_times: Sequence[float]) -> tuple[list[float], float, float]:
    """(gaps, max gap, p99 gap) of one request's token times."""
    gaps = list(map(operator.sub, token_times[1:], token_times[:-1]))
    if not gaps:
        return gaps, 0.0, 0.0
    return gaps, max(gaps), percentile(gaps, 99)


def count_gaps(bins: collections.Counter, gaps: Sequence[float]) -> None:
    """Add gaps to a Counter of 0.1 ms bin numbers (each gap counts at its bin's
    lower edge; C-speed: a run holds millions of gaps). `itl_histogram` turns it into
    {gap: count}."""
    bins.update(map(int, map(ITL_BINS_PER_S.__mul__, gaps)))


def itl_histogram(bins: collections.Counter) -> dict[float, int]:
    """{bin's lower edge in seconds: count}, in the order the bins were first seen."""
    return {b / ITL_BINS_PER_S: n for b, n in bins.items()}


@dataclass
class Record:
    itl_max: float = -1.0
    itl_p99: float = -1.0


class SmallBatches(ItlCounter):
    BATCH_TOKENS = 500  # flushes often, and some requests' tokens outnumber a batch
    VECTOR_TOP = 3  # and some p99s are partitioned one by one


class FewDenseBins(SmallBatches):
    DENSE_BINS = 5000  # a batch with a 1.3 s gap is counted by sorting, the others by bincount


def test_itl_counter_equals_request_itl_and_count_gaps() -> None:
    for counter_type in (ItlCounter, SmallBatches, FewDenseBins):
        rng = random.Random(4)
        counter, bins = counter_type(), collections.Counter()
        expected: list[tuple[Record, float, float]] = []
        for _ in range(400):
            t, times = rng.random(), []
            for _ in range(rng.choice([0, 1, 2, 3, 5, 33, 34, 101, 102, 200, 401, 700, 1500])):
                times.append(t)
                t += rng.choice([0.0, 0.0151, 0.02, rng.random() * 0.05, 1.3])  # ties, outliers
            gaps, longest, p99 = request_itl(times)
            count_gaps(bins, gaps)
            record = Record()
            counter.add(times, record)
            expected.append((record, longest, p99))
        assert counter.histogram() == dict(sorted(itl_histogram(bins).items()))
        for record, longest, p99 in expected:
            assert (record.itl_max, record.itl_p99) == (longest, p99)  # bit for bit


def test_a_p99_two_places_below_the_max_interpolates_between_them() -> None:
    """153 gaps: the p99 is 48 % of the way from the 3rd largest gap to the 2nd."""
    times = [0.0]
    for gap in [0.01] * 150 + [0.5, 0.4, 0.3]:
        times.append(times[-1] + gap)
    record = Record()
    counter = ItlCounter()
    counter.add(times, record)
    counter.flush()
    _, longest, p99 = request_itl(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert record.itl_max == longest == max(gaps)
    ordered = sorted(gaps)
    third, second = ordered[-3], ordered[-2]  # ~0.3 and ~0.4
    assert record.itl_p99 == p99 == third + (second - third) * (152 * 99 / 100.0 - 150)
