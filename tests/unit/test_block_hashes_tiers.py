"""The replica's report per KV tier: a block the device evicts into the host tier keeps its
stable hash (hashed once) under "host" until the host tier evicts it too; one loaded back is
reported on the device again."""

from __future__ import annotations

from block_hash_oracle import prompt_block_hashes

from iterserve.replica.block_hashes import BlockHashIndex
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.host_kv_index import HostKVIndex
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams

BLOCK = 4


def run_and_free(manager: BlockManager, rid: str, prompt: list[int]) -> int:
    """A request that computed its whole prompt and finished; its hit blocks."""
    request = Request(rid, prompt, SamplingParams(max_tokens=1), 0.0)
    hits = manager.find_cached_prefix(request)
    manager.allocate(request, len(prompt) - len(hits) * BLOCK, hits)
    manager.take_kv_copies()
    request.num_computed_tokens = len(prompt)
    manager.mark_computed(request)
    manager.free(request)
    return len(hits)


def tiered(device_blocks: int, host_slots: int) -> tuple[BlockManager, BlockHashIndex]:
    manager = BlockManager(device_blocks, BLOCK, True, HostKVIndex(host_slots))
    index = manager.cache_listener = BlockHashIndex()
    manager.host.listener = index
    return manager, index


def test_device_evictions_move_to_host_then_leave_with_the_host_tier() -> None:
    manager, index = tiered(device_blocks=4, host_slots=4)
    first = list(range(1, 14))  # 3 cacheable blocks
    run_and_free(manager, "a", first)
    chain = prompt_block_hashes(first, BLOCK)
    assert sorted(index.report()["device"]) == sorted(chain)
    run_and_free(manager, "b", list(range(100, 113)))  # evicts a's blocks into the host
    report = index.report()
    assert set(chain) <= set(report["host"]) and not set(chain) & set(report["device"])
    assert index.num_hashed == 6  # nothing re-hashed on the way down
    for i, base in enumerate((200, 300)):  # never hit again: out of the host tier too
        run_and_free(manager, f"x{i}", list(range(base, base + 13)))
    report = index.report()
    assert not set(chain) & {h for hashes in report.values() for h in hashes}
    assert len(index) == sum(len(h) for h in report.values()) == \
        len(manager.cached_blocks) + len(manager.host)


def test_a_block_loaded_back_is_reported_on_the_device_again() -> None:
    manager, index = tiered(device_blocks=4, host_slots=4)
    first = list(range(1, 14))
    chain = prompt_block_hashes(first, BLOCK)
    run_and_free(manager, "a", first)
    run_and_free(manager, "b", list(range(100, 113)))
    assert run_and_free(manager, "a2", first) == 3  # a host hit, copied back
    report = index.report()
    assert set(chain) <= set(report["device"]) and not set(chain) & set(report.get("host", []))
    assert index.num_hashed == 6


def test_the_cap_keeps_the_shallowest_levels_across_tiers() -> None:
    manager, index = tiered(device_blocks=4, host_slots=8)
    index.limit = 4
    run_and_free(manager, "a", list(range(1, 14)))
    run_and_free(manager, "b", list(range(100, 113)))  # a's 3 blocks -> host
    report = index.report()
    depth_one = {prompt_block_hashes(list(range(1, 14)), BLOCK)[0],
                 prompt_block_hashes(list(range(100, 113)), BLOCK)[0]}
    reported = {h for hashes in report.values() for h in hashes}
    assert depth_one <= reported and len(reported) <= 4
