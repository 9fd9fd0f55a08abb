"""Which prefix-cache blocks the host KV tier holds, in which slot, and which one leaves next.

The host tier (replica/host_kv_tier.py holds its tensors) keeps full KV blocks that the device
prefix cache evicted, under the same chain hash (`block_keys.block_hash`), so a prompt's hash
chain continues here where the device's hits stop. This index is pure Python: the block
manager asks it during scheduling, and the runner copies the slots it names.

Eviction is a segmented LRU (SLRU, as in Karedla et al. 1994 and Caffeine's window): a block
enters the *probation* segment; a hit (its KV copied back to the device) moves it to the
*protected* segment, capped at PROTECTED_FRACTION of the slots, whose least recent entries
fall back to probation's most recent end. The victim is probation's least recent entry (then
protected's). It weighs recency and frequency in O(1) per operation, and it resists scans: a
stream of prompts that never come back (no reuse) cycles through probation only, and cannot
flush the prefixes that came back at least once (a returning chat's history). A 2-hit
admission filter was not chosen: a chat turn's prefix is evicted once and wanted once, so
refusing first-time blocks would refuse exactly the blocks this tier exists for.

The protected share adapts, as ARC's target does: the keys probation evicted are remembered
(ghosts, at most num_slots), and a block stored again while remembered (it came back after
the tier let it go: probation is too small for what is reused now) shrinks the share by a slot,
demoting protected's least recent block; a promotion grows it back. Without this, one phase's
hit blocks held 80 % of the tier for good and the next phase never got a hit (measured over
HTTP, tests/unit/test_host_kv_index_phase.py). A scan never comes back, so it never shrinks it.

A slot named in this step's planned copies is *pinned* until the plan is handed to the runner
(`unpin_all`): it cannot be chosen as a victim, so a block being copied back is never
overwritten by a store planned in the same step (the runner runs the step's stores first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from iterserve.replica.block_keys import BlockHash, BlockTokens

PROTECTED_FRACTION = 0.8  # of the slots, at most, hold blocks hit at least once


@dataclass(frozen=True, slots=True)
class HostEntry:
    """One block in the host tier: its chain hash, its parent's, and its tokens (so that a
    block copied back can be announced to the router's hash index like a computed one); with
    a disk tier also its stable chain hash (replica/block_hashes.py), its file's name."""

    key: BlockHash
    parent: BlockHash
    tokens: BlockTokens
    stable: int = 0


class HostTierListener(Protocol):
    """Told of every block that joins or leaves the tier (the replica's index of stable
    hashes for routers, replica/block_hashes.py; a tier below this one)."""

    def host_stored(self, entry: HostEntry) -> None: ...
    def host_evicted(self, entry: HostEntry) -> None: ...


class HostKVIndex:
    def __init__(self, num_slots: int, protected_fraction: float = PROTECTED_FRACTION) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self.num_slots = num_slots
        self._slot_of: dict[BlockHash, int] = {}
        self._entries: list[HostEntry | None] = [None] * num_slots
        # Slots in order of last use, least recent first (OrderedDict as an O(1) LRU list).
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._protected_cap = max(1, int(num_slots * protected_fraction))
        self._max_protected = self._protected_cap  # adapts: see _adapt_to_ghost
        # Keys probation evicted, newest last, at most num_slots: a block stored again while
        # here came back after the tier let it go (ARC's B1 list).
        self._ghosts: OrderedDict[BlockHash, None] = OrderedDict()
        self._empty = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is used first
        self._pinned: set[int] = set()
        self.num_evicted = 0  # blocks that left the tier to make room
        # Told of each block evicted, with the slot it leaves (the disk tier writes it out).
        self.eviction_listener: Callable[[int, HostEntry], None] | None = None
        # Told of every block joining or leaving (the stable hashes a replica reports).
        self.listener: HostTierListener | None = None

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._slot_of

    def lookup(self, key: BlockHash) -> int | None:
        """The slot holding the block with this chain hash, or None."""
        return self._slot_of.get(key)

    def entry(self, slot: int) -> HostEntry:
        entry = self._entries[slot]
        if entry is None:
            raise KeyError(f"host KV slot {slot} is empty")
        return entry

    def can_store(self) -> bool:
        """Whether a new block can get a slot now (an empty one, or an unpinned victim)."""
        return bool(self._empty) or len(self._pinned) < len(self._slot_of)

    def store(self, entry: HostEntry) -> int | None:
        """A slot for a block leaving the device, or None when no copy is needed: the tier
        already holds it (it is touched instead) or every slot is pinned this step."""
        slot = self._slot_of.get(entry.key)
        if slot is not None:
            self._touch(slot)
            return None
        if not self.can_store():
            return None
        if entry.key in self._ghosts:
            del self._ghosts[entry.key]
            self._adapt_to_ghost()
        slot = self._empty.pop() if self._empty else self._evict()
        self._entries[slot] = entry
        self._slot_of[entry.key] = slot
        self._probation[slot] = None
        if self.listener is not None:
            self.listener.host_stored(entry)
        return slot

    def record_hit(self, slot: int) -> None:
        """The block in `slot` is being copied back: it moves to the protected segment, and is
        pinned until this step's copies are handed to the runner."""
        self._pinned.add(slot)
        if slot in self._probation:
            del self._probation[slot]
            self._max_protected = min(self._protected_cap, self._max_protected + 1)
        else:
            self._protected.pop(slot)
        self._protected[slot] = None
        self._demote_overflow()

    def _adapt_to_ghost(self) -> None:
        """A block probation evicted is back: probation was too small for what is reused now.
        The protected share shrinks by a slot and its least recent block falls to probation,
        so blocks hit in an earlier phase cannot hold the tier against the current one (ARC's
        adaptation; promotions grow the share back up to PROTECTED_FRACTION)."""
        self._max_protected = max(0, self._max_protected - 1)
        self._demote_overflow()

    def _demote_overflow(self) -> None:
        while len(self._protected) > self._max_protected:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        """This step's copies are planned and handed over: every slot may be evicted again."""
        self._pinned.clear()

    def _touch(self, slot: int) -> None:
        segment = self._protected if slot in self._protected else self._probation
        segment.move_to_end(slot)

    def _evict(self) -> int:
        """Free the least recent unpinned slot, probation first; can_store() must hold."""
        for segment in (self._probation, self._protected):
            for slot in segment:
                if slot not in self._pinned:
                    del segment[slot]
                    entry = self._entries[slot]
                    if entry is not None:
                        del self._slot_of[entry.key]
                        if segment is self._probation:
                            self._ghosts[entry.key] = None
                            if len(self._ghosts) > self.num_slots:
                                self._ghosts.popitem(last=False)
                        if self.eviction_listener is not None:
                            self.eviction_listener(slot, entry)
                        if self.listener is not None:
                            self.listener.host_evicted(entry)
                    self._entries[slot] = None
                    self.num_evicted += 1
                    return slot
        raise RuntimeError("every host KV slot is pinned; check can_store() first")
