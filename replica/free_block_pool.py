"""The free KV blocks, in the order they are reused.

Blocks that hold no cached tokens are reused first, the most recently freed first; blocks
that still hold a cached block of tokens follow, least recently freed first, so that the
prefix cache evicts its least recently used entries. A cached free block can also leave
from the middle (a prefix hit takes it back): it is only marked, and skipped when it
reaches the front.

The state is flat per block id (a list, a deque of ints, a bytearray), not an object and a
linked-list node per block: an engine holds 10^4-10^5 blocks, the cluster simulator 10^6
across its replicas, and cache churn scatters the order they are touched in (per-object
state made every take and free a few cache misses).
Invariant (`check`): num_free == the number of block ids b with is_free(b).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

_COMPACT_SLACK = 1024  # stale entries tolerated beyond the live ones before a rebuild


class FreeBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self._uncached = list(range(num_blocks - 1, -1, -1))  # a stack: its end is the front
        self._cached: deque[int] = deque()  # block ids in the order freed, some stale
        self._entries = [0] * num_blocks  # per block: how many times it is in _cached
        self._free = bytearray(b"\x01") * num_blocks
        self._num_cached = 0  # live entries of _cached
        self.num_free = num_blocks

    def is_free(self, block_id: int) -> bool:
        return self._free[block_id] == 1

    def release(self, uncached: Sequence[int], cached: Sequence[int]) -> None:
        """Blocks their last holder let go of, each list in the order let go: the uncached
        ones go to the front (the last one first), the cached ones to the back."""
        self._mark_free(uncached, cached)
        self._queue_cached(cached)

    def _mark_free(self, uncached: Sequence[int], cached: Sequence[int]) -> None:
        free = self._free
        for block_id in uncached:
            free[block_id] = 1
        for block_id in cached:
            free[block_id] = 1
        self._uncached.extend(uncached)
        self.num_free += len(uncached) + len(cached)
        self._num_cached += len(cached)

    def _queue_cached(self, cached: Sequence[int]) -> None:
        entries = self._entries
        for block_id in cached:
            entries[block_id] += 1
        self._cached.extend(cached)

    def take(self, count: int) -> list[int]:
        """The first `count` blocks in reuse order, no longer free. Raises RuntimeError,
        taking nothing, if fewer are free."""
        if count > self.num_free:
            raise RuntimeError(f"{count} blocks asked for, {self.num_free} free")
        stack = self._uncached
        k = count if count <= len(stack) else len(stack)
        taken = stack[len(stack) - k:]
        taken.reverse()
        del stack[len(stack) - k:]
        if k < count:
            self._take_cached(taken, count)
            self._num_cached -= count - k
        free = self._free
        for block_id in taken:
            free[block_id] = 0
        self.num_free -= count
        return taken

    def _take_cached(self, taken: list[int], count: int) -> None:
        """Append to `taken`, up to `count`, the free cached blocks from the queue's front."""
        pop, entries, free = self._cached.popleft, self._entries, self._free
        while len(taken) < count:
            block_id = pop()
            left = entries[block_id] - 1
            entries[block_id] = left
            if left == 0 and free[block_id]:  # its latest entry, and still free
                taken.append(block_id)

    def remove(self, block_id: int) -> None:
        """A cached free block taken back from wherever it is (a prefix hit)."""
        if not self._free[block_id] or not self._entries[block_id]:
            raise RuntimeError(f"block {block_id} is not a cached free block")
        self._free[block_id] = 0
        self._num_cached -= 1
        self.num_free -= 1
        if len(self._cached) > 2 * self._num_cached + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries of _cached (each block keeps only its latest, if free)."""
        entries, free = self._entries, self._free
        kept: deque[int] = deque()
        for block_id in self._cached:
            left = entries[block_id] - 1
            entries[block_id] = left
            if left == 0 and free[block_id]:
                kept.append(block_id)
        for block_id in kept:
            entries[block_id] = 1
        self._cached = kept

    def in_reuse_order(self) -> list[int]:
        """Every free block id, the next one taken first."""
        order = self._uncached[::-1]
        remaining = list(self._entries)
        for block_id in self._cached:
            remaining[block_id] -= 1
            if remaining[block_id] == 0 and self._free[block_id]:
                order.append(block_id)
        return order

    def check(self) -> None:
        """Raise RuntimeError if the pool's own accounting is inconsistent."""
        order = self.in_reuse_order()
        if len(order) != len(set(order)) or len(order) != self.num_free \
                or sum(self._free) != self.num_free:
            raise RuntimeError(f"free pool: {len(order)} listed, {len(set(order))} distinct, "
                               f"{sum(self._free)} marked free, num_free {self.num_free}")
