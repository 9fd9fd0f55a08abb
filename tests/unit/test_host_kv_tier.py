"""The host KV tier on its own: its index's eviction order and bound, its copies, its settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve.replica.config import EngineConfig, engine_settings
from iterserve.replica.cpu_attention import CpuAttention
from iterserve.replica.host_kv_eviction import SegmentedLRUEviction, make_eviction_policy
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex
from iterserve.replica.host_kv_tier import (
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    HostKVTier,
    auto_kv_offloading_gib,
    host_kv_slots,
)


def entry(key: int) -> HostEntry:
    return HostEntry(key=key, parent=0, tokens=bytes(8))


def test_the_tier_holds_at_most_its_slots_and_evicts_least_recent_first() -> None:
    index = HostKVIndex(3)
    slots = [index.store(entry(k)) for k in (1, 2, 3)]
    assert sorted(slots) == [0, 1, 2]
    index.store(entry(4))  # full: 1, the least recent, leaves
    assert len(index) == 3 and 1 not in index and all(k in index for k in (2, 3, 4))
    assert index.lookup(4) == slots[0]  # its slot is reused
    assert index.num_evicted == 1


def test_a_store_of_a_held_block_copies_nothing_and_counts_as_recent_use() -> None:
    index = HostKVIndex(2)
    index.store(entry(1))
    index.store(entry(2))
    assert index.store(entry(1)) is None  # no copy: touched instead
    index.store(entry(3))
    assert 1 in index and 2 not in index


@pytest.mark.parametrize("policy", ["arc", "slru"])  # lru lets it go: test_host_kv_eviction
def test_a_block_hit_once_outlives_a_scan_of_blocks_never_hit(policy: str) -> None:
    index = HostKVIndex(4, make_eviction_policy(policy, 4))
    kept = index.store(entry(100))
    index.record_hit(kept)  # a returning chat's prefix: protected
    index.unpin_all()
    for key in range(10):  # a stream of prompts that never come back
        index.store(entry(key))
    assert 100 in index and index.lookup(100) == kept


def test_protected_blocks_beyond_their_share_fall_back_to_probation() -> None:
    index = HostKVIndex(5, SegmentedLRUEviction(5))  # protected holds at most 4
    slots = [index.store(entry(k)) for k in range(5)]
    for slot in slots:
        index.record_hit(slot)
    index.unpin_all()
    # The least recently hit was demoted to probation: the next victim, though hit once.
    assert index.store(entry(99)) == slots[0]
    assert 0 not in index and all(k in index for k in (1, 2, 3, 4, 99))


def test_pinned_slots_are_never_victims_and_a_full_pinned_tier_stores_nothing() -> None:
    index = HostKVIndex(2)
    a, b = index.store(entry(1)), index.store(entry(2))
    index.record_hit(a)
    index.store(entry(3))  # b goes, a is pinned (being copied back this step)
    assert 1 in index and 2 not in index
    index.pin(index.lookup(3))
    assert not index.can_store() and index.store(entry(4)) is None
    index.unpin_all()
    assert index.can_store()
    assert b == index.lookup(3)


def random_caches(decode: str, num_blocks: int, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) caches laid out as the CPU engine lays them out, filled at random."""
    caches = [CpuAttention("sdpa", decode).allocate(num_blocks, 4, 2, 8, torch.float32)
              for _ in range(num_layers)]
    for k, v in caches:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    return caches


@pytest.mark.parametrize("decode", ["blocks", "loop"])  # block-transposed K, or contiguous
def test_blocks_come_back_bit_for_bit(decode: str) -> None:
    caches = random_caches(decode, num_blocks=6, num_layers=2)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tier = HostKVTier(3, caches)
    tier.store(caches, [(1, 0), (4, 2), (5, 2)])  # slot 2 named twice: block 5 stays
    for k, v in caches:
        k.zero_()
        v.zero_()
    tier.load(caches, [(0, 3), (2, 0)])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[3], k0[1]) and torch.equal(v[3], v0[1])
        assert torch.equal(k[0], k0[5]) and torch.equal(v[0], v0[5])
    assert tier.bytes_copied[DEVICE_TO_HOST] == 2 * tier.bytes_per_block
    assert tier.bytes_copied[HOST_TO_DEVICE] == 2 * tier.bytes_per_block
    assert tier.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x B x Hkv x D x fp32
    assert tier.copy_seconds[DEVICE_TO_HOST] > 0 and tier.copy_seconds[HOST_TO_DEVICE] > 0


def test_sizes_in_gib_become_slots() -> None:
    assert host_kv_slots(1.0, 2**20) == 1024
    with pytest.raises(ValueError, match="holds no KV block"):
        host_kv_slots(1e-9, 2**20)


