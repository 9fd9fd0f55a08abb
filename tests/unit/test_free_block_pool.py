"""FreeBlockPool against the structure it replaced: an OrderedDict in reuse order."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from iterserve.autoscale.sim.block_manager import SimFreeBlockPool
from iterserve.replica.free_block_pool import FreeBlockPool


class ReferencePool:
    """The old free list: uncached blocks moved to the front, cached ones appended."""

    def __init__(self, num_blocks: int) -> None:
        self.order: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    def release(self, uncached: list[int], cached: list[int]) -> None:
        for block_id in uncached:
            self.order[block_id] = None
            self.order.move_to_end(block_id, last=False)
        for block_id in cached:
            self.order[block_id] = None

    def take(self, count: int) -> list[int]:
        return [self.order.popitem(last=False)[0] for _ in range(count)]

    def remove(self, block_id: int) -> None:
        del self.order[block_id]


@pytest.mark.parametrize("seed", range(6))
def test_the_pool_reuses_blocks_in_the_order_of_the_ordered_dict_it_replaced(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 16, 300])
    pool, reference = FreeBlockPool(num_blocks), ReferencePool(num_blocks)
    held: list[int] = []  # taken blocks, not yet released
    cached: set[int] = set()  # blocks whose contents are cached (survive a release)
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            count = rng.randint(1, pool.num_free)
            taken = pool.take(count)
            assert taken == reference.take(count)
            cached.difference_update(taken)  # taken for new tokens: overwritten
            held += taken
        elif op < 0.7 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            let_go, held = held[:k], held[k:]
            cached.update(b for b in let_go if rng.random() < 0.6)
            uncached = [b for b in let_go if b not in cached]
            cached_now = [b for b in let_go if b in cached]
            pool.release(uncached, cached_now)
            reference.release(uncached, cached_now)
        else:  # a prefix hit takes back a cached free block from the middle
            free_cached = [b for b in reference.order if b in cached]
            if free_cached:
                block_id = rng.choice(free_cached)
                pool.remove(block_id)
                reference.remove(block_id)
                held.append(block_id)
        assert pool.in_reuse_order() == list(reference.order)
        assert pool.num_free == len(reference.order)
    pool.check()


def test_hits_on_a_popular_block_do_not_grow_the_pool_without_bound() -> None:
    pool = FreeBlockPool(8)
    (block_id,) = pool.take(1)
    for _ in range(20_000):  # freed with its cached prefix, then found again
        pool.release([], [block_id])
        pool.remove(block_id)
    assert len(pool._cached) <= 1030  # compacted: stale entries stay bounded
    pool.release([], [block_id])
    assert pool.in_reuse_order()[-1] == block_id
    pool.check()


def test_taking_more_than_is_free_takes_nothing() -> None:
    pool = FreeBlockPool(3)
    with pytest.raises(RuntimeError):
        pool.take(4)
    assert pool.take(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="not a cached free block"):
        pool.remove(1)


@pytest.mark.parametrize("seed", range(6))
def test_anonymous_blocks_take_cached_places_and_any_one_fills_a_place(seed: int) -> None:
    """Anonymous blocks (full, findable by nobody) keep a cached block's place in the
    reuse order; which of them is taken there is the pool's choice (here: the newest)."""
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 16, 300])
    pool, reference = SimFreeBlockPool(num_blocks), ReferencePool(num_blocks)
    held: list[int] = []
    cached: set[int] = set()
    anonymous: list[int] = []  # free anonymous blocks, the newest last
    next_marker = -1  # the reference's place holders: -1, -2, ...
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            count = rng.randint(1, pool.num_free)
            taken, places = pool.take(count), reference.take(count)
            for block_id, place in zip(taken, places, strict=True):
                if place < 0:
                    assert block_id == anonymous.pop()  # the newest anonymous block
                else:
                    assert block_id == place
            cached.difference_update(taken)
            held += taken
        elif op < 0.7 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            let_go, held = held[:k], held[k:]
            cached.update(b for b in let_go if rng.random() < 0.4)
            anon = [b for b in let_go if b not in cached and rng.random() < 0.5]
            uncached = [b for b in let_go if b not in cached and b not in anon]
            registered = [b for b in let_go if b in cached]
            pool.release(uncached, anon + registered, len(anon))
            markers = list(range(next_marker, next_marker - len(anon), -1))
            next_marker -= len(anon)
            reference.release(uncached, markers + registered)
            anonymous += anon
        else:
            free_cached = [b for b in reference.order if b >= 0 and b in cached]
            if free_cached:
                block_id = rng.choice(free_cached)
                pool.remove(block_id)
                reference.remove(block_id)
                held.append(block_id)
        assert pool.anonymous_blocks() == frozenset(anonymous)
        assert [b if b not in anonymous else -1 for b in pool.in_reuse_order()] == \
            [b if b >= 0 else -1 for b in reference.order]
        assert pool.num_free == len(reference.order)
    pool.check()


def test_an_anonymous_block_cannot_be_removed_as_a_prefix_hit() -> None:
    pool = SimFreeBlockPool(4)
    taken = pool.take(2)
    pool.release([], taken, 2)
    with pytest.raises(RuntimeError):
        pool.remove(taken[0])


def test_compaction_keeps_the_anonymous_places() -> None:
    pool = SimFreeBlockPool(8)
    anon = pool.take(2)
    (block_id,) = pool.take(1)
    pool.release([], anon, 2)
    for _ in range(5_000):  # stale entries pile up until the queue is compacted
        pool.release([], [block_id])
        pool.remove(block_id)
    assert len(pool._cached) <= 1030
    assert pool.in_reuse_order()[-2:] == anon[::-1]  # newest first
    pool.check()
