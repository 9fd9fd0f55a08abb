"""autoscale.shuffle.shuffle against the installed Python's random.Random.shuffle."""

from __future__ import annotations

import random

import pytest

from iterserve.autoscale.shuffle import shuffle


@pytest.mark.parametrize("seed", [0, 1, 12345, "router-3"])
def test_same_permutation_and_generator_state_as_stdlib(seed: object) -> None:
    ours, stdlib = random.Random(seed), random.Random(seed)
    for size in [0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 256, 300, 1500]:
        a, b = list(range(size)), list(range(size))
        shuffle(ours, a)
        stdlib.shuffle(b)
        assert a == b, f"size {size}"
    assert ours.getstate() == stdlib.getstate()


def test_a_permutation_of_any_items() -> None:
    items = [f"replica-{i}" for i in range(40)]
    shuffled = list(items)
    shuffle(random.Random(7), shuffled)
    assert sorted(shuffled) == sorted(items) and shuffled != items


class _Constant(random.Random):
    def random(self) -> float:
        return 0.0


def test_a_subclass_uses_its_own_shuffle() -> None:
    ours, theirs = _Constant(1), _Constant(1)
    a, b = list(range(20)), list(range(20))
    shuffle(ours, a)
    theirs.shuffle(b)
    assert a == b
