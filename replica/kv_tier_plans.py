"""The block manager's tiers below the device KV: what each step copies between them.

A mixin of BlockManager (replica/block_manager.py), the seam between the device's block
accounting and the tiers below it. With a host KV tier (`host`, replica/host_kv_index.py) a
cached block the device evicts is stored there under the same chain hash, and a prompt's
lookup continues its chain there where the device misses: such a hit takes a free block and is
copied back before the step that reads it. With a disk tier under the host tier (`disk`,
replica/disk_kv_tier.py) a block the host tier evicts is written to disk (a *spill*), and a
lookup that misses the device and the host reads the block from disk into a host slot (a
*promotion*), from where it is copied to the device as any host hit is: the disk tier is
read during scheduling, and a block whose file fails its checksum is simply a miss.

Disk files are named by stable chain hashes (replica/block_hashes.py), the same in every
process, so a restarted engine finds them; with a disk tier each cached block carries its
stable hash beside its parent and tokens (`block_origins`), computed once when it is cached.

The copies are planned here, during scheduling, and handed to the runner with the step
(`take_disk_copies`, `take_kv_copies`); the runner runs them in this order before the forward:
spills (read out of host slots before anything overwrites them), device -> host stores,
disk -> host promotions, host -> device loads. A slot written this step (a store or a
promotion) whose block is evicted again in the same step is not spilled: its bytes never
landed in the slot: it is spilled from the device block it was being stored from (spills run
first, before anything overwrites that block either).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iterserve.replica.block_hashes import ROOT, stable_block_hash
from iterserve.replica.block_keys import BlockHash, BlockTokens
from iterserve.replica.disk_kv_tier import DiskKVTier
from iterserve.replica.free_block_pool import FreeBlockPool
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex
from iterserve.replica.kv_write_generations import WriteGenerations

if TYPE_CHECKING:
    from iterserve.replica.host_kv_tier import BlockBytes

# Per cached block with a host tier: its parent's hash, its tokens, and its stable chain hash
# (0 without a disk tier: nothing reads it).
BlockOrigin = tuple[BlockHash, BlockTokens, int]


@dataclass(frozen=True, slots=True)
class DiskSpill:
    """A block the host tier evicted, to be written to disk under its stable hash: read out
    of its host slot, or, when it was stored there this very step, of the device block it
    was being stored from (exactly one of the two is set)."""

    stable: int
    host_slot: int | None = None
    device_block: int | None = None


def host_hit(slot: int) -> int:
    """A prefix hit in host slot `slot`, as find_cached_prefix lists it (device ids are >= 0)."""
    return -1 - slot


def host_slot(hit: int) -> int:
    """The host slot of a negative prefix hit (the inverse of host_hit)."""
    return -1 - hit


class KVTierPlans:
    # BlockManager's, read here
    block_size: int
    block_keys: list[BlockHash | None]
    cached_blocks: dict[BlockHash, int]
    free_pool: FreeBlockPool
    prefix_queries: int
    prefix_hits: int
    cache_listener: object  # a PrefixCacheListener or None; its _take_free takes free blocks

    def init_tiers(self, num_blocks: int, host: HostKVIndex | None,
                   disk: DiskKVTier | None) -> None:
        if disk is not None and host is None:
            raise ValueError("a disk KV tier needs a host KV tier above it")
        self.host = host
        self.disk = disk
        # The writes each step plans into device blocks and host slots, for readers off the
        # engine thread (replica/kv_write_generations.py, replica/kv_transfer.py).
        self.device_writes = WriteGenerations(num_blocks)
        self.host_writes = WriteGenerations(host.num_slots if host is not None else 0)
        self.host_queries = 0  # prompt tokens the device missed, looked up in the host tier
        self.host_hits = 0  # prompt tokens found there
        self.disk_queries = 0  # prompt tokens the device and the host missed
        self.disk_hits = 0  # prompt tokens read back from disk
        self.kv_blocks_received = 0  # blocks another engine sent into the host tier
        # With a disk tier: per request, the stable hash of its last registered block.
        self.stable_chains: dict[str, int] = {}
        self.block_origins: list[BlockOrigin | None] | None = (
            [None] * num_blocks if host is not None else None)
        # This step's planned copies: (device block, host slot) stores, (slot, block) loads,
        # (slot, stable hash) spills, (slot, payload) promotions from disk.
        self.kv_stores: list[tuple[int, int]] = []
        self.kv_loads: list[tuple[int, int]] = []
        self.kv_spills: list[DiskSpill] = []
        self.kv_disk_loads: list[tuple[int, BlockBytes]] = []
        # Host slots written this step: the device block stored there (None: a promotion).
        self._written_slots: dict[int, int | None] = {}
        self._from_disk: set[int] = set()  # host slots holding a promotion no request took yet
        if disk is not None:
            host.eviction_listener = self._spill_to_disk

    # ------------------------------------------------------------------------------ host
    def _load_from_host(self, slot: int) -> int:
        """A free block that the host tier's block in `slot` is copied into before the step
        runs; it joins the prefix cache at once, as a computed block would."""
        entry = self.host.entry(slot)
        self.host.record_hit(slot)
        self._from_disk.discard(slot)
        block_id = self._take_free(1)[0]
        self.device_writes.open(block_id)  # before its key names it: the copy lands later
        self.block_keys[block_id] = entry.key
        self.cached_blocks[entry.key] = block_id
        self.block_origins[block_id] = (entry.parent, entry.tokens, entry.stable)
        if self.cache_listener is not None:
            self.cache_listener.stored(entry.key, entry.parent, entry.tokens)
        self.kv_loads.append((slot, block_id))
        return block_id

    def _store_in_host(self, block_id: int, key: BlockHash) -> None:
        """A cached block leaving the device goes to the host tier, copied before the step
        that overwrites it runs (no copy when the tier already holds it, or cannot)."""
        origin = self.block_origins[block_id]
        self.block_origins[block_id] = None
        if origin is None:
            return
        slot = self.host.store(HostEntry(key, *origin))
        if slot is not None:
            self.host_writes.open(slot)
            self.kv_stores.append((block_id, slot))
            self._written_slots[slot] = block_id

    def take_kv_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's planned copies, (stores, loads), for the runner to run in that order
        before the step's forward; the host tier's slots are free to be evicted again."""
        stores, loads = self.kv_stores, self.kv_loads
        self.kv_stores, self.kv_loads = [], []
        self._written_slots.clear()
        if self.host is not None:
            self.host.unpin_all()
        return stores, loads

    def receive_block(self, entry: HostEntry, payload: BlockBytes) -> bool:
        """A block another engine sent (replica/kv_transfer.py) joins the host tier: its bytes
        are written into a host slot before the next step's loads, as a disk promotion's are,
        and a prompt's lookup then copies it to the device like any host hit. The slot stays
        pinned until that step is planned. False when no slot can be had (nothing changes)."""
        if not self.host.can_store():
            return False
        slot = self.host.store(entry)
        if slot is None:
            return False
        self.host_writes.open(slot)
        self.host.pin(slot)
        self._written_slots[slot] = None  # not spilled from a device block if evicted
        self.kv_disk_loads.append((slot, payload))
        return True

    def has_landed(self, hit: int) -> bool:
        """Whether a prefix hit's bytes are in place now, between steps: False for a device
        block or host slot whose planned copy waits for a step that has not run."""
        if hit >= 0:
            return all(block != hit for _, block in self.kv_loads)
        slot = host_slot(hit)
        return (all(written != slot for _, written in self.kv_stores)
                and all(written != slot for written, _ in self.kv_disk_loads))

    def take_opened_writes(self) -> tuple[list[int], list[int]]:
        """The (device block, host slot) writes planned since the last step, handed to the
        step that runs them; `close_writes` once it has finished."""
        return self.device_writes.take_opened(), self.host_writes.take_opened()

    def close_writes(self, opened: tuple[list[int], list[int]]) -> None:
        self.device_writes.close(opened[0])
        self.host_writes.close(opened[1])

    # ------------------------------------------------------------------------------ disk
    def stable_hash_of(self, hit: int) -> int:
        """The stable chain hash of a prefix hit (a device block or a host slot)."""
        if hit >= 0:
            return self.block_origins[hit][2]
        return self.host.entry(host_slot(hit)).stable

    def _promote_from_disk(self, key: BlockHash, parent: BlockHash, tokens: BlockTokens,
                           hits: list[int]) -> int | None:
        """The host slot a block missing on the device and the host is read into from disk,
        or None (not on disk, unreadable, no host slot free). `hits`: the prompt's hits so
        far, whose host slots are pinned first (the promotion may evict a host block)."""
        disk, host = self.disk, self.host
        stable = stable_block_hash(self.stable_hash_of(hits[-1]) if hits else ROOT, tokens)
        if stable not in disk or not host.can_store():
            return None
        for hit in hits:
            if hit < 0:
                host.pin(host_slot(hit))
        if not host.can_store():
            return None
        payload = disk.read(stable)
        if payload is None:
            return None  # counted by the disk tier: the block is computed
        slot = host.store(HostEntry(key, parent, tokens, stable))
        self.host_writes.open(slot)
        host.pin(slot)
        self._written_slots[slot] = None
        self._from_disk.add(slot)
        self.kv_disk_loads.append((slot, payload))
        return slot

    def _spill_to_disk(self, slot: int, entry: HostEntry) -> None:
        """The host tier evicts `entry` from `slot`: its bytes go to disk, read out of the slot
        before this step's copies overwrite it (the host index's eviction listener)."""
        self._from_disk.discard(slot)
        if entry.stable in self.disk:
            self.disk.touch(entry.stable)
        elif slot in self._written_slots:  # stored this step: its bytes are still on the device
            block = self._written_slots[slot]
            if block is not None:  # (a promotion is pinned: never evicted in its step)
                self.kv_spills.append(DiskSpill(entry.stable, device_block=block))
        else:
            self.kv_spills.append(DiskSpill(entry.stable, host_slot=slot))

    def take_disk_copies(self) -> tuple[list[DiskSpill], list[tuple[int, BlockBytes]]]:
        """This step's (spills, promotions), for the runner: spills before the stores,
        promotions after them and before the loads."""
        spills, promotions = self.kv_spills, self.kv_disk_loads
        self.kv_spills, self.kv_disk_loads = [], []
        return spills, promotions

    # ------------------------------------------------------------------------------ counts
    def record_prefix_lookup(self, num_prompt_tokens: int, hits: Sequence[int]) -> None:
        """Count a prompt's lookup per tier, in tokens: the device's queries are the prompt,
        the host tier's the tokens the device missed, the disk's those the host missed too."""
        lower = [host_slot(hit) for hit in hits if hit < 0]
        num_disk = sum(1 for slot in lower if slot in self._from_disk)
        device_hit_tokens = (len(hits) - len(lower)) * self.block_size
        host_hit_tokens = (len(lower) - num_disk) * self.block_size
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += device_hit_tokens
        if self.host is not None:
            self.host_queries += num_prompt_tokens - device_hit_tokens
            self.host_hits += host_hit_tokens
        if self.disk is not None:
            self.disk_queries += num_prompt_tokens - device_hit_tokens - host_hit_tokens
            self.disk_hits += num_disk * self.block_size
