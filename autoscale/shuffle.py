"""`random.Random.shuffle`, without a Python call per element.

A router shuffles its candidates for every request (ties keep candidate order, and
independent routers must not break them towards the same replica). At 256 replicas the
stdlib's shuffle, one `_randbelow` call per element, took 5 % of the cluster simulator's
time (py-spy). This one draws the same `getrandbits(k)` values in the same order inline, so it
gives the same permutation and leaves the generator in the same state
(tests/unit/test_shuffle.py checks both against the installed Python's shuffle): routers
that run through it make the same decisions, run for run.
"""

from __future__ import annotations

import random
from typing import TypeVar

T = TypeVar("T")


def shuffle(rng: random.Random, items: list[T]) -> None:
    """Shuffle items in place exactly as rng.shuffle(items) would."""
    if type(rng) is not random.Random:  # a subclass may draw its numbers differently
        rng.shuffle(items)
        return
    getrandbits = rng.getrandbits
    # stdlib: for i from the end down, j = _randbelow(i + 1): getrandbits(k) with
    # k = (i + 1).bit_length(), drawn again while j > i. k is constant over runs of i, so
    # it is computed once per run.
    top = len(items) - 1
    while top > 0:
        k = (top + 1).bit_length()
        low = 1 << (k - 1)  # i + 1 >= low has bit_length k
        for i in range(top, low - 2, -1):
            j = getrandbits(k)
            while j > i:
                j = getrandbits(k)
            items[i], items[j] = items[j], items[i]
        top = low - 2