def test_auto_is_half_a_replicas_share_of_free_memory_capped() -> None:
    assert auto_kv_offloading_gib(16 * 2**30, 4) == 2.0
    assert auto_kv_offloading_gib(1024 * 2**30, 2) == 64.0
    spec = next(s for s in engine_settings() if s.name == "kv_offloading_size")
    assert spec.type("auto") == "auto" and spec.type("1.5") == 1.5  # the CLI flag's parser
    assert EngineConfig.from_kwargs(kv_offloading_size="auto").cache.kv_offloading_size == "auto"


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offloading_backend="lmcache"), "unknown kv_offloading_backend 'lmcache'"),
    (dict(kv_offloading_size=0.0), "kv_offloading_size must be > 0"),
    (dict(kv_offloading_size=-1.0), "kv_offloading_size must be > 0"),
    (dict(kv_offloading_size="lots"), "must be > 0 GiB or 'auto', got 'lots'"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offloading_eviction_policy="lfu"), "unknown kv_offloading_eviction_policy 'lfu'"),
])
def test_bad_offloading_settings_are_refused_with_a_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_the_tier_is_off_by_default() -> None:
    cache = EngineConfig.from_kwargs().cache
    assert cache.kv_offloading_size is None and cache.kv_offloading_backend == "native"
    assert cache.kv_offloading_eviction_policy == "lru"  # vLLM's default too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_side_stream_path_brings_blocks_back_on_cuda() -> None:
    """The CUDA path (pinned slots, a side stream, events): not run on CPU-only machines."""
    caches = [(torch.randn(6, 16, 2, 64, device="cuda"), torch.randn(6, 16, 2, 64, device="cuda"))
              for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    tier = HostKVTier(4, caches)
    assert tier.keys[0].is_pinned()
    tier.store(caches, [(2, 1), (5, 3)])
    for k, v in caches:  # queued on the compute stream: must wait for the stores
        k.zero_()
        v.zero_()
    tier.load(caches, [(1, 0), (3, 4)])
    torch.cuda.synchronize()
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[0], k0[2]) and torch.equal(v[4], v0[5])
    assert tier.bytes_copied[HOST_TO_DEVICE] == 2 * tier.bytes_per_block


@pytest.mark.parametrize("decode", ["blocks", "loop"])  # block-transposed K, or contiguous
def test_a_slots_bytes_round_trip_for_the_disk_tier(decode: str) -> None:
    """read_slot / read_device_block give the disk tier a block's bytes; write_slots puts
    them back in a slot, from where the block loads bit for bit."""
    caches = random_caches(decode, num_blocks=6, num_layers=2)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tier = HostKVTier(3, caches)
    tier.store(caches, [(4, 1)])
    payload = tier.read_slot(1)
    assert len(payload) == tier.bytes_per_block
    assert payload == tier.read_device_block(caches, 4)  # the same bytes, the same order
    tier.write_slots([(2, payload)])
    tier.load(caches, [(2, 0)])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[0], k0[4]) and torch.equal(v[0], v0[4])
    with pytest.raises(ValueError, match="a block payload of 3 bytes"):
        tier.write_slots([(0, b"abc")])


@pytest.mark.parametrize("decode", ["blocks", "loop"])
def test_many_blocks_written_at_once_land_each_in_its_slot(decode: str) -> None:
    """A peer's payload rows (read-only numpy views, as Ray's object store hands them out)
    and disk bytes mixed, written to slots out of order in one call: each slot then holds
    its own block, bit for bit, and loads back into the device like a stored one."""
    caches = random_caches(decode, num_blocks=8, num_layers=3)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tier = HostKVTier(5, caches)
    rows = np.stack([np.frombuffer(tier.read_device_block(caches, block), dtype=np.uint8)
                     for block in (1, 2, 3)])
    rows.flags.writeable = False
    tier.write_slots([(4, rows[0]), (0, rows[1]), (2, tier.read_device_block(caches, 3))])
    tier.load(caches, [(4, 5), (0, 6), (2, 7)])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for block, source in ((5, 1), (6, 2), (7, 3)):
            assert torch.equal(k[block], k0[source]) and torch.equal(v[block], v0[source])
        assert torch.equal(k[0], k0[0])  # blocks no load named are untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_slot_bytes_wait_for_the_side_stream_on_cuda() -> None:
    """read_slot right after a store queued on the side stream sees the stored bytes (not
    run on CPU-only machines)."""
    caches = [(torch.randn(6, 16, 2, 64, device="cuda"), torch.randn(6, 16, 2, 64, device="cuda"))
              for _ in range(3)]
    tier = HostKVTier(4, caches)
    tier.store(caches, [(5, 3)])
    payload = tier.read_slot(3)
    assert payload == tier.read_device_block(caches, 5)
    tier.write_slots([(0, payload)])
    tier.load(caches, [(0, 1)])
    torch.cuda.synchronize()
    assert all(torch.equal(k[1], k[5]) and torch.equal(v[1], v[5]) for k, v in caches)
