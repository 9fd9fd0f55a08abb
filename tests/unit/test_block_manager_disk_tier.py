"""The block manager with a host tier and a disk tier under it, without a model: which blocks
a step spills to disk and reads back, under which stable hashes."""

from __future__ import annotations

import itertools
from array import array
from pathlib import Path

from iterserve.replica.block_hashes import ROOT, stable_block_hash
from iterserve.replica.block_manager import BlockManager, host_hit
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.disk_kv_store import DiskKVStore, kv_layout_identity
from iterserve.replica.disk_kv_tier import DiskKVTier
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.scheduling_policy import SchedulingPolicy

_ids = itertools.count()
BLOCK = 4
PAYLOAD = 64


def request(tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return Request(request_id=f"d{next(_ids)}", prompt_token_ids=tokens, sampling_params=params,
                   arrival_time=0.0)


def payload_of(stable: int) -> bytes:
    return stable.to_bytes(8, "little") * (PAYLOAD // 8)


def run_step(manager: BlockManager, disk: DiskKVTier, tokens: list[int]) -> list[int]:
    """Admit, compute the whole prompt, finish, then play the runner's part of the disk
    copies (the spilled blocks' bytes stand for their stable hash): the request's hits."""
    req = request(tokens)
    hits = manager.find_cached_prefix(req)
    manager.record_prefix_lookup(req.num_prompt_tokens, hits)
    manager.allocate(req, req.num_tokens - len(hits) * BLOCK, hits)
    manager.mark_computed(req, req.num_tokens)
    manager.free(req)
    manager.check_invariants()
    spills, _ = manager.take_disk_copies()
    manager.take_kv_copies()
    for spill in spills:
        disk.write_async(spill.stable, payload_of(spill.stable))
    disk.flush()
    return hits


def test_a_block_spilled_to_disk_comes_back_without_evicting_the_hits_before_it(
        tmp_path: Path) -> None:
    disk = DiskKVTier(DiskKVStore(tmp_path, kv_layout_identity("test")), 2**20, PAYLOAD)
    host = HostKVIndex(2)
    manager = BlockManager(4, BLOCK, True, host, disk)
    prompt = list(range(100, 109))  # blocks b0, b1 cached, one token left
    run_step(manager, disk, prompt)
    run_step(manager, disk, list(range(500, 513)))  # 4 blocks: b0 and b1 go to the host
    run_step(manager, disk, list(range(900, 905)))  # a third host store: b1 (LRU) to disk
    stable_b0 = stable_block_hash(ROOT, array("q", prompt[:4]).tobytes())
    stable_b1 = stable_block_hash(stable_b0, array("q", prompt[4:8]).tobytes())
    assert list(disk.store.directory.iterdir()) == [disk.store.path_of(stable_b1)]
    slot_b0 = next(slot for slot in range(2) if host.entry(slot).stable == stable_b0)

    again = request(prompt)
    hits = manager.find_cached_prefix(again)
    # b0 from the host; b1 read from disk into the host's other slot: the promotion had to
    # evict a host block, and b0's slot, already a hit, was pinned against it.
    assert hits == [host_hit(slot_b0), host_hit(1 - slot_b0)]
    assert host.entry(slot_b0).stable == stable_b0 and host.entry(1 - slot_b0).stable == stable_b1
    spills, promotions = manager.take_disk_copies()
    assert promotions == [(1 - slot_b0, payload_of(stable_b1))]
    assert [spill.host_slot for spill in spills] == [1 - slot_b0]  # the block it evicted
    manager.record_prefix_lookup(again.num_prompt_tokens, hits)
    assert (manager.host_hits, manager.disk_hits, manager.disk_queries) == (
        BLOCK, BLOCK, 9 + 13 + 5 + 9 - BLOCK)
    manager.allocate(again, 1, hits)
    stores, loads = manager.take_kv_copies()
    assert [slot for slot, _ in loads] == [slot_b0, 1 - slot_b0]
    manager.free(again)
    manager.check_invariants()
    disk.close()


def test_a_block_evicted_from_the_host_in_the_step_that_stored_it_spills_from_the_device(
        tmp_path: Path) -> None:
    """Its bytes never landed in the host slot: the runner reads them from the device block
    the store was copying (before the step overwrites it)."""
    disk = DiskKVTier(DiskKVStore(tmp_path, kv_layout_identity("test")), 2**20, PAYLOAD)
    manager = BlockManager(8, BLOCK, True, HostKVIndex(1), disk)
    run_step(manager, disk, list(range(100, 113)))  # three cached blocks
    req = request(list(range(500, 529)))  # all 8 blocks: the three cached go in one step
    manager.allocate(req, req.num_tokens)
    spills, _ = manager.take_disk_copies()
    kv_stores, _ = manager.take_kv_copies()
    assert len(kv_stores) == 3 and len(spills) == 2
    assert [spill.device_block for spill in spills] == [block for block, _ in kv_stores[:2]]
    assert all(spill.host_slot is None for spill in spills)
    manager.free(req)
    disk.close()


class RefusingPolicy(SchedulingPolicy):
    """fcfs, but no request fits: as when running requests that cannot be planned this step
    (their tokens in flight under async scheduling) hold the blocks an admission needs."""

    def fits(self, request: Request, num_new: int, hits: list[int], running: list[Request],
             blocks: BlockManager) -> bool:
        return False


def test_an_empty_step_keeps_its_disk_reads_for_the_next_step(tmp_path: Path) -> None:
    """A lookup reads a block from disk into a host slot even when its request is then not
    admitted; if nothing else runs, the step is empty and (under async scheduling) never
    reaches the runner. Its copies must wait, the slot pinned, for the next step: handed over
    with the empty step, the slot would be announced as holding bytes never written."""
    disk = DiskKVTier(DiskKVStore(tmp_path, kv_layout_identity("test")), 2**20, PAYLOAD)
    host = HostKVIndex(2)
    manager = BlockManager(4, BLOCK, True, host, disk)
    prompt = list(range(100, 109))
    for tokens in (prompt, list(range(500, 513)), list(range(900, 905))):
        run_step(manager, disk, tokens)  # as above: b0 in the host, b1 on disk
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), manager, policy=RefusingPolicy(64))
    scheduler.add_request(request(prompt))
    output = scheduler.schedule()
    assert output.is_empty and output.kv_disk_loads == [] and output.kv_loads == []
    (slot, data), = manager.kv_disk_loads  # still planned
    assert data == payload_of(host.entry(slot).stable)
    assert not host.can_store()  # both slots pinned: b0 (a hit) and the block read from disk
