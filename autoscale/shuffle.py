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
    for i in range(len(items) - 1, 0, -1):
        below = i + 1  # stdlib: j = _randbelow(i + 1), by rejection on getrandbits(k)
        k = below.bit_length()
        j = getrandbits(k)
        while j >= below:
            j = getrandbits(k)
        items[i], items[j] = items[j], items[i]
