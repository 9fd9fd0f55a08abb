"""The simulator's KV tiers (autoscale/sim/kv_tiers.py): device -> host -> disk eviction,
a disk block staged through the host tier on a hit, and what the copies cost a step."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from iterserve.autoscale.sim.block_manager import SimBlockManager
from iterserve.autoscale.sim.cluster import simulate
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.iterserve_router import IterserveRouter
from iterserve.autoscale.sim.kv_tiers import DiskTier, SimKVTiers, TierCopies
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_manager import host_slot
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


def run(manager: SimBlockManager, tokens: list[int]) -> list[int]:
    """Admit, compute the whole prompt, finish; the lookup's hits."""
    req = Request(f"t{next(_ids)}", tokens, SamplingParams(max_tokens=1), 0.0)
    hits = manager.find_cached_prefix(req)
    manager.record_prefix_lookup(req.num_prompt_tokens, hits)
    manager.allocate(req, req.num_tokens - len(hits) * BLOCK, hits)
    manager.mark_computed(req, req.num_tokens)
    manager.free(req)
    manager.check_invariants()
    return hits


def test_evictions_go_device_host_disk_and_a_disk_hit_is_staged_through_the_host() -> None:
    disk = DiskTier(16)
    manager = SimBlockManager(4, BLOCK, True, HostKVIndex(3), disk)
    copies = TierCopies(SimKVTiers(host_gib=1, disk_gib=1), bytes_per_block=10**6)
    first = list(range(100, 113))  # 3 cacheable blocks
    run(manager, first)
    copies.take_step_seconds(manager, 0)
    for base in (200, 300):  # 6 blocks pass through: the host (3 slots) spills to disk
        run(manager, list(range(base, base + 13)))
        copies.take_step_seconds(manager, 0)
    assert len(manager.host) == 3 and disk.num_written == 3 and len(disk.index) == 3
    assert not manager.cached_blocks.keys() & {k for k in disk.index._slot_of}
    hits = run(manager, first)  # first's blocks: on disk only
    assert len(hits) == 3 and all(hit < 0 for hit in hits)  # staged into host slots
    assert manager.disk_reads == 3 and manager.host_hits == 3 * BLOCK
    assert {manager.host.entry(host_slot(hit)).key for hit in hits} <= set(
        disk.index._slot_of)  # the disk keeps its copy
    stored_before = copies.num_stored
    seconds = copies.take_step_seconds(manager, manager.disk_reads)
    # every host slot is pinned by the staged blocks: the device's evictions this step
    # find no slot, and are dropped
    assert copies.num_loaded == 3 and copies.num_stored == stored_before == 6
    assert seconds == pytest.approx(3 * 1e6 / 25e9 + 3 * 1e6 / 6e9)  # 3 loads, 3 disk reads
    assert copies.num_disk_reads == 3


def test_without_tiers_a_lookup_is_the_engines() -> None:
    manager = SimBlockManager(4, BLOCK, True)
    first = list(range(100, 113))
    assert run(manager, first) == [] and len(run(manager, first)) == 3


def chats(sessions: int, turns: int, seed: int = 0) -> list[WorkloadRequest]:
    """Sessions whose every turn resends the last one's prompt and answer, then more."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        history: list[int] = []
        for turn in range(turns):
            prompt = history + [rng.randrange(16, 32000) for _ in range(300)]
            out.append(WorkloadRequest(f"s{s}t{turn}", s * 0.05 + turn * 4.0, prompt, 32,
                                       output_token_id=7))
            history = prompt + [7] * 32
    return sorted(out, key=lambda r: (r.arrival_time, r.request_id))


def test_a_cluster_with_tiers_hits_what_the_device_evicted_and_pays_the_copies() -> None:
    base = ClusterSimConfig(num_blocks=200, seed=0)  # 3,200 tokens a replica: evicts
    tiered = dataclasses.replace(base, kv_tiers=SimKVTiers(host_gib=64.0))
    workload = chats(sessions=40, turns=4)
    plain = simulate(workload, [IterserveRouter(), IterserveRouter()], 2, base)
    with_tiers = simulate(workload, [IterserveRouter(), IterserveRouter()], 2, tiered)
    summary = with_tiers.summary()
    assert "kv_tiers" not in plain.summary()
    assert summary["all_tier_hit_rate"] > plain.prefix_hit_rate + 0.2
    assert summary["kv_tiers"]["loaded_blocks"] > 0 and summary["kv_tiers"]["copy_seconds"] > 0
    again = simulate(workload, [IterserveRouter(), IterserveRouter()], 2, tiered)
    assert again.to_json() == with_tiers.to_json()  # same seed, same run


def test_the_simulated_router_charges_tiers_and_its_blind_arm_reads_the_device_alone() -> None:
    from iterserve.autoscale.config import RouterConfig
    from iterserve.autoscale.sim.routing_context import ReplicaView, RouteRequest, RoutingContext

    prompt = list(range(1000, 1000 + 64 * 16 + 1))
    views = [ReplicaView("host", None), ReplicaView("none", None)]
    ctx = RoutingContext(RouteRequest("q", prompt, 16, 0.0), views, 0.0, 16,
                         prefix_cache=lambda p, ids: {},  # the device holds nothing
                         prefix_tiers=lambda p, ids: {"host": [0, 64 * 16, 0]})
    rng = random.Random(0)
    aware = IterserveRouter()
    assert {aware.choose(ctx, rng) for _ in range(10)} == {"host"}
    assert aware._cached == {"host": round(64 * 16 * (1 - 131072 * 34000 / 25e9))}
    blind = IterserveRouter(RouterConfig(score_kv_tiers=False), name="iterserve-tierblind")
    assert {blind.choose(ctx, rng) for _ in range(40)} == {"host", "none"}


def test_stores_that_overlap_compute_cost_a_step_nothing() -> None:
    """The what-if arm: only loads and disk reads wait (stores written asynchronously)."""
    manager = SimBlockManager(4, BLOCK, True, HostKVIndex(8))
    run(manager, list(range(100, 113)))
    run(manager, list(range(200, 213)))  # evicts 3 blocks: 3 stores planned
    synchronous = TierCopies(SimKVTiers(host_gib=1), bytes_per_block=10**6)
    overlapped = TierCopies(SimKVTiers(host_gib=1, charge_stores=False), bytes_per_block=10**6)
    stores, loads = list(manager.kv_stores), list(manager.kv_loads)
    assert len(stores) == 3 and not loads
    assert synchronous.take_step_seconds(manager, 0) == pytest.approx(3 * 1e6 / 25e9)
    manager.kv_stores = stores
    assert overlapped.take_step_seconds(manager, 0) == 0.0 and overlapped.num_stored == 3


def test_the_host_tier_evicts_by_the_engines_policy_and_refuses_an_unknown_one() -> None:
    """SimKVTiers.host_eviction is the engine's kv_offloading_eviction_policy: the same
    blocks leave the simulated host tier as the engine's (lru by default)."""
    from iterserve.replica.host_kv_eviction import ARCEviction, LRUEviction

    assert isinstance(SimKVTiers(host_gib=1).host_index(4)._policy, LRUEviction)
    arc = SimKVTiers(host_gib=1, host_eviction="arc").host_index(4)
    assert isinstance(arc._policy, ARCEviction) and arc.num_slots == 4
    with pytest.raises(ValueError, match="unknown host_eviction 'lfu'"):
        SimKVTiers(host_gib=1, host_eviction="lfu")
