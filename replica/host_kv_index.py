"""Which prefix-cache blocks the host KV tier holds, in which slot, and which one leaves next.

The host tier (replica/host_kv_tier.py holds its tensors) keeps full KV blocks that the device
prefix cache evicted, under the same chain hash (`block_keys.block_hash`), so a prompt's hash
chain continues here where the device's hits stop. This index is pure Python: the block
manager asks it during scheduling, and the runner copies the slots it names.

Which block leaves next is a policy's choice (replica/host_kv_eviction.py: LRU by default, as in
vLLM; ARC; a segmented LRU), told of every store, touch and copy back; this index owns the
slots, the keys and the pins.

A slot named in this step's planned copies is *pinned* until the plan is handed to the runner
(`unpin_all`): it cannot be chosen as a victim, so a block being copied back is never
overwritten by a store planned in the same step (the runner runs the step's stores first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from iterserve.replica.block_keys import BlockHash, BlockTokens
from iterserve.replica.host_kv_eviction import EvictionPolicy, LRUEviction


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
    def __init__(self, num_slots: int, policy: EvictionPolicy | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._policy: EvictionPolicy = policy if policy is not None else LRUEviction()
        self._slot_of: dict[BlockHash, int] = {}
        self._entries: list[HostEntry | None] = [None] * num_slots
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
            self._policy.on_touch(slot)
            return None
        if not self.can_store():
            return None
        self._policy.on_admit(entry.key)
        slot = self._empty.pop() if self._empty else self._evict()
        self._entries[slot] = entry
        self._slot_of[entry.key] = slot
        self._policy.on_store(slot, entry.key)
        if self.listener is not None:
            self.listener.host_stored(entry)
        return slot

    def record_hit(self, slot: int) -> None:
        """The block in `slot` is being copied back: the policy counts the reuse, and the slot
        is pinned until this step's copies are handed to the runner."""
        self._pinned.add(slot)
        self._policy.on_hit(slot)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        """This step's copies are planned and handed over: every slot may be evicted again."""
        self._pinned.clear()

    def _evict(self) -> int:
        """Free the slot the policy lets go among the unpinned; can_store() must hold."""
        slot = self._policy.pop_victim(self._pinned)
        if slot is None:
            raise RuntimeError("every host KV slot is pinned; check can_store() first")
        entry = self._entries[slot]
        if entry is not None:
            del self._slot_of[entry.key]
            if self.eviction_listener is not None:
                self.eviction_listener(slot, entry)
            if self.listener is not None:
                self.listener.host_evicted(entry)
        self._entries[slot] = None
        self.num_evicted += 1
        return slot
