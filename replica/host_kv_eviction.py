"""Which block the host KV tier lets go next: LRU (vLLM's default), ARC (vLLM's option), or a
segmented LRU. One setting picks one (`kv_offloading_eviction_policy`, vLLM's `eviction_policy`
of its CPU offloading spec, with its names for the two it has).

Each policy orders the tier's *slots* (replica/host_kv_index.py owns slots, keys and pins) and
is told every event in a block's life there: about to be stored (`on_admit`, before a victim
is chosen for it, so that a returning block's ghost adapts the choice), stored (`on_store`),
stored again while held (`on_touch`), copied back to the device (`on_hit`), and asked for the
next victim among the unpinned slots (`pop_victim`). Invariant: a slot is in the policy's
lists iff it holds a block.

Replayed over seven workload shapes (loadtests/studies/kv_tiers/host_index_shapes.py and its
results/host_index_shapes.md), no policy wins every one: LRU serves every phase of working sets
that fit the tier (0.98-1.00 of reused blocks) and loses a loop larger than the tier (0.38);
the segmented LRU keeps part of that loop (0.81 / 0.49 / 0.57) and loses half of every later
phase (0.50); ARC sits between them. LRU is the default, as in vLLM, because chats and RAG
whose working set fits are what the tier is for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from iterserve.replica.block_keys import BlockHash
from iterserve.replica.config import EVICTION_POLICIES

PROTECTED_FRACTION = 0.8  # slru: of the slots, at most, hold blocks hit at least once


class EvictionPolicy(Protocol):
    def on_admit(self, key: BlockHash) -> None: ...
    def on_store(self, slot: int, key: BlockHash) -> None: ...
    def on_touch(self, slot: int) -> None: ...
    def on_hit(self, slot: int) -> None: ...
    def pop_victim(self, pinned: set[int]) -> int | None: ...


def _first_unpinned(order: Iterable[int], pinned: set[int]) -> int | None:
    for slot in order:
        if slot not in pinned:
            return slot
    return None


class LRUEviction:
    """Least recently stored, touched or copied back leaves first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # least recent first

    def on_admit(self, key: BlockHash) -> None:
        pass  # no ghosts: LRU does not adapt

    def on_store(self, slot: int, key: BlockHash) -> None:
        self._order[slot] = None

    def on_touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def on_hit(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def pop_victim(self, pinned: set[int]) -> int | None:
        slot = _first_unpinned(self._order, pinned)
        if slot is not None:
            del self._order[slot]
        return slot


class _GhostList:
    """Keys of blocks a segment evicted, newest last, at most `capacity` (ARC's B lists)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._keys

    def remember(self, key: BlockHash) -> None:
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget(self, key: BlockHash) -> None:
        self._keys.pop(key, None)


class ARCEviction:
    """ARC (Megiddo and Modha, FAST 2003) as vLLM ports it (`vllm/v1/kv_offload/cpu/policies/
    arc.py`): T1 holds blocks never copied back, T2 blocks copied back at least once; B1/B2
    remember the keys each evicted. T1 leaves first while it is at least its target size, which
    starts at 0 (LRU over T1, T2 kept) and moves with the ghosts: a block stored again while in
    B1 grows the target by max(1, |B2|/|B1|) (recency matters now), one in B2 shrinks it.

    One difference from vLLM: vLLM adapts when a request's lookup finds a ghost; here a lookup
    may repeat every step while a request waits for room, so the ghost counts when the block,
    computed again, is stored again (once per block coming back)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.target_t1 = 0.0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, BlockHash] = {}
        self._b1, self._b2 = _GhostList(num_slots), _GhostList(num_slots)

    def on_admit(self, key: BlockHash) -> None:
        if key in self._b1:
            grow = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1 = min(self.target_t1 + grow, float(self.num_slots))
        elif key in self._b2:
            shrink = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1 = max(self.target_t1 - shrink, 0.0)
        self._b1.forget(key)
        self._b2.forget(key)

    def on_store(self, slot: int, key: BlockHash) -> None:
        self._key_of[slot] = key
        self._t1[slot] = None

    def on_touch(self, slot: int) -> None:
        # A store of a block already held is no reuse: recency only, as vLLM's insertion_only.
        (self._t1 if slot in self._t1 else self._t2).move_to_end(slot)

    def on_hit(self, slot: int) -> None:
        self._t1.pop(slot, None)
        self._t2.pop(slot, None)
        self._t2[slot] = None

    def pop_victim(self, pinned: set[int]) -> int | None:
        from_t1 = len(self._t1) >= int(self.target_t1)
        order = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        for segment in order:
            slot = _first_unpinned(segment, pinned)
            if slot is not None:
                del segment[slot]
                ghosts = self._b1 if segment is self._t1 else self._b2
                ghosts.remember(self._key_of.pop(slot))
                return slot
        return None


class SegmentedLRUEviction:
    """A segmented LRU (Karedla et al. 1994): a block enters *probation*; a copy back moves it
    to *protected*, capped at `protected_fraction` of the slots, whose least recent entries fall
    back to probation's most recent end; the victim is probation's least recent (then
    protected's). A scan of blocks never reused cycles through probation alone. The cap adapts
    down as ARC's target does: a block stored again after probation evicted it (a B1 ghost)
    shrinks it by a slot; a promotion grows it back. It keeps part of a working set larger
    than the tier, and loses part of every phase change (the module docstring's replay)."""

    def __init__(self, num_slots: int, protected_fraction: float = PROTECTED_FRACTION) -> None:
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._protected_cap = max(1, int(num_slots * protected_fraction))
        self._max_protected = self._protected_cap
        self._key_of: dict[int, BlockHash] = {}
        self._ghosts = _GhostList(num_slots)

    def on_admit(self, key: BlockHash) -> None:
        if key in self._ghosts:
            self._ghosts.forget(key)
            self._max_protected = max(0, self._max_protected - 1)
            self._demote_overflow()

    def on_store(self, slot: int, key: BlockHash) -> None:
        self._key_of[slot] = key
        self._probation[slot] = None

    def on_touch(self, slot: int) -> None:
        (self._protected if slot in self._protected else self._probation).move_to_end(slot)

    def on_hit(self, slot: int) -> None:
        if slot in self._probation:
            del self._probation[slot]
            self._max_protected = min(self._protected_cap, self._max_protected + 1)
        else:
            self._protected.pop(slot)
        self._protected[slot] = None
        self._demote_overflow()

    def _demote_overflow(self) -> None:
        while len(self._protected) > self._max_protected:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def pop_victim(self, pinned: set[int]) -> int | None:
        for segment in (self._probation, self._protected):
            slot = _first_unpinned(segment, pinned)
            if slot is not None:
                del segment[slot]
                key = self._key_of.pop(slot)
                if segment is self._probation:
                    self._ghosts.remember(key)
                return slot
        return None


def make_eviction_policy(name: str, num_slots: int) -> EvictionPolicy:
    """The policy a setting names, for a tier of `num_slots`."""
    if name == "lru":
        return LRUEviction()
    if name == "arc":
        return ARCEviction(num_slots)
    if name == "slru":
        return SegmentedLRUEviction(num_slots)
    raise ValueError(f"unknown host KV eviction policy {name!r}; one of "
                     f"{', '.join(EVICTION_POLICIES)}")
