"""KV tiers below a simulated replica's device KV: host memory and local disk.

Each replica's block manager (the engine's, `SimBlockManager`) gets the engine's host tier
index (replica/host_kv_index.py, keyed by the prefix cache's chain hash, evicting by the
engine's `kv_offloading_eviction_policy`: `SimKVTiers.host_eviction`): a cached block the
device evicts is stored there, a prompt's lookup continues its chain there and copies the
block back. Below it a disk tier of the same kind (`DiskTier`, a segmented LRU as the engine's
disk tier is: replica/disk_kv_tier.py), fed by the host tier's evictions (device -> host ->
disk); a lookup that reaches a block only the disk holds reads it into the host tier (as
LMCache and SGLang HiCache stage disk reads through host memory) and copies it on to the
device from there.

Time: a step lasts the cost model's time plus its copies (`TierCopies.seconds`): the
blocks stored device -> host and loaded host -> device this step at `host_gb_s`, and the
blocks read from disk at `disk_gb_s`, as the engine runs a step's copies before its forward.
Disk writes are asynchronous (not charged). Bandwidths are assumptions, labelled as such
(`SimKVTiers`), not measurements; so is everything the simulator says of GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import EVICTION_POLICIES
from iterserve.replica.host_kv_eviction import SegmentedLRUEviction, make_eviction_policy
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex
from iterserve.replica.outputs import SchedulerOutput

if TYPE_CHECKING:
    from iterserve.autoscale.sim.simulated_replica import SimulatedReplica

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class SimKVTiers:
    """Per replica: tier sizes (GiB; 0: no such tier) and bandwidths (GB/s).

    Defaults: 25 GB/s host <-> device (pinned memory over PCIe 4.0 x16) and 6 GB/s disk ->
    device (one PCIe 4.0 NVMe drive), the router's own assumptions
    (RouterConfig.host_kv_read_gb_s, disk_kv_read_gb_s)."""

    host_gib: float = 0.0
    disk_gib: float = 0.0
    host_gb_s: float = 25.0
    disk_gb_s: float = 6.0
    # The engine's compute stream waits for a step's device -> host stores (they must land
    # before the blocks are overwritten); False models stores that overlap compute, as
    # vLLM's offloading connector writes asynchronously (what-if: not iterserve's engine).
    charge_stores: bool = True
    host_eviction: str = "lru"  # the engine's kv_offloading_eviction_policy

    def __post_init__(self) -> None:
        if self.host_gib < 0 or self.disk_gib < 0:
            raise ValueError("tier sizes must be >= 0")
        if self.disk_gib > 0 and self.host_gib <= 0:
            raise ValueError("a disk tier is fed by the host tier's evictions: give host_gib")
        if self.host_gb_s <= 0 or self.disk_gb_s <= 0:
            raise ValueError("tier bandwidths must be > 0")
        if self.host_eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown host_eviction {self.host_eviction!r}; one of "
                             f"{', '.join(EVICTION_POLICIES)}")

    def host_index(self, num_slots: int) -> HostKVIndex:
        """The host tier's index, evicting as the engine's setting would."""
        return HostKVIndex(num_slots, make_eviction_policy(self.host_eviction, num_slots))

    def num_blocks(self, gib: float, bytes_per_block: int) -> int:
        return int(gib * GIB // bytes_per_block)


class DiskTier:
    """The disk tier's index (a HostKVIndex over disk slots), listening to the host tier:
    a block the host tier evicts is written here (asynchronously: no step waits for it)."""

    def __init__(self, num_slots: int) -> None:
        self.index = HostKVIndex(num_slots, SegmentedLRUEviction(num_slots))
        self.num_written = 0

    def host_stored(self, entry: HostEntry) -> None:
        """Nothing to do: the disk keeps its copy of a block read back up."""

    def host_evicted(self, entry: HostEntry) -> None:
        if self.index.store(entry) is not None:
            self.num_written += 1


class TierCopies:
    """One replica's tier traffic: each step's copies, taken from its block manager, and
    what they cost in seconds."""

    def __init__(self, tiers: SimKVTiers, bytes_per_block: int) -> None:
        self.host_s_per_block = bytes_per_block / (tiers.host_gb_s * GB)
        self.store_s_per_block = self.host_s_per_block if tiers.charge_stores else 0.0
        self.disk_s_per_block = bytes_per_block / (tiers.disk_gb_s * GB)
        self.num_stored = 0  # device -> host
        self.num_loaded = 0  # host -> device
        self.num_disk_reads = 0  # disk -> host
        self.seconds = 0.0  # all copies so far

    def take_step_seconds(self, manager: BlockManager, disk_reads: int,
                          scheduled: SchedulerOutput | None = None) -> float:
        """The step's copies in seconds: those the scheduler handed over with the step's
        output (`scheduled`), those planned outside it (a decode's new block evicting one;
        taken here: the host tier's slots unpinned), and disk_reads blocks read from disk."""
        stores, loads = manager.take_kv_copies()
        num_stores, num_loads = len(stores), len(loads)
        if scheduled is not None:
            num_stores += len(scheduled.kv_stores)
            num_loads += len(scheduled.kv_loads)
        self.num_stored += num_stores
        self.num_loaded += num_loads
        self.num_disk_reads += disk_reads
        seconds = num_stores * self.store_s_per_block + num_loads * self.host_s_per_block \
            + disk_reads * self.disk_s_per_block
        self.seconds += seconds
        return seconds


def tier_tokens(replicas: Sequence[SimulatedReplica]) -> dict[str, float]:
    """The replicas' tier traffic, summed (SimResult.tier_tokens): prompt tokens looked up
    in and found in the host tier (blocks staged from disk included), tokens read from disk,
    blocks copied each way, and the copies' seconds."""
    totals = dict.fromkeys(("host_query_tokens", "host_hit_tokens", "disk_read_tokens",
                            "stored_blocks", "loaded_blocks", "copy_seconds"), 0.0)
    for replica in replicas:
        bm, copies = replica.block_manager, replica.tier_copies
        totals["host_query_tokens"] += bm.host_queries
        totals["host_hit_tokens"] += bm.host_hits
        if copies is not None:
            totals["disk_read_tokens"] += copies.num_disk_reads * bm.block_size
            totals["stored_blocks"] += copies.num_stored
            totals["loaded_blocks"] += copies.num_loaded
            totals["copy_seconds"] += copies.seconds
    return totals
