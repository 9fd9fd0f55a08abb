"""Inter-token gaps of a cluster simulation: a histogram of every gap, and per request its
longest gap and its p99 gap, for the millions of gaps a run makes.

`ItlCounter` computes them a batch of requests at a time: each finished
request's token times are appended to one float buffer (C-speed), and a full buffer is
turned into gaps, bins, maxima and p99s by a fixed number of numpy passes over the whole
batch instead of a dozen numpy calls per request (the per-request calls cost ~7 % of a
64-replica run). Same IEEE operations on the same values, so the same floats:
tests/unit/test_cluster_sim_itl.py checks equality with the definitions (one request at a
time, plain Python), which live there.
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import Sequence
from typing import Protocol

import numpy as np

ITL_RESOLUTION_S = 1e-4  # inter-token gaps are counted in 0.1 ms bins
ITL_BINS_PER_S = 1e4


class ItlRecord(Protocol):
    """Where a request's figures go (`RequestRecord`)."""

    itl_max: float
    itl_p99: float


class ItlCounter:
    """`add(token_times, record)` for each finished request; its record's itl_max and
    itl_p99 are set when its batch is computed, at the latest by `flush()` or `histogram()`
    (read them after either)."""

    BATCH_TOKENS = 1 << 21  # token times buffered before a batch is computed (16 MiB)
    VECTOR_TOP = 8  # p99s that sit deeper below the max than this are partitioned one by one
    DENSE_BINS = 1 << 22  # a batch whose gaps all fall below this bin (7 min) is bincounted

    def __init__(self) -> None:
        self._bins: collections.Counter = collections.Counter()
        self._times = array("d")
        self._lengths = array("q")
        self._records: list[ItlRecord] = []

    def add(self, token_times: Sequence[float], record: ItlRecord) -> None:
        self._times.extend(token_times)
        self._lengths.append(len(token_times))
        self._records.append(record)
        if len(self._times) >= self.BATCH_TOKENS:
            self.flush()

    def histogram(self) -> dict[float, int]:
        """{bin's lower edge in seconds: count} of every gap added, in bin order."""
        self.flush()
        return {b / ITL_BINS_PER_S: self._bins[b] for b in sorted(self._bins)}

    def flush(self) -> None:
        """Compute the buffered requests' figures and count their gaps."""
        if not self._records:
            return
        times = np.array(self._times, dtype=np.float64)
        lengths = np.array(self._lengths, dtype=np.int64)
        records = self._records
        self._times, self._lengths, self._records = array("d"), array("q"), []
        gaps, num_gaps = _batch_gaps(times, lengths)
        if len(gaps):
            bins = (gaps * ITL_BINS_PER_S).astype(np.int64)
            if bins.max() < self.DENSE_BINS:  # counted in one pass, not sorted
                counts = np.bincount(bins)
                values = np.flatnonzero(counts)
                counts = counts[values]
            else:
                values, counts = np.unique(bins, return_counts=True)
            self._bins.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))
        longest, p99 = self._maxima_and_p99s(gaps, num_gaps)
        for record, top, tail in zip(records, longest, p99, strict=True):
            record.itl_max, record.itl_p99 = top, tail

    def _maxima_and_p99s(self, gaps: np.ndarray, num_gaps: np.ndarray
                         ) -> tuple[list[float], list[float]]:
        """Per request (num_gaps[i] gaps, laid end to end in gaps): max and `percentile(.,
        99)` (0.0, 0.0 without gaps). The p99 interpolates between the order statistics lo
        and hi = lo + 1, which sit within a few places of the max; those are read off the
        top of each request's gaps, one max per pass (VECTOR_TOP passes at most)."""
        n = num_gaps
        has = n > 0
        longest = np.zeros(len(n))
        p99 = np.zeros(len(n))
        if not has.any():
            return longest.tolist(), p99.tolist()
        starts = (np.cumsum(n) - n)[has]
        m = n[has]
        rank = (m - 1) * 99 / 100.0  # percentile's own spelling, elementwise
        lo = np.floor(rank).astype(np.int64)
        hi = np.minimum(lo + 1, m - 1)
        from_top_lo, from_top_hi = m - 1 - lo, m - 1 - hi  # 0: the max
        near = from_top_lo < self.VECTOR_TOP
        work = gaps.copy()
        depth = int(from_top_lo[near].max()) + 1 if near.any() else 1
        tops = []
        owner = np.repeat(np.arange(len(m)), m)
        for level in range(depth):
            top = np.maximum.reduceat(work, starts)
            tops.append(top)
            if level + 1 < depth:  # take one occurrence of each request's top out
                at = np.flatnonzero(work == top[owner])
                _, first = np.unique(owner[at], return_index=True)
                work[at[first]] = -np.inf
        stacked = np.stack(tops)
        rows = np.arange(len(m))
        low = np.zeros(len(m))
        high = np.zeros(len(m))
        low[near] = stacked[from_top_lo[near], rows[near]]
        high[near] = stacked[from_top_hi[near], rows[near]]
        for i in np.flatnonzero(~near).tolist():  # a p99 deep below the max: a long request
            own = np.partition(gaps[starts[i] : starts[i] + m[i]], (lo[i], hi[i]))
            low[i], high[i] = own[lo[i]], own[hi[i]]
        longest[has] = tops[0]
        p99[has] = low + (high - low) * (rank - lo)
        return longest.tolist(), p99.tolist()


def _batch_gaps(times: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gaps of requests whose token times lie end to end (lengths[i] each), in order,
    and how many each has (max(0, length - 1))."""
    num_gaps = np.maximum(lengths - 1, 0)
    if len(times) < 2:
        return np.zeros(0), num_gaps
    diffs = times[1:] - times[:-1]
    starts = np.cumsum(lengths) - lengths
    keep = np.ones(len(diffs), dtype=bool)
    crossing = starts[(starts > 0) & (starts < len(times))] - 1  # last time -> next's first
    keep[crossing] = False
    gaps = diffs[keep]
    if len(gaps) != int(num_gaps.sum()):
        raise RuntimeError("ITL batch: gap count does not match the requests' lengths")
    return gaps, num_gaps

